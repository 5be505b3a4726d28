#!/bin/bash
# GPU runbook (session 5, H200): the DS select tests with the experimental select flags, the
# select sweep (benchmarks/sweep-s5a.json), then the prefill attention / GEMM sweep. Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== kernel tests"
timeout 150 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider -k "pipelines or repeated or threshold" 2>&1 | tail -4
echo "== select sweep"
timeout 330 python3 -m doublesparse.bench.attention --sweep-file benchmarks/sweep-s5a.json \
  --sweep-cases ${SWEEP_CASES:-3x65536,8x16384,3x131072fp8} --json $OUT/sweep.json
echo "== prefill sweep"
timeout 150 python3 benchmarks/prefill_attn_sweep.py --json $OUT/prefill.json
echo "== end"
