#!/bin/bash
# GPU runbook, prepared in session 13 for the next session (H200): which select phases should load
# their keys one block ahead. Session 13 measured "23" (both) against "" (neither): the DS decode step
# 8.61 vs 8.69 ms at bs 16 x 32K, and in the two-part profile the low-byte pass got shorter while
# the compact pass got longer. Here "", "2", "3" and "23", alternating twice, at issue 5's decode
# shape (bs 16 x 32K, two parts, r 16, k 2048), then once each at issue 3's 60K x 3 DS row (r 16,
# k 3750). Writes $OUT/console.log and $OUT/*.json. About 7 minutes on a started machine.
source benchmarks/runbook_lib.sh; runbook_start
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --model-path llama-3.1-8b --enable-double-sparsity --ds-heavy-channel-num 16"
S="$B --batch-size 16 --output-len 32 --input-len 32768 --max-total-tokens 540672 --ds-heavy-token-num 2048 --ds-batch-parts 2"
L="$B --batch-size 3 --output-len 200 --input-len 60000 --max-total-tokens 190000 --ds-heavy-token-num 3750"
for i in 1 2; do
  for v in none 2 3 23; do
    p=$v; [ $v = none ] && p=""
    echo "== bs16-32k prefetch=$v $i"
    DOUBLESPARSE_TUNING="{\"select_prefetch\": \"$p\"}" timeout 75 $S \
      --result-json $OUT/bs16-32k-ds-parts2-prefetch-$v-$i.json 2>&1 | grep -E "^(Profile. decode|Decode.  median latency)"
  done
done
for v in none 2 23; do
  p=$v; [ $v = none ] && p=""
  echo "== 60k-bs3 prefetch=$v"
  DOUBLESPARSE_TUNING="{\"select_prefetch\": \"$p\"}" timeout 60 $L \
    --result-json $OUT/llama31-8b-60k-bs3-ds-r16-k3750-prefetch-$v.json 2>&1 | grep -E "^(Decode.  median|Profile. decode)"
done
echo "== end"
