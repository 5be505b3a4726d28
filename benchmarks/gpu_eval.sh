#!/usr/bin/env bash
# Full Double Sparsity accuracy protocol (issue 4) on the embedded SmolLM2-135M, in ONE GPU call.
#
#   bash benchmarks/gpu_eval.sh --stage          # here, once: eval plays -> .stage/shakespeare/
#   bash benchmarks/gpu_eval.sh OUT [protocol flags...]   # on the GPU box (no network)
#
# Writes into OUT (4 files, each well under 16 MiB): results.json, table.md, plot.png, console.log.
# The work is ordered by importance and stops itself before the budget (GPU_EVAL_BUDGET_S, default
# 480 s counted from this script's start); results.json/table.md are rewritten after every setting.
# Extra flags go to `python -m doublesparse.eval.protocol` (see --help), e.g. for a CPU smoke run:
#   bash benchmarks/gpu_eval.sh /tmp/smoke --device cpu --window-len 1024 --decode-len 5 \
#        --num-windows 1 --retrieval-lens 1024 --retrieval-trials 1   (GPU_EVAL_BUDGET_S=300 before it)
# Environment: PYTHON (default python3), DOUBLESPARSE_SMOLLM2 (model GGUF; default /root/m/smollm2.gguf when it exists),
# DOUBLESPARSE_SHAKESPEARE_DIR (texts; default .stage/shakespeare when it exists).
set -uo pipefail
T0=$(date +%s.%N)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python3 || command -v python)}

if [ "${1:-}" = "--stage" ]; then
    exec "$PY" -m doublesparse.eval.protocol --stage-texts .stage/shakespeare
fi
OUT=${1:?usage: benchmarks/gpu_eval.sh OUT_DIR [flags] | --stage}
shift
mkdir -p "$OUT"
BUDGET=${GPU_EVAL_BUDGET_S:-480}

if [ -z "${DOUBLESPARSE_SMOLLM2:-}" ] && [ -f /root/m/smollm2.gguf ]; then
    export DOUBLESPARSE_SMOLLM2=/root/m/smollm2.gguf
fi
if [ -z "${DOUBLESPARSE_SHAKESPEARE_DIR:-}${DOUBLESPARSE_SHAKESPEARE:-}" ] && [ -d .stage/shakespeare ]; then
    export DOUBLESPARSE_SHAKESPEARE_DIR="$PWD/.stage/shakespeare"
fi

{
    echo "gpu_eval.sh: $(date -u +%FT%TZ) budget ${BUDGET}s; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "DOUBLESPARSE_SMOLLM2=${DOUBLESPARSE_SMOLLM2:-} DOUBLESPARSE_SHAKESPEARE_DIR=${DOUBLESPARSE_SHAKESPEARE_DIR:-}"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
    "$PY" -c "import matplotlib" 2>/dev/null || echo "WARNING: no matplotlib: plot.png will be missing (make it later with --replot OUT/results.json)"
    # the backstop kill comes 60 s after the budget; the protocol itself stops ~reserve_s before it
    timeout -k 5 "$((${BUDGET%.*} + 60))" "$PY" -u -m doublesparse.eval.protocol -o "$OUT" \
        --budget-s "$BUDGET" --t0 "$T0" "$@"
    echo "gpu_eval.sh: exit $? after $("$PY" -c "import time; print(round(time.time() - $T0, 1))") s"
} 2>&1 | tee "$OUT/console.log"
