#!/bin/bash
# GPU runbook, session 18 (H200), part e: the final tree. The engine's GPU tests of the split-K
# GEMM and the graphs; issue 2's attention grid ($OUT/attention-h200.{json,md}); issue 3's
# Llama-3.1-8B and LongChat-7B rows and SmolLM2-135M rows ($OUT/one-batch/*.json; SmolLM2 needs
# /root/m/smollm2.gguf, staged by ../shared/tools/split-embedded-model.sh, and the gguf wheel on
# PYTHONPATH). Writes $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 90 python3 -m pytest -q -x tests/test_fused.py tests/test_engine.py -k "skinny or linear or graph" 2>&1 | tail -2
echo "== attention grid"; timeout 150 python3 -m doublesparse.bench.attention --json $OUT/attention-h200.json \
    --md $OUT/attention-h200.md 2>&1 | tail -12
mkdir -p $OUT/one-batch; cd $OUT/one-batch
RUN_TIMEOUT=80 issue3_rows
S="python3 -m doublesparse.bench_one_batch --profile --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
RUN_TIMEOUT=50
run smollm2-8k-bs1-dense $S
run smollm2-8k-bs1-ds $S --enable-double-sparsity
echo "== end"
