#!/bin/bash
# GPU runbook, session 18 (H200), part g: score_tc.cu's launch geometry for LongChat-7B's labels
# (32 KV heads x r 16, eight heads per warp, never tuned for them): issue 3's LongChat DS row with
# the default and four TUNING overrides, in the order listed, twice for the default.
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
C="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024"
i=0
for t in '{}' '{"score_cuda_tc_tiles": 1}' '{"score_cuda_programs_per_sm": 3}' '{"score_cuda_programs_per_sm": 4}' '{"score_cuda_min_blocks": 3}' '{}'; do
  i=$((i+1)); echo "== $t"
  RUN_TIMEOUT=60 DOUBLESPARSE_TUNING="$t" run longchat-ds-$i $C
done
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("longchat-ds-*.json")):
    p = json.load(open(f))["results"][0]["profile"]
    us = {k["name"]: k["us_per_step"] / k["calls_per_step"] for k in p["kernels"] if k["name"].startswith("ds_score")}
    print(f, "score us per call", {k: round(v, 1) for k, v in us.items()}, "GPU step", round(p["gpu_step_median_s"] * 1e3, 3))
PY
echo "== end"
