#!/bin/bash
# GPU runbook prepared in session 5 for the next session (H200): time the split-prefix prefill
# (attention/prefill.SPLIT_PREFIX) at the kernel level and in bench_one_batch (Llama-3.1-8B 60K x 3,
# chunks of 4096 and one 16384 case), with the GPU tests of the prefill path first.
# Writes under $OUT (bench_one_batch JSONs as e2e.tgz).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== tests"; timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_prefill_attention.py tests/test_engine.py -k "sdpa or chunk or graph" 2>&1 | tail -2
echo "== prefill sweep"; timeout 150 python3 benchmarks/prefill_attn_sweep.py --json $OUT/prefill.json 2>&1 | grep '^{'
mkdir -p /tmp/e2e; cd /tmp/e2e
B="python3 -m doublesparse.bench_one_batch --load-format dummy --skip-warmup --batch-size 3 --output-len 16"
G='^(Prefill|Decode.  median)'
L="$B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
echo "== dense"; timeout 90 $L --result-json dense.json 2>&1 | grep -E "$G"
echo "== dense split"; DOUBLESPARSE_PREFILL_SPLIT_PREFIX=1 timeout 90 $L --result-json dense-split.json 2>&1 | grep -E "$G"
echo "== dense chunk 16384 split"; DOUBLESPARSE_PREFILL_SPLIT_PREFIX=1 timeout 90 $L --chunked-prefill-size 16384 --result-json dense-split-16k.json 2>&1 | grep -E "$G"
echo "== ds split"; DOUBLESPARSE_PREFILL_SPLIT_PREFIX=1 timeout 90 $L --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750 --result-json ds-split.json 2>&1 | grep -E "$G"
tar czf $OUT/e2e.tgz *.json
echo "== end"
