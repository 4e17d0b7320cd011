#!/usr/bin/env bash
# One device call that works through STEPS (space-separated, in order) until LIMIT seconds from
# its start (default 570), after cute_a.sh on the same warm machine (carry .gpu and .cute2; .ab_old
# for `ab`). Each step streams to $OUT/log and gets the time left; fla's autotune choices live in
# /tmp/fla_configs (seeded from benchmarks/fla_configs, kept while the machine stays warm) and come
# back as $OUT/fla_configs.tgz after every step. Steps:
#   op:SHAPE[,SHAPE]   the whole op, fla and ours, rows to $OUT/op.jsonl
#   opc:SHAPE[,SHAPE]  the same, ours with $CANDIDATE (STAGE=module:function:supports) registered
#   opoff:SHAPES:STAGE the same, ours with STAGE (a unit: its stages one by one) on fla's
#   layer              fla's KimiDeltaAttention layer, unpatched and through patch_fla(), B2 T8192
#   stage:STAGE:SHAPES[:sweep] one stage alone against fla's (pinned configs, or the entry's sweep),
#                      rows to $OUT/stages.jsonl
#   rel:PARTS[:SHAPE[:TOOLS]] benchmarks.reliability --parts PARTS (SOAK_ITERS, default 300) [--shape
#                      SHAPE] [--tools TOOLS: the sanitizer's, e.g. initcheck,synccheck; SHAPE may be empty]
#   ab                 research/gpu/ab_old.sh (one round)
#   tests[:EXPR]       tests/test_gpu_sm90.py (-k EXPR), fla on its stored choices and their defaults
#   gtests:EXPR        tests/test_gpu.py -k EXPR (a + for " or "), the same way
#   msan:EXPR          tests/test_gpu_sm90.py -k EXPR under compute-sanitizer's memcheck (the first
#                      20 errors named, with the kernel and the access), log to $OUT/msan.log
#   host[:SHAPE]       research/gpu/host_issue.py: host issue time against event time, fla and ours
#                      (layer2x8192 by default), and a cProfile of our forward, to $OUT/host_issue.txt
#   ffi[:SHAPES]       research/gpu/b7_ffi_ab.py: B7-B10's CuTe call through TVM-FFI against the shipped call
#                      (parity bit for bit, B7-B10's host time, the op's fwd+bwd), rows to $OUT/ffi.jsonl
#   ncu                Nsight Compute on the CuTe kernel's launch in the op (research/gpu/op_unit_once.py):
#                      details and SASS back
set -o pipefail
start=$(date +%s)
source .gpu/env.sh
source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }
[ -d /tmp/fla_configs ] || cp -r benchmarks/fla_configs /tmp/fla_configs
export KERNEL_FUN_FLA_CONFIGS=/tmp/fla_configs
export KERNEL_FUN_COMMIT=$(cut -c1-12 .gpu/commit)
log=$OUT/log
echo "commit $(cat .gpu/commit) $(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tee -a $log
for step in $STEPS; do
  left=$(( ${LIMIT:-570} - 15 - ($(date +%s) - start) ))
  [ $left -lt 20 ] && { echo "== skipped $step: ${left}s left" | tee -a $log; continue; }
  echo "== $step $(date +%T), ${left}s left" | tee -a $log
  IFS=: read -r what a b c <<< "$step"
  case $what in
    op) timeout -k 5 $left python3 -m benchmarks.op --shapes $a --impls fla,ours --out $OUT/op.jsonl 2>&1 | tail -30 ;;
    layer) timeout -k 5 $left python3 -m benchmarks.layer --B 2 --T 8192 --out $OUT/layer.jsonl 2>&1 | tail -12 ;;
    opc) timeout -k 5 $left python3 -m benchmarks.op --shapes $a --impls fla,ours --candidate "$CANDIDATE" \
           --out $OUT/op.jsonl 2>&1 | tail -30 ;;
    opoff) timeout -k 5 $left python3 -m benchmarks.op --shapes $a --impls ours --off $b --out $OUT/op.jsonl 2>&1 | tail -30 ;;
    stage) timeout -k 5 $left python3 -m benchmarks.stage --stage $a --shapes $b --configs ${c:-pinned} \
             --out $OUT/stages.jsonl 2>&1 | tail -24 ;;
    rel) timeout -k 5 $left python3 -m benchmarks.reliability --parts $a --soak-iters ${SOAK_ITERS:-300} \
           --soak-seconds 90 ${b:+--shape $b} ${c:+--tools $c} --out $OUT/reliability.jsonl 2>&1 | tail -40 ;;
    gtests) FLA_CONFIG_DIR=$(python3 -c "import torch; from benchmarks.fla_configs import gpu_dir; print(gpu_dir(torch.cuda.get_device_name()))") \
           FLA_CACHE_MODE=full timeout -k 5 $left python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/test_gpu.py \
           -k "${a//+/ or }" 2>&1 | tee -a $OUT/g.log | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error|vs fla" | tail -40 ;;
    ab) ROUNDS=1 timeout -k 5 $left bash research/gpu/ab_old.sh ;;
    msan) san=$(python3 -c "from benchmarks.reliability import sanitizer; print(sanitizer() or '')")
          if [ -z "$san" ]; then echo "no compute-sanitizer on this machine"; else
          FLA_CONFIG_DIR=$(python3 -c "import torch; from benchmarks.fla_configs import gpu_dir; print(gpu_dir(torch.cuda.get_device_name()))") \
          FLA_CACHE_MODE=full timeout -k 5 $left $san --tool memcheck --print-limit 20 python3 -m pytest -x -v -s \
           -p no:cacheprovider -m gpu tests/test_gpu_sm90.py -k "${a//+/ or }" > $OUT/msan.log 2>&1
          grep -E "Invalid|at 0x|by thread|Address|ERROR SUMMARY|PASSED|FAILED" $OUT/msan.log | head -40; fi ;;
    tests) FLA_CONFIG_DIR=$(python3 -c "import torch; from benchmarks.fla_configs import gpu_dir; print(gpu_dir(torch.cuda.get_device_name()))") \
           FLA_CACHE_MODE=full timeout -k 5 $left python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/test_gpu_sm90.py \
           ${a:+-k "$a"} 2>&1 | tee -a $OUT/t.log | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error" | tail -40 ;;
    host) PYTHONPATH=$PWD:$PYTHONPATH timeout -k 5 $left python3 research/gpu/host_issue.py ${a:-layer2x8192} > $OUT/host_issue.txt 2>&1
          head -8 $OUT/host_issue.txt ;;
    ffi) PYTHONPATH=$PWD:$PYTHONPATH timeout -k 5 $left python3 research/gpu/b7_ffi_ab.py ${a:-layer2x8192,grid1024} ;;
    ncu) timeout -k 5 $left ncu --clock-control none --set full --import-source yes -k regex:kernel_cutlass \
           --launch-count 1 -f -o /tmp/op_unit python3 research/gpu/op_unit_once.py 2>&1 | tail -5
         ncu --import /tmp/op_unit.ncu-rep --page details > $OUT/ncu_unit.txt
         ncu --import /tmp/op_unit.ncu-rep --page source --csv --print-source sass | gzip > $OUT/ncu_unit.sass.csv.gz ;;
    *) echo "unknown step $step" ;;
  esac 2>&1 | tee -a $log
  echo "rc ${PIPESTATUS[0]} $step $(date +%T)" | tee -a $log
  tar czf $OUT/fla_configs.tgz -C /tmp fla_configs 2>/dev/null
done
echo "done $(date +%T)" | tee -a $log
