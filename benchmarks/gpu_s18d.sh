#!/bin/bash
# GPU runbook, session 18 (H200), part d: the package's split-K GEMM (skinny.py) at 3 rows with
# each split_k and one or two weight tiles loaded before the PDL wait, against cuBLAS, on
# Llama-3.1-8B's projections and lm_head (skinny_gemm_probe.py); its tests first. Ran at 2c9cebe;
# pre_tiles (no gain) was removed after it, and --package now takes split_k values only.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 100 python3 -m pytest -q -x tests/test_fused.py -k "skinny or linear" 2>&1 | tail -2
echo "== probe"; timeout 300 python3 benchmarks/skinny_gemm_probe.py --rows 3 --configs "" --repeats 20 \
  --package 1:1,2:1,4:1,8:1,16:1,1:2,2:2,4:2,8:2,16:2 \
  --shapes 4096x4096,6144x4096,4096x14336,28672x4096,128256x4096 --json $OUT/skinny-split-probe.json 2>&1 | grep -v -i warn
echo "== end"
