#!/bin/bash
# GPU runbook, session 20 (H200), part f: the sparse attention stage sits ~4 us above what one
# launch needs to gather its 50 MB of rows (call b's read_ceiling.py), so its launch knobs are
# swept again on the current kernels (programs per SM, pipeline stages, tile, warps; the default
# first and last) at 3 x 64K, 3 x 128K and 16 x 32K (benchmarks/sweep-s20.json).
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
timeout 400 python -m doublesparse.bench.attention --sweep-file $OLDPWD/benchmarks/sweep-s20.json \
  --sweep-cases 3x65536,3x131072,16x32768 --json sweep-s20.json 2>&1 | grep -v "^#" | cut -c1-220
echo "== end"
