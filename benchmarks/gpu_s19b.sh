#!/bin/bash
# GPU runbook, session 19 (H200), part b: the accuracy of fp8 labels (e4m3, scale 1, as the engine
# stores them with --ds-label-dtype fp8) on the embedded SmolLM2-135M: issue 4's protocol, parts a
# (text: ppl, KL, top-1) and b (retrieval), for dense, the default, the baseline, and the default
# and its k = ctx/8 in fp8 (and k = ctx/8 in bf16). Needs /root/m/smollm2.gguf (staged) and
# .stage/shakespeare (bash benchmarks/gpu_eval.sh --stage).
source benchmarks/runbook_lib.sh; runbook_start
GPU_EVAL_BUDGET_S=420 bash benchmarks/gpu_eval.sh $OUT/eval --parts ab --label-dtypes bf16 fp8 | tail -25
echo "== end"
