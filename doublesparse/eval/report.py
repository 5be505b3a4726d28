"""Rows, markdown table and plot of an evaluation run."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path


def _f(x, fmt="{:.3f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def _nanmean(xs):
    xs = [x for x in (xs or []) if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def rows(settings, bytes_of, text=None, retrieval=None) -> list[dict]:
    """One dict per setting. ``bytes_of(setting) -> int`` (bytes per decode step);
    ``text``: {setting: TextResult}; ``retrieval``: {setting: {"acc": ..}}."""
    dense_bytes = next((bytes_of(s) for s in settings if s.kind == "dense"), None)
    out = []
    for s in settings:
        b = bytes_of(s)
        r = {"setting": s.name, "line": s.line, "kind": s.kind, "channel_type": s.channel_type,
             "mode": s.mode, "r": s.r, "k_frac": s.k_frac, "num_sink": s.num_sink,
             "num_recent": s.num_recent, "dense_layers": s.dense_layers, "bytes_per_step": b,
             "bytes_vs_dense": b / dense_bytes if dense_bytes else float("nan")}
        if text and s in text:
            t = text[s]
            r.update(ppl=t.ppl, kl=t.kl, top1=t.top1, tokens=t.tokens,
                     recall=_nanmean(t.recall), rel_err=_nanmean(t.rel_err),
                     recall_per_layer=t.recall, rel_err_per_layer=t.rel_err)
        if retrieval and s in retrieval:
            r["retrieval_acc"] = retrieval[s]["acc"]
            r["retrieval_cells"] = {f"{n}@{d:g}": v for (n, d), v in retrieval[s]["cells"].items()}
        out.append(r)
    return out


def markdown(rs: list[dict], title: str, notes: list[str] = ()) -> str:
    head = ["setting", "KiB/step", "x dense", "ppl", "KL(dense||ds)", "top-1 agree", "retrieval",
            "attn recall", "out rel err"]
    lines = [f"# {title}", ""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rs:
        lines.append("| " + " | ".join([
            r["setting"], _f(r["bytes_per_step"] / 1024, "{:.0f}"), _f(r["bytes_vs_dense"], "{:.3f}"),
            _f(r.get("ppl"), "{:.3f}"), _f(r.get("kl"), "{:.4f}"), _f(r.get("top1"), "{:.3f}"),
            _f(r.get("retrieval_acc"), "{:.2f}"),
            _f(r.get("recall") if r["kind"] == "ds" else None, "{:.3f}"),
            _f(r.get("rel_err") if r["kind"] == "ds" else None, "{:.3f}")]) + " |")
    cells = [r for r in rs if r.get("retrieval_cells")]
    if cells:
        keys = list(cells[0]["retrieval_cells"])
        lines += ["", "Retrieval accuracy per context length @ depth:", "",
                  "| setting | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
        for r in cells:
            lines.append(f"| {r['setting']} | " + " | ".join(_f(r["retrieval_cells"].get(k), "{:.2f}")
                                                            for k in keys) + " |")
    return "\n".join(lines) + "\n"


def plot(rs: list[dict], path: str | Path, title: str) -> Path | None:
    """Accuracy (retrieval, else top-1 agreement) and perplexity vs bytes per step; one line per
    mode/type series. Returns the PNG path, or None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    acc_key = "retrieval_acc" if any("retrieval_acc" in r for r in rs) else "top1"
    panels = [(acc_key, "retrieval accuracy" if acc_key == "retrieval_acc" else "top-1 agreement"),
              ("ppl", "perplexity")]
    panels = [p for p in panels if any(p[0] in r for r in rs)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    series = defaultdict(list)
    for r in rs:
        series[r["line"]].append(r)
    for ax, (key, label) in zip(axes[0], panels):
        for name, pts in sorted(series.items()):
            pts = sorted((p for p in pts if key in p), key=lambda p: p["bytes_per_step"])
            if not pts:
                continue
            xs = [p["bytes_per_step"] / 1024 for p in pts]
            ys = [p[key] for p in pts]
            if name == "dense":
                ax.axhline(ys[0], color="k", ls="--", lw=1, label=f"dense ({xs[0]:.0f} KiB)")
            else:
                ax.plot(xs, ys, marker="o", ms=4, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("KiB read per decode step (labels + selected K/V, all layers)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
