#!/bin/bash
# GPU runbook, session 20 (H200), part a: score_tc.cu's label rows in a ring of DEPTH steps
# (DEPTH - 1 steps' loads in flight while one is scored; session 19's ncu found the score
# latency-bound at ~0.45 eligible warps per scheduler). First the CUDA score tests on the GPU
# (depths 2, 3, 8 against the Triton score), then the score alone by ring depth and tiles per
# step at 3 x 64K and 16 x 32K (bf16) and 3 x 61440 (fp8), rotating over 4 label copies.
source benchmarks/runbook_lib.sh; runbook_start
timeout 200 python -m pytest -q -x tests/test_kernels.py -k "cuda_score" 2>&1 | tail -3
cd $OUT
timeout 300 python $OLDPWD/benchmarks/score_cuda_probe.py --cases 3x65536,16x32768,3x61440fp8 --geometries depth \
  --variants loads,full --rounds 2 --copies 4 --json score-depth.json
echo "== end"
