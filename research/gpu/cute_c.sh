#!/usr/bin/env bash
# After cute_a.sh on the same warm machine (carry .gpu and .cute2: this call joins CuTe DSL): the
# whole op, fla and ours as registered (B7-B10's CuTe kernel where CuTe DSL runs), each with the op
# bench's parity and fla in-process, at prod8192_gate or SHAPES (comma-separated; each one's first
# fla compile takes minutes on a fresh machine). LAYER=1: then fla's layer through patch_fla().
# NCU=1: Nsight Compute on the CuTe kernel's launch in the op (research/gpu/op_unit_once.py),
# details and SASS back.
source .gpu/env.sh
source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }
log=$OUT/log
export KERNEL_FUN_COMMIT=$(cut -c1-12 .gpu/commit)  # (the rows' commit: the machine's copy of .git may be older)
echo "commit $(cat .gpu/commit) $(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tee -a $log
echo "== op $(date +%T)" | tee -a $log
python3 -m benchmarks.op --shapes ${SHAPES:-prod8192_gate} --impls fla,ours --out $OUT/op.jsonl 2>&1 | tail -25 | tee -a $log
if [ "${LAYER:-0}" = 1 ]; then  # fla's KimiDeltaAttention layer through patch_fla()
  echo "== layer $(date +%T)" | tee -a $log
  python3 -m benchmarks.layer --B 2 --T 8192 --out $OUT/layer.jsonl 2>&1 | tail -8 | tee -a $log
fi
if [ "${NCU:-0}" = 1 ]; then  # Nsight Compute on the CuTe kernel's launch in the op
  echo "== ncu $(date +%T)" | tee -a $log
  timeout -k 5 ${NCU_LIMIT:-150} ncu --clock-control none --set full --import-source yes -k regex:kernel_cutlass \
    --launch-count 1 -f -o /tmp/op_unit python3 research/gpu/op_unit_once.py >> $log 2>&1
  echo "rc $? ncu" | tee -a $log
  ncu --import /tmp/op_unit.ncu-rep --page details > $OUT/ncu_unit.txt 2>>$log
  ncu --import /tmp/op_unit.ncu-rep --page source --csv --print-source sass 2>>$log | gzip > $OUT/ncu_unit.sass.csv.gz
fi
# fla's autotune choices for this GPU (benchmarks/fla_configs/<gpu>): back with the results, to commit
tar czf $OUT/fla_configs.tgz -C benchmarks fla_configs 2>/dev/null
echo "done $(date +%T)" | tee -a $log
