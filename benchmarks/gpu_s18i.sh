#!/bin/bash
# GPU runbook, session 18 (H200), part i: LongChat-7B's DS row with score_tc.cu's fused high-byte
# histogram (32 score rows per block: 32 x 256 shared-memory bins, flushed by global atomics) and
# without it (the select's phase 1 as its own launch), alternating, two rounds.
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
C="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024"
i=0
for t in '{}' '{"score_cuda_hist": false}' '{}' '{"score_cuda_hist": false}'; do
  i=$((i+1)); echo "== $t"
  RUN_TIMEOUT=60 DOUBLESPARSE_TUNING="$t" run longchat-ds-hist-$i $C
done
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("longchat-ds-hist-*.json")):
    p = json.load(open(f))["results"][0]["profile"]
    us = {k["name"]: round(k["us_per_step"] / k["calls_per_step"], 1) for k in p["kernels"]
          if k["name"].startswith(("ds_score", "ds_select"))}
    print(f, us, "GPU step", round(p["gpu_step_median_s"] * 1e3, 3))
PY
echo "== end"
