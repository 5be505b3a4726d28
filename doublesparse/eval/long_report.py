"""Summary, markdown table and plot of a long-context run (:mod:`.long_context`).

``res["text"][length][setting]``: ppl, kl, top1, tokens, avg_k, bytes_per_step;
``res["ruler"][length][setting]``: points 0-100 per task.
"""

from __future__ import annotations

import json
from pathlib import Path


def _pct(a, b):
    return 100 * (a / b - 1) if a is not None and b else None


FP8_KV = "fp8_e4m3"   # the fp8 K/V cache the fp8_kv_* keys are of


def summary(res: dict) -> dict:
    """Per length: the default's perplexity increase over dense (%) and its bytes per decode step
    as a fraction of dense's; the largest RULER drop of the default below dense over tasks and
    lengths (points); the same for every setting under ``per_setting``. With an fp8 K/V cache's
    rows (``--kv-cache-dtypes``): per length ``fp8_kv_ppl_increase_pct_{n}`` (dense over fp8 K/V
    against dense over the model's cache, %) and ``fp8_kv_ds_ppl_points_{n}`` (the default over
    fp8 K/V's increase over dense minus the default's, percentage points)."""
    d = res.get("default_setting")
    out: dict = {"default_setting": d}
    per: dict = {}
    for n, rows in res.get("text", {}).items():
        dense = rows.get("dense", {})
        for name, r in rows.items():
            if name == "dense" or not dense:
                continue
            e = per.setdefault(name, {})
            e[f"ppl_increase_pct_{n}"] = _pct(r["ppl"], dense["ppl"])
            e[f"bytes_fraction_{n}"] = r["bytes_per_step"] / dense["bytes_per_step"]
    for n, rows in res.get("ruler", {}).items():
        dense = rows.get("dense")
        for name, pts in rows.items():
            if name == "dense" or not dense:
                continue
            drops = [dense[t] - pts[t] for t in pts if t in dense]
            e = per.setdefault(name, {})
            e[f"ruler_max_drop_pts_{n}"] = max(drops) if drops else None
            e[f"ruler_mean_pts_{n}"] = sum(pts.values()) / len(pts)
        if dense:
            per.setdefault("dense", {})[f"ruler_mean_pts_{n}"] = sum(
                dense.values()
            ) / len(dense)
    if d in per:
        out.update({k: v for k, v in per[d].items() if not k.startswith("ruler_mean")})
        drops = [
            v
            for k, v in per[d].items()
            if k.startswith("ruler_max_drop_pts_") and v is not None
        ]
        out["ruler_max_drop_pts"] = max(drops) if drops else None
    suffix = f"/kv:{FP8_KV}"
    for n, rows in res.get("text", {}).items():
        dense = rows.get("dense", {})
        f8 = rows.get("dense" + suffix)
        if dense and f8:
            out[f"fp8_kv_ppl_increase_pct_{n}"] = _pct(f8["ppl"], dense["ppl"])
            out[f"fp8_kv_ppl_increase_pct_{n}_ci95"] = f8.get("ppl_pct_ci95")
        if dense and d in rows and (d + suffix) in rows:
            out[f"fp8_kv_ds_ppl_points_{n}"] = (_pct(rows[d + suffix]["ppl"], dense["ppl"])
                                                 - _pct(rows[d]["ppl"], dense["ppl"]))
    out["per_setting"] = per
    return out


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    L = [
        f"# Long-context accuracy: {res['model']}",
        "",
        f"- channels: {res['channels']}; device: {res['device']}; default: `{res['default_setting']}`",
        f"- the default is the engine's {(res.get('operating_point') or {}).get('summary', 'operating point')}",
        (
            f"- text: {res['num_windows']} window(s) per length from the eval plays (concatenated), "
            f"the last "
            f"{res['decode_len'] - 1} tokens decoded and scored; bytes per decode step vs dense at that length "
            "(top-p: at the tokens measured per row)"
        ),
        (
            f"- RULER-style tasks: {res['samples_per_task']} sample(s) per task and length "
            f"(seed {res['seed']}), greedy, points = 100 x fraction of expected strings in the answer"
        ),
        "",
    ]
    if res.get("text"):
        L += [
            "| length | setting | x dense bytes | ppl | ppl +% | KL(dense||DS) | top-1 agree |",
            "|---|---|---|---|---|---|---|",
        ]
        for n, rows in res["text"].items():
            dense = rows.get("dense", {})
            for name, r in rows.items():
                frac = r["bytes_per_step"] / dense["bytes_per_step"] if dense else None
                L.append(
                    f"| {n} | {name} | {_f(frac)} | {_f(r['ppl'])} | {_f(_pct(r['ppl'], dense.get('ppl')), '{:+.2f}')} "
                    f"| {_f(r['kl'], '{:.4f}')} | {_f(r['top1'])} |"
                )
        ci = [(n, name, r["ppl_pct_ci95"]) for n, rows in res["text"].items() for name, r in rows.items()
              if r.get("ppl_pct_ci95")]
        if ci:
            L += ["", "ppl +%, 95 % interval from the windows' paired mean NLL differences (Student's t):", ""]
            L += [f"- {n} {name}: {lo:+.2f} % to {hi:+.2f} %" for n, name, (lo, hi) in ci]
        L.append("")
    if res.get("ruler"):
        tasks = res["tasks"]
        L += [
            "| length | setting | " + " | ".join(tasks) + " | mean |",
            "|---|---|" + "---|" * (len(tasks) + 1),
        ]
        for n, rows in res["ruler"].items():
            for name, pts in rows.items():
                vals = [pts.get(t) for t in tasks]
                got = [v for v in vals if v is not None]
                L.append(
                    f"| {n} | {name} | "
                    + " | ".join(_f(v, "{:.0f}") for v in vals)
                    + f" | {_f(sum(got) / len(got) if got else None, '{:.1f}')} |"
                )
        L.append("")
    s = res.get("summary", {})
    L += ["Summary (the default vs dense):", ""]
    L += [
        f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}"
        for k, v in s.items()
        if k != "per_setting"
    ]
    if res.get("skipped") or res.get("errors"):
        L += ["", f"Skipped (time): {res.get('skipped')}; errors: {res.get('errors')}"]
    return "\n".join(L) + "\n"


def draw(res: dict, path: str | Path) -> Path | None:
    """Left: perplexity increase over dense vs context length, one line per setting; right: RULER
    points per task at the longest length with results, one bar per setting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = res["settings"]
    for name in names[1:]:
        pts = [
            (int(n), _pct(r[name]["ppl"], r["dense"]["ppl"]))
            for n, r in res.get("text", {}).items()
            if name in r and "dense" in r
        ]
        if pts:
            a1.plot(*zip(*sorted(pts)), marker="o", label=name)
    a1.axhline(0, color="k", lw=1, ls="--")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("context length (tokens)")
    a1.set_ylabel("perplexity increase over dense (%)")
    a1.grid(alpha=0.3)
    if a1.get_legend_handles_labels()[0]:
        a1.legend(fontsize=7)
    if res.get("ruler"):
        n = max(res["ruler"], key=int)
        rows, tasks = res["ruler"][n], res["tasks"]
        w = 0.8 / max(len(rows), 1)
        for i, (name, pts) in enumerate(rows.items()):
            a2.bar(
                [j + i * w for j in range(len(tasks))],
                [pts.get(t, 0) for t in tasks],
                w,
                label=name,
            )
        a2.set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks, fontsize=8)
        a2.set_ylabel(f"RULER-style points at {n} tokens")
        a2.set_ylim(0, 105)
        a2.legend(fontsize=7)
    else:
        a2.axis("off")
    fig.suptitle(f"Long-context accuracy: {res['model']}", fontsize=10)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.12, top=0.9, wspace=0.2)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out_dir: str | Path, res: dict, with_plot: bool = False) -> dict:
    """``results.json`` (``res`` with its ``summary``), ``table.md`` and, ``with_plot``, ``plot.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res["summary"] = summary(res)
    if with_plot:
        png = draw(res, out / "plot.png")
        res["plot"] = str(png) if png else None
    (out / "table.md").write_text(markdown(res))
    tmp = out / "results.json.tmp"  # a kill mid-write must not leave a truncated file
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(out / "results.json")
    return res


# --- the ``accuracy-long`` benchmark suite (benchmarks/run.py): one run per row, merged ---------

QWEN_ROWS = {"16k": "qwen15b-16k", "32k": "qwen15b-32k"}
SMOL_ROW = "smollm2-8k"
# the 1.5B at the shorter contexts where the cost model decodes sparsely from batch 8 (text only)
QWEN_SHORT_ROW = "qwen15b-4k-8k"


def merged(rows: dict) -> dict | None:
    """The Qwen rows' results as one run (their text and ruler parts side by side), or None."""
    parts = [
        rows[n]
        for n in QWEN_ROWS.values()
        if isinstance(rows.get(n), dict) and "settings" in rows[n]
    ]
    if not parts:
        return None
    res = dict(parts[0], text={}, ruler={})
    for p in parts:
        res["text"].update(p.get("text", {}))
        res["ruler"].update(p.get("ruler", {}))
    return res


def _largest(rows: dict, prefix: str):
    """The largest value of the summary keys starting with ``prefix`` over every row (None: none)."""
    vals = [v for r in rows.values() if isinstance(r, dict)   # (numbers: not the _ci95 intervals)
            for k, v in (r.get("summary") or {}).items() if k.startswith(prefix) and isinstance(v, (int, float))]
    return max(vals) if vals else None


def suite_summary(rows: dict) -> dict:
    """The suite's summary keys from its rows' ``results.json`` (None where a row has none)."""
    q = {k: rows.get(n, {}).get("summary", {}) for k, n in QWEN_ROWS.items()}
    smol = rows.get(SMOL_ROW, {}).get("summary", {})
    short = rows.get(QWEN_SHORT_ROW, {}).get("summary", {})
    drops = [
        s.get("ruler_max_drop_pts")
        for s in q.values()
        if s.get("ruler_max_drop_pts") is not None
    ]
    res = merged(rows)
    return {
        "default_setting": q["32k"].get("default_setting")
        or q["16k"].get("default_setting"),
        "qwen15b_ppl_increase_pct_16k": q["16k"].get("ppl_increase_pct_16384"),
        "qwen15b_ppl_increase_pct_32k": q["32k"].get("ppl_increase_pct_32768"),
        **{f"qwen15b_ppl_increase_pct_{n // 1024}k": short.get(f"ppl_increase_pct_{n}") for n in (4096, 8192)},
        **{f"default_bytes_fraction_{n // 1024}k": short.get(f"bytes_fraction_{n}") for n in (4096, 8192)},
        "ruler_max_drop_pts": max(drops) if drops else None,
        "smollm2_ppl_increase_pct": smol.get("ppl_increase_pct_8192"),
        "default_bytes_fraction_32k": q["32k"].get("bytes_fraction_32768"),
        # fp8 K/V alone (% over dense with the model's cache) and the default with it (points over
        # the default's increase), the largest over the rows that ran them
        **{f"fp8_kv_{k}_max": _largest(rows, f"fp8_kv_{k}_") for k in ("ppl_increase_pct", "ds_ppl_points")},
        # where each model's default came from: calibrated (its KL target and what calibration
        # measured) or its shape
        "operating_points": {"qwen15b": next((rows.get(n, {}).get("operating_point") for n in QWEN_ROWS.values()
                                              if rows.get(n, {}).get("operating_point")), None),
                             "smollm2": rows.get(SMOL_ROW, {}).get("operating_point")},
        "qwen15b_per_setting": summary(res)["per_setting"] if res else {},
    }


def suite_plot(rows: dict, path: str | Path) -> Path | None:
    res = merged(rows)
    return draw(res, path) if res else None
