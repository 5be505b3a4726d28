#!/bin/bash
# GPU runbook, session 15 (H200): the CUDA select after its loads went one chunk ahead (the first
# before each kernel's prologue), the candidates' slots load before the ranking, and one barrier
# per compact step. Same checks as gpu_s15a.sh, then the select's programs per SM swept.
# Writes $OUT/console.log, $OUT/select-probe.json, $OUT/streams-impl.json. ~5 minutes started.
source benchmarks/runbook_lib.sh; runbook_start
DOUBLESPARSE_TUNING='{"select_impl": "cuda"}' timeout 200 python3 -m pytest -q -x \
  tests/test_kernels.py -k "ds_" 2>&1 | tail -3
timeout 120 python3 benchmarks/select_impl_probe.py --cases 16x32768,3x65536,3x131072 \
  --json $OUT/select-probe.json 2>&1 | grep -v -i "warn\|capture_end"
C='"select_impl": "cuda"'
timeout 280 python3 benchmarks/ds_streams.py --cases 16x32768,3x65536 --variants 1/1,2/2 \
  --tunings "[{}, {$C}, {$C, \"select_programs_per_sm\": 8}, {$C, \"select_programs_per_sm\": 16}, {$C, \"hist_programs_per_sm\": 4}, {$C, \"hist_programs_per_sm\": 16}, {}, {$C}]" \
  --json $OUT/streams-impl.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
