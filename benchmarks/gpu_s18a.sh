#!/bin/bash
# GPU runbook, session 18 (H200), part a: the GPU tests of session 17's last (GPU-untested) tidies;
# the K/V pool layout probe with a head-major layout added; the select's phases per kernel.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 240 python3 -m pytest -q -x tests/test_kernels.py -k "cuda or ds_ or pipelines or score_impl or tensor_core" 2>&1 | tail -5
echo "== kv layout"; timeout 200 python3 benchmarks/kv_layout_probe.py --cases 3x65536,16x32768 --json $OUT/kv-layout-probe.json 2>&1 | tail -40
echo "== select phases"; timeout 100 python3 benchmarks/select_impl_probe.py --cases 3x65536,3x131072 --json $OUT/select-impl-probe.json 2>&1 | tail -40
echo "== end"
