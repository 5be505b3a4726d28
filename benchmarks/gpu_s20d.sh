#!/bin/bash
# GPU runbook, session 20 (H200), part d: the final tree's issue 3 rows (Llama-3.1-8B 60K x 3 and
# LongChat-7B 20K x 3, dense and DS; the commands of results/bench-one-batch-h200.json).
source benchmarks/runbook_lib.sh; runbook_start
mkdir -p $OUT/one-batch; cd $OUT/one-batch
RUN_TIMEOUT=85 issue3_rows
echo "== end"
