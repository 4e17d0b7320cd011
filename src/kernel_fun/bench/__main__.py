import sys

from kernel_fun.bench.op import main

sys.exit(main())
