#!/bin/bash
# GPU runbook, session 10 (H200), part b: batch parts on streams with launch parameters scaled
# down for two concurrent parts (benchmarks/ds_streams.py --tunings), then the engine's DS decode
# step at issue 5's serving shape (bs 16 x 32K, r 16, k 2048) with --ds-batch-parts 1 and 2.
# Writes $OUT/streams.json, $OUT/*.json (bench_one_batch) and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== streams"; timeout 150 python3 benchmarks/ds_streams.py --cases 16x32768,3x131072,8x32768 --variants 1/1,2/2 \
    --tunings '[{}, {"score_programs_per_sm": 4, "mma_programs_per_sm": 2}, {"select_programs_per_sm": 2, "hist_programs_per_sm": 4}, {"sparse_attn_programs_per_sm": 2}, {"mma_programs_per_sm": 2, "select_programs_per_sm": 2, "hist_programs_per_sm": 4, "sparse_attn_programs_per_sm": 2}]' \
    --json $OUT/streams.json 2>&1 | grep -v -i "warn\|capture_end"
cd $OUT
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 16 --output-len 32 --model-path llama-3.1-8b --input-len 32768 --max-total-tokens 540672 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 2048"
RUN_TIMEOUT=110
run llama31-8b-32k-bs16-ds-r16-k2048-parts1 $B
run llama31-8b-32k-bs16-ds-r16-k2048-parts2 $B --ds-batch-parts 2
echo "== end"
