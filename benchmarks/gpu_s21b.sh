#!/bin/bash
# GPU runbook, session 21, part b (after part a's tests pass): the persistent DS decode in the
# engine, Llama-3.1-8B's DS step at 60K x 3 (issue 3's r16 k3750 row) with it and without, the
# default first and last; then the same with fp8 labels. Kernel times from the profile.
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
L="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
RUN_TIMEOUT=90 run l-default $L
RUN_TIMEOUT=90 DOUBLESPARSE_TUNING='{"ds_persistent": true}' run l-persistent $L
RUN_TIMEOUT=90 run l-default-again $L
RUN_TIMEOUT=90 run l-fp8-default $L --ds-label-dtype fp8
RUN_TIMEOUT=90 DOUBLESPARSE_TUNING='{"ds_persistent": true}' run l-fp8-persistent $L --ds-label-dtype fp8
python3 -c "
import json
for f in ['l-default', 'l-persistent', 'l-default-again', 'l-fp8-default', 'l-fp8-persistent']:
    try:
        p = json.load(open(f + '.json'))['results'][0]['profile']
    except (OSError, KeyError, IndexError) as e:
        print(f, 'missing', e); continue
    print(f, round(p['gpu_step_median_s'] * 1e3, 3), {k['name'][:24]: round(k['us_per_step'] / k['calls_per_step'], 1) for k in p['kernels'] if k['name'].startswith('ds_')})"
echo "== end"
