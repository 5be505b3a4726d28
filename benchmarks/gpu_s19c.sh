#!/bin/bash
# GPU runbook, session 19 (H200), part c: issue 3's DS rows (Llama-3.1-8B 60K x 3 r16 k3750,
# LongChat-7B 20K x 3 r16 k1024) with fp8 labels (--ds-label-dtype fp8) beside the same rows in
# bf16, in one lease.
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
B="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
L="$B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
C="$B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024"
run llama31-8b-60k-bs3-ds-r16-k3750-fp8 $L --ds-label-dtype fp8
run llama31-8b-60k-bs3-ds-r16-k3750 $L
run longchat-7b-20k-bs3-ds-r16-k1024-fp8 $C --ds-label-dtype fp8
run longchat-7b-20k-bs3-ds-r16-k1024 $C
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("*.json")):
    p = json.load(open(f))["results"][0]["profile"]
    us = {k["name"]: round(k["us_per_step"] / k["calls_per_step"], 1) for k in p["kernels"]
          if k["name"].startswith(("ds_", "decode_attn", "merge"))}
    print(f, us, "GPU step", round(p["gpu_step_median_s"] * 1e3, 3))
PY
echo "== end"
