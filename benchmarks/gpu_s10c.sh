#!/bin/bash
# GPU runbook, session 10 (H200), part c: launch parameters for two batch parts on two streams
# (gpu_s10b.sh's sweep stopped at its first override: a bug in ds_streams.py, fixed).
# Writes $OUT/streams.json and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== streams"; timeout 250 python3 benchmarks/ds_streams.py --cases 16x32768,3x131072 --variants 1/1,2/2 \
    --tunings '[{}, {"fuse_merge": true}, {"score_programs_per_sm": 4, "mma_programs_per_sm": 2}, {"select_programs_per_sm": 2, "hist_programs_per_sm": 4}, {"sparse_attn_programs_per_sm": 2}, {"mma_programs_per_sm": 2, "select_programs_per_sm": 2, "hist_programs_per_sm": 4, "sparse_attn_programs_per_sm": 2}, {"select_block_n": 2048}, {"hist_block_n": 2048}, {"mma_programs_per_sm": 8}, {"sparse_attn_programs_per_sm": 8}]' \
    --json $OUT/streams.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
