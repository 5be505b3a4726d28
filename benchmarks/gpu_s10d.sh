#!/bin/bash
# GPU runbook, session 10 (H200), part d: where a 32K prompt's prefill goes (issue 5's prefill,
# 16384-token chunks; benchmarks/profile_prefill.py), dense and DS.
# Writes $OUT/prefill-*.json and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
timeout 120 python3 benchmarks/profile_prefill.py --json $OUT/prefill-dense.json
timeout 120 python3 benchmarks/profile_prefill.py --enable-double-sparsity --json $OUT/prefill-ds.json
timeout 120 python3 benchmarks/profile_prefill.py --chunked-prefill-size 32768 --json $OUT/prefill-dense-32k-chunk.json
echo "== end"
