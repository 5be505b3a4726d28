#!/bin/bash
# GPU runbook, session 19 (H200), part e: the o_proj weights loaded into L2 during the DS select
# (TUNING["ds_prefetch"], ds_decode(prefetch=W)). Its tests, the one-layer probe (DS + o_proj,
# after an L2 flush), then Llama-3.1-8B's DS decode step at 60K x 3 (r16 k3750) with and without,
# alternating.
source benchmarks/runbook_lib.sh; runbook_start
timeout 200 python -m pytest -q -x tests/test_kernels.py -k "prefetch or graph" 2>&1 | tail -2
(cd benchmarks && timeout 120 python prefetch_probe.py --cases 3x65536,3x131072 --json $OUT/prefetch-probe.json)
cd $OUT
L="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
i=0
for t in '{}' '{"ds_prefetch": true}' '{}' '{"ds_prefetch": true}'; do
  i=$((i+1)); echo "== $t"
  RUN_TIMEOUT=90 DOUBLESPARSE_TUNING="$t" run llama-ds-$i $L
done
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("llama-ds-*.json")):
    p = json.load(open(f))["results"][0]["profile"]
    us = {k["name"][:24]: round(k["us_per_step"] / k["calls_per_step"], 1) for k in p["kernels"][:9]}
    print(f, us, "GPU step", round(p["gpu_step_median_s"] * 1e3, 3))
PY
echo "== end"
