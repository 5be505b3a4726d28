"""Where Double Sparsity pays: the decode-step map of the ``speedup-map`` suite (benchmarks/run.py).

Reads the dense and DS ``bench_one_batch`` runs over one grid of batch x prompt cells and returns,
per cell, the measured speedup (dense step / DS step), the byte-floor speedup (dense bytes / DS
bytes per step) and the share of DS steps that ran sparse; renders them as a table and a heatmap.
"""

from __future__ import annotations

from pathlib import Path

MAP_BATCHES = (1, 4, 8, 16, 32, 64)
MAP_PROMPTS = (4096, 8192, 16384, 32768, 65536, 120000)


def _cells(run: dict) -> dict:
    out = {}
    for r in run.get("results", []):
        if "median_decode_latency" in r:
            out[(r["batch_size"], r["input_len"])] = r
    return out


def cells(dense: dict, ds: dict) -> list[dict]:
    d, s = _cells(dense), _cells(ds)
    out = []
    for key in sorted(set(d) & set(s)):
        a, b = d[key], s[key]
        out.append({"batch": key[0], "prompt": key[1],
                    "dense_ms": a["median_decode_latency"] * 1e3, "ds_ms": b["median_decode_latency"] * 1e3,
                    "ratio": a["median_decode_latency"] / b["median_decode_latency"],
                    "floor_ratio": a["median_step_bytes"] / b["median_step_bytes"],
                    "sparse_share": b["sparse_steps"] / max(1, b["decode_steps"])})
    return out


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n / 1000:g}K"


def table(cs: list[dict]) -> list[str]:
    """Markdown: one row per batch, one column per prompt; 'ratio (floor ratio)' per cell."""
    prompts = sorted({c["prompt"] for c in cs})
    batches = sorted({c["batch"] for c in cs})
    at = {(c["batch"], c["prompt"]): c for c in cs}
    L = ["| batch \\ prompt | " + " | ".join(_k(p) for p in prompts) + " |",
         "|---|" + "---|" * len(prompts)]
    for b in batches:
        row = []
        for p in prompts:
            c = at.get((b, p))
            row.append("" if c is None else f"{c['ratio']:.2f} ({c['floor_ratio']:.2f})"
                       + ("" if c["sparse_share"] > 0 else " dense"))
        L.append(f"| {b} | " + " | ".join(row) + " |")
    return L


def heatmap(cs: list[dict], path: Path, title: str) -> Path:
    """Two panels, measured and byte-floor speedup, over batch x prompt."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    prompts = sorted({c["prompt"] for c in cs})
    batches = sorted({c["batch"] for c in cs})
    at = {(c["batch"], c["prompt"]): c for c in cs}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for ax, key, name in ((axes[0], "ratio", "measured: dense step / DS step"),
                          (axes[1], "floor_ratio", "byte floor: dense bytes / DS bytes")):
        m = np.full((len(batches), len(prompts)), np.nan)
        for i, b in enumerate(batches):
            for j, p in enumerate(prompts):
                if (b, p) in at:
                    m[i, j] = at[(b, p)][key]
        im = ax.imshow(m, cmap="RdYlGn", vmin=0.5, vmax=max(2.5, float(np.nanmax(m))), origin="lower")
        for i in range(len(batches)):
            for j in range(len(prompts)):
                if not np.isnan(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(prompts)), [_k(p) for p in prompts])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("batch")
        ax.set_title(name)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def at(cs: list[dict], batch: int, prompt: int) -> float | None:
    return next((c["ratio"] for c in cs if c["batch"] == batch and c["prompt"] == prompt), None)


def accuracy(rows: dict) -> dict:
    """The default's perplexity increase over dense (worst of the text rows, %) and the share of
    retrieval cells within one trial of dense, from the suite's `doublesparse eval` rows."""
    texts = [r["rows"] for n, r in rows.items() if n.startswith("accuracy-text-") and r.get("rows")]
    out = {}
    if texts:
        out["default_ppl_increase_pct_max"] = max(100 * (t[1]["ppl"] / t[0]["ppl"] - 1) for t in texts)
    ret = rows.get("accuracy-retrieval", {})
    if ret.get("rows"):
        dense, default = ret["rows"][0]["retrieval_cells"], ret["rows"][1]["retrieval_cells"]
        trials = ret["retrieval_trials"]
        out["retrieval_cells_equal"] = sum(abs(dense[c] - default[c]) * trials <= 1 for c in dense) / len(dense)
    return out


def accuracy_table(rows: dict) -> list[str]:
    """Markdown of the accuracy rows: perplexity per length, retrieval per cell."""
    L = []
    texts = {n: r for n, r in rows.items() if n.startswith("accuracy-text-") and r.get("rows")}
    if texts:
        L += ["## Accuracy of the default (embedded SmolLM2-135M)", "",
              "`doublesparse eval --default-only`: perplexity over 8 windows x 255 scored tokens of held-out "
              "text per length; pass-key retrieval at 5 depths x 20 trials.", "",
              "| length | dense ppl | default ppl | increase | KL | top-1 agreement | bytes x dense |",
              "|---|---|---|---|---|---|---|"]
        for r in texts.values():
            d, s = r["rows"][0], r["rows"][1]
            L.append(f"| {r['window_len']} | {d['ppl']:.3f} | {s['ppl']:.3f} | {100 * (s['ppl'] / d['ppl'] - 1):+.2f} % "
                     f"| {s['kl']:.4f} | {s['top1']:.3f} | {s['bytes_vs_dense']:.3f} |")
    ret = rows.get("accuracy-retrieval", {})
    if ret.get("rows"):
        d, s = ret["rows"][0]["retrieval_cells"], ret["rows"][1]["retrieval_cells"]
        L += ["", "| retrieval (fraction of trials) | " + " | ".join(d) + " |", "|---|" + "---|" * len(d),
              "| dense | " + " | ".join(f"{v:.2f}" for v in d.values()) + " |",
              "| default | " + " | ".join(f"{v:.2f}" for v in s.values()) + " |"]
    return L
