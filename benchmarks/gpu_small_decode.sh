#!/bin/bash
# GPU runbook: checks the decode graph (req_to_token written inside the graph), then measures
# SmolLM2-135M-shaped decode (dummy weights, bs 1, 8K). Writes under $OUT.
# results/small-decode-h200/ came from this script when it also tested a Triton GEMV for the small
# projections (commit a91f66e, with that GEMV on); the GEMV measured the same per call as cuBLAS
# and was removed.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
echo "== tests"; timeout 90 python3 -m pytest -q -x tests/test_engine.py tests/test_fused.py -k graph -p no:cacheprovider 2>&1 | tail -3
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --model-path smollm2-135m --batch-size 1 --input-len 8000 --output-len 128"
echo "== smollm2 dense"; timeout 60 $B --result-json $OUT/smol-dummy-dense.json 2>&1 | grep -E "^(Prefill|Decode.  median|Profile)"
echo "== smollm2 ds"; timeout 60 $B --enable-double-sparsity --result-json $OUT/smol-dummy-ds.json 2>&1 | grep -E "^(Prefill|Decode.  median|Profile)"
echo "== end"
