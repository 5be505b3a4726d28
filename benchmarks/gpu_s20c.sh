#!/bin/bash
# GPU runbook, session 20 (H200), part c: the final tree (score_tc.cu's ring of 3 steps by
# default). The CUDA score/select and graph tests on the GPU; issue 2's attention grid
# ($OUT/attention-h200.{json,md}); Llama-3.1-8B and LongChat-7B DS rows with fp8 labels.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 150 python3 -m pytest -q tests/test_kernels.py -k "cuda or graph" 2>&1 | tail -2
echo "== attention grid"; timeout 170 python3 -m doublesparse.bench.attention --json $OUT/attention-h200.json \
    --md $OUT/attention-h200.md 2>&1 | tail -12
mkdir -p $OUT/one-batch; cd $OUT/one-batch
B="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
RUN_TIMEOUT=80 run llama31-8b-60k-bs3-ds-r16-k3750-fp8 $B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750 --ds-label-dtype fp8
RUN_TIMEOUT=80 run longchat-7b-20k-bs3-ds-r16-k1024-fp8 $B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024 --ds-label-dtype fp8
echo "== end"
