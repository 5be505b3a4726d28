#!/bin/bash
# GPU runbook, session 17 (H200), part e: attn.cu with a cp.async ring (and the double fix of its
# scale argument): its GPU tests with the other DS tests, per-kernel eager times against the
# Triton attention, whole DS calls in CUDA graphs for several geometries (two alternating
# rounds), and the quick grid with it as the default.
# Ran at e7dd393; attn.cu and its TUNING knobs were removed after call e (b860024), so this
# runbook does not run at later trees.
source benchmarks/runbook_lib.sh; runbook_start
echo "== tests"; timeout 300 python3 -m pytest -q -x tests/test_kernels.py tests/test_ds_batch_parts.py -k "cuda or ds_ or pipelines or graph or parts" 2>&1 | tail -4
echo "== eager kernels"; timeout 100 python3 benchmarks/select_impl_probe.py --knob attn_impl --values triton,cuda --cases 3x65536,16x32768 --json $OUT/attn-impl-probe.json 2>&1 | grep -v Warn | tail -8
T='[{"attn_impl": "triton"}, {"attn_impl": "cuda"}, {"attn_cuda_tokens": 2, "attn_cuda_stages": 6}, {"attn_cuda_tokens": 3, "attn_cuda_stages": 4}, {"attn_cuda_tokens": 6, "attn_cuda_stages": 2}, {"attn_cuda_programs_per_sm": 3}, {"attn_cuda_programs_per_sm": 6}]'
T="${T%]}, ${T#[}"  # every tuning twice, alternating: two rounds
echo "== graphs"; timeout 240 python3 benchmarks/ds_streams.py --cases 3x65536,3x131072,16x32768 --variants 1/1 --tunings "$T" --json $OUT/streams-attn.json 2>&1 | tail -2
python3 benchmarks/ds_streams.py --summarize $OUT/streams-attn.json 2>&1 | tail -25
echo "== quick grid"; timeout 100 python3 -m doublesparse.bench.attention --quick --json $OUT/quick.json 2>&1 | tail -8
echo "== end"
