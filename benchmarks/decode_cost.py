"""The automatic dense/sparse choice's two figures (kernels/tuning.py), measured on this machine.

The ``decode-cost`` suite runs one model at batch 1 over several prompt lengths (the pools filled
with random values) twice with Double Sparsity's default budget: every step dense
(``--ds-sparse-decode-threshold`` beyond the lengths), and every step sparse (threshold 0).

* bandwidth: the dense steps' time against the bytes they read is a line (a least-squares fit
  through ``(median_step_bytes, median_decode_latency)``); its slope is 1 / bandwidth, its
  intercept ``t0`` the step's time that reads nothing (launches, norms, sampling).
* sparse-step overhead: per sparse step, its time less ``t0`` less its bytes / bandwidth, per
  layer; the median over the lengths.

These are what attention/budget.py's cost model compares: the bytes sparse decode saves over the
bandwidth, against the overhead times the layers. The summary gives them as the KernelTuning
fields of the machine's kind (``cpu_*`` on a CPU), for ``--kernel-tuning FILE.json``.
"""

from __future__ import annotations

import statistics


def _points(doc: dict) -> list[tuple[int, int, float, int]]:
    """(input_len, step bytes, step seconds, sparse steps) per measured length."""
    return [(r["input_len"], r["median_step_bytes"], r["median_decode_latency"], r["sparse_steps"])
            for r in doc.get("results", []) if r.get("median_decode_latency")]


def figures(dense: dict, sparse: dict) -> dict:
    """Summary of the two rows' bench_one_batch JSONs."""
    pd, ps = _points(dense), _points(sparse)
    if len(pd) < 2 or not ps:
        return {"error": "needs at least two dense lengths and one sparse one"}
    xs, ys = [b for _, b, _, _ in pd], [t for _, _, t, _ in pd]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    t0 = my - slope * mx
    bw = 1.0 / slope
    L = int(sparse["num_layers"])
    over = [(t - t0 - b / bw) / L for _, b, t, _ in ps]
    kind = "cuda" if str(dense.get("device", "")).startswith("cuda") else "cpu"
    prefix = "" if kind == "cuda" else "cpu_"
    o_us = statistics.median(over) * 1e6
    return {"device_kind": kind, "num_layers": L, "bandwidth_gbs": bw / 1e9, "t0_ms": t0 * 1e3,
            "ds_step_overhead_us_per_layer": o_us,
            "overhead_us_per_layer_by_len": {str(n): o * 1e6 for (n, _, _, _), o in zip(ps, over)},
            "dense_sparse_steps": sum(s for *_, s in pd), "sparse_all_sparse": all(
                s == r["decode_steps"] for (_, _, _, s), r in zip(ps, sparse["results"])),
            "kernel_tuning": {f"{prefix}decode_bandwidth_gbs": round(bw / 1e9, 2),
                              f"{prefix}ds_step_overhead_us_per_layer": round(max(o_us, 1.0), 1)}}


def table(dense: dict, sparse: dict) -> list[str]:
    """Markdown rows: per length, the dense and sparse step and what the fitted line predicts."""
    s = figures(dense, sparse)
    if "error" in s:
        return [s["error"]]
    bw, t0 = s["bandwidth_gbs"] * 1e9, s["t0_ms"] / 1e3
    out = ["| prompt | dense ms | dense MB | fitted dense ms | sparse ms | sparse MB | sparse overhead us/layer |",
           "|---|---|---|---|---|---|---|"]
    sp = {n: (b, t) for n, b, t, _ in _points(sparse)}
    for n, b, t, _ in _points(dense):
        sb, st = sp.get(n, (None, None))
        o = s["overhead_us_per_layer_by_len"].get(str(n))
        out.append(f"| {n} | {t * 1e3:.2f} | {b / 1e6:.1f} | {(t0 + b / bw) * 1e3:.2f} | "
                   + ("" if st is None else f"{st * 1e3:.2f}") + " | "
                   + ("" if sb is None else f"{sb / 1e6:.1f}") + " | " + ("" if o is None else f"{o:.0f}") + " |")
    return out
