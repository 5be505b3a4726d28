#!/bin/bash
# GPU runbook, session 16 (H200), part e: the CUDA label score, fourth version (each query piece
# read once for a thread's 4 rows; c2d845a). GPU tests of the CUDA/DS kernels and the engine's
# graphs; whole DS calls in graphs, Triton (mma) vs CUDA score alternating (ds_streams.py, one
# part); issue 3's Llama-3.1-8B DS row (r16 k3750) with each score. Writes $OUT/console.log,
# $OUT/streams-score4.json, $OUT/llama31-8b-60k-bs3-ds-r16-k3750-{mma,cuda}.json.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
  -k "cuda or ds_ or graph" 2>&1 | tail -3
echo "== streams"
T='[{"score_impl": "mma"}, {}, {"score_impl": "mma"}, {}, {"score_impl": "mma"}, {}]'
timeout 150 python3 benchmarks/ds_streams.py --cases 3x65536,16x32768,3x131072 --variants 1/1,2/2 --tunings "$T" \
  --json $OUT/streams-score4.json 2>&1 | grep -v -i "warn\|capture_end"
cd $OUT
L="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
for impl in mma cuda; do
  echo "== score_impl $impl"
  DOUBLESPARSE_TUNING="{\"score_impl\": \"$impl\"}" timeout 90 $L --result-json llama31-8b-60k-bs3-ds-r16-k3750-$impl.json 2>&1 \
    | grep -E "^(Prefill|Profile. decode|Decode.  median latency)"
done
echo "== end"
