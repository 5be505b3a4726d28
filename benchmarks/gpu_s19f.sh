#!/bin/bash
# GPU runbook, session 19 (H200), part f: call e's L2 prefetch with fewer programs (less
# interference with the select it runs beside), one-layer probe only.
source benchmarks/runbook_lib.sh; runbook_start
(cd benchmarks && timeout 150 python prefetch_probe.py --cases 3x65536,3x131072 --programs 528,132,66,33,16 \
  --json $OUT/prefetch-probe-programs.json)
echo "== end"
