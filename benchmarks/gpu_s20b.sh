#!/bin/bash
# GPU runbook, session 20 (H200), part b: (1) how fast one kernel reads 12-400 MB, contiguous or
# as random rows (benchmarks/read_ceiling.py): the ceiling for the DS stages' short reads; (2) call
# a's best score geometry (score_tc.cu, 2 tiles per step, a ring of 3 steps) in Llama-3.1-8B's DS
# step at 60K x 3 (r16 k3750, bf16 labels), against the default (4 tiles, ring of 2), alternating.
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
timeout 150 python $OLDPWD/benchmarks/read_ceiling.py --json read-ceiling.json
L="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
RUN_TIMEOUT=80 DOUBLESPARSE_TUNING='{"score_cuda_tc_tiles": 2, "score_cuda_tc_depth": 3}' run ring3 $L
RUN_TIMEOUT=80 run ring2 $L
python3 -c "
import json
for f in ['ring3.json', 'ring2.json']:
    p = json.load(open(f))['results'][0]['profile']
    print(f, round(p['gpu_step_median_s'] * 1e3, 3), {k['name'][:24]: round(k['us_per_step'] / k['calls_per_step'], 1) for k in p['kernels'] if k['name'].startswith('ds_')})"
echo "== end"
