#!/bin/bash
# GPU runbook, session 19 (H200), part i: the MLP's down projection doing the SiLU-mul as it loads
# (TUNING["skinny_gated"], skinny.py GATED). Its tests on the GPU, then issue 3's Llama-3.1-8B rows
# at 60K x 3 (dense, DS r16 k3750) with and without it, alternating.
source benchmarks/runbook_lib.sh; runbook_start
timeout 200 python -m pytest -q tests/test_fused.py -k "gated or skinny or linear or graph" 2>&1 | tail -2
DOUBLESPARSE_TUNING='{"skinny_gated": true}' timeout 200 python -m pytest -q tests/test_fused.py tests/test_engine.py -k "graph or fused_path" 2>&1 | tail -2
cd $OUT
L="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
D="--enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
DOUBLESPARSE_TUNING='{"skinny_gated": true}' run ds-gated-1 $L $D
run ds-plain-1 $L $D
DOUBLESPARSE_TUNING='{"skinny_gated": true}' run dense-gated-1 $L
run dense-plain-1 $L
DOUBLESPARSE_TUNING='{"skinny_gated": true}' run ds-gated-2 $L $D
run ds-plain-2 $L $D
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("*.json")):
    r = json.load(open(f))["results"][0]
    p = r["profile"]
    us = {k["name"][:20]: round(k["us_per_step"] / k["calls_per_step"], 1) for k in p["kernels"]
          if k["name"].startswith(("skinny", "silu"))}
    print(f, "decode median", round(r["median_decode_latency"] * 1e3, 3), "GPU step", round(p["gpu_step_median_s"] * 1e3, 3), us)
PY
echo "== end"
