#!/bin/bash
# GPU runbook, session 17 (H200), part f: K/V pool layout (split pools vs one interleaved
# [slots, Hkv, 2, D] tensor) for the selected rows' gather, the whole DS call and dense decode.
source benchmarks/runbook_lib.sh; runbook_start
timeout 300 python3 benchmarks/kv_layout_probe.py --json $OUT/kv-layout-probe.json 2>&1 | tail -80
echo "== end"
