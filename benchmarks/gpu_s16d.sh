#!/bin/bash
# GPU runbook, session 16 (H200), part d: the CUDA C++ label score, third version (query in shared memory, LPT rows in flight per thread in registers; score.cu, with the
# select's high-byte histogram fused in). GPU tests of the CUDA and DS kernels; per-kernel times
# of one layer with the Triton (mma) and the CUDA score (select_impl_probe.py); whole DS calls in
# CUDA graphs under the CUDA score's knobs (ds_streams.py, one part). Writes $OUT/console.log,
# $OUT/score-probe.json, $OUT/streams-score.json.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda or ds_" 2>&1 | tail -4
echo "== probe"; timeout 90 python3 benchmarks/select_impl_probe.py --knob score_impl --values mma,cuda \
  --cases 3x65536,3x131072,16x32768 --json $OUT/score-probe.json 2>&1 | grep -v -i "warn"
echo "== streams"
T='[{"score_impl": "mma"}, {}, {"score_cuda_min_blocks": 2, "score_cuda_programs_per_sm": 2}, {"score_cuda_rows_per_thread": 4, "score_cuda_min_blocks": 2, "score_cuda_programs_per_sm": 2}, {"score_cuda_rows_per_thread": 4}, {"score_cuda_rows_per_thread": 1, "score_cuda_min_blocks": 4, "score_cuda_programs_per_sm": 4}, {"score_cuda_min_blocks": 4, "score_cuda_programs_per_sm": 4}, {"score_cuda_hist": false}, {"score_impl": "mma"}, {}]'
timeout 200 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072,16x32768 --variants 1/1 --tunings "$T" \
  --json $OUT/streams-score.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
