#!/bin/bash
# GPU runbook, session 19 (H200), part h: Llama-3.1-8B's decode step at 60K x 3 (DS r16 k3750 and
# dense) with programmatic dependent launch off, so that each kernel's profiled time is its own
# (with PDL a kernel launched early counts its wait): what the norms, RoPE + store and SiLU-mul cost
# on their own, to size a fusion of them into the projections. Without PDL the projections run on
# cuBLAS (skinny.py needs PDL).
source benchmarks/runbook_lib.sh; runbook_start
cd $OUT
B="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
DOUBLESPARSE_TUNING='{"pdl": false}' run llama-ds-nopdl $B --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
DOUBLESPARSE_TUNING='{"pdl": false}' run llama-dense-nopdl $B
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("*.json")):
    p = json.load(open(f))["results"][0]["profile"]
    print(f, "GPU step", round(p["gpu_step_median_s"] * 1e3, 3), "kernel sum", round(p["kernel_us_per_step"] / 1e3, 3))
    for k in p["kernels"][:14]:
        print(f"   {k['name'][:60]:60s} {k['us_per_step'] / k['calls_per_step']:8.1f} us x {k['calls_per_step']:.0f}")
PY
echo "== end"
