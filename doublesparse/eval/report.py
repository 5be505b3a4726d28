"""Rows, markdown table and plot of an evaluation run."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path


def _f(x, fmt="{:.3f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def nanmean(xs):
    xs = [x for x in (xs or []) if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def rows(settings, bytes_of, text=None, retrieval=None) -> list[dict]:
    """One dict per setting. ``bytes_of(setting) -> int`` (bytes per decode step);
    ``text``: {setting: TextResult}; ``retrieval``: {setting: {"acc": ..}}."""
    # dense over the model's cache where it ran (an fp8 cache's dense reads half of it)
    dense = sorted((s for s in settings if s.kind == "dense"), key=lambda s: s.kv != "auto")
    dense_bytes = bytes_of(dense[0]) if dense else None
    out = []
    for s in settings:
        b = bytes_of(s)
        r = {"setting": s.name, "line": s.line, "kind": s.kind, "kv_cache_dtype": s.kv, "channel_type": s.channel_type,
             "mode": s.mode_name, "r": s.r, "k_frac": s.k_frac, "num_sink": s.num_sink,
             "num_recent": s.num_recent, "dense_layers": s.dense_layers, "bytes_per_step": b,
             "bytes_vs_dense": b / dense_bytes if dense_bytes else float("nan")}
        if s.layer_modes:
            r["layer_modes"] = list(s.layer_modes)
        if text and s in text:
            t = text[s]
            if "avg_k" in t.extra:
                r["avg_k"] = t.extra["avg_k"]
            if "ppl_pct_ci95" in t.extra:
                r["ppl_pct_ci95"] = t.extra["ppl_pct_ci95"]
            r.update(ppl=t.ppl, kl=t.kl, top1=t.top1, tokens=t.tokens,
                     recall=nanmean(t.recall), rel_err=nanmean(t.rel_err),
                     recall_per_layer=t.recall, rel_err_per_layer=t.rel_err)
            if t.mass is not None:
                r.update(attn_mass=nanmean(t.mass), attn_mass_per_layer=t.mass)
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
    ci = [r for r in rs if r.get("ppl_pct_ci95")]
    if ci:
        lines += ["", ("Perplexity against dense over the model's cache, 95 % interval from the windows' paired "
                       "mean NLL differences (Student's t; windows, not tokens, independent):"), ""]
        lines += [f"- {r['setting']}: {r['ppl_pct_ci95'][0]:+.2f} % to {r['ppl_pct_ci95'][1]:+.2f} %" for r in ci]
    measured = [r for r in rs if r.get("avg_k") is not None and "/p" in r["setting"]]
    if measured:
        lines += ["", ("Tokens attended per selection row and layer where a request decoded sparsely "
                       "(top-p settings; their bytes use it):"), ""]
        lines += [f"- {r['setting']}: {r['avg_k']:.1f}" for r in measured]
    cells = [r for r in rs if r.get("retrieval_cells")]
    if cells:
        keys = list(cells[0]["retrieval_cells"])
        lines += ["", "Retrieval accuracy per context length @ depth:", "",
                  "| setting | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
        for r in cells:
            lines.append(f"| {r['setting']} | " + " | ".join(_f(r["retrieval_cells"].get(k), "{:.2f}")
                                                            for k in keys) + " |")
    return "\n".join(lines) + "\n"


def _series_parts(line: str) -> tuple[str, str]:
    """``"group_max/qk+sink4/recent32"`` -> (``"group_max+sink4/recent32"``, ``"qk"``)."""
    mode, rest = line.split("/", 1)
    ctype = rest.split("+")[0]
    return mode + rest[len(ctype):], ctype


def plot(rs: list[dict], path: str | Path, title: str) -> Path | None:
    """Top-1 agreement, perplexity and retrieval accuracy (the panels that have data) vs bytes
    per step; one line per mode/type series. Returns the PNG path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [("top1", "next-token top-1 agreement with dense"), ("kl", "KL(dense||DS), nats/token"),
              ("ppl", "perplexity"), ("retrieval_acc", "pass-key retrieval accuracy")]
    panels = [p for p in panels if any(p[0] in r for r in rs)]
    if not panels:
        return None
    ncol = min(2, len(panels))
    nrow = (len(panels) + 1) // 2
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.5 * ncol + 3, 4.3 * nrow), squeeze=False)
    axes = axes.reshape(-1)
    for ax in axes[len(panels):]:
        ax.axis("off")
    series = defaultdict(list)
    for r in rs:
        series[r["line"]].append(r)
    # colour = mode + extras, line style = channel type: 3 x 3 grid lines plus variants stay apart
    styles = {"qk": "-", "k": "--", "q": ":"}
    # dense lines: "dense", and "dense+kv:<dtype>" over another K/V cache (horizontal lines)
    kinds = sorted({_series_parts(n)[0] for n in series if not n.startswith("dense")})
    colour = {k: plt.get_cmap("tab10" if len(kinds) <= 10 else "tab20")(i) for i, k in enumerate(kinds)}
    for ax, (key, label) in zip(axes, panels):
        for name, pts in sorted(series.items()):
            pts = sorted((p for p in pts if key in p), key=lambda p: p["bytes_per_step"])
            if not pts:
                continue
            xs = [p["bytes_per_step"] / 1024 for p in pts]
            ys = [p[key] for p in pts]
            if key == "kl":  # log axis: dense (0) has no point, and a ranking is what matters
                if name == "dense":
                    continue
                ys = [max(y, 1e-6) for y in ys]
            if name.startswith("dense"):
                ax.axhline(ys[0], color="k" if name == "dense" else "0.5", ls="--" if name == "dense" else ":",
                           lw=1, label=f"{name} ({xs[0]:.0f} KiB)")
                continue
            kind, ctype = _series_parts(name)
            ax.plot(xs, ys, marker="o", ms=3.5, lw=1.2, ls=styles.get(ctype, "-"), color=colour[kind],
                    label=name)
        ax.set_xscale("log")
        if key == "kl":
            ax.set_yscale("log")
        ax.set_xlabel("KiB read per decode step (labels + selected K/V, all layers)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    legend = {}
    for ax in axes[:len(panels)]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    fig.legend(list(legend.values()), list(legend), loc="center right", fontsize=7)
    fig.suptitle(title + "  (line style: channel type qk -, k --, q :)", fontsize=10)
    # fixed margins: tight_layout took seconds per call, and the protocol plots after every part
    fig.subplots_adjust(left=0.6 / fig.get_figwidth(), right=1 - 3.0 / fig.get_figwidth(), bottom=0.09,
                        top=0.93, wspace=0.25, hspace=0.3)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(out_dir: str | Path, rs: list[dict], title: str, notes: list[str], result: dict,
                  with_plot: bool = True) -> dict:
    """``table.md``, ``plot.png`` (if ``with_plot`` and matplotlib is there) and ``results.json``
    (``result`` plus ``rows`` and ``plot``) into ``out_dir``; returns the JSON dict."""
    import json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(markdown(rs, title, notes))
    png = plot(rs, out_dir / "plot.png", title) if with_plot else None
    result = dict(result, rows=rs, notes=list(notes))
    if with_plot:
        result["plot"] = str(png) if png else None
    tmp = out_dir / "results.json.tmp"  # a kill mid-write must not leave a truncated file
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(out_dir / "results.json")
    return result
