#!/bin/bash
# GPU runbook (session 4, H200): LongChat-7B (MHA: 32 KV heads) 20K x 3, DS r16 k1024, with each
# score kernel (rows = one KV head per program, mma = all heads per program). Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
cd $OUT
C="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --skip-warmup --batch-size 3 --output-len 200 --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024"
for impl in rows mma; do
  echo "== longchat ds score_impl=$impl"
  DOUBLESPARSE_TUNING="{\"score_impl\": \"$impl\"}" timeout 80 $C --result-json longchat-ds-$impl.json 2>&1 | grep -E '^(Prefill|Decode.  median|Profile. decode)'
done
echo "== end"
