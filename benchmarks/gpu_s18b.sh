#!/bin/bash
# GPU runbook, session 18 (H200), part b: the CUDA select's phases 2 and 3 fused into one launch
# with a per-row barrier (select.cu ds_select_fused, TUNING select_fused): its tests, its kernel
# times against the two launches (eager), the whole DS call in graphs (ds_streams.py, alternating
# rounds), and issue 3's DS decode step at 60K x 3 with and without it.
# Ran at ce20724; the fused kernel was no faster and was removed after this call (see
# results/h200-s18/README.md), so the knob select_fused no longer exists.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 200 python3 -m pytest -q -x tests/test_kernels.py -k "fused or cuda_select or pipelines" 2>&1 | tail -3
echo "== kernels"; timeout 100 python3 benchmarks/select_impl_probe.py --knob select_fused --values false,true --cases 3x65536,3x131072,16x32768 --json $OUT/select-fused-probe.json 2>&1 | grep -v -i warn
F='{"select_fused": true}'
echo "== graphs"; timeout 200 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072,16x32768 --variants 1/1,2/2 \
  --tunings "[{}, $F, {}, $F]" --json $OUT/streams-fused.json 2>&1 | grep -v -i "warn\|capture_end"
cd $OUT
for f in false true; do
  RUN_TIMEOUT=80 DOUBLESPARSE_TUNING="{\"select_fused\": $f}" run llama31-8b-60k-bs3-ds-r16-k3750-fused-$f \
    python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200 \
    --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
done
echo "== end"
