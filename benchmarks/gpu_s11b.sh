#!/bin/bash
# GPU runbook, session 11 (H200), part b: the select's compact phase with its own launch geometry
# (compact_* knobs; the count loop's pipelining depth apart from the emit loop's), and hist_low's
# select_* knobs now that they no longer move compact. One layer, r 16, k = L/16, group_max;
# 16 x 32K in one part and in two parts on two streams (issue 5's decode shape), 3 x 64K (issue 2).
# Writes $OUT/console.log and $OUT/streams-s11b.json.
source benchmarks/runbook_lib.sh; runbook_start
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "select or topk" 2>&1 | tail -2
T='[{}, {"compact_count_stages": 2}, {"compact_count_stages": 3}, {"compact_loop_stages": 2},
 {"compact_count_stages": 3, "compact_loop_stages": 2}, {"compact_block_n": 2048}, {"compact_block_n": 512},
 {"compact_programs_per_sm": 8}, {"compact_programs_per_sm": 2}, {"compact_block_n": 2048, "compact_count_stages": 3},
 {"select_loop_stages": 2}, {"select_block_n": 2048}, {"select_programs_per_sm": 8}, {}]'
timeout 420 python3 benchmarks/ds_streams.py --cases 16x32768 --variants 1/1,2/2 --tunings "$T" \
    --json $OUT/streams-s11b.json 2>&1 | grep -v -i "warn\|capture_end"
timeout 100 python3 benchmarks/ds_streams.py --cases 3x65536 --variants 1/1 --tunings "$T" \
    --json $OUT/streams-s11b-64k.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
