#!/usr/bin/env bash
# Call 1 of 2 (carry .gpu and .cute1; research/gpu/stage_cute.sh made them): stage CuTe DSL's first part on the machine.
# Before: ../shared/gpu/prep (.gpu: fla and env.sh), research/gpu/stage_cute.sh, and git rev-parse HEAD > .gpu/commit.
# Then, on the same warm machine: research/gpu/queue.sh or ab_old.sh (carry .gpu and .cute2).
source .gpu/env.sh
source research/gpu/cute_env.sh
echo "commit $(cat .gpu/commit)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
python3 -c "import sys; sys.path.insert(0, '/tmp/cute-site')
try:
    import google.protobuf; print('protobuf in image', google.protobuf.__version__)
except Exception as e: print('protobuf', e)"
ls -la /tmp/cute-parts | tee $OUT/a.log
