#!/bin/bash
# GPU runbook, session 8 (H200), part d: the final tree (the select's three phases as one kernel,
# ds_topk.py). GPU tests of the DS kernels, engine graphs and overlap; issue 2's attention grid
# ($OUT/attention-h200.{json,md}); SmolLM2-135M (the real GGUF at /root/m/smollm2.gguf) bs 1 x 8K
# dense, DS and one step at a time; issue 3's Llama-3.1-8B and LongChat-7B rows, now each with a
# short warm-up run (--warmup-input-len 1024) so no timed prefill pays first-call compiles.
# Writes $OUT/s8d.tgz and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    tests/test_overlap.py -k "ds_ or pipelines or repeated or graph or overlap" 2>&1 | tail -3
echo "== attention grid"; timeout 170 python3 -m doublesparse.bench.attention --json $OUT/attention-h200.json \
    --md $OUT/attention-h200.md 2>&1 | tail -25
mkdir -p /tmp/s8d; cd /tmp/s8d
S="python3 -m doublesparse.bench_one_batch --profile --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
RUN_TIMEOUT=60
run smollm2-8k-bs1-dense $S
run smollm2-8k-bs1-ds $S --enable-double-sparsity
run smollm2-8k-bs1-dense-sync $S --disable-overlap-schedule
RUN_TIMEOUT=70
issue3_rows
tar czf $OUT/s8d.tgz *.json
echo "== end"
