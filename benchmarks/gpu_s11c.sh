#!/bin/bash
# GPU runbook, session 11 (H200), part c: batch parts skewed across streams (ds_streams.py variants
# "P/Ps": part j's stream waits until part j-1's score has run, so one part's select overlaps the
# next part's score instead of every part scoring at once), against 1 part and plain 2 parts.
# One layer, r 16, k = L/16, group_max. Writes $OUT/console.log and $OUT/streams-s11c.json.
source benchmarks/runbook_lib.sh; runbook_start
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "score_then_rest or workspace_rows" 2>&1 | tail -2
T='[{}, {"compact_count_stages": 3, "select_loop_stages": 2}]'
timeout 400 python3 benchmarks/ds_streams.py --cases 16x32768,3x65536,3x131072,8x16384 \
    --variants 1/1,2/2,2/2s,3/3s,4/4s --tunings "$T" --json $OUT/streams-s11c.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
