#!/bin/bash
# GPU runbook, prepared in session 11 for the next session (H200), part a:
# (1) the GPU tests of what session 11 changed after its last device call (ds_launch.py split,
#     the diagnostic contiguous-slot score);
# (2) what a label layout in request order could gain: the mma score reading each request's
#     labels as one run of slots, pipelined through shared memory by Triton (launch.TUNING
#     "diag_contiguous_slots"; the benchmark's pools hold one run per request), against the
#     gathering score. One layer, r 16, k = L/16, group_max.
# Writes $OUT/console.log and $OUT/streams-contig.json.
# Ran in session 12 at 05cfd1a (results/h200-s12/): no gain, so the diagnostic knobs were removed
# afterwards; this runbook only runs at that commit.
source benchmarks/runbook_lib.sh; runbook_start
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_ds_batch_parts.py \
    tests/test_fused.py 2>&1 | tail -2
T='[{}, {"diag_contiguous_slots": true}, {"diag_contiguous_slots": true, "diag_contiguous_stages": 2},
 {"diag_contiguous_slots": true, "diag_contiguous_stages": 4}, {"diag_contiguous_slots": true, "mma_programs_per_sm": 3}, {}]'
timeout 300 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072,16x32768 --variants 1/1 \
    --tunings "$T" --json $OUT/streams-contig.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
