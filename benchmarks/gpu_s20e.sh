#!/bin/bash
# GPU runbook, session 20 (H200), part e: score_tc.cu requesting its first label rows before it
# makes the query's B fragments (EARLY_ROWS), so that the slot -> row chain and the channel -> q
# chain overlap: the CUDA score tests on the GPU, then the score alone, "full" (early rows) against
# "full-late" (the order before), at the new default (2 tiles, ring of 3) and the old geometry.
source benchmarks/runbook_lib.sh; runbook_start
timeout 150 python -m pytest -q tests/test_kernels.py -k "cuda_score" 2>&1 | tail -2
cd $OUT
timeout 200 python $OLDPWD/benchmarks/score_cuda_probe.py --cases 3x65536,16x32768,3x61440fp8 --geometries s20 \
  --variants loads,full,full-late --rounds 3 --copies 4 --json score-early.json
echo "== end"
