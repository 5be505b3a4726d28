#!/bin/bash
# GPU runbook, session 9 (H200), part b: the sample select with its single-program phases as
# 16-way searches (comparisons and sums) instead of tl.histogram (gpu_s9a: pivots 15.8 us, the
# select 43.7 vs the radix select's 25.2 us at 64K x 3). GPU tests of the sample select, the
# bracket check, a short sweep; issue 3's Llama DS r16 row with the sample select if it is faster.
# Writes $OUT/sweep.json, $OUT/s9b.tgz and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "sample or ties or pipelines" 2>&1 | tail -4
echo "== bracket"; timeout 40 python3 benchmarks/select_bracket_check.py 3x65536 16x32768
cat > /tmp/sweep.json <<'J'
[{}, {"select_impl": "sample"}, {"select_impl": "sample", "sample_size": 2048},
 {"select_impl": "sample", "resolve_block": 4096, "resolve_warps": 16}, {"select_impl": "sample", "resolve_warps": 8},
 {"select_impl": "sample", "sample_warps": 16}]
J
echo "== sweep"; timeout 150 python3 -m doublesparse.bench.attention --sweep-file /tmp/sweep.json \
    --sweep-cases 3x65536,16x32768 --json $OUT/sweep.json 2>&1 | grep -E "^(sweep|#)"
mkdir -p /tmp/s9b; cd /tmp/s9b
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
RUN_TIMEOUT=70
DOUBLESPARSE_TUNING='{"select_impl": "sample"}' run llama31-8b-60k-bs3-ds-r16-k3750-sample $B --model-path llama-3.1-8b \
    --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
tar czf $OUT/s9b.tgz *.json
echo "== end"
