#!/bin/bash
# GPU runbook, session 8 (H200), part a: the one-launch top-k select (kernels/triton/ds_topk.py,
# PHASE 0 with per-row barriers; launch.TUNING "select_coop"). GPU tests of the DS kernels and
# the graph paths; the stage-by-stage sweep of the select variants against the three-launch
# select at issue 2's cases and at the serving load (bs 16 x 32K); issue 3's two DS rows.
# Writes $OUT/sweep.json, $OUT/s8a.tgz and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fused.py \
    tests/test_engine.py -k "ds_ or select or one_launch or graph" 2>&1 | tail -4
cat > /tmp/sweep.json <<'J'
[{}, {"select_coop": false}, {"coop_block_n": 2048}, {"coop_block_n": 1024}, {"coop_warps": 8},
 {"coop_block_n": 2048, "coop_warps": 8}]
J
echo "== sweep"; timeout 240 python3 -m doublesparse.bench.attention --sweep-file /tmp/sweep.json \
    --sweep-cases 3x65536,3x131072,3x131072fp8,16x32768 --json $OUT/sweep.json 2>&1 | grep -E "^(sweep|#)"
mkdir -p /tmp/s8a; cd /tmp/s8a
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --skip-warmup --batch-size 3 --output-len 200"
run llama31-8b-60k-bs3-ds-r16-k3750 $B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 \
    --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
run longchat-7b-20k-bs3-ds-r16-k1024 $B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 \
    --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024
tar czf $OUT/s8a.tgz *.json
echo "== end"
