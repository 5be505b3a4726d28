#!/bin/bash
# GPU runbook, session 13, part b: does halving the label bytes (fp8 e4m3 labels) shorten the DS
# decode step at issue 5's decode shape? bench_one_batch, dummy Llama-3.1-8B, bs 16 x 32K, two batch
# parts, r 16, k 2048 (the serving run's DS settings), bf16 labels then fp8 labels, then bf16 again
# (a repeat, to show the spread). Writes $OUT/console.log and $OUT/bs16-32k-ds-parts2-*.json.
source benchmarks/runbook_lib.sh; runbook_start
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 16 --output-len 32 --model-path llama-3.1-8b --input-len 32768 --max-total-tokens 540672 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 2048 --ds-batch-parts 2"
for v in bf16 fp8 bf16-repeat; do
  echo "== $v"
  timeout 150 $B --ds-label-dtype ${v%-repeat} --result-json $OUT/bs16-32k-ds-parts2-$v.json 2>&1 \
    | grep -E "^(Profile. decode|Decode.  median latency)"
done
echo "== end"
