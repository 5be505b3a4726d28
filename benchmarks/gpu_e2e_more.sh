#!/bin/bash
# Second GPU runbook for results/bench-one-batch-h200-s2/: LongChat-7B 20K x 3 (dense, DS r16 k1024) and
# Llama-3.1-8B 60K x 3 with the seed setting (DS r32 k3000). Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --skip-warmup --batch-size 3 --output-len 64"
echo "== longchat dense"; timeout 100 $B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --result-json $OUT/longchat-7b-20k-bs3-dense.json 2>&1 | grep -E "^(Prefill|Decode.  median|Profile. decode|KV pool)"
echo "== longchat ds"; timeout 100 $B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024 --result-json $OUT/longchat-7b-20k-bs3-ds-r16-k1024.json 2>&1 | grep -E "^(Prefill|Decode.  median|Profile. decode|Double)"
echo "== llama ds r32 k3000"; timeout 100 $B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 32 --ds-heavy-token-num 3000 --result-json $OUT/llama31-8b-60k-bs3-ds-r32-k3000.json 2>&1 | grep -E "^(Prefill|Decode.  median|Profile. decode|Double)"
echo "== end"
