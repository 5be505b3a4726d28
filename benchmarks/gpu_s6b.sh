#!/bin/bash
# GPU runbook, session 6 (H200): the DS decode kernels' launch parameters at issue 5's serving shape
# (one layer, bs 16 x 32K, r 16, k = L/16 = 2048, group_max), where the session-6 serving run
# (results/serving-h200.md) left DS output tok/s at 1.375x dense against 1.4. Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 400 python3 -m doublesparse.bench.attention --sweep-file benchmarks/sweep-s6.json \
    --sweep-cases 16x32768 --json $OUT/sweep-s6.json 2>&1 | grep -E "^sweep|Error"
echo "== end"
