#!/bin/bash
# GPU runbook, session 14 (H200): one layer's DS decode at issue 5's decode shape (16 x 32K, r 16,
# k 2048, two batch parts on two streams), `benchmarks/ds_streams.py`.
#  1. Which select phases load their keys one block ahead (TUNING["select_prefetch"]: "23" is the
#     default, against "", "2", "3"), plain parts, listed twice so the variants alternate.
#  2. Skewed parts (part 1's score waits for part 0's) with the select's grids cut down, so that
#     part 0's latency-bound select leaves SMs to part 1's byte-bound score. Session 11 measured
#     skew only with the full-GPU select grids (137.1 vs 133.3 us plain).
# Writes $OUT/console.log and $OUT/streams-*.json. About 2 minutes on a started machine.
source benchmarks/runbook_lib.sh; runbook_start
timeout 150 python3 benchmarks/ds_streams.py --cases 16x32768 --variants 2/2 \
  --tunings '[{}, {"select_prefetch": ""}, {"select_prefetch": "2"}, {"select_prefetch": "3"}, {}, {"select_prefetch": ""}, {"select_prefetch": "2"}, {"select_prefetch": "3"}]' \
  --json $OUT/streams-prefetch.json 2>&1 | grep -v -i "warn\|capture_end"
timeout 150 python3 benchmarks/ds_streams.py --cases 16x32768 --variants 2/2,2/2s \
  --tunings '[{}, {"select_programs_per_sm": 2, "hist_programs_per_sm": 4}, {"select_programs_per_sm": 1, "hist_programs_per_sm": 2}, {"select_programs_per_sm": 2, "hist_programs_per_sm": 4, "sparse_attn_programs_per_sm": 2}, {"select_programs_per_sm": 1, "hist_programs_per_sm": 1}]' \
  --json $OUT/streams-skew.json 2>&1 | grep -v -i "warn\|capture_end"
echo "== end"
