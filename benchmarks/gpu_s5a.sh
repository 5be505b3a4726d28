#!/bin/bash
# GPU runbook (session 5, H200): SmolLM2-shaped dense decode attention sweep (splits, tile,
# fused merge), the SmolLM2-shaped bench_one_batch profile (dummy weights), and the mma_depth
# sweep of the score kernel at bs3 64K. Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== small attention sweep"
timeout 200 python3 benchmarks/small_decode_sweep.py --json $OUT/small-sweep.json
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --model-path smollm2-135m --batch-size 1 --input-len 8000 --output-len 128"
echo "== smollm2 dense"; timeout 90 $B --result-json $OUT/smol-dense.json 2>&1 | grep -E "^(Prefill|Decode.  median|Profile)"
echo "== mma sweep"
timeout 200 python3 -m doublesparse.bench.attention --sweep-file benchmarks/sweep-s4d.json --sweep-cases 3x65536 --json $OUT/sweep.json
echo "== end"
