#!/bin/bash
# GPU runbook, session 15 (H200): the CUDA C++ select (kernels/cuda/select.cu, NVRTC) against the
# Triton select (ds_topk.py).
#  1. The DS kernel tests with the CUDA select (DOUBLESPARSE_TUNING select_impl=cuda): every
#     selection against the PyTorch reference, awkward sizes included.
#  2. benchmarks/select_impl_probe.py: both selections equal element for element, per-kernel times.
#  3. benchmarks/ds_streams.py: one layer's DS call in CUDA graphs, one part and two parts, the two
#     implementations alternating.
# Writes $OUT/console.log, $OUT/select-probe.json, $OUT/streams-impl.json. ~4 minutes started.
source benchmarks/runbook_lib.sh; runbook_start
python3 -c "import torch, time; t = time.time(); from doublesparse.kernels.cuda import select as s; print('CUDA select unavailable:', s.unavailable(torch.device('cuda')), f'({time.time() - t:.1f} s)')"
DOUBLESPARSE_TUNING='{"select_impl": "cuda"}' timeout 200 python3 -m pytest -q -x \
  tests/test_kernels.py -k "ds_" 2>&1 | tail -5
timeout 120 python3 benchmarks/select_impl_probe.py --cases 16x32768,3x65536,3x131072 \
  --json $OUT/select-probe.json 2>&1 | grep -v -i "warn\|capture_end"
timeout 200 python3 benchmarks/ds_streams.py --cases 16x32768,3x65536 --variants 1/1,2/2 \
  --tunings '[{}, {"select_impl": "cuda"}, {}, {"select_impl": "cuda"}]' \
  --json $OUT/streams-impl.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
