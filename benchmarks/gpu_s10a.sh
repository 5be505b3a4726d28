#!/bin/bash
# GPU runbook, session 10 (H200), part a: GPU tests of the DS kernels (the select's per-phase
# kernel names from session 9 had not run compiled on a GPU; ws.rows), then the batch-parts-on-
# streams experiment (benchmarks/ds_streams.py) at the serving load and issue 2's/3's shapes.
# Writes $OUT/streams.json and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fused.py \
    -k "ds_ or select or ties or graph or pipelines or repeated or workspace_rows" 2>&1 | tail -4
echo "== streams"; timeout 200 python3 benchmarks/ds_streams.py --cases 16x32768,3x65536,8x16384,3x131072 \
    --variants 1/1,2/1,2/2,4/2,4/4,3/3,16/4 --json $OUT/streams.json
echo "== end"
