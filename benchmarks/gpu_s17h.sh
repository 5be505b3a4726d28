#!/bin/bash
# GPU runbook, session 17 (H200), part h: score_tc.cu with all KV heads of a token in one warp
# (whole label rows per warp): tests, the score probe (two rounds), the quick grid with it on.
# Ran at 58f1de9; that commit (UPW) was reverted after this call, so this runbook does not run at
# later trees.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 240 python3 -m pytest -q -x tests/test_kernels.py -k "cuda_score or tensor_core" 2>&1 | tail -3
echo "== score probe"; timeout 150 python3 benchmarks/score_cuda_probe.py --rounds 2 --cases 3x65536,3x131072fp8,16x32768 --json $OUT/score-cuda-probe.json 2>&1 | grep -E "^bs|triton|full" | tail -40
echo "== quick grid"; DOUBLESPARSE_TUNING='{"score_cuda_tc_all_units": true}' timeout 100 python3 -m doublesparse.bench.attention --quick --json $OUT/quick-all-units.json 2>&1 | tail -8
echo "== end"
