#!/usr/bin/env bash
# The whole op at prod8192_gate with B7-B10 as registered and with an earlier commit's research
# candidate in its place, alternating, ROUNDS times each, on one warm machine after cute_a.sh
# (carry .gpu, .cute2 and .ab_old). Stage the earlier research tree here first, as research_old:
#   rm -rf .ab_old && mkdir .ab_old && git archive ${REV:-90ee3f8} research | tar x -C .ab_old &&
#   mv .ab_old/research .ab_old/research_old && sed -i 's/\bresearch\./research_old./g' .ab_old/research_old/*.py
# CAND: the candidate (default the pair-by-pair loop with its sums in registers, as at 90ee3f8).
source .gpu/env.sh
source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }
export KERNEL_FUN_COMMIT=$(cut -c1-12 .gpu/commit)
CAND=${CAND:-B7-B10=research_old.b7_cute_probe:intra_bwd_l2_rolled:supports_l2}
for i in $(seq ${ROUNDS:-2}); do
  echo "== registered $i $(date +%T)" | tee -a $OUT/log
  python3 -m benchmarks.op --shapes prod8192_gate --impls ours --out $OUT/op.jsonl 2>&1 | grep "kernel-fun" | tee -a $OUT/log
  echo "== $CAND $i $(date +%T)" | tee -a $OUT/log
  PYTHONPATH="$PWD/.ab_old:$PYTHONPATH" python3 -m benchmarks.op --shapes prod8192_gate --impls ours \
    --candidate "$CAND" --out $OUT/op.jsonl 2>&1 | grep "kernel-fun" | tee -a $OUT/log
done
