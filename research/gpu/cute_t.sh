#!/usr/bin/env bash
# B7-B10's CuTe kernel's GPU tests (tests/test_gpu_sm90.py, and FILES others) on a warm machine
# after cute_a.sh (carry .gpu, and .cute2 if this call joins CuTe DSL): one process, verbose, its
# log under $OUT.
# fla takes the stored autotune choices for this GPU and their defaults (FLA_CACHE_MODE=full):
# the test's shapes (T = 500, packed, K = 64) otherwise autotune every fla kernel for minutes.
# K: pytest's -k expression (default all); LIMIT: seconds (default 560).
source .gpu/env.sh
source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }
export FLA_CONFIG_DIR=$(python3 -c "import torch; from benchmarks.fla_configs import gpu_dir; print(gpu_dir(torch.cuda.get_device_name()))")
export FLA_CACHE_MODE=full
echo "commit $(cat .gpu/commit) configs $FLA_CONFIG_DIR ($(ls $FLA_CONFIG_DIR 2>/dev/null | wc -l))" | tee $OUT/t.log
timeout -k 5 ${LIMIT:-560} python3 -m pytest -v -s -p no:cacheprovider -m gpu ${FILES:-tests/test_gpu_sm90.py} \
  ${K:+-k "$K"} 2>&1 | tee -a $OUT/t.log | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | tail -40
