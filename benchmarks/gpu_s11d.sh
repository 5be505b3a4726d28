#!/bin/bash
# GPU runbook, session 11 (H200), part d: the split-prefix prefill folds the query group into the
# chunk-vs-prefix call instead of repeating the prefix K/V (attention/prefill.py). Tests, a one-layer
# A/B against session 10's path (benchmarks/prefill_split_ab.py), then profile_prefill with
# 16384-token chunks (call a: kernel time 1.288 s, norm/elementwise 114 ms) and with the engine's
# default 4096. Writes $OUT/console.log, $OUT/split-ab.json, $OUT/prefill-*.json.
source benchmarks/runbook_lib.sh; runbook_start
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_attention.py tests/test_fused.py \
    -k "lse or split or sdpa" 2>&1 | tail -2
timeout 90 python3 benchmarks/prefill_split_ab.py --json $OUT/split-ab.json 2>&1 | grep -v -i warn
timeout 120 python3 benchmarks/profile_prefill.py --json $OUT/prefill-dense-16k-chunks.json 2>&1 | grep -v -i warn | head -9
timeout 120 python3 benchmarks/profile_prefill.py --chunked-prefill-size 4096 --json $OUT/prefill-dense-4k-chunks.json 2>&1 | grep -v -i warn | head -9
echo "== end"
