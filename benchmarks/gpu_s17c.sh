#!/bin/bash
# GPU runbook, session 17 (H200), part c: score_tc.cu with two KV heads per warp (16-byte lane
# loads): its GPU tests, the score probe in two rounds, and the quick grid with it as the default.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 300 python3 -m pytest -q -x tests/test_kernels.py -k "cuda_score or tensor_core or pipelines or score_impl" 2>&1 | tail -4
echo "== score probe"; timeout 200 python3 benchmarks/score_cuda_probe.py --rounds 2 --json $OUT/score-cuda-probe.json 2>&1 | tail -90
echo "== quick grid"; timeout 100 python3 -m doublesparse.bench.attention --quick --json $OUT/quick.json 2>&1 | tail -8
echo "== end"
