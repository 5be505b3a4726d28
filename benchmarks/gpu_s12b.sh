#!/bin/bash
# GPU runbook, session 12, part b: the select's count and compact phases as two launches with
# per-program counts (deterministic selection) against the one-launch compact with atomic output
# reservation (tree cae0fed, checked out beside this one as a git worktree).
# (1) GPU tests of the kernels (now also the selection's order, tests/test_kernels.py);
# (2) one layer, r 16, k = L/16, group_max: new, old, new, each with two repeats of the default
#     launch parameters, so that the max|diff| column shows whether a repeat is bitwise equal.
# Writes $OUT/console.log and $OUT/streams-{new,old,new2}.json.
# Ran in session 12 at b4b89b1 (results/h200-s12/); the worktree step failed on the device.
source benchmarks/runbook_lib.sh; runbook_start
git worktree add -f /tmp/old cae0fed > /dev/null 2>&1 || echo "no worktree of cae0fed"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_ds_batch_parts.py \
    tests/test_fused.py 2>&1 | tail -2
for tree in new old new2; do
  dir=$PWD; [ $tree = old ] && dir=/tmp/old
  echo "== tree $tree ($(cd $dir && git rev-parse --short HEAD))"
  (cd $dir && PYTHONPATH=$dir timeout 150 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072,16x32768 \
      --variants 1/1,2/2 --tunings '[{}, {}]' --json $OUT/streams-$tree.json 2>&1 | grep -v -i "warn\|capture_end")
done
echo "== end"
