#!/bin/bash
# GPU runbook, session 19 (H200), part j: ncu on the tensor-core label score (ds_score_tc) at
# issue 3's Llama-3.1-8B shape (3 x 61440, r 16, group_max), bf16 and fp8 labels (ncu flushes the
# caches before each profiled launch, so the labels come from DRAM): its throughputs, occupancy
# and warp stall reasons, for why it does not halve with its label bytes.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/console.log) 2>&1
for lab in bf16 fp8; do
  F=""; [ $lab = fp8 ] && F="--fp8"
  timeout 100 ncu --clock-control none -k regex:ds_score_tc --launch-skip 2 --launch-count 1 --set full \
    --import-source no --page details python3 benchmarks/profile_kernels.py --batch 3 --ctx 61440 --iters 3 $F \
    > $OUT/ncu-score-$lab.txt 2>&1
  echo "== $lab"
  grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc Active|Waves Per SM|Block Limit|Stall" $OUT/ncu-score-$lab.txt | head -40
done
echo "== end"
