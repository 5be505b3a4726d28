#!/bin/bash
# GPU runbook, session 19 (H200), part g: where the CUDA label score's time goes with fp8 labels
# against bf16 (score_cuda_probe.py's loads / products / full / no-hist variants, five geometries),
# at issue 3's Llama-3.1-8B shape (3 x 60K), to see whether fp8 labels want another geometry.
source benchmarks/runbook_lib.sh; runbook_start
(cd benchmarks && timeout 300 python score_cuda_probe.py --cases 3x61440,3x61440fp8 --rounds 2 \
  --json $OUT/score-probe-fp8.json)
echo "== end"
