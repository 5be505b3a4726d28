#!/bin/bash
# GPU runbook, session 13, part d: where the select's time goes at issue 5's decode shape (one
# layer, bs 16 x 32K, r 16, k 2048, group_max, one part, eager): ncu's full set for the three
# select phases and the score and attention around them, and per-SASS-instruction warp stall
# counters of the hist_high and compact phases. Writes $OUT/ncu.txt, $OUT/ncu_{hist,compact}_src.csv.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
P="python3 benchmarks/profile_kernels.py --batch 16 --ctx 32768 --iters 3"
timeout 200 ncu --clock-control none -k regex:'score_mma|hist_high|hist_low|compact|decode_attn' --launch-skip 5 \
    --launch-count 5 --set full --import-source no --page details $P > $OUT/ncu.txt 2>&1; tail -2 $OUT/ncu.txt
for k in hist_high compact; do
  timeout 100 ncu --clock-control none -k regex:$k --launch-skip 1 --launch-count 1 --section SourceCounters \
      --section WarpStateStats --page source --print-source sass --csv $P > $OUT/ncu_${k}_src.csv 2>&1
  tail -1 $OUT/ncu_${k}_src.csv | cut -c1-200
done
grep -E "^  [a-z_]+_kernel|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc Active|Waves Per SM" $OUT/ncu.txt | head -120
echo "== end"
