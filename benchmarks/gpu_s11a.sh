#!/bin/bash
# GPU runbook, session 11 (H200), part a: (1) the prefill's Triton split-prefix merge on the GPU
# (tests, then profile_prefill with 16384-token chunks: session 10 measured 1.329 s with the
# PyTorch merge); (2) why the issue-5 servers took ~1.35 s per 32K prompt against 1.24 s in
# profile_prefill: a 16-prompt cohort through the engine, step by step, with nvidia-smi clocks.
# Writes $OUT/console.log, $OUT/prefill-*.json, $OUT/cohort-*.json.
source benchmarks/runbook_lib.sh; runbook_start
nvidia-smi -q -d POWER,CLOCK | grep -E "Power Limit|Max Clocks|SM  |Graphics" | head -12
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_attention.py tests/test_fused.py \
    -k "lse or split or sdpa" 2>&1 | tail -3
timeout 120 python3 benchmarks/profile_prefill.py --json $OUT/prefill-dense-16k-chunks.json 2>&1 | grep -v -i warn | head -12
timeout 200 python3 benchmarks/cohort_prefill.py --json $OUT/cohort-dense.json 2>&1 | grep -v -i warn
nvidia-smi -q -d PERFORMANCE | head -30
echo "== end"
