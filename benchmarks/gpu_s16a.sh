#!/bin/bash
# GPU runbook, session 16 (H200), part a: the current tree's GPU tests of the DS kernels (incl. the
# CUDA select), issue 2's attention grid ($OUT/attention-h200.{json,md}), the per-kernel stage
# times of one layer (select_impl_probe.py) and issue 3's SmolLM2-135M rows (the real GGUF at
# /root/m/smollm2.gguf, staged by ../shared/tools/split-embedded-model.sh). Writes $OUT/console.log,
# $OUT/select-probe.json and $OUT/one-batch/smollm2-8k-bs1-*.json.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda_select or ds_" 2>&1 | tail -2
echo "== attention grid"; timeout 200 python3 -m doublesparse.bench.attention --json $OUT/attention-h200.json \
    --md $OUT/attention-h200.md 2>&1 | tail -12
echo "== stages"; timeout 60 python3 benchmarks/select_impl_probe.py --cases 3x65536,3x131072,16x32768 \
    --json $OUT/select-probe.json 2>&1 | grep -v -i "warn"
mkdir -p $OUT/one-batch; cd $OUT/one-batch
S="python3 -m doublesparse.bench_one_batch --profile --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
RUN_TIMEOUT=60
run smollm2-8k-bs1-dense $S
run smollm2-8k-bs1-ds $S --enable-double-sparsity
echo "== end"
