#!/bin/bash
# GPU runbook, session 6 (H200): the select kernels' per-program stats (TUNING select_prog_stats:
# compact without its counting pass) on the GPU: the DS select tests, then an A/B sweep at
# bs3 x 64K / 128K, bs8 x 16K and issue 5's bs16 x 32K; then refresh issue 3's bench_one_batch
# Llama-3.1-8B and LongChat-7B rows
# on the current tree (split-prefix prefill on by default since session 6; the LongChat DS row now
# runs the engine's default score kernel choice, which picks "rows" for 32 KV heads x r 16).
# The commands are those of results/bench-one-batch-h200.json. Writes $OUT/e2e.tgz + console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k "pipelines or many_programs or repeated or graph" 2>&1 | tail -2
echo "== sweep"; timeout 150 python3 -m doublesparse.bench.attention --sweep-file benchmarks/sweep-s6c.json \
    --sweep-cases 3x65536,16x32768,8x16384,3x131072 --json $OUT/sweep-s6c.json 2>&1 | grep -E "^sweep|Error"
mkdir -p /tmp/e2e; cd /tmp/e2e
issue3_rows
tar czf $OUT/e2e.tgz *.json
echo "== end"
