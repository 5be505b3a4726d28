#!/bin/bash
# GPU runbook, session 7 (H200), part c: the final PDL split (pdl.py: RMSNorm, SiLU-mul, RoPE +
# store, the attention merge and the GEMV launched with PDL; attention and DS kernels normally).
# GPU tests; an A/B of the decode kernels (one layer, PDL on/off); SmolLM2-135M (the real GGUF at
# /root/m/smollm2.gguf) bs 1 x 8K dense and DS; issue 3's Llama-3.1-8B and LongChat-7B rows (the
# commands of results/bench-one-batch-h200.json). Writes $OUT/s7c.tgz and $OUT/console.log.
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
exec > >(tee -a $OUT/console.log) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_kernels.py \
    tests/test_engine.py tests/test_overlap.py \
    -k "gemv or linear or fused_path or pipelines or many_programs or repeated or graph or overlap or dense" 2>&1 | tail -3
mkdir -p /tmp/s7c
echo "== sweep"; timeout 100 python3 -m doublesparse.bench.attention --sweep-file benchmarks/sweep-s7.json \
    --sweep-cases 3x65536,16x32768 --json /tmp/s7c/sweep-s7c.json 2>&1 | grep -E "^sweep|Error"
cd /tmp/s7c
G='^(Prefill|Decode.  median|Profile. (decode|kernels))'
run() { local name=$1; shift; echo "== $name"; timeout 100 "$@" --result-json $name.json 2>&1 | grep -E "$G"; }
S="python3 -m doublesparse.bench_one_batch --profile --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
run smollm2-8k-bs1-dense $S
run smollm2-8k-bs1-ds $S --enable-double-sparsity
run smollm2-8k-bs1-dense-sync $S --disable-overlap-schedule
B="python -m doublesparse.bench_one_batch --profile --load-format dummy --skip-warmup --batch-size 3 --output-len 200"
L="$B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
C="$B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000"
run llama31-8b-60k-bs3-dense $L
run llama31-8b-60k-bs3-ds-r16-k3750 $L --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
run llama31-8b-60k-bs3-ds-r32-k3000 $L --enable-double-sparsity --ds-heavy-channel-num 32 --ds-heavy-token-num 3000
run longchat-7b-20k-bs3-dense $C
run longchat-7b-20k-bs3-ds-r16-k1024 $C --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024
tar czf $OUT/s7c.tgz *.json
echo "== end"
