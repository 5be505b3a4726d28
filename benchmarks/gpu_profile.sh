#!/bin/bash
# GPU runbook (2026-12-02, H200) behind the first profile in results/attention-h200-notes.md ("Session 2")
# and the pre-fusion launch counts in the session note: ncu on the decode kernels at bs3 64K, the
# compiled kernels (TTGIR/PTX/SASS), and bench_one_batch --profile before the fused kernels landed
# (the tree of 0a43963 plus the --profile change later committed as cb37964). Writes under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=$OUT/log.txt
exec > >(tee -a $L) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
which ncu; ncu --version | tail -1
echo "== rope tests"; timeout 120 python3 -m pytest -q tests/test_kernels.py -p no:cacheprovider -k rope 2>&1 | tail -3
echo "== dump"; timeout 100 python3 benchmarks/profile_kernels.py --dump /tmp/dump --iters 2
(cd /tmp/dump && for f in *.cubin; do cuobjdump -sass $f > ${f%.cubin}.sass 2>/dev/null; done; tar czf $OUT/dump.tgz .)
echo "== ncu"; timeout 200 ncu --clock-control none -k regex:'score_kernel|hist_low|compact|decode_attn|merge' --launch-skip 5 --launch-count 5 --set full --import-source no --page details python3 benchmarks/profile_kernels.py --iters 2 > /tmp/ncu.txt 2>&1; tail -3 /tmp/ncu.txt
timeout 60 ncu --clock-control none -k regex:'score_kernel' --launch-skip 1 --launch-count 1 --section SourceCounters --page source --print-source sass --csv python3 benchmarks/profile_kernels.py --iters 2 > /tmp/ncu_src.csv 2>&1; tail -2 /tmp/ncu_src.csv
tar czf $OUT/ncu.tgz -C /tmp ncu.txt ncu_src.csv
B="python3 -m doublesparse.bench_one_batch --load-format dummy --skip-warmup --profile"
echo "== e2e llama dense"; timeout 150 $B --model-path llama-3.1-8b --batch-size 3 --input-len 60000 --output-len 16 --max-total-tokens 190000 --profile-json $OUT/prof_dense.json 2>&1 | grep -v "^Decode.  latency"
echo "== e2e llama ds"; timeout 150 $B --model-path llama-3.1-8b --batch-size 3 --input-len 60000 --output-len 16 --max-total-tokens 190000 --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750 --profile-json $OUT/prof_ds.json 2>&1 | grep -v "^Decode.  latency"
echo "== e2e smollm2 dense"; timeout 90 $B --model-path smollm2-135m --batch-size 1 --input-len 8000 --output-len 64 --profile-json $OUT/prof_smol.json 2>&1 | grep -v "^Decode.  latency"
echo "== e2e smollm2 ds"; timeout 90 $B --model-path smollm2-135m --batch-size 1 --input-len 8000 --output-len 64 --enable-double-sparsity 2>&1 | grep -v "^Decode.  latency"
echo "== end"
