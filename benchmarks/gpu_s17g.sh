#!/bin/bash
# GPU runbook, session 17 (H200), part g: score_tc.cu for fp16 and fp8 labels (fp16 mma), the CUDA
# attention removed: the CUDA-score and DS tests, the score probe with fp8 labels, the quick grid.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 300 python3 -m pytest -q -x tests/test_kernels.py -k "cuda or ds_ or pipelines or score_impl or tensor_core" 2>&1 | tail -4
echo "== score probe"; timeout 150 python3 benchmarks/score_cuda_probe.py --cases 3x131072fp8,3x65536fp8,3x65536 --json $OUT/score-cuda-probe.json 2>&1 | grep -E "^bs|triton|full|loads" | tail -40
echo "== quick grid"; timeout 100 python3 -m doublesparse.bench.attention --quick --json $OUT/quick.json 2>&1 | tail -8
echo "== end"
