#!/bin/bash
# GPU runbook, session 7 (H200), part c: the final PDL split (pdl.py: RMSNorm, SiLU-mul, RoPE +
# store, the attention merge and the GEMV launched with PDL; attention and DS kernels normally).
# GPU tests; an A/B of the decode kernels (one layer, PDL on/off); SmolLM2-135M (the real GGUF at
# /root/m/smollm2.gguf) bs 1 x 8K dense and DS; issue 3's Llama-3.1-8B and LongChat-7B rows (the
# commands of results/bench-one-batch-h200.json). Writes $OUT/s7c.tgz and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_kernels.py \
    tests/test_engine.py tests/test_overlap.py \
    -k "gemv or linear or fused_path or pipelines or many_programs or repeated or graph or overlap or dense" 2>&1 | tail -3
mkdir -p /tmp/s7c
echo "== sweep"; timeout 100 python3 -m doublesparse.bench.attention --sweep-file benchmarks/sweep-s7.json \
    --sweep-cases 3x65536,16x32768 --json /tmp/s7c/sweep-s7c.json 2>&1 | grep -E "^sweep|Error"
cd /tmp/s7c
S="python3 -m doublesparse.bench_one_batch --profile --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
run smollm2-8k-bs1-dense $S
run smollm2-8k-bs1-ds $S --enable-double-sparsity
run smollm2-8k-bs1-dense-sync $S --disable-overlap-schedule
issue3_rows
tar czf $OUT/s7c.tgz *.json
echo "== end"
