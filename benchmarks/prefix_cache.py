"""The prefix-cache suite of benchmarks/run.py: its rows, summary and table.

Llama-3.1-8B (dummy weights), Double Sparsity on, SGLang's generated-shared-prefix workload through
``bench_serving``: 4 groups x 16 questions, a 32768-token system prompt per group, 256-token
questions, 128 output tokens, 16 in flight; once with the prefix cache and once with
``--disable-radix-cache`` (same flags otherwise), then an eviction run: 16 groups x 2 questions
against a pool of about 4 prompts, so the distinct prefixes exceed the pool about 4 times.
"""

from __future__ import annotations

PORT = 30000
_SERVER = (
    f"python -m doublesparse.launch_server --model-path llama-3.1-8b --load-format dummy "
    f"--context-length 33792 --port {PORT} --log-level info --graceful-shutdown-timeout 10 "
    "--enable-double-sparsity --chunked-prefill-size 8192"
)
# 16 full windows (71 GB of KV): on a card under 120 GB the server sizes its pool to the card
SERVER = f"{_SERVER} {{pool:540672:120}} --max-running-requests 16"
SERVER_DISABLED = f"{SERVER} --disable-radix-cache"
SERVER_SMALL_POOL = f"{_SERVER} --max-total-tokens 135000 --max-running-requests 4"
_CLIENT = (
    f"python -m doublesparse.bench_serving --base-url http://127.0.0.1:{PORT} --endpoint generate "
    "--dataset-name generated-shared-prefix --gsp-system-prompt-len 32768 --gsp-question-len 256 "
    "--gsp-output-len 128 --request-rate inf --warmup-requests 2 --warmup-input-len 512 "
    "--warmup-output-len 4 --disable-tqdm --progress-interval 20 --result-json {out}.json"
)
CLIENT = f"{_CLIENT} --gsp-num-groups 4 --gsp-prompts-per-group 16 --max-concurrency 16"
CLIENT_EVICTION = (
    f"{_CLIENT} --gsp-num-groups 16 --gsp-prompts-per-group 2 --max-concurrency 4"
)


def rows(serving_row) -> list[dict]:
    return [
        serving_row("disabled", SERVER_DISABLED, CLIENT),
        serving_row("radix-cache", SERVER, CLIENT),
        serving_row("eviction", SERVER_SMALL_POOL, CLIENT_EVICTION),
    ]


def _lost(m: dict) -> int:
    """Valid requests that did not complete (errors, cut or never answered)."""
    return m["valid_requests"] - m["completed"]


def summary(rows: dict) -> dict:
    on, off, ev = (rows[k]["metrics"] for k in ("radix-cache", "disabled", "eviction"))
    evicted = (ev.get("server_counters") or {}).get("prefix_cache_evicted_tokens")
    return {
        "speedup_vs_disabled": off["duration_s"] / on["duration_s"],
        "ttft_warm_over_cold_p50": on["ttft_warm_over_cold_p50"],
        "hit_rate": on["prefix_cache_hit_rate"],
        "eviction_run_failed": _lost(ev),
        "eviction_run_evicted_tokens": evicted,
        "failed_requests": _lost(on) + _lost(off),
    }


_COLS = [
    ("duration s", "duration_s", 1),
    ("TTFT cold p50 ms", "ttft_cold_ms_p50", 0),
    ("TTFT warm p50 ms", "ttft_warm_ms_p50", 0),
    ("warm / cold", "ttft_warm_over_cold_p50", 3),
    ("hit rate", "prefix_cache_hit_rate", 3),
    ("output tok/s", "output_throughput", 1),
    ("TPOT p50 ms", "tpot_ms_p50", 2),
    ("completed", "completed", 0),
    ("errors", "errors", 0),
]


def table(rows: dict) -> list[str]:
    out = [
        "| run | " + " | ".join(c for c, _, _ in _COLS) + " |",
        "|---|" + "---|" * len(_COLS),
    ]
    for name, d in rows.items():
        m = d.get("metrics", {})
        out.append(
            f"| {name} | "
            + " | ".join(
                "" if m.get(k) is None else f"{m[k]:.{nd}f}" for _, k, nd in _COLS
            )
            + " |"
        )
    return out


NOTE = (
    "Cold: the first request sent of each group (its prefix is computed); warm: the others "
    "(TTFT from the client's send). Hit rate: prompt tokens the server found in its prefix "
    "cache / prompt tokens, over the measured requests (the server's /metrics)."
)
