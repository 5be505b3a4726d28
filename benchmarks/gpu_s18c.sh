#!/bin/bash
# GPU runbook, session 18 (H200), part c: the one-launch split-K GEMM for decode projections of a
# few rows (kernels/triton/skinny.py, TUNING skinny_max_rows): its tests and the model's fused
# path, the engine's graph tests; the projections alone against cuBLAS (skinny_gemm_probe.py,
# Llama-3.1-8B's four projections and its lm_head); issue 3's 60K x 3 rows with it off and on.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 200 python3 -m pytest -q -x tests/test_fused.py tests/test_engine.py -k "skinny or linear or gemv or model or graph" 2>&1 | tail -3
echo "== probe"; timeout 120 python3 benchmarks/skinny_gemm_probe.py --rows 3,1 --configs "" --repeats 20 \
  --shapes 4096x4096,6144x4096,4096x14336,28672x4096,128256x4096 --json $OUT/skinny-probe.json 2>&1 | grep -v -i warn
cd $OUT
L="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
DS="--enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
for rows in 0 4; do
  RUN_TIMEOUT=80 DOUBLESPARSE_TUNING="{\"skinny_max_rows\": $rows}" run llama31-8b-60k-bs3-dense-skinny$rows $L
  RUN_TIMEOUT=80 DOUBLESPARSE_TUNING="{\"skinny_max_rows\": $rows}" run llama31-8b-60k-bs3-ds-r16-k3750-skinny$rows $L $DS
done
echo "== end"
