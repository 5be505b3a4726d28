"""The offload suite of benchmarks/run.py: DS-Offload rows, summary and table.

Llama-3.1-8B shapes with a 1M-token context (shipped config ``llama-3.1-8b-1m``, dummy weights), the
engine held to a 24 GiB GPU budget (``--gpu-memory-budget-gb 24``, standing for a 24 GB card), K/V
in pinned host memory, k = 4096, r = 16: 1 x 500K and 4 x 120K for DS-Offload with the hot set,
without reuse, and full-KV offload (dense attention reading every token's K/V from host memory each
step). The pools are filled with random values (``--fill random``): a real prefill of 500K tokens
does not fit one 10-minute device command, so these rows time decode only. In-GPU Double
Sparsity and dense at 4 x 120K do not fit 24 GiB (their K/V alone is 63 GB); their rows run
without the budget, where the card holds them. Then the embedded SmolLM2-135M at 8K tokens of real
text: host->device bytes per step with reuse against without, and whether the generated tokens equal
in-GPU Double Sparsity's.
"""

from __future__ import annotations

_ONE = ("python -m doublesparse.bench_one_batch --load-format dummy --model-path llama-3.1-8b-1m --fill random "
        "--warmup-input-len 1024 --ds-heavy-channel-num 16 --ds-heavy-token-num 4096")
_OFF = "--enable-ds-offload --gpu-memory-budget-gb 24"
# batch, prompt, KV tokens (pool = host store), extra flags: 4 x 120K keeps its hot set within the
# budget with 6144 hot tokens per request and layer (1.5 k)
CASES = {
    "1x500k": (1, 500000, 500100, ""),
    "4x120k": (4, 120000, 480400, "--ds-offload-hot-tokens 6144"),
}
NOTE = ("Decode step of one static batch, Llama-3.1-8B shapes (dummy weights, `llama-3.1-8b-1m`), pools "
        "filled with random values (`--fill random`: decode only, no prefill), k = 4096, r = 16. "
        "DS-Offload rows hold the engine to `--gpu-memory-budget-gb 24` with K/V in pinned host memory; "
        "`host MB/step` is what crossed PCIe per decode step (full-kv: every token's K/V). Random "
        "weights give random queries, the worst case for reuse; the SmolLM2 row is real text.")


def _row(name: str, cmd: str, timeout: int = 600) -> dict:
    return {"name": name, "cmd": f"{cmd} --result-json {{out}}.json", "result": "{out}.json", "timeout": timeout}


def rows() -> list[dict]:
    out = []
    for stem, (bs, n, pool, extra) in CASES.items():
        base = (f"{_ONE} --batch-size {bs} --input-len {n} --max-total-tokens {pool} "
                f"--max-running-requests {bs}")
        out += [
            _row(f"{stem}-ds-offload", f"{base} {_OFF} --output-len 64 {extra}".strip()),
            _row(f"{stem}-prefetch", f"{base} {_OFF} --ds-offload-prefetch next-layer --output-len 64 {extra}".strip()),
            _row(f"{stem}-no-reuse", f"{base} {_OFF} --ds-offload-fetch no-reuse --output-len 32 {extra}".strip()),
            _row(f"{stem}-full-kv", f"{base} {_OFF} --ds-offload-fetch full-kv --output-len 6 {extra}".strip()),
        ]
    base = f"{_ONE} --batch-size 4 --input-len 120000 --max-total-tokens 480400 --max-running-requests 4 --output-len 64"
    out += [_row("4x120k-in-gpu-ds", f"{base} --enable-double-sparsity"),
            _row("4x120k-in-gpu-dense", base)]
    out.append(_row("host-gather", "python -m doublesparse.bench.offload --gather-only", 300))
    out.append({"name": "smollm2-8k-text", "result": "{out}.json", "timeout": 600,
                "cmd": "python -m doublesparse.bench.offload --input-len 8000 "
                       "--output-len 128 --result-json {out}.json"})
    return out


def _median_ms(rows: dict, name: str):
    r = rows.get(name, {})
    res = (r.get("results") or [{}])[0]
    v = res.get("median_decode_latency")
    return v * 1000 if v is not None else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def summary(rows: dict) -> dict:
    s = {}
    for stem in CASES:
        ms = {k: _median_ms(rows, f"{stem}-{k}") for k in ("ds-offload", "prefetch", "no-reuse", "full-kv")}
        # the best of the fetch policies a user can pick (the hot set as the layer runs, the hot set
        # with next-layer prediction, no hot set); random queries are reuse's worst case
        policies = {"reuse": ms["ds-offload"], "reuse+next-layer": ms["prefetch"], "no-reuse": ms["no-reuse"]}
        known = {k: v for k, v in policies.items() if v is not None}
        best = min(known.values(), default=None)
        s[f"step_ms_{stem}"] = best
        s[f"best_fetch_policy_{stem}"] = min(known, key=known.get) if known else None
        s[f"full_offload_over_ds_offload_{stem}"] = _ratio(ms["full-kv"], best)
        s[f"no_prefetch_step_ms_{stem}"] = ms["ds-offload"]
        s[f"prefetch_step_ms_{stem}"] = ms["prefetch"]
        s[f"no_reuse_step_ms_{stem}"] = ms["no-reuse"]
        s[f"full_offload_step_ms_{stem}"] = ms["full-kv"]
        off = ((rows.get(f"{stem}-ds-offload", {}).get("results") or [{}])[0]).get("offload") or {}
        s[f"hit_rate_{stem}"] = off.get("hit_rate")
        s[f"host_mb_per_step_{stem}"] = (off["host_bytes_per_step"] / 1e6) if "host_bytes_per_step" in off else None
    s["step_ms_4x120k_in_gpu_ds"] = _median_ms(rows, "4x120k-in-gpu-ds")
    s["step_ms_4x120k_in_gpu_dense"] = _median_ms(rows, "4x120k-in-gpu-dense")
    gather = rows.get("host-gather", {})
    s["host_gather_gb_s"] = gather.get("summary", {}).get("host_gather_gb_s")
    s["host_gather_head_gb_s"] = gather.get("summary", {}).get("host_gather_head_gb_s")
    s["pinned_copy_gb_s"] = max((r.get("copy_gb_s", 0) for r in gather.get("runs", {}).values()), default=None)
    text = rows.get("smollm2-8k-text", {}).get("summary", {})
    s["reuse_bytes_fraction_8k"] = text.get("reuse_bytes_fraction")
    s["outputs_identical_8k"] = text.get("outputs_identical")
    s["hit_rate_8k"] = text.get("hit_rate")
    return s


def table(rows: dict) -> list[str]:
    L = ["| row | batch x prompt | step ms | host MB/step | hit rate |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        res = (r.get("results") or [None])[0]
        if not res or "batch_size" not in res:  # the transformers row has its own line below
            continue
        off = res.get("offload") or {}
        mb = f"{off['host_bytes_per_step'] / 1e6:.1f}" if "host_bytes_per_step" in off else ""
        hr = f"{off['hit_rate'] * 100:.1f}%" if off.get("hit_rate") is not None else ""
        ms = res.get("median_decode_latency")
        L.append(f"| {name} | {res['batch_size']} x {res['input_len']} | "
                 f"{'' if ms is None else f'{ms * 1000:.2f}'} | {mb} | {hr} |")
    hf = rows.get("hf-offloaded-cache", {}).get("summary")
    if hf:
        L += ["", f"transformers' offloaded cache: longest length that finished {hf.get('longest_length')}, "
                  f"median decode step {hf.get('median_step_ms')} ms."]
    t = rows.get("smollm2-8k-text", {}).get("summary")
    if t:
        L += ["", f"SmolLM2-135M, 8K real text: outputs identical to in-GPU DS: {t.get('outputs_identical')}; "
                  f"host bytes per step with reuse {t.get('reuse_bytes_per_step')}, without "
                  f"{t.get('no_reuse_bytes_per_step')} (fraction {t.get('reuse_bytes_fraction')}); "
                  f"hit rate {t.get('hit_rate')}."]
    return L
