#!/bin/bash
# GPU runbook (session 5, H200; prepared, not run: the session's device time went to the serving
# runs): the prefill, engine and DS kernel tests on the GPU, then bench_one_batch (--profile, 200 output tokens) for Llama-3.1-8B
# 60K x 3 (dense, DS r16 k3750, DS r32 k3000; and dense with --chunked-prefill-size 16384).
# Writes under $OUT (the bench_one_batch JSONs as e2e.tgz).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== tests"; timeout 130 python3 -m pytest -q -x -p no:cacheprovider tests/test_prefill_attention.py tests/test_engine.py \
  tests/test_kernels.py -k "not interpreter and (sdpa or engine or graph or pipelines or repeated or chunk or mixed or dense)" 2>&1 | tail -3
mkdir -p /tmp/e2e; cd /tmp/e2e
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --skip-warmup --batch-size 3 --output-len 200"
G='^(Prefill|Decode.  median|Profile. decode|Double|KV pool)'
L="$B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
echo "== llama dense"; timeout 100 $L --result-json llama31-8b-60k-bs3-dense.json 2>&1 | grep -E "$G"
echo "== llama ds r16"; timeout 100 $L --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750 --result-json llama31-8b-60k-bs3-ds-r16-k3750.json 2>&1 | grep -E "$G"
echo "== llama ds r32"; timeout 100 $L --enable-double-sparsity --ds-heavy-channel-num 32 --ds-heavy-token-num 3000 --result-json llama31-8b-60k-bs3-ds-r32-k3000.json 2>&1 | grep -E "$G"
echo "== llama dense chunk 16384"; timeout 100 $L --chunked-prefill-size 16384 --result-json llama31-8b-60k-bs3-dense-chunk16k.json 2>&1 | grep -E "$G"
tar czf $OUT/e2e.tgz *.json
echo "== end"
