#!/bin/bash
# GPU runbook, session 7 (H200), part a: programmatic dependent launch for the GEMV that loads its
# weights before it waits (launch.TUNING "pdl" / "gemv_max_bytes"; kernels/triton/pdl.py, gemv.py).
# GPU tests of the changed kernels; SmolLM2-135M (the real GGUF at /root/m/smollm2.gguf) decode at
# bs 1 x 8K: as committed (GEMV + PDL, overlap schedule), DS, without the GEMV, and one step at a
# time (--disable-overlap-schedule). Writes $OUT/s7a.tgz and $OUT/console.log.
# An earlier version of this runbook (tree 16688f6, every Triton kernel launched with PDL and
# waiting at entry) also ran an A/B sweep of the decode kernels: results/h200-s7/README.md.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_kernels.py \
    tests/test_engine.py tests/test_overlap.py \
    -k "gemv or linear or fused_path or compile or pipelines or many_programs or repeated or graph or overlap or dense" 2>&1 | tail -4
mkdir -p /tmp/s7a; cd /tmp/s7a
S="python3 -m doublesparse.bench_one_batch --profile --model-path /root/m/smollm2.gguf --batch-size 1 --input-len 8000 --output-len 128"
RUN_TIMEOUT=90
run smollm2-8k-bs1-dense $S
run smollm2-8k-bs1-ds $S --enable-double-sparsity
DOUBLESPARSE_TUNING='{"gemv_max_bytes": 0}' run smollm2-8k-bs1-dense-nogemv $S
run smollm2-8k-bs1-dense-sync $S --disable-overlap-schedule
tar czf $OUT/s7a.tgz *.json
echo "== end"
