#!/usr/bin/env bash
# The registration run in one call after cute_a.sh on the same warm machine (carry .gpu and .cute2):
# the whole op at SHAPES (default prod8192_gate), fla and ours as registered, then B7-B10's CuTe
# kernel's GPU tests (tests/test_gpu_sm90.py, K a -k expression) and the chain's launch witness
# until LIMIT seconds from the start (default 570). fla on its stored autotune choices for the
# op bench (STRICT: it autotunes what it times), and on them and their defaults for the tests.
# OP=0: the tests alone.
start=$(date +%s)
source .gpu/env.sh
source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }
log=$OUT/log
export KERNEL_FUN_COMMIT=$(cut -c1-12 .gpu/commit)
echo "commit $(cat .gpu/commit) $(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tee -a $log
if [ "${OP:-1}" = 1 ]; then
  echo "== op $(date +%T)" | tee -a $log
  timeout -k 5 $(( ${LIMIT:-570} - 60 - ($(date +%s) - start) )) python3 -m benchmarks.op --shapes ${SHAPES:-prod8192_gate} \
    --impls fla,ours --out $OUT/op.jsonl 2>&1 | tail -30 | tee -a $log
  tar czf $OUT/fla_configs.tgz -C benchmarks fla_configs 2>/dev/null
fi
left=$(( ${LIMIT:-570} - ($(date +%s) - start) ))
echo "== tests $(date +%T), ${left}s left" | tee -a $log
export FLA_CONFIG_DIR=$(python3 -c "import torch; from benchmarks.fla_configs import gpu_dir; print(gpu_dir(torch.cuda.get_device_name()))")
export FLA_CACHE_MODE=full
timeout -k 5 $left python3 -m pytest -v -s -p no:cacheprovider -m gpu ${FILES:-tests/test_gpu_sm90.py} \
  ${K:+-k "$K"} 2>&1 | tee -a $OUT/t.log | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error" | tail -40
echo "done $(date +%T)" | tee -a $log
