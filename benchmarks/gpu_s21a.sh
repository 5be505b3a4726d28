#!/bin/bash
# GPU runbook, session 21, part a: the persistent DS decode (kernels/triton/ds_persistent.py, off
# by default; written in session 21 without a GPU). First its tests, kernel and engine: only on a
# GPU do its programs run concurrently and wait on each other's counters, so this is where the
# synchronisation is checked (the kernel tests with a spin limit, so that a synchronisation bug
# fails naming the stalled item instead of hanging; session 22). Then, if they pass, a sweep at 3 x 64K, 3 x 128K (bf16 and fp8
# labels: case "3x131072fp8" times both) and 16 x 32K (benchmarks/sweep-s21.json): the default
# separate launches (CUDA score and select), the separate Triton launches that run the same code
# as the persistent kernel, and persistent variants (fused histogram, programs per SM, score
# item size, lags, select slices, attention splits, warps).
source benchmarks/runbook_lib.sh; runbook_start
if timeout 240 python -m pytest -q -x tests/test_ds_persistent.py tests/test_engine.py -k "persistent" 2>&1 | tail -8; [ "${PIPESTATUS[0]}" = 0 ]; then
  cd $OUT
  timeout 320 python -m doublesparse.bench.attention --sweep-file $OLDPWD/benchmarks/sweep-s21.json \
    --sweep-cases 3x65536,3x131072fp8,16x32768 --json sweep-s21.json 2>&1 | grep -v "^#" | cut -c1-220
fi
echo "== end"
