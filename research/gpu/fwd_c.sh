#!/usr/bin/env bash
# One call (carry .gpu; after cute_a.sh and a .cute2 call on the same machine when CAND names
# l2): the forward's candidates on a GPU, then the whole op with every candidate at once.
#   1. research.l2norm_fwd gpu: F1 in one launch against fla's two (bits, float64), five blocks timed.
#   2. research.f4_diag gpu: F4 against fla's, F3-F6 with it against fla's stage, timed.
#   3. benchmarks.op at prod8192_gate: fla, and ours with F1, F3-F6 (and B7-B10 with CAND=l2)
#      as the candidates, in one process; the stage times tell each candidate's share.
# fla's autotune choices come back in $OUT/fla_configs.tgz.
source .gpu/env.sh
[[ "${CAND:-}" == *l2* ]] && { source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }; }
export KERNEL_FUN_COMMIT=$(cut -c1-12 .gpu/commit)
log=$OUT/log
echo "commit $(cat .gpu/commit) $(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tee -a $log
echo "== f1 $(date +%T)" | tee -a $log
timeout -k 5 ${F1_LIMIT:-120} python3 -m research.l2norm_fwd gpu --out $OUT/f1.jsonl 2>&1 | tail -c 3000 | tee -a $log
echo "== f4 $(date +%T)" | tee -a $log
timeout -k 5 ${F4_LIMIT:-240} python3 -m research.f4_diag gpu --out $OUT/f4.jsonl 2>&1 | tail -c 3000 | tee -a $log
C="--candidate F1=research.l2norm_fwd:l2norm_fwd:supports --candidate F3-F6=research.f4_diag:intra:supports"
[[ "${CAND:-}" == *l2* ]] && C="$C --candidate B7-B10=research.b7_cute_probe:intra_bwd_l2:supports_l2"
echo "== op $C $(date +%T)" | tee -a $log
timeout -k 5 ${OP_LIMIT:-400} python3 -m benchmarks.op --shapes ${SHAPES:-prod8192_gate} --impls fla,ours $C \
  --out $OUT/op.jsonl 2>&1 | tail -25 | tee -a $log
tar czf $OUT/fla_configs.tgz -C benchmarks fla_configs 2>/dev/null
echo "done $(date +%T)" | tee -a $log
