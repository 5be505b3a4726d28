#!/usr/bin/env bash
# Serving benchmark of issue 5 on one H200: bench_serving against `doublesparse serve` with dummy
# Llama-3.1-8B (32K-token prompts, 1024 output tokens, 16 concurrent, 100 requests by default).
#
#   benchmarks/serving_h200.sh dense     OUTDIR   # dense decode
#   benchmarks/serving_h200.sh ds        OUTDIR   # Double Sparsity, then the malformed mix
#   benchmarks/serving_h200.sh malformed OUTDIR   # only the malformed mix (on a DS server)
#
# One call = one server: it starts in the background, the script waits for /health, runs
# bench_serving (JSON under OUTDIR), scrapes /metrics and stops the server. Everything ends within
# CALL_BUDGET seconds of the script's start (default 560, under the device tool's 600 s), also when
# the benchmark would run longer: bench_serving gets a --deadline, writes partial JSON every
# PROGRESS seconds, and `timeout` backs both up. merge_serving.py turns OUTDIRs into results/.
#
# Environment (defaults are issue 5's workload on the H200):
#   NUM_PROMPTS=100 INPUT_LEN=32768 OUTPUT_LEN=1024 CONCURRENCY=16  the measured run
#   MIX=1 (ds) / 0 (dense)  also run the malformed mix after the measured run, if time is left
#   MIX_PROMPTS=40 MIX_INPUT_LEN=4096 MIX_OUTPUT_LEN=128            the mix (10% malformed)
#   MODEL_ARGS="--model-path llama-3.1-8b --load-format dummy"      e.g. "--device cpu" for the
#                                                                   embedded SmolLM2 on CPU
#   CALL_BUDGET=560 STARTUP_MAX=300 PORT=30000 PROGRESS=20 PYTHON=python3 EXTRA_SERVER_ARGS=
# Missing server packages (fastapi, uvicorn, pydantic, ...) are installed from .stage/whl
# (benchmarks/stage_serving_wheels.sh makes it; name .stage in the device tool's carry).
set -u
MODE=${1:-}
OUTDIR=${2:-}
case "$MODE" in dense|ds|malformed) ;; *) echo "usage: $0 dense|ds|malformed OUTDIR" >&2; exit 2 ;; esac
[ -n "$OUTDIR" ] || { echo "usage: $0 dense|ds|malformed OUTDIR" >&2; exit 2; }
T0=$(date +%s)
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/console-$MODE.log") 2>&1

PY=${PYTHON:-python3}
BUDGET=${CALL_BUDGET:-560}
STARTUP_MAX=${STARTUP_MAX:-300}
PORT=${PORT:-30000}
PROGRESS=${PROGRESS:-20}
NUM_PROMPTS=${NUM_PROMPTS:-100}
INPUT_LEN=${INPUT_LEN:-32768}
OUTPUT_LEN=${OUTPUT_LEN:-1024}
CONCURRENCY=${CONCURRENCY:-16}
MIX_PROMPTS=${MIX_PROMPTS:-40}
MIX_INPUT_LEN=${MIX_INPUT_LEN:-4096}
MIX_OUTPUT_LEN=${MIX_OUTPUT_LEN:-128}
MODEL_ARGS=${MODEL_ARGS:---model-path llama-3.1-8b --load-format dummy}
if [ "$MODE" = dense ]; then MIX=${MIX:-0}; else MIX=${MIX:-1}; fi
STOP_MARGIN=${STOP_MARGIN:-15}   # seconds kept for stopping the server and writing files
MIX_RESERVE=${MIX_RESERVE:-30}   # kept for the mix (warm server; ~15 s of work at the H200 sizes)
URL=http://127.0.0.1:$PORT

say() { echo "[serving_h200 $MODE +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

export PYTHONUNBUFFERED=1
if ! "$PY" -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
    if ls .stage/whl/*.whl >/dev/null 2>&1; then
        say "installing the server packages from .stage/whl"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .stage/whl/*.whl || { say "wheel install failed"; exit 1; }
        export PYTHONPATH=/tmp/site
    else
        say "fastapi/uvicorn/pydantic missing and no .stage/whl: run benchmarks/stage_serving_wheels.sh"
        exit 1
    fi
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD

# Server: a KV pool of exactly CONCURRENCY full windows, so all of them run at once and the
# context window is the workload's (Llama-3.1's own 128K would size buffers 4x larger for nothing).
CTX=$(( INPUT_LEN + OUTPUT_LEN ))
SERVER_ARGS="$MODEL_ARGS --context-length $CTX --max-total-tokens $(( CONCURRENCY * CTX ))"
SERVER_ARGS+=" --max-running-requests $CONCURRENCY --port $PORT --log-level info"
SERVER_ARGS+=" --graceful-shutdown-timeout 10${EXTRA_SERVER_ARGS:+ $EXTRA_SERVER_ARGS}"
if [ "$MODE" != dense ]; then   # k = context / 16, as the issue asks (2048 for 32K prompts)
    SERVER_ARGS+=" --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num $(( INPUT_LEN / 16 ))"
fi
SERVER_CMD="python3 -m doublesparse.launch_server $SERVER_ARGS"
COMMON="--base-url $URL --endpoint generate --dataset random --request-rate inf"
COMMON+=" --max-concurrency $CONCURRENCY --disable-tqdm --progress-interval $PROGRESS"
WARM_IN=$(( INPUT_LEN < 512 ? INPUT_LEN : 512 ))
BENCH_ARGS="$COMMON --num-prompts $NUM_PROMPTS --input-len $INPUT_LEN --output-len $OUTPUT_LEN"
BENCH_ARGS+=" --warmup-requests 2 --warmup-input-len $WARM_IN --warmup-output-len 4"
BENCH_CMD="python3 -m doublesparse.bench_serving $BENCH_ARGS"
MIX_ARGS="$COMMON --input-len $MIX_INPUT_LEN --output-len $MIX_OUTPUT_LEN --malformed-fraction 0.1"
MIX_GEN_CMD="python3 -m doublesparse.bench_serving $MIX_ARGS --num-prompts $MIX_PROMPTS"
MIX_OAI_CMD="python3 -m doublesparse.bench_serving ${MIX_ARGS/--endpoint generate/--endpoint completions} --num-prompts $(( MIX_PROMPTS / 2 ))"

# What ran where, for the results file (commands exactly as run, minus output paths).
RUNBOOK="NUM_PROMPTS=$NUM_PROMPTS INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN CONCURRENCY=$CONCURRENCY"
RUNBOOK+=" MIX=$MIX MIX_PROMPTS=$MIX_PROMPTS MIX_INPUT_LEN=$MIX_INPUT_LEN MIX_OUTPUT_LEN=$MIX_OUTPUT_LEN"
RUNBOOK+=" CALL_BUDGET=$BUDGET MODEL_ARGS='$MODEL_ARGS'${EXTRA_SERVER_ARGS:+ EXTRA_SERVER_ARGS='$EXTRA_SERVER_ARGS'} bash benchmarks/serving_h200.sh $MODE OUTDIR"
RUNBOOK_="$RUNBOOK" MODE_="$MODE" SERVER_CMD="$SERVER_CMD" BENCH_CMD="$BENCH_CMD" MIX_GEN_CMD="$MIX_GEN_CMD" \
MIX_OAI_CMD="$MIX_OAI_CMD" "$PY" - "$OUTDIR/env-$MODE.json" <<'EOF'
import datetime, json, os, platform, sys
env = {"mode": os.environ["MODE_"], "runbook": os.environ["RUNBOOK_"], "server_cmd": os.environ["SERVER_CMD"],
       "bench_cmd": os.environ["BENCH_CMD"], "mix_generate_cmd": os.environ["MIX_GEN_CMD"],
       "mix_completions_cmd": os.environ["MIX_OAI_CMD"], "python": platform.python_version(),
       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
try:
    import torch, triton
    env.update(torch=torch.__version__, triton=triton.__version__,
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as e:  # the record must not stop the run
    env["env_error"] = repr(e)
json.dump(env, open(sys.argv[1], "w"), indent=1)
print("env:", {k: env.get(k) for k in ("gpu", "torch", "triton", "python", "date")})
EOF

say "server: $SERVER_CMD"
$PY -m doublesparse.launch_server $SERVER_ARGS > "$OUTDIR/server-$MODE.log" 2>&1 &
SPID=$!
stop_server() {
    kill -0 $SPID 2>/dev/null || return 0
    kill -TERM $SPID 2>/dev/null   # drains: in-flight requests finish or were aborted on disconnect
    for _ in $(seq 1 20); do kill -0 $SPID 2>/dev/null || return 0; sleep 1; done
    say "server still up 20 s after SIGTERM: SIGKILL"
    kill -KILL $SPID 2>/dev/null
}
trap stop_server EXIT

get() {  # GET URL/$1 -> stdout (stdlib only: the image may lack curl)
    "$PY" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$URL$1', timeout=5).read().decode())" 2>/dev/null
}
while ! H=$(get /health); do
    if ! kill -0 $SPID 2>/dev/null; then say "server exited during startup:"; tail -30 "$OUTDIR/server-$MODE.log"; exit 1; fi
    if [ $(( $(date +%s) - T0 )) -ge "$STARTUP_MAX" ]; then say "server not healthy after ${STARTUP_MAX}s"; tail -30 "$OUTDIR/server-$MODE.log"; exit 1; fi
    sleep 2
done
say "server healthy: $H"
tr '\r' '\n' < "$OUTDIR/server-$MODE.log" | grep -E "KV pool|Double Sparsity|graph" | head -5

bench() {  # bench NAME DEADLINE ARGS...: one bench_serving run, ended by DEADLINE (s) at the latest
    local name=$1 deadline=$2; shift 2
    say "bench $name (deadline ${deadline}s): $*"
    timeout -k 5 $(( deadline + 10 )) "$PY" -m doublesparse.bench_serving "$@" --deadline "$deadline" \
        --result-json "$OUTDIR/$name.json"
    say "bench $name exit $?"
}

if [ "$MODE" != malformed ]; then
    D=$(( $(left) - STOP_MARGIN - (MIX == 1 ? MIX_RESERVE : 0) ))
    if [ "$D" -lt 30 ]; then say "only ${D}s left for the benchmark: skipped"; else bench "$MODE" "$D" $BENCH_ARGS; fi
fi
if [ "$MODE" = malformed ] || [ "$MIX" = 1 ]; then
    D=$(( ($(left) - STOP_MARGIN) / 2 ))
    if [ "$D" -lt 10 ]; then say "no time left for the malformed mix"; else
        bench malformed-generate "$D" $MIX_ARGS --num-prompts "$MIX_PROMPTS"
        D=$(( $(left) - STOP_MARGIN ))
        [ "$D" -ge 10 ] && bench malformed-completions "$D" \
            ${MIX_ARGS/--endpoint generate/--endpoint completions} --num-prompts $(( MIX_PROMPTS / 2 ))
    fi
fi
get /metrics > "$OUTDIR/metrics-$MODE.txt"
say "server after the run: $(get /health)"
stop_server
trap - EXIT
say "done; files in $OUTDIR: $(ls "$OUTDIR" | tr '\n' ' ')"
