"""Run a named benchmark suite and write its result files.

    python benchmarks/run.py SUITE [--out results/] [--machine NAME] [--dry-run] [--only ROW ...]
    python benchmarks/run.py --list
    python benchmarks/run.py stage --suite SUITE      # on a networked machine: what SUITE needs, in transfers
    python benchmarks/run.py unstage [--partial-ok]   # on the GPU machine: unpack what arrived

Each suite (``SUITES`` below) is a list of rows; a row is one command of the package, run as a
subprocess from the repository root. ``{out}`` in a command is replaced by a path under the raw
folder (``--raw``, default ``<out>/raw/<area>-<machine>/``, git-ignored), where the command writes
its own JSON; the driver reads that file back. A row with a ``server`` command runs against that
server: the driver starts it, waits for ``/health``, runs the row and stops the server when the
next row needs another one (or none).

Writes ``<out>/<area>-<machine>.json`` (``suite``, ``commands``, ``commit`` (git rev-parse HEAD),
``machine`` (the GPU's name from torch, else the CPU), ``date``, ``kernel_tuning`` (the
KernelTuning defaults the rows ran with), ``summary`` and ``rows``: each
row's JSON output under its name) and ``<out>/<area>-<machine>.md`` (the same, as tables).
``--dry-run`` prints the commands and runs nothing. ``--render FILE.json`` rewrites the markdown
of an existing result file.

To add a suite, add an entry to ``SUITES``: ``area`` (the result files' name), optional
``machine`` (a fixed machine label, e.g. ``cpu`` for a run that never uses the GPU) and ``rows``.
``{gpus}`` in a command is replaced by the number of GPUs of the machine (tensor-parallel rows),
``{pool:TOKENS:GB}`` by ``--max-total-tokens TOKENS`` on a card of at least GB gigabytes (else by
nothing: the engine sizes its pool to the card). A row with ``min_gb`` above the card's memory is
skipped with why, as is a row with ``max_gb`` (a smaller card's variant) on a card of that much; a row with ``lane`` runs beside the main lane (a thread of its own); a suite with
``budget_s`` starts no row past that many seconds (``--budget-s`` overrides); ``needs`` names what
``stage`` packs for a machine without network (benchmarks/stage.py); a row's ``env`` is added to
the environment of its command and its server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
import cpu_embedded  # noqa: E402
import decode_cost  # noqa: E402
import gpu_check  # noqa: E402
import lm_eval_suite  # noqa: E402
import offload  # noqa: E402
import prefix_cache  # noqa: E402
import speedup_map  # noqa: E402
import stage  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# --- suites ----------------------------------------------------------------------------------

_ONE_BATCH = ("python -m doublesparse.bench_one_batch --profile --load-format dummy --warmup-input-len 1024 "
              "--batch-size 3 --output-len 200")
_LLAMA = f"{_ONE_BATCH} --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000"
_RECALL = ("python -m doublesparse.bench_one_batch --load-format dummy --model-path llama-3.1-8b "
           "--warmup-input-len 1024 --output-len 257 --fill random")
_LONGCHAT = f"{_ONE_BATCH} --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000"
# SmolLM2's rows read the embedded model's GGUF, staged on the machine (benchmarks/README.md)
_SMOL = ("python -m doublesparse.bench_one_batch --profile --batch-size 1 "
         "--input-len 8000 --output-len 128")
_DS = "--enable-double-sparsity --ds-heavy-channel-num"
_COST = ("python -m doublesparse.bench_one_batch --device cpu --batch-size 1 --input-len 1024 2048 4096 8000 "
         "--output-len 16 --fill random --warmup-input-len 256 --enable-double-sparsity")


def _one_batch_row(name: str, cmd: str) -> dict:
    return {"name": name, "cmd": f"{cmd} --result-json {{out}}.json", "result": "{out}.json", "timeout": 300}


# The serving workload: 100 requests of 32768 + 1024 tokens, 16 in flight, dummy Llama-3.1-8B, on a
# server whose KV pool holds exactly 16 full windows (71 GB: a card of 120 GB or more; a smaller one
# sizes the pool to its memory, see expand); DS with r = 16, k = prompt / 16.
_PORT = 30000
_SERVER_BASE = (f"python -m doublesparse.launch_server --model-path llama-3.1-8b --load-format dummy "
                f"--context-length 33792 {{pool:540672:120}} --max-running-requests 16 --port {_PORT} "
                "--log-level info --graceful-shutdown-timeout 10 --chunked-prefill-size 32768 --prefill-schedule cohort")
# the server decodes with Double Sparsity unless told not to: the dense peer says so
_SERVER = f"{_SERVER_BASE} --no-enable-double-sparsity"
_SERVER_DS = f"{_SERVER_BASE} {_DS} 16 --ds-heavy-token-num 2048"
_CLIENT = (f"python -m doublesparse.bench_serving --base-url http://127.0.0.1:{_PORT} --endpoint generate "
           "--dataset random --request-rate inf --max-concurrency 16 --disable-tqdm --progress-interval 20")
_LOAD = (f"{_CLIENT} --num-prompts 100 --input-len 32768 --output-len 1024 --warmup-requests 2 "
         "--warmup-input-len 512 --warmup-output-len 4 --result-json {out}.json")
# 10 % malformed requests on the DS server: every valid one must complete, every malformed one get a 4xx
_MIX = f"{_CLIENT} --input-len 4096 --output-len 128 --malformed-fraction 0.1"


# The speedup map: Llama-3.1-8B (dummy weights), every batch x prompt cell that fits the pools, dense
# and Double Sparsity with default flags, the pools filled with random values instead of a prefill;
# the 3 x 60K cell again with a real prefill.
_MAP = ("python -m doublesparse.bench_one_batch --load-format dummy --model-path llama-3.1-8b "
        "--batch-size 1 4 8 16 32 64 --input-len 4096 8192 16384 32768 65536 120000 --output-len 24 "
        "--fill random --skip-unfit --warmup-input-len 1024 --max-running-requests 64 --cuda-graph-max-bs 64")
_MAP_60K = ("python -m doublesparse.bench_one_batch --load-format dummy --model-path llama-3.1-8b "
            "--warmup-input-len 1024 --batch-size 3 --input-len 60000 --output-len 200 --max-total-tokens 190000")


# The fp8 KV cache (--kv-cache-dtype fp8_e4m3) against bf16 in one run: 3 x 60K dense and DS, the
# speedup map's dense bf16 / dense fp8 / DS fp8 cells, and the decode throughput at 32K prompts of
# DS with each cache at the largest batch its pool holds (pools sized from the card's memory, so
# the batches that do not fit are skipped). fp8 rotates q and K by default (--kv-cache-k-rotation);
# the -norot rows at 3 x 60K time the same without it (the fused RoPE store), the rotation's cost.
_FP8 = "--kv-cache-dtype fp8_e4m3"
_NOROT = "--kv-cache-k-rotation none"
_TPUT_32K = ("python -m doublesparse.bench_one_batch --load-format dummy --model-path llama-3.1-8b "
             "--batch-size 8 12 14 16 20 24 28 32 --input-len 32768 --output-len 24 --fill random --skip-unfit "
             "--warmup-input-len 1024 --max-running-requests 32 --cuda-graph-max-bs 32 --enable-double-sparsity")

_SERVER_SOAK = (f"python -m doublesparse.launch_server --model-path llama-3.1-8b --load-format dummy "
                f"--context-length 33792 --max-running-requests 64 --port {_PORT} --log-level warning "
                "--graceful-shutdown-timeout 10")


_LONG = "python -m doublesparse.eval.long_context --device cuda --budget-s 540"
# the accuracy suite's fp8 K/V row (its summary keys: _fp8_kv_keys)
_FP8_ACCURACY_ROW = "fp8-kv-text-8192"
_EVAL_DEFAULT = ("doublesparse eval --device cuda --default-only "
                 "--no-fidelity")


def _serving_row(name: str, server: str, cmd: str, timeout: int = 600) -> dict:
    return {"name": name, "server": server, "cmd": cmd, "result": "{out}.json", "timeout": timeout}


# MoE / MLA families (dummy weights, pools filled with random values): each family's dense decode
# against its byte floor (the experts the batch touches, the other weights, KV or latent bytes) and
# Double Sparsity (default flags) against dense. Mixtral's context is 32768 positions in all.
# --profile: each row also holds one step's kernel table (benchmarks/step_breakdown.py reads the
# suite's result file: where the step's time goes by kernel class)
_FAMILY = ("python -m doublesparse.bench.family_decode --load-format dummy --fill random --warmup-input-len 1024 "
           "--output-len 64 --floor-steps 8 --profile")
_FAMILY_CASES = {  # row stem -> model, batch, prompt, KV pool tokens, card memory it needs (GB), and
    # the memory of the cards the row is for at most (GB; a bigger card runs the row above it instead)
    "dsv2-lite-128k-bs4": ("deepseek-v2-lite", 4, 131072, 525000, 0, None),
    # 61 GB of weights + 26 GB of KV at 8 x 32K; 13 GB at 4 x 32K fits an 80 GB card; Mixtral: 93 GB of weights
    "qwen3-moe-32k-bs8": ("qwen3-30b-a3b", 8, 32768, 263000, 120, None),
    "qwen3-moe-32k-bs4": ("qwen3-30b-a3b", 4, 32768, 132000, 0, 120),
    "mixtral-32k-bs8": ("mixtral-8x7b-v0.1", 8, 32640, 262000, 120, None),
}
# The routed experts alone (bench/moe_experts.py): both models' shapes at 4, 16 and 64 tokens.
_EXPERT_ROW = {"name": "expert-path", "cmd": "python -m doublesparse.bench.moe_experts --result-json {out}.json",
               "result": "{out}.json", "timeout": 600}
# summary key stem -> row stem
_FAMILY_KEYS = {"dsv2_lite": ("dsv2-lite-128k-bs4",), "qwen3_moe": ("qwen3-moe-32k-bs8", "qwen3-moe-32k-bs4"),
                "mixtral": ("mixtral-32k-bs8",)}


# transformers' offloaded KV cache (cache_implementation="offloaded", bench/hf_offload.py), one
# sequence of Llama-3.1-8B shapes with the 1M config, random K/V in host memory, over increasing
# lengths until one does not finish within 240 s (the sweep within 480 s)
_HF_OFFLOAD = ("python -m doublesparse.bench.hf_offload --model-path llama-3.1-8b-1m --fill random "
               "--lengths 65536 131072 262144 500000 --decode-steps 8 --budget-s 240 --total-budget-s 480 "
               "--result-json {out}.json")

# Tensor parallelism (dummy weights, real prefill): Llama-3.1-70B over all the machine's GPUs at
# 60K x 8 and 120K x 4, Mixtral-8x7B over 2 GPUs at 32K x 16 (its pools need ~81 GB a GPU: H200-class);
# dense and Double Sparsity with default flags. Figures are rank 0's (weights, bytes, floor per rank).
_TP = ("python -m doublesparse.bench_one_batch --load-format dummy --warmup-input-len 1024 --output-len 64 "
       "--chunked-prefill-size 16384")
_TP_CASES = {  # row stem -> model, tp, batch, prompt, KV pool tokens, card memory it needs (GB)
    "llama70b-60k-bs8": ("llama-3.1-70b", "{gpus}", 8, 60000, 481000, 0),
    "llama70b-120k-bs4": ("llama-3.1-70b", "{gpus}", 4, 120000, 481000, 0),
    "mixtral-tp2-32k-bs16": ("mixtral-8x7b-v0.1", "2", 16, 32640, 524000, 120),
}


def _tp_rows() -> list[dict]:
    rows = []
    for stem, (model, tp, bs, n, pool, gb) in _TP_CASES.items():
        cmd = (f"{_TP} --model-path {model} --tp-size {tp} --batch-size {bs} --input-len {n} "
               f"--max-total-tokens {pool}")
        rows += [{**_one_batch_row(f"{stem}-dense", cmd), "timeout": 1800, "min_gb": gb},
                 {**_one_batch_row(f"{stem}-ds", f"{cmd} --enable-double-sparsity"), "timeout": 1800, "min_gb": gb}]
    return rows


_HEAP = ("python -m doublesparse.bench.heap --model-path llama-3.1-8b --load-format dummy --context-length 33792 "
         "--max-running-requests 64 --max-total-tokens 160000 --requests 48 --prompt-len 2000 --max-tokens 64 --rounds 6")
# ds-fixed-len (one prompt length) is the control: per-shape caches stay flat there. The ~400 KB a
# request the other rows once kept (greedy, eager and without the overlap schedule alike) came
# from prompt lengths: what CudnnShapes (attention/prefill.py) now bounds.
_HEAP_ROWS = {"ds": "", "ds-no-prefix-cache": "--disable-radix-cache", "dense": "--no-enable-double-sparsity",
              "ds-fixed-len": "--fixed-len", "ds-greedy": "--greedy", "ds-eager": "--disable-cuda-graph"}


def _heap_rows() -> list[dict]:
    return [{"name": n, "cmd": f"{_HEAP} {extra} --result-json {{out}}.json".replace("  ", " "),
             "result": "{out}.json", "timeout": 240} for n, extra in _HEAP_ROWS.items()]


def _family_rows() -> list[dict]:
    rows = []
    for stem, (model, bs, n, pool, gb, below_gb) in _FAMILY_CASES.items():
        cmd = f"{_FAMILY} --model-path {model} --batch-size {bs} --input-len {n} --max-total-tokens {pool}"
        fit = {"timeout": 900, "min_gb": gb, **({"max_gb": below_gb} if below_gb else {})}
        rows += [{**_one_batch_row(f"{stem}-dense", cmd), **fit},
                 {**_one_batch_row(f"{stem}-ds", f"{cmd} --enable-double-sparsity"), **fit}]
    return rows


SUITES: dict[str, dict] = {
    # One decode step of one layer (Llama-3.1-8B heads): SDPA, the dense kernel and Double Sparsity,
    # stage by stage, at batch 1/3/8/32 x 4K..256K (what fits). GPU only.
    "attention": {
        "area": "attention",
        "rows": [{"name": "grid", "cmd": "python -m doublesparse.bench.attention --json {out}.json --md {out}.md",
                  "result": "{out}.json", "timeout": 600}],
    },
    # End to end, one static batch (SGLang's bench_one_batch): Llama-3.1-8B 60K x 3 and LongChat-7B
    # 20K x 3 with dummy weights, dense and DS; SmolLM2-135M 8K x 1 from its GGUF.
    "one-batch": {
        "area": "bench-one-batch",
        "rows": [
            _one_batch_row("llama31-8b-60k-bs3-dense", _LLAMA),
            _one_batch_row("llama31-8b-60k-bs3-ds-r16-k3750", f"{_LLAMA} {_DS} 16 --ds-heavy-token-num 3750"),
            _one_batch_row("llama31-8b-60k-bs3-ds-r32-k3000", f"{_LLAMA} {_DS} 32 --ds-heavy-token-num 3000"),
            _one_batch_row("longchat-7b-20k-bs3-dense", _LONGCHAT),
            _one_batch_row("longchat-7b-20k-bs3-ds-r16-k1024", f"{_LONGCHAT} {_DS} 16 --ds-heavy-token-num 1024"),
            _one_batch_row("smollm2-8k-bs1-dense", _SMOL),
            _one_batch_row("smollm2-8k-bs1-ds", f"{_SMOL} --enable-double-sparsity"),
        ],
    },
    # Where DS pays: dense vs DS (default flags) over batch x prompt; table, JSON and heatmap.
    "speedup-map": {
        "area": "speedup-map",
        "rows": [
            _one_batch_row("map-dense", _MAP),
            _one_batch_row("map-ds", f"{_MAP} --enable-double-sparsity"),
            _one_batch_row("prefill-60k-bs3-dense", _MAP_60K),
            _one_batch_row("prefill-60k-bs3-ds", f"{_MAP_60K} --enable-double-sparsity"),
            # the default's accuracy on the embedded SmolLM2-135M (its GGUF staged on the machine)
            *[{"name": f"accuracy-text-{n}", "result": "{out}/results.json", "timeout": 300,
               "cmd": f"{_EVAL_DEFAULT} --no-retrieval --window-len {n} --decode-len 256 --num-windows 8 "
                      "-o {out}"} for n in (2048, 4096, 8192)],
            {"name": "accuracy-retrieval", "result": "{out}/results.json", "timeout": 300,
             "cmd": f"{_EVAL_DEFAULT} --no-text --retrieval-lens 2048 4096 8192 --retrieval-trials 20 -o {{out}}"},
        ],
    },
    "fp8-kv": {
        "area": "fp8-kv",
        "rows": [
            _one_batch_row("llama31-8b-60k-bs3-dense", _LLAMA),
            _one_batch_row("llama31-8b-60k-bs3-dense-fp8", f"{_LLAMA} {_FP8}"),
            _one_batch_row("llama31-8b-60k-bs3-ds", f"{_LLAMA} --enable-double-sparsity"),
            _one_batch_row("llama31-8b-60k-bs3-ds-fp8", f"{_LLAMA} --enable-double-sparsity {_FP8}"),
            _one_batch_row("llama31-8b-60k-bs3-dense-fp8-norot", f"{_LLAMA} {_FP8} {_NOROT}"),
            _one_batch_row("llama31-8b-60k-bs3-ds-fp8-norot", f"{_LLAMA} --enable-double-sparsity {_FP8} {_NOROT}"),
            _one_batch_row("map-dense", _MAP),
            _one_batch_row("map-dense-fp8", f"{_MAP} {_FP8}"),
            _one_batch_row("map-ds-fp8", f"{_MAP} --enable-double-sparsity {_FP8}"),
            _one_batch_row("tput-32k-ds", _TPUT_32K),
            _one_batch_row("tput-32k-ds-fp8", f"{_TPUT_32K} {_FP8}"),
        ],
    },
    # Mixtral, Qwen3-MoE, DeepSeek-V2-Lite: dense decode over its byte floor, DS over dense. GPU only.
    # + the routed experts alone at 4, 16, 64 tokens: decode path and grouped GEMM against copy bandwidth.
    "models": {"area": "models", "rows": [*_family_rows(), _EXPERT_ROW]},
    # DS-Offload and its peers on the GPU with the K/V in host memory: transformers' offloaded cache,
    # then benchmarks/offload.py's rows (Llama-3.1-8B shapes with a 1M context under a 24 GiB GPU
    # budget at 1 x 500K and 4 x 120K: DS-Offload with and without next-layer prefetch, no reuse,
    # full-KV offload; in-GPU DS and dense at 4 x 120K without the budget; the host-gather kernel's
    # bandwidth; reuse on SmolLM2 at 8K of real text). GPU only.
    "offload": {
        "area": "offload",
        "rows": [{"name": "hf-offloaded-cache", "cmd": _HF_OFFLOAD, "result": "{out}.json", "timeout": 600},
                 *offload.rows()],
    },
    # Tensor parallelism on a multi-GPU machine (rows above _tp_rows).
    "tp": {"area": "tp", "rows": _tp_rows()},
    # A mixed load for 8 minutes (one device command) at concurrency 32 against the DS server (prompts up to ~32K): lost
    # valid requests, 5xx, duplicates, RSS growth, /metrics against the client's counts.
    "soak": {
        "area": "soak",
        "rows": [_serving_row("soak", _SERVER_SOAK,
                              f"python -m doublesparse.bench.soak --base-url http://127.0.0.1:{_PORT} "
                              "--duration 480 --concurrency 32 --max-tokens 64 --prompt-words 2000 "
                              "--burst-words 20000 --burst-size 8 --oversize-words 60000 --token-ids "
                              "--result-json {out}.json", 570)],
    },
    # Host memory per request, the engine driven in-process (bench/heap.py): the soak's mix
    # (shared prefixes, aborts, logprobs) in rounds, the prefix cache at steady state, glibc's heap
    # in use fitted per request; one row per part that runs only on a GPU or can be switched off
    # (CUDA graphs, the overlap schedule, Double Sparsity, the prefix cache), greedy requests (no
    # generator each), one prompt length, and one traced row.
    "heap": {"area": "heap", "budget_s": 540, "rows": _heap_rows()},
    # The OpenAI-compatible server under load, dense and DS, then the malformed-request mix.
    "serving": {
        "area": "serving",
        "rows": [
            _serving_row("dense", _SERVER, _LOAD),
            _serving_row("ds", _SERVER_DS, _LOAD),
            _serving_row("malformed-generate", _SERVER_DS, f"{_MIX} --num-prompts 40 --result-json {{out}}.json", 120),
            _serving_row("malformed-completions", _SERVER_DS,
                         f"{_MIX.replace('--endpoint generate', '--endpoint completions')} --num-prompts 20 "
                         "--result-json {out}.json", 120),
        ],
    },
    # Prefix cache: a shared-prefix workload with and without --disable-radix-cache, and an eviction
    # run whose distinct prefixes exceed the pool (benchmarks/prefix_cache.py).
    "prefix-cache": {
        "area": "prefix-cache",
        "rows": prefix_cache.rows(_serving_row),
    },
    # Accuracy of DS settings against dense on the embedded SmolLM2-135M: the full protocol in one
    # time-budgeted run (8 x 8K text windows, retrieval at 2K/4K/8K, attention fidelity; GPU); and
    # the fp8 KV cache's text rows at 8K (dense and the default over fp8 K/V beside the model's
    # cache, each prefilled through its own cache).
    "accuracy": {
        "area": "accuracy",
        "rows": [{"name": "protocol", "cmd": "python -m doublesparse.eval.protocol --output-dir {out} --budget-s 480",
                  "result": "{out}/results.json", "md": "{out}/table.md", "timeout": 600},
                 {"name": _FP8_ACCURACY_ROW, "result": "{out}/results.json", "md": "{out}/table.md", "timeout": 600,
                  "cmd": "doublesparse eval --device cuda --no-retrieval --no-fidelity --default-only "
                         "--window-len 8192 --decode-len 256 --num-windows 8 --kv-cache-dtypes auto fp8_e4m3 "
                         "-o {out}"}],
    },
    # The top-p budget (--ds-budget-mode top_p): decode latency beside the ratio budget it cuts down
    # (Llama-3.1-8B dummy weights with random pools: flat attention, so the upper bound is kept and
    # the rows time the two extra launches; SmolLM2 from its GGUF: real attention), and accuracy
    # and measured tokens per row of top-p eval settings on SmolLM2 at 8K.
    "top-p": {
        "area": "top-p",
        "rows": [
            _one_batch_row("llama31-8b-60k-bs3-ds", f"{_LLAMA} --enable-double-sparsity"),
            _one_batch_row("llama31-8b-60k-bs3-ds-top-p", f"{_LLAMA} --enable-double-sparsity --ds-budget-mode top_p"),
            _one_batch_row("smollm2-8k-bs1-ds", f"{_SMOL} --enable-double-sparsity"),
            _one_batch_row("smollm2-8k-bs1-ds-top-p",
                           f"{_SMOL} --enable-double-sparsity --ds-budget-mode top_p --ds-heavy-token-min 128"),
            {"name": "accuracy-text-8192", "result": "{out}/results.json", "md": "{out}/table.md", "timeout": 600,
             "cmd": "doublesparse eval --device cuda --no-retrieval "
                    "--window-len 8192 --decode-len 256 --num-windows 8 --no-fidelity --settings "
                    "qk/group_max/r16/k1:16/s4w32 qk/group_max/r16/k1:8/s4w32 "
                    "qk/group_max/r16/k1:8/s4w32/p0.9min128 qk/group_max/r16/k1:8/s4w32/p0.98min128 -o {out}"},
        ],
    },
    # The sampled attention recall (attention/recall.py). Its cost: decode steps with the probe
    # off, at its default interval and on every step; the summary compares mean step times (a
    # sampled step is 1 in 64, so the median would hide it). Its agreement with the offline eval:
    # SmolLM2 (its GGUF staged) at 8K of held-out text, teacher-forced through the engine with the
    # probe on every step, against `doublesparse eval`'s attention mass on the same windows and
    # settings (doublesparse/bench/recall_agreement.py).
    "recall": {
        "area": "recall",
        "rows": [_one_batch_row(f"llama31-8b-{shape}-ds-recall{n}",
                                f"{_RECALL} {args} --enable-double-sparsity --ds-recall-sample-interval {n}")
                 for shape, args in (("60k-bs3", "--batch-size 3 --input-len 60000 --max-total-tokens 190000"),
                                     ("16k-bs32", "--batch-size 32 --input-len 16000 --max-total-tokens 520000 "
                                                  "--skip-unfit"))
                 for n in (0, 64, 1)]
        + [{"name": "smollm2-8k-agreement", "result": "{out}.json", "timeout": 600,
            "cmd": "python -m doublesparse.bench.recall_agreement --device cuda --window-len 8192 "
                   "--decode-len 256 --num-windows 8 --result-json {out}.json"}],
    },
    # The adaptive budget (--ds-budget-mode adaptive, target recall 0.95) against the ratio default:
    # perplexity and KV/label bytes read per decode step on held-out text, teacher-forced through
    # the engine's stack (doublesparse/bench/adaptive.py); SmolLM2 at 8K (its GGUF staged) and
    # Qwen2.5-Coder-1.5B at 16K (fetched or staged). Summary: adaptive_bytes_saving_pct (SmolLM2's),
    # per model beside it.
    "adaptive": {
        "area": "adaptive",
        "rows": [{"name": name, "result": "{out}.json", "timeout": 600,
                  "cmd": f"python -m doublesparse.bench.adaptive {args} --decode-len 256 --target-recall 0.95 "
                         "--result-json {out}.json"}
                 for name, args in (("smollm2-8k", "--window-len 8192 --num-windows 8 --warmup-windows 8"),
                                    ("qwen15b-16k", "--model-path qwen2.5-coder-1.5b --window-len 16384 "
                                                    "--num-windows 4 --warmup-windows 4"))],
    },
    # The embedded default on this CPU: our decode vs transformers' generate on the same GGUF and
    # prompt, side by side, and the engine's load time (benchmarks/cpu_embedded.py).
    "cpu-embedded": {
        "area": "cpu-embedded",
        "machine": "cpu",
        "stem": "cpu-embedded",
        "rows": [{"name": "embedded", "cmd": "python benchmarks/cpu_embedded.py --output {out}.json --runs 3 --new-tokens 32 --float-weights-too",
                  "result": "{out}.json", "timeout": 3600},
                 # CPU decode's packed weight copies against float32 (benchmarks/cpu_packed_accuracy.py)
                 {"name": "packed-accuracy", "cmd": "python benchmarks/cpu_packed_accuracy.py --output {out}.json",
                  "result": "{out}.json", "timeout": 3600}],
    },
    # The automatic dense/sparse choice's figures on this CPU (benchmarks/decode_cost.py): the
    # embedded model at batch 1, every step dense, then every step sparse.
    "decode-cost": {
        "area": "decode-cost",
        "machine": "cpu",
        "rows": [_one_batch_row(name, f"{_COST} --ds-sparse-decode-threshold {t}")
                 for name, t in (("dense", 1 << 30), ("sparse", 0))],
    },
    # The sampling step's extras (logprobs, penalties, min_p, grammar masks) against plain
    # sampling, per batch size, on the device (no model forward in it).
    "sampling": {
        "area": "sampling",
        "rows": [{"name": "grid", "cmd": "python -m doublesparse.bench.sampling --json {out}.json --md {out}.md",
                  "result": "{out}.json", "timeout": 600}],
    },
    # Long-context accuracy (eval/long_context.py): Qwen2.5-Coder-1.5B (`doublesparse fetch
    # qwen2.5-coder-1.5b` before, or its staged cache) at 16K and 32K, text + RULER-style tasks, dense vs
    # the default and the alternatives, and at 4K and 8K (text, the default); the embedded SmolLM2 at 8K
    # (text, the default only). One row
    # per length, each budgeted to 540 s (the runner skips what would not fit, and records it).
    "accuracy-long": {
        "area": "accuracy-long",
        "rows": [
            *[{"name": f"qwen15b-{n // 1024}k", "result": "{out}/results.json", "md": "{out}/table.md", "timeout": 600,
               "cmd": f"{_LONG} --model-path qwen2.5-coder-1.5b --lengths {n} -o {{out}}"} for n in (16384, 32768)],
            # the 1.5B at 4K and 8K (text; dense and the default), where decode turns sparse from batch 8
            {"name": "qwen15b-4k-8k", "result": "{out}/results.json", "md": "{out}/table.md", "timeout": 600,
             "cmd": f"{_LONG} --model-path qwen2.5-coder-1.5b --lengths 4096 8192 --parts text "
                    "--settings dense default -o {out}"},
            # the fp8 KV cache (--kv-cache-dtype fp8_e4m3) alone and under the default, text only
            *[{"name": f"qwen15b-{n // 1024}k-fp8-kv", "result": "{out}/results.json", "md": "{out}/table.md",
               "timeout": 600, "cmd": f"{_LONG} --model-path qwen2.5-coder-1.5b --lengths {n} --parts text "
                                      "--settings dense default --kv-cache-dtypes auto fp8_e4m3 -o {out}"}
              for n in (16384, 32768)],
            {"name": "smollm2-8k", "result": "{out}/results.json", "md": "{out}/table.md", "timeout": 600,
             "cmd": f"{_LONG} --lengths 8192 --parts text --settings dense "
                    "default --num-windows 8 --kv-cache-dtypes auto fp8_e4m3 -o {out}"},
        ],
    },
    # The GPU build in one device command: the test suite on the GPU, then one small row of each
    # GPU suite sized to the card (benchmarks/gpu_check.py), within a 540 s budget.
    "gpu-check": {"area": "gpu-check", "budget_s": gpu_check.BUDGET_S, "rows": gpu_check.rows(_serving_row)},
    # lm-evaluation-harness's local-completions model against the server on the CPU (embedded
    # SmolLM2): the shipped Shakespeare task, dense, DS, and DS forced sparse on generate-until
    # (benchmarks/lm_eval_suite.py). Needs PyPI lm-eval importable by this interpreter.
    "lm-eval": {"area": "lm-eval", "machine": "cpu", "rows": lm_eval_suite.rows(_serving_row)},
    # The CPU preset of the accuracy protocol (few settings, 1K contexts): `doublesparse eval --small`.
    "accuracy-small": {
        "area": "accuracy",
        "machine": "cpu",
        "rows": [{"name": "small", "cmd": "doublesparse eval --small --output-dir {out}",
                  "result": "{out}/results.json", "md": "{out}/table.md", "timeout": 3600}],
    },
}


# What each GPU suite needs on a machine without network (``run.py stage --suite NAME``,
# benchmarks/stage.py): "wheels" the Python packages a bare GPU image may lack (the server's, the
# tests'), "smollm2" the embedded model, "texts" the evaluation plays, "plots" matplotlib, "qwen"
# the fetched Qwen2.5-Coder-1.5B.
_NEEDS = {
    "attention": ("wheels",), "one-batch": ("wheels", "smollm2"), "sampling": ("wheels",),
    "speedup-map": ("wheels", "smollm2", "texts", "plots"), "models": ("wheels",), "tp": ("wheels",),
    "offload": ("wheels", "smollm2", "texts"), "soak": ("wheels",), "serving": ("wheels",),
    "prefix-cache": ("wheels",), "heap": ("wheels",), "accuracy": ("wheels", "smollm2", "texts", "plots"),
    "top-p": ("wheels", "smollm2", "texts"), "accuracy-long": ("wheels", "qwen", "smollm2", "texts", "plots"),
    "gpu-check": ("wheels", "smollm2", "texts"), "fp8-kv": ("wheels",),
    "adaptive": ("wheels", "smollm2", "qwen", "texts"), "recall": ("wheels", "smollm2", "texts"),
}
for _name, _needs in _NEEDS.items():
    SUITES[_name]["needs"] = _needs

# --- environment -----------------------------------------------------------------------------

def cpu_name() -> str:
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"CPU ({model or platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def machine_name() -> str:
    """The GPU's name from torch, else the CPU's."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # no torch: a CPU
        pass
    return cpu_name()


def _from_root(path: Path) -> Path:
    """``path`` relative to the repository root where it lies inside it (commands run from there)."""
    path = path.resolve()
    try:
        return path.relative_to(ROOT)
    except ValueError:
        return path


def machine_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; any CPU -> 'cpu'."""
    if name.lower().startswith("cpu"):
        return "cpu"
    words = [w for w in re.split(r"[\s_]+", name) if w.lower() not in ("nvidia", "amd", "geforce", "tesla")]
    return re.sub(r"[^a-z0-9.-]", "", (words[0] if words else name).lower()) or "gpu"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --- commands --------------------------------------------------------------------------------

def card_gb() -> float:
    """Memory of the first GPU in GB (0 without one): what the suites size their rows by."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 1e9
    except Exception:  # no torch: a CPU
        pass
    return 0.0


_POOL = re.compile(r"\{pool:(\d+):(\d+)\}")


def _fill(cmd: str, out: str, gb: float) -> str:
    """``{out}``, ``{gpus}`` and ``{pool:TOKENS:GB}`` of a command: the last becomes
    ``--max-total-tokens TOKENS`` on a card of at least GB gigabytes, else nothing (the engine then
    sizes its pool to the card's memory)."""
    cmd = cmd.replace("{out}", out)
    if "{gpus}" in cmd:
        cmd = cmd.replace("{gpus}", str(_gpu_count()))
    return _POOL.sub(lambda m: f"--max-total-tokens {m[1]}" if gb >= int(m[2]) else "", cmd)


def expand(suite: dict, raw: Path, gb: float | None = None) -> list[dict]:
    """The suite's rows with ``{out}`` filled in: argv lists and the paths to read back. ``gb``:
    the card's memory (default: this machine's); a row whose ``min_gb`` exceeds it gets ``skip``,
    the reason it is not run."""
    gb = card_gb() if gb is None else gb
    rows = []
    for row in suite["rows"]:
        out = str(raw / row["name"])
        cmd = _fill(row["cmd"], out, gb)
        server = _fill(row["server"], out, gb) if row.get("server") else None
        r = dict(row, cmd=cmd, result=row["result"].replace("{out}", out), server=server)
        if row.get("min_gb", 0) > gb:
            r["skip"] = f"needs a card of >= {row['min_gb']} GB, this one has {gb:.0f} GB"
        elif gb >= row.get("max_gb", float("inf")):
            r["skip"] = f"sized for cards below {row['max_gb']} GB; this one ({gb:.0f} GB) runs the larger row"
        if "md" in row:
            r["md"] = row["md"].replace("{out}", out)
        r["argv"] = shlex.split(r["cmd"])
        r["server_argv"] = shlex.split(r["server"]) if r.get("server") else None
        rows.append(r)
    return rows


def _gpu_count() -> int:
    import torch
    return max(1, torch.cuda.device_count())


def _python_argv(argv: list[str]) -> list[str]:
    """`python -m ...` runs under this interpreter; `doublesparse ...` through its CLI module."""
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    if argv[0] == "doublesparse":
        return [sys.executable, "-m", "doublesparse.cli", *argv[1:]]
    return argv


def _env(extra: dict | None = None) -> dict:
    """The commands' environment; ``extra``: a row's own ``env`` (its server's too)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


class Server:
    """A `doublesparse.launch_server` process, up until stop()."""

    def __init__(self, argv: list[str], log: Path, startup_s: float = 300.0, env: dict | None = None):
        self.argv = argv
        port = argv[argv.index("--port") + 1] if "--port" in argv else "30000"
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        print(f"[run] server: {shlex.join(argv)}", flush=True)
        self.proc = subprocess.Popen(_python_argv(argv), cwd=ROOT, env=_env(env), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5).read()
                break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() - t0 > startup_s:
                self.stop()
                raise RuntimeError(f"server did not become healthy (see {log})")
            time.sleep(2)
        print(f"[run] server healthy after {time.time() - t0:.0f} s", flush=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # drains: in-flight requests finish or are aborted
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_rows(rows: list[dict], raw: Path, deadline: float | None = None,
             on_row: Callable[[dict], None] | None = None) -> dict:
    """Run the rows in order (a row with ``lane`` set runs with the other rows of its lane, in a
    thread beside the main lane: e.g. server rows beside the tests) -> {name: the row's JSON}.
    ``deadline`` (time.time()): a row is not started when fewer than its ``min_s`` (30) seconds
    are left, and its timeout is cut to what is left. ``on_row``: called with the rows ended so
    far (in suite order) after each row, so a run killed from outside keeps what it finished."""
    lanes: dict = {}
    for r in rows:
        lanes.setdefault(r.get("lane"), []).append(r)
    results: dict = {}
    lock = threading.Lock()

    def ended(name: str, entry: dict) -> None:
        with lock:
            results[name] = entry
            if on_row is not None:
                on_row({r["name"]: results[r["name"]] for r in rows if r["name"] in results})

    threads = [threading.Thread(target=lambda rs=rs: _run_lane(rs, raw, deadline, ended))
               for lane, rs in lanes.items() if lane is not None]
    for t in threads:
        t.start()
    _run_lane(lanes.get(None, []), raw, deadline, ended)
    for t in threads:
        t.join()
    return {r["name"]: results[r["name"]] for r in rows}


def _run_lane(rows: list[dict], raw: Path, deadline: float | None,
              ended: Callable[[str, dict], None]) -> None:
    server = None
    try:
        for r in rows:
            left = None if deadline is None else deadline - time.time()
            why = r.get("skip") or (f"not run: {max(left, 0):.0f} s of the suite's budget left"
                                    if left is not None and left < r.get("min_s", 30) else None)
            if why:
                print(f"[run] {r['name']}: skipped ({why})", flush=True)
                ended(r["name"], {"skipped": why})
                continue
            if server and server.argv != r["server_argv"]:
                server.stop()
                server = None
            try:
                if r["server_argv"] and server is None:
                    server = Server(r["server_argv"], raw / f"server-{r['name']}.log", env=r.get("env"))
            except RuntimeError as e:
                print(f"[run] {r['name']}: {e}", flush=True)
                ended(r["name"], {"error": str(e)})
                continue
            timeout = r.get("timeout")
            if left is not None:
                timeout = min(timeout or left, max(left, 1))
            print(f"[run] {r['name']}: {r['cmd']}", flush=True)
            t0 = time.time()
            try:
                rc = subprocess.run(_python_argv(r["argv"]), cwd=ROOT, env=_env(r.get("env")),
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            path = Path(r["result"])
            entry = json.loads(path.read_text()) if path.is_file() else {}
            if not isinstance(entry, dict):
                entry = {"output": entry}
            if rc != 0:
                entry["error"] = f"exit {rc}"
            if r.get("md") and Path(r["md"]).is_file():
                entry["table_md"] = Path(r["md"]).read_text()
            entry.setdefault("wall_s", round(time.time() - t0, 1))
            print(f"[run] {r['name']}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
            ended(r["name"], entry)
    finally:
        if server:
            server.stop()


# --- summaries and markdown ------------------------------------------------------------------

def _ratio(a, b):
    return a / b if a is not None and b else None


def _summary_recall(rows: dict) -> dict:
    """recall_overhead_pct: the default interval's mean decode step over the probe-off one, less 1,
    in percent, per shape (the worst is the summary key's value); every_step: with interval 1.
    recall_agreement_abs: |sampled recall - the offline eval's| (the agreement row's summary)."""
    agree = rows.get("smollm2-8k-agreement", {}).get("summary") or {}
    mean = {n: statistics.fmean(r["results"][0]["decode_latencies"]) for n, r in rows.items()
            if r.get("results") and r["results"][0].get("decode_latencies")}
    out = {}
    for shape in ("60k-bs3", "16k-bs32"):
        base = mean.get(f"llama31-8b-{shape}-ds-recall0")
        for n, key in ((64, "default"), (1, "every_step")):
            got = mean.get(f"llama31-8b-{shape}-ds-recall{n}")
            if base and got:
                out.setdefault("by_shape", {}).setdefault(shape, {})[key] = 100 * (got / base - 1)
    shapes = out.get("by_shape", {}).values()
    pct = [v["default"] for v in shapes if "default" in v]
    return {"recall_overhead_pct": max(pct) if pct else None,
            "recall_agreement_abs": agree.get("recall_agreement_abs"), **out,
            **({"agreement": agree} if agree else {})}


def _summary_fp8_kv(rows: dict) -> dict:
    """The fp8 KV cache against bf16 (the fp8-kv suite): decode speedups at 3 x 60K, dense fp8
    over its byte floor, the speedup-map cells against dense bf16, and at 32K prompts the DS
    decode throughput of each cache at the largest batch its pool held, and the pool tokens; the
    q/K rotation's cost (decode step with it over without, dense and DS at 3 x 60K)."""
    med = {n: r["results"][0]["median_decode_latency"] for n, r in rows.items()
           if n.startswith("llama31-") and r.get("results")}
    base = med.get("llama31-8b-60k-bs3-dense")
    s = {"fp8_kv_dense_speedup_60k_bs3": _ratio(base, med.get("llama31-8b-60k-bs3-dense-fp8")),
         "fp8_kv_ds_speedup_60k_bs3": _ratio(base, med.get("llama31-8b-60k-bs3-ds-fp8")),
         "fp8_kv_ds_over_ds_bf16_60k_bs3": _ratio(med.get("llama31-8b-60k-bs3-ds"),
                                                  med.get("llama31-8b-60k-bs3-ds-fp8")),
         "fp8_kv_rotation_step_ratio_dense_60k_bs3": _ratio(med.get("llama31-8b-60k-bs3-dense-fp8"),
                                                            med.get("llama31-8b-60k-bs3-dense-fp8-norot")),
         "fp8_kv_rotation_step_ratio_ds_60k_bs3": _ratio(med.get("llama31-8b-60k-bs3-ds-fp8"),
                                                         med.get("llama31-8b-60k-bs3-ds-fp8-norot"))}
    d = rows.get("llama31-8b-60k-bs3-dense-fp8", {})
    if d.get("results"):
        r = d["results"][0]
        s["fp8_kv_dense_over_floor_60k_bs3"] = r["median_decode_latency"] / (r["median_step_bytes"] / d["copy_bandwidth"])

    def best(name):  # (decode tok/s, batch) at the largest batch that fit the pool
        done = [r for r in rows.get(name, {}).get("results", []) if "skipped" not in r]
        top = max(done, key=lambda r: r["batch_size"], default=None)
        return (top["median_decode_throughput"], top["batch_size"]) if top else (None, None)

    (bf, bf_bs), (f8, f8_bs) = best("tput-32k-ds"), best("tput-32k-ds-fp8")
    s.update(fp8_kv_ds_max_throughput_gain_32k=_ratio(f8, bf), max_batch_32k_bf16=bf_bs, max_batch_32k_fp8=f8_bs)
    pools = [rows.get(n, {}).get("kv_pool_tokens") for n in ("tput-32k-ds", "tput-32k-ds-fp8")]
    s["fp8_kv_pool_tokens_ratio"] = _ratio(pools[1], pools[0]) if all(pools) else None
    for key, name in (("dense_fp8", "map-dense-fp8"), ("ds_fp8", "map-ds-fp8")):
        if rows.get("map-dense", {}).get("results") and rows.get(name, {}).get("results"):
            s[f"map_{key}_cells"] = speedup_map.cells(rows["map-dense"], rows[name])
    return s


def summarize(area: str, rows: dict) -> dict:
    try:
        if area in ("attention", "sampling"):
            return rows["grid"]["summary"]
        if area == "bench-one-batch":
            med = {n: r["results"][0]["median_decode_latency"] for n, r in rows.items() if r.get("results")}
            s = {"ds_decode_speedup": _ratio(med.get("llama31-8b-60k-bs3-dense"), med.get("llama31-8b-60k-bs3-ds-r16-k3750")),
                 "ds_decode_speedup_r32_k3000": _ratio(med.get("llama31-8b-60k-bs3-dense"),
                                                       med.get("llama31-8b-60k-bs3-ds-r32-k3000")),
                 "longchat_ds_decode_speedup": _ratio(med.get("longchat-7b-20k-bs3-dense"),
                                                      med.get("longchat-7b-20k-bs3-ds-r16-k1024"))}
            d = rows.get("llama31-8b-60k-bs3-dense", {})
            if d.get("results"):
                r = d["results"][0]
                s["dense_decode_over_floor"] = r["median_decode_latency"] / (r["median_step_bytes"] / d["copy_bandwidth"])
            return s
        if area == "tp":
            return _summary_tp(rows)
        if area == "serving":
            d, x = rows["dense"]["metrics"], rows["ds"]["metrics"]
            mixes = [rows[k]["metrics"] for k in ("malformed-generate", "malformed-completions") if k in rows]
            return {"ds_over_dense_output_tok_s": _ratio(x["output_throughput"], d["output_throughput"]),
                    # the server's own count: 0 for the dense row, every step for the DS row
                    "sparse_decode_steps": {n: (m.get("server_counters") or {}).get("sparse_decode_steps")
                                            for n, m in (("dense", d), ("ds", x))},
                    "ds_over_dense_tpot_p50": _ratio(x["tpot_ms_p50"], d["tpot_ms_p50"]),
                    "ds_over_dense_itl_p50": _ratio(x["itl_ms_p50"], d["itl_ms_p50"]),
                    "failed_requests": d["errors"] + x["errors"],
                    "malformed_run_valid_lost": sum(m["valid_requests"] - m["completed"] for m in mixes),
                    "malformed_unexpected": sum(m["malformed_unexpected"] for m in mixes)}
        if area == "speedup-map":
            cs = speedup_map.cells(rows["map-dense"], rows["map-ds"])
            med = {n: r["results"][0]["median_decode_latency"] for n, r in rows.items()
                   if n.startswith("prefill-") and r.get("results")}
            return {"min_ratio": min((c["ratio"] for c in cs), default=None),
                    "bs32_16k": speedup_map.at(cs, 32, 16384), "bs8_32k": speedup_map.at(cs, 8, 32768),
                    "bs3_60k": _ratio(med.get("prefill-60k-bs3-dense"), med.get("prefill-60k-bs3-ds")),
                    "bs1_120k": speedup_map.at(cs, 1, 120000), **speedup_map.accuracy(rows), "cells": cs}
        if area == "models":
            return _summary_models(rows)
        if area == "fp8-kv":
            return _summary_fp8_kv(rows)
        if area == "prefix-cache":
            return prefix_cache.summary(rows)
        if area == "lm-eval":
            return lm_eval_suite.summary(rows)
        if area == "offload":
            hf = rows.get("hf-offloaded-cache", {}).get("summary", {})
            return {"hf_offload_longest_length": hf.get("longest_length"),
                    "hf_offload_step_ms": hf.get("median_step_ms"), **offload.summary(rows)}
        if area == "decode-cost":
            return decode_cost.figures(rows["dense"], rows["sparse"])
        if area == "cpu-embedded":
            acc = rows.get("packed-accuracy", {}).get("settings")
            return {**rows["embedded"]["summary"], **({"packed_accuracy": acc} if acc else {})}
        if area == "soak":
            r = rows["soak"]
            return {k: r.get(k) for k in ("lost_valid", "http_5xx", "fanout_disconnects", "rid_collisions",
                                          "rid_collisions_intact", "duplicates_identical", "rss_growth_pct",
                                          "metrics_consistent", "minutes")}
        if area == "heap":
            return {f"{n}_heap_bytes_per_request": r["summary"]["heap_in_use_bytes_per_request"]
                    for n, r in rows.items() if r.get("summary")} | {
                "containers_grown": {n: r["summary"]["containers_grown"] for n, r in rows.items()
                                     if r.get("summary", {}).get("containers_grown")},
                "traced_growth_top": rows.get("ds-traced", {}).get("summary", {}).get("traced_growth_top")}
        if area == "recall":
            return _summary_recall(rows)
        if area == "adaptive":
            by = {n: r["summary"] for n, r in rows.items() if r.get("summary")}
            first = by.get("smollm2-8k") or next(iter(by.values()), {})
            return {"adaptive_bytes_saving_pct": first.get("adaptive_bytes_saving_pct"),
                    "adaptive_ppl_no_worse": all(v["adaptive_ppl_no_worse"] for v in by.values()) if by else None,
                    "by_model": by}
        if area == "top-p":
            med = {n: r["results"][0]["median_decode_latency"] for n, r in rows.items() if r.get("results")}
            acc = rows.get("accuracy-text-8192", {}).get("rows", [])
            dense = next((r["ppl"] for r in acc if r["kind"] == "dense"), None)
            return {"llama_top_p_over_ratio_decode": _ratio(med.get("llama31-8b-60k-bs3-ds-top-p"),
                                                            med.get("llama31-8b-60k-bs3-ds")),
                    "smollm2_top_p_over_ratio_decode": _ratio(med.get("smollm2-8k-bs1-ds-top-p"),
                                                              med.get("smollm2-8k-bs1-ds")),
                    "ppl_increase_pct": {r["setting"]: 100 * (r["ppl"] / dense - 1) for r in acc if dense},
                    "avg_k": {r["setting"]: r["avg_k"] for r in acc if "avg_k" in r},
                    "bytes_vs_dense": {r["setting"]: r["bytes_vs_dense"] for r in acc}}
        if area == "accuracy-long":
            from doublesparse.eval.long_report import suite_summary
            return suite_summary(rows)
        if area == "accuracy":
            f8 = _fp8_kv_keys(rows.get(_FP8_ACCURACY_ROW, {}).get("rows", []), 8192)
            res = next((r for n, r in rows.items() if n != _FP8_ACCURACY_ROW), None)
            if res is None:
                return f8
            if "summary" in res:  # the protocol writes its own
                return {**res["summary"], **f8}
            dense, default = res["rows"][0], res["rows"][1]  # `doublesparse eval`: dense, the engine's default, ...
            return {"default_setting": default["setting"], "dense_ppl": dense["ppl"], "default_ppl": default["ppl"],
                    "default_ppl_increase_pct": 100 * (default["ppl"] / dense["ppl"] - 1),
                    "kl_default": default["kl"], "top1_default": default["top1"],
                    "retrieval_dense": dense.get("retrieval_acc"), "retrieval_default": default.get("retrieval_acc"),
                    **f8}
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as e:
        return {"error": f"no summary: {e!r}"}
    return {}


def _fp8_kv_keys(eval_rows: list, n: int) -> dict:
    """From a `doublesparse eval --default-only --kv-cache-dtypes auto fp8_e4m3` run's rows (dense,
    the default, then both over fp8 K/V): fp8 K/V alone over dense (%), and the default over fp8
    K/V's increase over dense minus the default's (percentage points)."""
    by = {r["setting"]: r for r in eval_rows if r.get("ppl")}
    if "dense" not in by or "dense/kv:fp8_e4m3" not in by or len(eval_rows) < 2:
        return {}
    dense, default = by["dense"]["ppl"], eval_rows[1]
    f8 = by.get(default["setting"] + "/kv:fp8_e4m3")
    return {f"fp8_kv_ppl_increase_pct_{n}": 100 * (by["dense/kv:fp8_e4m3"]["ppl"] / dense - 1),
            f"fp8_kv_ppl_increase_pct_{n}_ci95": by["dense/kv:fp8_e4m3"].get("ppl_pct_ci95"),
            f"fp8_kv_ds_ppl_points_{n}": 100 * (f8["ppl"] - default["ppl"]) / dense if f8 else None}


def _table_one_batch(rows: dict) -> list[str]:
    L = ["| case | prefill tok/s | decode median ms | decode tok/s | step bytes (MB) | floor ms | over floor |"
         " sparse steps | GPU-only step ms |", "|---|---|---|---|---|---|---|---|---|"]
    for n, d in rows.items():
        if not d.get("results"):
            L.append(f"| {n} | {d.get('error', 'no result')} |||||||| ")
            continue
        r = d["results"][0]
        fl = r["median_step_bytes"] / d["copy_bandwidth"]
        gpu = r.get("profile", {}).get("gpu_step_median_s")
        L.append(f"| {n} | {r['prefill_throughput']:.0f} | {r['median_decode_latency'] * 1e3:.2f} | "
                 f"{r['median_decode_throughput']:.1f} | {r['median_step_bytes'] / 1e6:.0f} | {fl * 1e3:.2f} | "
                 f"{r['median_decode_latency'] / fl:.2f} | {r['sparse_steps']}/{r['decode_steps']} | "
                 f"{'' if gpu is None else f'{gpu * 1e3:.3f}'} |")
    return L


def _summary_tp(rows: dict) -> dict:
    med = {n: r["results"][0]["median_decode_latency"] for n, r in rows.items() if r.get("results")}
    d = rows.get("llama70b-60k-bs8-dense", {})
    s = {"tp": d.get("config", {}).get("tp_size"),
         "llama70b_60k_bs8_ds_speedup": _ratio(med.get("llama70b-60k-bs8-dense"), med.get("llama70b-60k-bs8-ds")),
         "llama70b_120k_bs4_ds_speedup": _ratio(med.get("llama70b-120k-bs4-dense"), med.get("llama70b-120k-bs4-ds")),
         "mixtral_tp2_32k_bs16_ds_speedup": _ratio(med.get("mixtral-tp2-32k-bs16-dense"),
                                                   med.get("mixtral-tp2-32k-bs16-ds"))}
    if d.get("results"):
        r = d["results"][0]
        s["llama70b_dense_over_floor"] = r["median_decode_latency"] / (r["median_step_bytes"] / d["copy_bandwidth"])
    return s


def _summary_models(rows: dict) -> dict:
    s = {}
    for key, stems in _FAMILY_KEYS.items():
        # the card-sized row that ran (an 80 GB card runs Qwen3's 4 x 32K in place of 8 x 32K)
        stem = next((t for t in stems if rows.get(f"{t}-dense", {}).get("results")), stems[0])
        d, x = (rows.get(f"{stem}-{v}", {}).get("results", [{}])[0] for v in ("dense", "ds"))
        size = stem.split("-")[-2] + "_" + stem.split("-")[-1]  # "128k_bs4"
        s[f"{key}_{size}_ds_speedup"] = _ratio(d.get("median_decode_latency"), x.get("median_decode_latency"))
        s[f"{key}_dense_over_floor"] = d.get("floor", {}).get("over_floor")
        s[f"{key}_ds_over_floor"] = x.get("floor", {}).get("over_floor")
        s[f"{key}_floor_ratio"] = _ratio(d.get("floor", {}).get("floor_s"), x.get("floor", {}).get("floor_s"))
    expert = rows.get(_EXPERT_ROW["name"], {})
    s["expert_path_bw_frac_min"] = expert.get("summary", {}).get("expert_path_bw_frac_min")
    if expert.get("rows"):  # time = bytes / stream rate + fixed cost, per path and model
        from doublesparse.bench.moe_experts import fixed_cost
        s["expert_path_fit"] = fixed_cost(expert["rows"])
    return s


def _table_models(rows: dict) -> list[str]:
    head = ("| case | decode median ms | floor ms | over floor | weights GB | experts GB (touched / layer) | "
            "cache GB | sparse steps |")
    L = [head, "|---|---|---|---|---|---|---|---|"]
    for n, d in rows.items():
        if n == _EXPERT_ROW["name"]:
            continue
        r = (d.get("results") or [{}])[0]
        f = r.get("floor")
        if not f or not r.get("median_decode_latency"):
            L.append(f"| {n} | {d.get('error', 'no result')} |||||||")
            continue
        touched = f.get("touched_experts_mean")
        L.append(f"| {n} | {r['median_decode_latency'] * 1e3:.2f} | {f['floor_s'] * 1e3:.2f} | {f['over_floor']:.2f} | "
                 f"{f['static_weight_bytes'] / 1e9:.2f} | {f['expert_bytes'] / 1e9:.2f}"
                 f"{'' if touched is None else f' ({touched:.1f})'} | {f['attention_bytes'] / 1e9:.2f} | "
                 f"{r['sparse_steps']}/{r['decode_steps']} |")
    return L


_SERVING_COLS = [("output tok/s", "output_throughput", 1), ("TTFT p50 ms", "ttft_ms_p50", 0),
                 ("TPOT p50 ms", "tpot_ms_p50", 2), ("TPOT p99 ms", "tpot_ms_p99", 2),
                 ("ITL p50 ms", "itl_ms_p50", 2), ("ITL p99 ms", "itl_ms_p99", 2), ("errors", "errors", 0)]


def _table_serving(rows: dict) -> list[str]:
    L = ["| run | " + " | ".join(c for c, _, _ in _SERVING_COLS) + " |", "|---|" + "---|" * len(_SERVING_COLS)]
    for n, d in rows.items():
        m = d.get("metrics", {})
        L.append(f"| {n} | " + " | ".join("" if m.get(k) is None else f"{m[k]:.{nd}f}" for _, k, nd in _SERVING_COLS)
                 + " |")
    return L


def _default_tuning() -> dict:
    """The tree's KernelTuning defaults: what every row ran with (no suite row passes
    --kernel-tuning; the rows that take one record their own as well)."""
    import dataclasses
    from doublesparse.kernels.tuning import KernelTuning
    return dataclasses.asdict(KernelTuning())


def _other_commits(doc: dict) -> str:
    """" (rows ... at commit X)" for the rows of a merged result that an earlier commit gave."""
    other: dict = {}
    for row, c in doc.get("row_commits", {}).items():
        if c != doc["commit"]:
            other.setdefault(c, []).append(row)
    return "".join(f" (rows {', '.join(rows)} at `{c}`)" for c, rows in other.items())


def markdown(doc: dict) -> str:
    area, rows = doc["area"], doc["rows"]
    L = [f"# {doc['suite']} on {doc['machine']}", "",
         f"Date: {doc['date']}. Commit: `{doc['commit']}`{_other_commits(doc)}. Machine: {doc['machine']}. "
         f"Rerun: `python benchmarks/run.py {doc['suite']}`.", ""]
    for note in doc.get("notes", []):
        L += [note, ""]
    if area in ("bench-one-batch", "top-p", "tp"):
        L += _table_one_batch({n: d for n, d in rows.items() if "results" in d or "error" in d}) + [""]
    elif area == "speedup-map" and doc["summary"].get("cells"):
        L += ["Decode-step speedup of Double Sparsity over dense (dense ms / DS ms), the byte-floor "
              "speedup in brackets; 'dense': the automatic choice decoded that cell densely. The map's "
              "cells start from random K/V/label values instead of a prefill; the 3 x 60K rows prefill.",
              "", *speedup_map.table(doc["summary"]["cells"]), "",
              f"![speedup map]({doc.get('png', '')})", "", *speedup_map.accuracy_table(doc["rows"]), ""]
        L += _table_one_batch({n: d for n, d in rows.items() if n.startswith("prefill-")}) + [""]
    elif area == "serving":
        L += _table_serving(rows) + [""]
    elif area == "decode-cost":
        L += [decode_cost.__doc__.split("\n\n")[1].replace("\n", " "), "",
              *decode_cost.table(rows["dense"], rows["sparse"]), "",
              f"As KernelTuning fields: `{json.dumps(doc['summary'].get('kernel_tuning'))}`", ""]
    elif area == "models":
        note = ("Decode step of one static batch (dummy weights, pools filled with random values) against "
                "its byte floor: the weights every step reads, the routed experts the batch touches "
                "(counted on 8 extra eager steps), and the cache (dense: every token's KV / latent row; "
                "DS: labels + the selected rows), over the copy bandwidth measured at start.")
        L += [note, "", *_table_models(rows), ""]
        if rows.get(_EXPERT_ROW["name"], {}).get("rows"):
            from doublesparse.bench.moe_experts import __doc__ as doc_, table
            L += [doc_.split("\n\n")[1].replace("\n", " "), "", *table(rows[_EXPERT_ROW["name"]]), ""]
    elif area == "prefix-cache":
        L += [prefix_cache.NOTE, "", *prefix_cache.table(rows), ""]
    elif area == "offload":
        L += [offload.NOTE, "", *offload.table(rows), ""]
    elif area == "gpu-check":
        L += [gpu_check.NOTE, "", *gpu_check.table(rows), ""]
    elif area == "lm-eval":
        L += [lm_eval_suite.NOTE, "", *lm_eval_suite.table(rows), ""]
    elif area == "cpu-embedded" and "embedded" in rows and "runs" in rows["embedded"]:
        L += cpu_embedded.table(rows["embedded"])
    for n, d in rows.items():
        if d.get("table_md"):
            L += [f"## {n}", "", d["table_md"].strip(), ""]
        elif area == "attention" and d.get("rows"):
            L += ["| batch | ctx | variant | us | speedup over best dense |", "|---|---|---|---|---|"]
            for r in d["rows"]:
                v = r["variant"] + (f"/r{r['r']}/k{r['k']}" if "r" in r else "")
                v += f"/{r['label']}" if r.get("label") not in (None, "bfloat16") else ""
                sp = f"{r['speedup']:.2f}" if "speedup" in r else ""
                L.append(f"| {r['batch']} | {r['ctx']} | {v} | {r['us']:.1f} | {sp} |")
            L.append("")
        if d.get("error"):
            L += [f"`{n}`: {d['error']}", ""]
    L += ["## Summary", "", "```json", json.dumps(doc["summary"], indent=1), "```", "", "## Commands", ""]
    L += [f"- `{c}`" for c in doc["commands"]]
    return "\n".join(L) + "\n"


# --- main ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__.splitlines()[0])
    p.add_argument("suite", nargs="?", choices=sorted(SUITES))
    p.add_argument("--out", type=Path, default=ROOT / "results", help="where the result files go")
    p.add_argument("--raw", type=Path, default=None, help="the commands' own files (default <out>/raw/<area>-<machine>)")
    p.add_argument("--machine", default=None, help="machine label of the file names (default: from the GPU's name)")
    p.add_argument("--only", nargs="+", default=None, metavar="ROW", help="run only these rows")
    p.add_argument("--commit", default=None,
                   help="the commit the tree is at, where it has no .git (default: git rev-parse HEAD)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--list", action="store_true", help="list the suites and their rows")
    p.add_argument("--render", type=Path, default=None, metavar="JSON", help="rewrite the markdown of a result file")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no row after this many seconds (default: the suite's own budget, if any)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows (and commands) of an existing result file that this run does not redo: "
                        "a suite run in parts with --only, e.g. one device command per part")
    return p


def suite_commands(name: str, raw: Path | None = None) -> list[dict]:
    """The expanded rows of suite ``name`` (raw files under ``raw``, default a placeholder)."""
    return expand(SUITES[name], raw or Path("RAW"))


def write_result(results: dict, prev: dict | None, meta: dict, plots: bool) -> None:
    """Write ``{out}/{stem}.json`` and ``.md`` from the rows run (merged over ``prev``, the file a
    ``--merge`` run found). ``plots``: draw the area's figure too (the last write)."""
    commands, commit, date, machine = meta["commands"], meta["commit"], meta["date"], meta["machine"]
    row_commits = {name: commit for name in results}
    if prev is not None:
        kept = {k: v for k, v in prev["rows"].items() if k not in results}
        # each kept row keeps the commit that gave it
        row_commits = {**{k: prev.get("row_commits", {}).get(k, prev["commit"]) for k in kept}, **row_commits}
        results = {**kept, **results}
        commands = [c for c in prev["commands"] if c not in commands] + commands
    area, out, stem = meta["area"], meta["out"], meta["stem"]
    doc = {"suite": meta["suite"], "area": area, "commands": commands, "commit": commit, "machine": machine,
           "date": date, "kernel_tuning": _default_tuning(), "summary": summarize(area, results),
           "rows": results}
    if len(set(row_commits.values())) > 1:
        doc["row_commits"] = row_commits
    if area == "gpu-check":
        doc["summary"] = gpu_check.summary(results, machine, time.time() - meta["started"])
    if area in ("models", "prefix-cache", "accuracy-long", "offload"):  # the summary names its provenance itself
        doc["summary"].update(commands=commands, date=date, device=machine, commit=commit)
    if area == "cpu-embedded":  # its summary names where it came from too
        doc["summary"].update(commands=commands, date=date, machine=machine, commit=commit)
    out.mkdir(parents=True, exist_ok=True)
    if plots and area == "speedup-map" and doc["summary"].get("cells"):
        png = speedup_map.heatmap(doc["summary"]["cells"], out / f"{stem}.png",
                                  f"Double Sparsity vs dense decode, Llama-3.1-8B, {machine}")
        doc["png"] = png.name
    if plots and area == "accuracy-long":
        from doublesparse.eval.long_report import suite_plot
        png = suite_plot(results, out / f"{stem}.png")
        doc["png"] = png.name if png else None
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(doc))
    if plots:
        print(f"[run] wrote {out / stem}.json and .md")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stage"]:  # staging for a machine without network: benchmarks/stage.py
        return stage.stage_main(argv[1:], {name: s.get("needs", ()) for name, s in SUITES.items()})
    if argv[:1] == ["unstage"]:
        return stage.unstage_main(argv[1:])
    p = build_parser()
    a = p.parse_args(argv)
    if a.render:  # the summary again from the rows, then the markdown
        doc = json.loads(a.render.read_text())
        doc["summary"] = {**doc["summary"], **summarize(doc["area"], doc["rows"])}
        a.render.write_text(json.dumps(doc, indent=1) + "\n")
        a.render.with_suffix(".md").write_text(markdown(doc))
        return 0
    if a.list:
        for name, s in SUITES.items():
            print(f"{name} -> {s['area']}-*: " + ", ".join(r["name"] for r in s["rows"]))
        return 0
    if not a.suite:
        p.error("a suite is required (see --list)")
    suite = SUITES[a.suite]
    if a.only:
        unknown = set(a.only) - {r["name"] for r in suite["rows"]}
        if unknown:
            p.error(f"no rows {sorted(unknown)} in suite {a.suite}")
        suite = dict(suite, rows=[r for r in suite["rows"] if r["name"] in a.only])
    machine = cpu_name() if suite.get("machine") == "cpu" else machine_name()
    slug = a.machine or suite.get("machine") or machine_slug(machine)
    stem = suite.get("stem") or f"{suite['area']}-{slug}"
    raw = _from_root(a.raw or (a.out / "raw" / stem))
    rows = expand(suite, raw)
    if a.dry_run:
        server = None
        for r in rows:
            if r.get("skip"):
                print(f"# {r['name']}: skipped ({r['skip']})")
                continue
            if r["server"] and r["server"] != server:
                print(f"# server (up while the rows below run): {r['server']}")
            server = r.get("server")
            print(r["cmd"] + (f"   # lane {r['lane']}" if r.get("lane") else ""))
        print(f"# writes {a.out / stem}.json and .md")
        return 0
    raw.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commit = a.commit or git_commit()
    started = time.time()
    budget = a.budget_s if a.budget_s is not None else suite.get("budget_s")
    commands = []
    for r in rows:
        if r["server"] and r["server"] not in commands:
            commands.append(r["server"])
        commands.append(r["cmd"])
    old = a.out / f"{stem}.json"
    prev = json.loads(old.read_text()) if a.merge and old.is_file() else None
    meta = dict(suite=a.suite, area=suite["area"], commands=commands, commit=commit, machine=machine, date=date,
                started=started, out=a.out, stem=stem)
    # after each row, the file so far (the rows not ended yet say so), then once more with the plots
    pending = {r["name"]: {"skipped": "not ended: the suite's run stopped before it"}
               for r in rows if r["name"] not in (prev or {}).get("rows", {})}

    def on_row(done: dict) -> None:
        try:
            write_result({**pending, **done}, prev, meta, plots=False)
        except Exception as e:  # a summary that needs the rows still running: the last write tells
            print(f"[run] the file so far not written ({type(e).__name__}: {e})", flush=True)

    results = run_rows(rows, raw, deadline=None if budget is None else time.time() + budget, on_row=on_row)
    write_result(results, prev, meta, plots=True)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
