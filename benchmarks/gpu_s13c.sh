#!/bin/bash
# GPU runbook, session 13, part c: the select with one key per thread per access
# (TUNING["select_vector_keys"] = "", ds_select._block_offs) against 16-byte key loads in all three
# phases ("123", the layout before), and mixes. On sm_90 (CPU compile) the scalar layout cut
# registers 96/56/112 -> 64/40/64 for phases 1/2/3 and the barriers of phases 2/3 18/42 -> 13/34.
# (1) GPU kernel tests on the new default; (2) one layer, r 16, k = L/16, group_max: 16 x 32K with
# one and two parts, 3 x 64K and 3 x 128K with one part; old and new each timed twice.
# Writes $OUT/console.log and $OUT/streams-*.json.
# Ran at f6570fb (call c of results/h200-s13/README.md). Slower at every shape, so 2843016 removed
# the knob: on later trees the tunings naming it are refused.
source benchmarks/runbook_lib.sh; runbook_start
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -2
T='[{"select_vector_keys": "123"}, {}, {"select_vector_keys": "1"}, {"select_programs_per_sm": 8}, {"select_vector_keys": "123"}, {}]'
timeout 150 python3 benchmarks/ds_streams.py --cases 16x32768 --variants 1/1,2/2 --tunings "$T" \
    --json $OUT/streams-16x32k.json 2>&1 | grep -v -i "warn\|capture_end"
timeout 120 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072 --variants 1/1 --tunings "$T" \
    --json $OUT/streams-bs3.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
