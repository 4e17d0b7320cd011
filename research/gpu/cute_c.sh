#!/usr/bin/env bash
# Call 3 (carry .gpu), on the same warm machine after cute_a/cute_n: the whole op at
# prod8192_gate, fla and ours with the registered stages, then ours with each candidate, each
# with the op bench's parity and fla in-process.
# CAND: any of unit, l2, b6, fused, or both (unit and b6); default unit; none: the registered
# chain alone (with B7-B10's CuTe kernel where CuTe DSL runs). NCU=1: Nsight Compute on
# the unit's launch in the op (research/gpu/op_unit_once.py), details and SASS back.
# BASE=0 leaves out the first (registered) run. SHAPES (comma-separated): other shapes than
# prod8192_gate (each one's first fla compile takes minutes on a fresh machine). LAYER=1: then
# fla's layer through patch_fla(), registered and with the unit with B10.
source .gpu/env.sh
source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }
log=$OUT/log; CAND=${CAND:-unit}
export KERNEL_FUN_COMMIT=$(cut -c1-12 .gpu/commit)  # (the rows' commit: the machine's copy of .git may be older)
echo "commit $(cat .gpu/commit) $(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tee -a $log
run() { echo "== $* $(date +%T)" | tee -a $log; python3 -m benchmarks.op --shapes ${SHAPES:-prod8192_gate} --out $OUT/op.jsonl "$@" 2>&1 | tail -25 | tee -a $log; }
[ "${BASE:-1}" = 0 ] || run --impls fla,ours
case $CAND in *unit*|both) run --impls fla,ours --candidate B7-B9=research.b7_cute_probe:intra_bwd:supports;; esac
case $CAND in *l2*|both) run --impls fla,ours --candidate B7-B10=research.b7_cute_probe:intra_bwd_l2:supports_l2;; esac
case $CAND in *b6*|both) run --impls fla,ours --candidate B6=research.b6_cute_probe:wy_dqkg_bwd:supports;; esac
case $CAND in *fused*) run --impls fla,ours --candidate B6-B9=research.b6_cute_probe:wy_intra_bwd:supports_fused;; esac
if [ "${LAYER:-0}" = 1 ]; then  # fla's KimiDeltaAttention layer through patch_fla(): registered, then with the unit with B10
  for c in "" $([ "$CAND" = none ] || echo "--candidate B7-B10=research.b7_cute_probe:intra_bwd_l2:supports_l2"); do
    echo "== layer $c $(date +%T)" | tee -a $log
    python3 -m benchmarks.layer --B 2 --T 8192 --out $OUT/layer.jsonl $c 2>&1 | tail -8 | tee -a $log
  done
fi
if [ "${NCU:-0}" = 1 ]; then  # Nsight Compute on the unit's launch in the op
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
