#!/bin/bash
# GPU runbook, session 17 (H200), part k: score_tc.cu with up to 8 / G KV heads per warp (MHA:
# 8 heads), taken by score_impl "auto" wherever it fits: its tests for G = 1 and 2, then the
# LongChat-7B DS row (its dense row is call i's: the dense path did not change).
source benchmarks/runbook_lib.sh; runbook_start
timeout 100 python3 -m pytest -q -x tests/test_kernels.py -k "tensor_core or score_tc" 2>&1 | tail -2
mkdir -p $OUT/one-batch; cd $OUT/one-batch
B="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
C="$B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000"
RUN_TIMEOUT=80 run longchat-7b-20k-bs3-ds-r16-k1024 $C --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024
echo "== end"
