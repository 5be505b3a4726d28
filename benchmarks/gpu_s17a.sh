#!/bin/bash
# GPU runbook, session 17 (H200), part a: the GPU tests never run on a GPU (session 16's CUDA-score
# pipelines, fallback, tidies), the score probe with PROBE 3 (warp loads over contiguous bytes),
# and the quick grid's stage times at the session's starting tree.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 240 python3 -m pytest -q -x tests/test_kernels.py -k "cuda or ds_ or pipelines or score_impl" 2>&1 | tail -5
echo "== score probe"; timeout 150 python3 benchmarks/score_cuda_probe.py --json $OUT/score-cuda-probe.json 2>&1 | tail -30
echo "== quick grid"; timeout 100 python3 -m doublesparse.bench.attention --quick --json $OUT/quick.json 2>&1 | tail -8
echo "== end"
