#!/bin/bash
# GPU runbook that produced results/bench-one-batch-h200-s2/ and results/attention-h200-quick.*:
# kernel + fused-kernel tests, the quick attention benchmark, bench_one_batch --profile for
# Llama-3.1-8B (dummy, 60K x 3) and SmolLM2 (GGUF at /root/m/smollm2.gguf, 8K x 1). Writes under $OUT.
export PYTHONUNBUFFERED=1
exec > >(tee -a $OUT/log.txt) 2>&1
echo "== tests"; timeout 240 python3 -m pytest -q -x tests/test_fused.py tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -4
timeout 120 python3 -m pytest -q tests/test_engine.py -k "graph" -p no:cacheprovider 2>&1 | tail -3
echo "== bench quick"; timeout 100 python3 -m doublesparse.bench.attention --quick --json $OUT/att.json --md $OUT/att.md 2>&1 | grep -v "^bs3.*per_head"
B="python3 -m doublesparse.bench_one_batch --profile"
L="$B --load-format dummy --model-path llama-3.1-8b --batch-size 3 --input-len 60000 --output-len 64 --max-total-tokens 190000 --skip-warmup"
mkdir -p $OUT/e2e
echo "== llama dense"; timeout 100 $L --result-json $OUT/e2e/llama31-8b-60k-bs3-dense.json 2>&1 | grep -v "^Decode.  latency" | head -24
echo "== llama ds"; timeout 100 $L --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750 --result-json $OUT/e2e/llama31-8b-60k-bs3-ds-r16-k3750.json 2>&1 | grep -v "^Decode.  latency" | head -24
S="$B --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
echo "== smol dense"; timeout 90 $S --result-json $OUT/e2e/smollm2-8k-bs1-dense.json 2>&1 | grep -v "^Decode.  latency" | head -20
echo "== smol ds"; timeout 90 $S --enable-double-sparsity --result-json $OUT/e2e/smollm2-8k-bs1-ds.json 2>&1 | grep -v "^Decode.  latency" | head -20
(cd $OUT && tar czf e2e.tgz e2e && rm -rf e2e)
echo "== end"
