# Shared by the GPU runbooks (source it from the repository root): console capture, the bench
# row runner and issue 3's bench_one_batch rows (the commands of results/bench-one-batch-h200.json).

runbook_start() {  # PYTHONPATH, unbuffered output, everything also into $OUT/console.log
  export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
  exec > >(tee -a "$OUT/console.log") 2>&1
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
}

# run NAME CMD...: one bench_one_batch row, written to NAME.json, its summary lines printed
run() {
  local name=$1; shift
  echo "== $name"
  timeout "${RUN_TIMEOUT:-100}" "$@" --result-json "$name.json" 2>&1 \
    | grep -E '^(Prefill|Decode.  median|Profile. (decode|kernels))'
}

# issue 3's Llama-3.1-8B (60K x 3) and LongChat-7B (20K x 3) rows, dense and DS
issue3_rows() {
  local B="python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 --batch-size 3 --output-len 200"
  local L="$B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
  local C="$B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000"
  run llama31-8b-60k-bs3-dense $L
  run llama31-8b-60k-bs3-ds-r16-k3750 $L --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750
  run llama31-8b-60k-bs3-ds-r32-k3000 $L --enable-double-sparsity --ds-heavy-channel-num 32 --ds-heavy-token-num 3000
  run longchat-7b-20k-bs3-dense $C
  run longchat-7b-20k-bs3-ds-r16-k1024 $C --enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024
}
