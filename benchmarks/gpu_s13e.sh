#!/bin/bash
# GPU runbook, session 13, part e: the select's phases 2 and 3 loading each block's keys one
# iteration ahead, the first before their prologue (TUNING["select_prefetch"], default on) against
# loading them where they are used (off, the select before). ncu (call d) put the compact phase's
# largest stall on the first use of its keys (long scoreboard, 18 % of samples).
# (1) one layer, r 16, k = L/16, group_max, on/off alternating: 16 x 32K one and two parts,
# 3 x 64K, 3 x 128K; (2) GPU kernel tests; (3) the engine's DS decode step, off/on alternating, at
# issue 5's shape (bs 16 x 32K, two parts, r 16, k 2048) and issue 3's 60K x 3 DS row (r 16, k 3750).
# Writes $OUT/console.log, $OUT/streams-*.json and the bench_one_batch JSON files.
source benchmarks/runbook_lib.sh; runbook_start
T='[{"select_prefetch": false}, {}, {"select_prefetch": false}, {}]'
timeout 90 python3 benchmarks/ds_streams.py --cases 16x32768 --variants 1/1,2/2 --tunings "$T" \
    --json $OUT/streams-16x32k.json 2>&1 | grep -v -i "warn\|capture_end"
timeout 80 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072 --variants 1/1 --tunings "$T" \
    --json $OUT/streams-bs3.json 2>&1 | grep -v -i "warn\|capture_end"
timeout 110 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -2
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --model-path llama-3.1-8b --enable-double-sparsity --ds-heavy-channel-num 16"
S="$B --batch-size 16 --output-len 32 --input-len 32768 --max-total-tokens 540672 --ds-heavy-token-num 2048 --ds-batch-parts 2"
L="$B --batch-size 3 --output-len 200 --input-len 60000 --max-total-tokens 190000 --ds-heavy-token-num 3750"
for v in off on; do
  tun='{}'; [ $v = off ] && tun='{"select_prefetch": false}'
  echo "== bs16-32k $v"
  DOUBLESPARSE_TUNING="$tun" timeout 75 $S --result-json $OUT/bs16-32k-ds-parts2-prefetch-$v.json 2>&1 \
    | grep -E "^(Profile. decode|Decode.  median latency)"
done
for v in off on; do
  tun='{}'; [ $v = off ] && tun='{"select_prefetch": false}'
  echo "== 60k-bs3 $v"
  DOUBLESPARSE_TUNING="$tun" timeout 60 $L --result-json $OUT/llama31-8b-60k-bs3-ds-r16-k3750-prefetch-$v.json 2>&1 \
    | grep -E "^(Prefill|Decode.  median|Profile. decode)"
done
echo "== end"
