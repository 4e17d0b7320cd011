#!/usr/bin/env bash
# Call 2 (carry .gpu and .cute2), right after cute_a.sh on the same machine: join CuTe DSL, then
# the fragment builds of the B7 and B6 probes, each step in its own process while LIMIT allows:
# the unit (and with its tiles by stmatrix) at the gentle, the bench's and strong gates, the unit with
# B10, the persistent B6, the fused B6 and B7-B9, Nsight Compute on the unit, the unit with B10 on
# two warpgroups, then the rest.
# ONLY (a bash regex over the step names, "ncu" for the profile) runs just the steps it matches.
source .gpu/env.sh
source research/gpu/cute_env.sh || { echo "no cute"; exit 3; }
LIMIT=${LIMIT:-480}
start=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - start) )); }
log=$OUT/log
echo "commit $(cat .gpu/commit) $(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tee -a $log
step() {  # step NAME FILE SECONDS CMD...
  local name=$1 file=$2 want=$3; shift 3
  if [ -n "$ONLY" ] && ! [[ "$name" =~ $ONLY ]]; then return; fi
  local l; l=$(left)
  if [ "$l" -lt 30 ]; then echo "skip $name: ${l}s left" | tee -a $log; return; fi
  [ "$want" -gt "$l" ] && want=$l
  echo "== $name (limit ${want}s) $(date +%T)" | tee -a $log
  timeout -k 5 "$want" "$@" > >(tee -a "$OUT/$file") 2> >(tail -c 4000 >> $log); echo "rc $? $name $(date +%T)" | tee -a $log
}
step "b7 unit" b7.jsonl 150 python3 -m research.b7_cute_probe gpu 2
step "b7 unit, tiles by stmatrix" b7.jsonl 100 python3 -m research.b7_cute_probe gpu 2:stm
step "b7 unit, bench gates" b7.jsonl 100 python3 -m research.b7_cute_probe gpu 2:stm:benchgate
step "b7 unit, strong gates" b7.jsonl 100 python3 -m research.b7_cute_probe gpu 2:stm:strong
step "b7 unit with b10, bench gates" b7.jsonl 120 python3 -m research.b7_cute_probe gpu 2:l2:stm:benchgate
step "b7 unit with b10, bench gates, rows a run-time extent (dyn)" b7.jsonl 120 python3 -m research.b7_cute_probe gpu 2:l2:stm:benchgate:dyn
step "b7 unit with b10" b7.jsonl 120 python3 -m research.b7_cute_probe gpu 2:l2
step "b6 persistent" b6.jsonl 100 python3 -m research.b6_cute_probe gpu 8
step "b6 then b7-b9, fused" b6.jsonl 100 python3 -m research.b6_cute_probe gpu 8:fused
if [ "$(left)" -gt 90 ] && { [ -z "$ONLY" ] || [[ ncu =~ $ONLY ]]; }; then
  echo "== ncu unit $(date +%T)" | tee -a $log
  timeout -k 5 $(( $(left) > 150 ? 140 : $(left) - 10 )) ncu --clock-control none --set full --import-source yes \
    -k regex:kernel_cutlass --launch-count 1 -f -o /tmp/unit python3 research/gpu/unit_once.py >> $log 2>&1
  echo "rc $? ncu" | tee -a $log
  ncu --import /tmp/unit.ncu-rep --page details > $OUT/unit.details.txt 2>>$log
  ncu --import /tmp/unit.ncu-rep --page source --csv --print-source sass > $OUT/unit.sass.csv 2>>$log
  ls -la $OUT | tee -a $log
fi
step "b7 unit with b10, roles on two warpgroups at 232 registers" b7.jsonl 120 python3 -m research.b7_cute_probe gpu 2:l2:ws
step "b7 sums, unit lb nobias" b7.jsonl 150 python3 -m research.b7_cute_probe gpu 0 2:lb:nobias
step "b6 full" b6.jsonl 80 python3 -m research.b6_cute_probe gpu 7
step "b7 unit with b10, phased" b7.jsonl 120 python3 -m research.b7_cute_probe gpu 2:l2:phased
step "b6 persistent, dA both ways" b6.jsonl 100 python3 -m research.b6_cute_probe gpu 8:both
echo "done $(( $(date +%s) - start ))s" | tee -a $log
