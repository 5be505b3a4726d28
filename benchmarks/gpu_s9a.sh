#!/bin/bash
# GPU runbook, session 9 (H200), part a: the sample select (kernels/triton/ds_sample.py,
# launch.TUNING "select_impl": "sample") against the radix select. GPU tests of the DS kernels;
# how often the sample's bracket holds; the stage-by-stage sweep at issue 2's cases and at the
# serving load (bs 16 x 32K); issue 3's Llama DS r16 row with each select.
# Writes $OUT/sweep.json, $OUT/s9a.tgz and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "ds_ or select or ties or graph" 2>&1 | tail -4
echo "== bracket"; timeout 60 python3 benchmarks/select_bracket_check.py 3x65536 3x131072 16x32768 8x16384
cat > /tmp/sweep.json <<'J'
[{}, {"select_impl": "sample"}, {"select_impl": "sample", "sample_size": 2048},
 {"select_impl": "sample", "sample_size": 8192}, {"select_impl": "sample", "sample_z": 4.0},
 {"select_impl": "sample", "resolve_warps": 4}, {"select_impl": "sample", "resolve_warps": 16},
 {"select_impl": "sample", "sample_warps": 4}, {"select_impl": "sample", "select_block_n": 2048},
 {"select_impl": "sample", "select_programs_per_sm": 8}, {"select_impl": "sample", "resolve_block": 2048}]
J
echo "== sweep"; timeout 260 python3 -m doublesparse.bench.attention --sweep-file /tmp/sweep.json \
    --sweep-cases 3x65536,3x131072,3x131072fp8,16x32768 --json $OUT/sweep.json 2>&1 | grep -E "^(sweep|#)"
mkdir -p /tmp/s9a; cd /tmp/s9a
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
RUN_TIMEOUT=70
run llama31-8b-60k-bs3-ds-r16-k3750-radix $B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 \
    --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
DOUBLESPARSE_TUNING='{"select_impl": "sample"}' run llama31-8b-60k-bs3-ds-r16-k3750-sample $B --model-path llama-3.1-8b \
    --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
tar czf $OUT/s9a.tgz *.json
echo "== end"
