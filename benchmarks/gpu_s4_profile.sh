#!/bin/bash
# GPU runbook (session 4, H200): ncu on the DS decode kernels at bs3 64K (r16, k4096, group_max)
# with the two-pass select, and the per-instruction stall counters of the score kernel. Writes
# under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/log.txt) 2>&1
T='{"select_impl": "two_pass", "sparse_prefetch": false}'
timeout 200 ncu --clock-control none -k regex:'score_mma|hist_high|hist_low|compact|decode_attn|merge' --launch-skip 6 --launch-count 6 --set full --import-source no --page details python3 benchmarks/profile_kernels.py --iters 3 --tuning "$T" > $OUT/ncu.txt 2>&1; tail -2 $OUT/ncu.txt
timeout 100 ncu --clock-control none -k regex:'score_mma' --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --page source --print-source sass --csv python3 benchmarks/profile_kernels.py --iters 2 --tuning "$T" > $OUT/ncu_score_src.csv 2>&1; tail -1 $OUT/ncu_score_src.csv | cut -c1-200
grep -E "^  [a-z_]+_kernel|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|One or More Eligible" $OUT/ncu.txt | head -80
echo "== end"
