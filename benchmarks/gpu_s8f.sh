#!/bin/bash
# GPU runbook, session 8 (H200), part f: the select's three phases as three named kernel entries
# over one body (ds_topk.py; af7e1eb had one entry with a PHASE argument, which profiles lumped).
# GPU tests of the DS kernels and the graph paths; issue 3's Llama-3.1-8B DS r16 row, whose
# profile now names each phase. Writes $OUT/s8f.tgz and $OUT/console.log.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    -k "ds_ or pipelines or repeated or graph" 2>&1 | tail -3
mkdir -p /tmp/s8f; cd /tmp/s8f
B="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
RUN_TIMEOUT=70
run llama31-8b-60k-bs3-ds-r16-k3750 $B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 \
    --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
python3 - <<'P'
import json
p = json.load(open("llama31-8b-60k-bs3-ds-r16-k3750.json"))["results"][0]["profile"]
for k in p["kernels"]:
    if any(s in k["name"] for s in ("hist", "compact", "score", "decode_attn", "merge")):
        print(f"{k['name']:<24} {k['us_per_step'] / 32:6.1f} us per layer, {k['calls_per_step']:.0f} calls per step")
P
tar czf $OUT/s8f.tgz *.json
echo "== end"
