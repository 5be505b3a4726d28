#!/bin/bash
# GPU runbook, session 17 (H200), part b: the tensor-core label score (kernels/cuda/score_tc.cu):
# its GPU tests and the CUDA-score tests, the score probe (both sources, several geometries), and
# the quick grid with it as the default.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 300 python3 -m pytest -q -x tests/test_kernels.py -k "cuda_score or tensor_core or pipelines or score_impl" 2>&1 | tail -5
echo "== score probe"; timeout 150 python3 benchmarks/score_cuda_probe.py --json $OUT/score-cuda-probe.json 2>&1 | tail -60
echo "== quick grid"; timeout 100 python3 -m doublesparse.bench.attention --quick --json $OUT/quick.json 2>&1 | tail -8
echo "== end"
