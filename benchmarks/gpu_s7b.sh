#!/bin/bash
# GPU runbook, session 7 (H200), part b: issue 3's bench_one_batch rows for Llama-3.1-8B (60K x 3)
# and LongChat-7B (20K x 3), the commands of results/bench-one-batch-h200.json, on the tree with
# programmatic dependent launch and the overlapped decode loop. Writes $OUT/s7b.tgz + console.log.
source benchmarks/runbook_lib.sh; runbook_start
mkdir -p /tmp/s7b; cd /tmp/s7b
issue3_rows
tar czf $OUT/s7b.tgz *.json
echo "== end"
