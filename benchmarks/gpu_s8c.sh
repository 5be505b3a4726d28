#!/bin/bash
# GPU runbook, session 8 (H200), part c: the hand-pipelined attention loop (decode_attn PREFETCH;
# TUNING attn_prefetch / sparse_attn_prefetch) and the sparse attention's launch knobs, stage by
# stage, at issue 2's bs 3 cases and the serving load (bs 16 x 32K); the phased select with its
# first phase's own geometry again (hist_block_n / hist_programs_per_sm) vs the one-launch select.
# The first row of a bench.attention process reads slow (results/h200-s7), so {} runs first and last.
# Writes $OUT/sweep.json and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "prefetch or one_launch or pipelines or dense_decode" 2>&1 | tail -3
cat > /tmp/sweep.json <<'J'
[{}, {"sparse_attn_prefetch": true}, {"sparse_attn_prefetch": true, "attn_block_n": 32},
 {"sparse_attn_prefetch": true, "attn_warps": 8}, {"sparse_attn_stages": 3}, {"sparse_attn_stages": 1},
 {"sparse_attn_programs_per_sm": 8}, {"sparse_attn_programs_per_sm": 2}, {"select_coop": true},
 {"attn_prefetch": true}, {}]
J
echo "== sweep"; timeout 330 python3 -m doublesparse.bench.attention --sweep-file /tmp/sweep.json \
    --sweep-cases 3x65536,3x131072,16x32768 --json $OUT/sweep.json 2>&1 | grep -E "^(sweep|#)"
echo "== end"
