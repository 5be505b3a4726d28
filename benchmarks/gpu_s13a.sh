#!/bin/bash
# GPU runbook, prepared in session 12 for the next session (H200): the GPU tests that session 12's
# last device call did not reach for the select without a count pass (2c12270): the CUDA-graph
# capture tests of the kernels, and the engine's graph-vs-eager and batch-parts tests; the whole
# kernel test files with a timeout long enough this time (call f of session 12 was cut at 120 s).
# Without the embedded SmolLM2 on the machine, the engine tests that need it skip.
# Writes $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_ds_batch_parts.py \
    tests/test_fused.py 2>&1 | tail -3
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py -k "graph or parts or cohort" 2>&1 | tail -3
echo "== end"
