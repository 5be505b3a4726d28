#!/bin/bash
# GPU runbook, session 15 (H200): the CUDA select with 8 or 16 keys per thread per step
# (select_cuda_vec), one layer (ds_streams.py), then the engine's DS decode step at issue 5's shape
# (bench_one_batch, 16 x 32K, r 16, k 2048, two batch parts) with the Triton and the CUDA select.
# Ran at commit 64d7212. 16 keys per thread were no faster, so the knob was removed afterwards.
# Writes $OUT/console.log, $OUT/streams-vec.json, $OUT/bs16-32k-ds-parts2-{triton,cuda}.json.
source benchmarks/runbook_lib.sh; runbook_start
C='"select_impl": "cuda"'
timeout 200 python3 benchmarks/ds_streams.py --cases 16x32768,3x65536 --variants 1/1,2/2 \
  --tunings "[{$C}, {$C, \"select_cuda_vec\": 16}, {}, {$C}, {$C, \"select_cuda_vec\": 16}]" \
  --json $OUT/streams-vec.json 2>&1 | grep -v -i "warn\|capture_end"
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --model-path llama-3.1-8b --enable-double-sparsity --ds-heavy-channel-num 16 --batch-size 16 --output-len 32 --input-len 32768 --max-total-tokens 540672 --ds-heavy-token-num 2048 --ds-batch-parts 2"
for impl in triton cuda; do
  echo "== bs16-32k select_impl $impl"
  DOUBLESPARSE_TUNING="{\"select_impl\": \"$impl\"}" timeout 80 $B --result-json $OUT/bs16-32k-ds-parts2-$impl.json 2>&1 \
    | grep -E "^(Profile. decode|Decode.  median latency)"
done
echo "== end"
