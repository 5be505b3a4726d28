#!/bin/bash
# GPU runbook, session 7 (H200), part a: programmatic dependent launch (launch.TUNING "pdl",
# kernels/triton/pdl.py) and the GEMV that loads its weights before it waits (TUNING
# "gemv_max_bytes", kernels/triton/gemv.py). GPU tests of the changed kernels; A/B of the DS and
# dense decode kernels with PDL on and off; SmolLM2-135M (the real GGUF at /root/m/smollm2.gguf)
# decode at bs 1 x 8K with everything on, without the GEMV, without PDL, and without the overlap
# schedule. Writes $OUT/s7a.tgz and $OUT/console.log.
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
exec > >(tee -a $OUT/console.log) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== tests"; timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_kernels.py \
    tests/test_engine.py tests/test_overlap.py \
    -k "gemv or linear or fused_path or compile or pipelines or many_programs or repeated or graph or overlap" 2>&1 | tail -4
mkdir -p /tmp/s7a
echo "== sweep"; timeout 150 python3 -m doublesparse.bench.attention --sweep-file benchmarks/sweep-s7.json \
    --sweep-cases 3x65536,16x32768,8x16384,3x131072 --json /tmp/s7a/sweep-s7.json 2>&1 | grep -E "^sweep|Error"
cd /tmp/s7a
S="python3 -m doublesparse.bench_one_batch --profile --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
G='^(Prefill|Decode.  median|Profile. (decode|kernels))'
run() { local name=$1; shift; echo "== $name"; timeout 90 "$@" --result-json $name.json 2>&1 | grep -E "$G"; }
run smollm2-8k-bs1-dense $S
run smollm2-8k-bs1-ds $S --enable-double-sparsity
DOUBLESPARSE_TUNING='{"gemv_max_bytes": 0}' run smollm2-8k-bs1-dense-nogemv $S
DOUBLESPARSE_TUNING='{"pdl": false}' run smollm2-8k-bs1-dense-nopdl $S
run smollm2-8k-bs1-dense-sync $S --disable-overlap-schedule
tar czf $OUT/s7a.tgz *.json
echo "== end"
