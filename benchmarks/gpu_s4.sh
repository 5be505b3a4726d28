#!/bin/bash
# GPU runbook (session 4, H200): the DS kernel tests on the GPU, then a launch-parameter sweep
# (SWEEP_FILE, default benchmarks/sweep-s4a.json) at bs3 64K bf16 and bs3 128K fp8 labels.
# Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== kernel tests"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tail -4
echo "== sweep"
timeout ${SWEEP_TIMEOUT:-360} python3 -m doublesparse.bench.attention --sweep-file ${SWEEP_FILE:-benchmarks/sweep-s4a.json} \
  --sweep-cases ${SWEEP_CASES:-3x65536,3x131072fp8} --json $OUT/sweep.json
echo "== end"
