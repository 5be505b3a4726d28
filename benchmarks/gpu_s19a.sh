#!/bin/bash
# GPU runbook, session 19 (H200), part a: the select's last phase inside the attention launch
# (TUNING["compact_attn"], kernels/triton/ds_compact_attn.py). Its kernel tests on the GPU, then
# the DS call with and without it (and the fused merge) at issue 2's shapes, alternating, then
# Llama-3.1-8B's DS decode step at 60K x 3 (issue 3's r16 k3750 row) with and without it.
source benchmarks/runbook_lib.sh; runbook_start
timeout 300 python -m pytest -q -x tests/test_kernels.py -k "compact_attn or graph or pipelines or test_ds_decode" 2>&1 | tail -4
cd $OUT
cat > sweep.json <<'J'
[{}, {"compact_attn": true}, {"fuse_merge": true}, {"compact_attn": true, "fuse_merge": true},
 {}, {"compact_attn": true}]
J
timeout 200 python -m doublesparse.bench.attention --sweep-file sweep.json \
  --sweep-cases 3x65536,3x131072,3x131072fp8,16x32768 --json sweep-compact-attn.json | grep '^sweep'
L="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750"
i=0
for t in '{}' '{"compact_attn": true}' '{}' '{"compact_attn": true}'; do
  i=$((i+1)); echo "== $t"
  RUN_TIMEOUT=90 DOUBLESPARSE_TUNING="$t" run llama-ds-$i $L
done
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("llama-ds-*.json")):
    p = json.load(open(f))["results"][0]["profile"]
    us = {k["name"]: round(k["us_per_step"] / k["calls_per_step"], 1) for k in p["kernels"]
          if k["name"].startswith(("ds_", "decode_attn", "merge", "compact"))}
    print(f, us, "GPU step", round(p["gpu_step_median_s"] * 1e3, 3))
PY
echo "== end"
