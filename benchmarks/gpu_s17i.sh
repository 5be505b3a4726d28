#!/bin/bash
# GPU runbook, session 17 (H200), part i: the final kernels (score_tc.cu as the CUDA score for
# bf16/fp16/fp8 labels where its shapes allow): issue 2's attention grid ($OUT/attention-h200.{json,md})
# and issue 3's Llama-3.1-8B and LongChat-7B rows ($OUT/one-batch/*.json). Writes $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== attention grid"; timeout 200 python3 -m doublesparse.bench.attention --json $OUT/attention-h200.json \
    --md $OUT/attention-h200.md 2>&1 | tail -12
mkdir -p $OUT/one-batch; cd $OUT/one-batch
RUN_TIMEOUT=90 issue3_rows
echo "== end"
