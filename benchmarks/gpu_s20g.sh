#!/bin/bash
# GPU runbook, prepared in session 20 (H200), not yet run: LongChat-7B's label score (MHA, 32 KV
# heads; score_tc.cu puts 8 heads in a warp, which leaves registers for 1 tile in a ring of 2) with
# at most 4 heads per warp, so that a deeper ring fits (score_cuda_tc_max_heads_per_warp). Its
# score moved 61 MB at ~0.49 of the copy bandwidth in session 18, where one launch reading 61 MB
# can reach about 0.83 (interpolated between session 20's read_ceiling.py rows: 0.81 at 50 MB,
# 0.93 at 100 MB, contiguous). The CUDA score tests first, then LongChat's DS
# row under each override, the default first and last.
source benchmarks/runbook_lib.sh; runbook_start
timeout 150 python -m pytest -q tests/test_kernels.py -k "cuda_score" 2>&1 | tail -2
cd $OUT
C="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024"
RUN_TIMEOUT=60 run lc-default $C
RUN_TIMEOUT=60 DOUBLESPARSE_TUNING='{"score_cuda_tc_max_heads_per_warp": 4}' run lc-hpw4-ring3 $C
RUN_TIMEOUT=60 DOUBLESPARSE_TUNING='{"score_cuda_tc_max_heads_per_warp": 4, "score_cuda_tc_depth": 4}' run lc-hpw4-ring4 $C
RUN_TIMEOUT=60 DOUBLESPARSE_TUNING='{"score_cuda_tc_max_heads_per_warp": 4, "score_cuda_tc_depth": 2}' run lc-hpw4-ring2 $C
RUN_TIMEOUT=60 run lc-default-again $C
python3 -c "
import json
for f in ['lc-default', 'lc-hpw4-ring3', 'lc-hpw4-ring4', 'lc-hpw4-ring2', 'lc-default-again']:
    p = json.load(open(f + '.json'))['results'][0]['profile']
    print(f, round(p['gpu_step_median_s'] * 1e3, 3), {k['name'][:24]: round(k['us_per_step'] / k['calls_per_step'], 1) for k in p['kernels'] if k['name'].startswith('ds_')})"
echo "== end"
