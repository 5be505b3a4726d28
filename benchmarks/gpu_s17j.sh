#!/bin/bash
# GPU runbook, session 17 (H200), part j: the final tree's CUDA-score and DS tests on the GPU (the
# score kernels' shared parameter list and block slice moved into score_common.cuh after call i).
source benchmarks/runbook_lib.sh; runbook_start
timeout 200 python3 -m pytest -q -x tests/test_kernels.py -k "cuda_score or tensor_core or ds_decode or pipelines" 2>&1 | tail -3
echo "== end"
