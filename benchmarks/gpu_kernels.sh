#!/bin/bash
# GPU runbook (2026-12-02, H200) behind the first fixes in results/attention-h200-notes.md: kernel
# tests, the quick attention benchmark, the launch-parameter sweep and ncu of the decode kernels
# (the decode kernels as committed in 4926b01). Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a $OUT/log.txt) 2>&1
echo "== kernel tests"; timeout 200 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -4
echo "== bench quick"; timeout 150 python3 -m doublesparse.bench.attention --quick --json $OUT/att.json --md $OUT/att.md
echo "== sweep"; timeout 200 python3 -m doublesparse.bench.attention --sweep
echo "== ncu"; timeout 90 ncu --clock-control none -k regex:'score_kernel|hist_low|compact|decode_attn' --launch-skip 4 --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats --section InstructionStats --section WarpStateStats python3 benchmarks/profile_kernels.py --iters 2 > $OUT/ncu2.txt 2>&1; grep -E "^  [a-z_]+kernel|Duration|Registers Per|Executed Instructions |Achieved Occ|DRAM Throughput" $OUT/ncu2.txt
echo "== end"
