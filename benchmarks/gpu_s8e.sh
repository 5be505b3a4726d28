#!/bin/bash
# GPU runbook, session 8 (H200), part e: is Llama-3.1-8B's dense prefill slower than DS's (14.1K vs
# 15.2K tok/s in gpu_s8d.sh, same prefill code) because of the order of the rows? DS first, then
# dense twice, each its own process as in issue3_rows. Writes $OUT/s8e.tgz and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
mkdir -p /tmp/s8e; cd /tmp/s8e
B="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
L="$B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
RUN_TIMEOUT=70
run llama31-8b-60k-bs3-ds-r16-k3750 $L --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
run llama31-8b-60k-bs3-dense $L
run llama31-8b-60k-bs3-dense-again $L
tar czf $OUT/s8e.tgz *.json
echo "== end"
