#!/bin/bash
# GPU runbook prepared in session 5 for the next session (H200): the prefill path's GPU tests, the
# prefill kernel sweep (split-prefix included, with first-call times: cuDNN builds a graph per new
# shape), then bench_one_batch prefill for Llama-3.1-8B 60K x 3 with and without
# DOUBLESPARSE_PREFILL_SPLIT_PREFIX=1, chunks of 4096 and 16384 (with the warmup run, so steady-state
# times are not cuDNN graph builds); then a decode-step profile at issue 5's serving shape (bs 16 x
# 32K, dense and DS). Writes under $OUT (bench_one_batch JSONs as e2e.tgz).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== tests"; timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/test_prefill_attention.py tests/test_engine.py -k "sdpa or chunk or graph" 2>&1 | tail -2
echo "== prefill sweep"; timeout 140 python3 benchmarks/prefill_attn_sweep.py --json $OUT/prefill.json 2>&1 | grep '^{'
mkdir -p /tmp/e2e; cd /tmp/e2e
L="python3 -m doublesparse.bench_one_batch --load-format dummy --batch-size 3 --output-len 4 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
G='^(Prefill|Decode.  median)'
for chunk in 4096 16384; do
  echo "== dense chunk $chunk"; timeout 80 $L --chunked-prefill-size $chunk --result-json dense-$chunk.json 2>&1 | grep -E "$G"
  echo "== dense chunk $chunk split"; DOUBLESPARSE_PREFILL_SPLIT_PREFIX=1 timeout 80 $L --chunked-prefill-size $chunk --result-json dense-$chunk-split.json 2>&1 | grep -E "$G"
done
# where a DS decode step at issue 5's serving shape (bs 16 x 32K) spends its time, dense beside it
S="python3 -m doublesparse.bench_one_batch --profile --skip-warmup --load-format dummy --model-path llama-3.1-8b --batch-size 16 --input-len 32768 --output-len 8 --max-total-tokens 540000"
echo "== serving shape dense"; timeout 100 $S --result-json serve-dense.json 2>&1 | grep -E "$G|^Profile|^ +[0-9]" | head -30
echo "== serving shape ds"; timeout 100 $S --enable-double-sparsity --result-json serve-ds.json 2>&1 | grep -E "$G|^Profile|^ +[0-9]" | head -30
tar czf $OUT/e2e.tgz *.json
echo "== end"
