#!/bin/bash
# GPU runbook, session 19 (H200), part d: would the o_proj / qkv weights read from L2 make the
# engine's split-K GEMM (skinny.py) faster at 3 rows? l2_prefetch_probe.py with --gemm skinny and
# cuBLAS, the stream sized as Llama-3.1-8B's gathered K/V at 60K x 3, k 3750 (46 MB).
source benchmarks/runbook_lib.sh; runbook_start
cd benchmarks
for g in skinny cublas; do
  timeout 120 python l2_prefetch_probe.py --gemm $g --rows 3 --stream-mb 46 --shapes 4096x4096,6144x4096 \
    --repeats 20 --json $OUT/l2-prefetch-$g.json
done
echo "== end"
