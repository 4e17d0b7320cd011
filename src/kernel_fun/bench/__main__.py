import sys

from kernel_fun.bench.kda import main

sys.exit(main())
