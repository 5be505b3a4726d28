#!/bin/bash
# GPU runbook, session 12, part c: the select without a count pass (phase 2 leaves per-program
# low-byte histograms and counts, phase 3 sums them for its offsets; deterministic) against the
# select of cae0fed (count loop + atomic output reservation, one launch), whose package the call
# carries as .stage/old (`git archive cae0fed doublesparse | tar -x -C .stage/old`).
# (1) GPU tests of the kernels; (2) one layer, r 16, k = L/16, group_max, one part, old and new
# alternating twice on one machine, each with a repeat (max|diff| 0 = bitwise equal repeat).
# Writes $OUT/console.log and $OUT/streams-{old,new}-{1,2}.json.
source benchmarks/runbook_lib.sh; runbook_start
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -2
for i in 1 2; do
  for t in old new; do
    P=$PWD; [ $t = old ] && P=$PWD/.stage/old
    echo "== $t $i"
    PYTHONPATH=$P timeout 60 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072,16x32768 --variants 1/1 \
        --tunings '[{}, {}]' --json $OUT/streams-$t-$i.json 2>&1 | grep -v -i "warn\|capture_end"
  done
done
echo "== end"
