#!/bin/bash
# GPU runbook (session 3, H200): correctness of the pipelined select / fused-merge kernels on the
# GPU, then the launch-parameter sweep of benchmarks/sweep-s3a.json at bs3 64K (bf16 labels) and
# bs3 128K (bf16 and fp8 labels). Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== kernel tests (new paths)"
timeout 150 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider -k "pipelines or fused_merge or graph or ds_decode" 2>&1 | tail -3
echo "== sweep"
timeout ${SWEEP_TIMEOUT:-420} python3 -m doublesparse.bench.attention --sweep-file ${SWEEP_FILE:-benchmarks/sweep-s3a.json} \
  --sweep-cases ${SWEEP_CASES:-3x65536,3x131072fp8} --json $OUT/sweep.json
echo "== end"
