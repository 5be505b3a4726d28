#!/bin/bash
# GPU runbook, session 8 (H200), part b: issue 3's Llama-3.1-8B 60K x 3 DS row with the one-launch
# select at coop_block_n 2048 and with it off (three launches), and LongChat's; then the Triton
# GEMV (gemv.py) for every decode projection with K <= 8192 (gemv_max_bytes 1 GiB: qkv, o and
# gate_up of the 8B model at bs 3; down keeps cuBLAS), dense and DS. Writes $OUT/s8b.tgz.
source benchmarks/runbook_lib.sh; runbook_start
mkdir -p /tmp/s8b; cd /tmp/s8b
B="python3 -m doublesparse.bench_one_batch --profile --load-format dummy --skip-warmup --batch-size 3 --output-len 200"
L="$B --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
C="$B --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000"
DS="--enable-double-sparsity --ds-heavy-channel-num 16"
DOUBLESPARSE_TUNING='{"coop_block_n": 2048}' run llama-ds-coop2048 $L $DS --ds-heavy-token-num 3750
DOUBLESPARSE_TUNING='{"select_coop": false}' run llama-ds-nocoop $L $DS --ds-heavy-token-num 3750
DOUBLESPARSE_TUNING='{"coop_block_n": 2048}' run longchat-ds-coop2048 $C $DS --ds-heavy-token-num 1024
DOUBLESPARSE_TUNING='{"select_coop": false}' run longchat-ds-nocoop $C $DS --ds-heavy-token-num 1024
DOUBLESPARSE_TUNING='{"select_coop": false, "gemv_max_bytes": 1073741824}' run llama-dense-gemv $L
DOUBLESPARSE_TUNING='{"select_coop": false, "gemv_max_bytes": 1073741824}' run llama-ds-nocoop-gemv $L $DS --ds-heavy-token-num 3750
tar czf $OUT/s8b.tgz *.json
echo "== end"
