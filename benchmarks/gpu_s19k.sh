#!/bin/bash
# GPU runbook, session 19 (H200), part k: call j's ncu showed the fp8-label score at 2 blocks per
# SM (0.67 waves of its 3-block capacity, 22 % occupancy): Llama-3.1-8B's DS step at 60K x 3 with
# fp8 labels, score_cuda_programs_per_sm 3 against the default 2.
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
L="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750 --ds-label-dtype fp8"
RUN_TIMEOUT=75 DOUBLESPARSE_TUNING='{"score_cuda_programs_per_sm": 3}' run fp8-pps3 $L
RUN_TIMEOUT=75 run fp8-default $L
python3 -c "
import json
for f in ['fp8-pps3.json', 'fp8-default.json']:
    p = json.load(open(f))['results'][0]['profile']
    print(f, round(p['gpu_step_median_s'] * 1e3, 3), {k['name']: round(k['us_per_step'] / k['calls_per_step'], 1) for k in p['kernels'] if k['name'].startswith('ds_score')})"
echo "== end"
