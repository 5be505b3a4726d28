"""Benchmark one decode step of one attention layer: torch SDPA, our dense kernel, Double Sparsity.

    python -m doublesparse.bench.attention [--quick] [--json results/attention-h200.json]
                                           [--md results/attention-h200.md] [--sweep]

Every variant runs inside a CUDA graph that calls it several times over rotating copies of the
pool (so the cache never holds the data), replayed many times; we report the median per call.
Bytes are the essential ones: K/V read once for dense; labels read once plus the selected K/V
rows for Double Sparsity (its "byte floor"). The copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from ..kernels.ops import DSDecodeArgs
from ..kernels import ops, parts
from ..kernels.tuning import KernelTuning
from ..kernels.workspace import DecodeWorkspace

HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B
FP8 = torch.float8_e4m3fn
MIN_BYTES_PER_GRAPH = 1 << 30  # rotate copies until one graph touches >= 1 GiB


def copy_bandwidth(dev) -> float:
    """Device-to-device copy rate (bytes read + written per second), best of a few sizes."""
    best = 0.0
    for gib in (1, 4):
        x = torch.empty(gib << 29, dtype=torch.bfloat16, device=dev).normal_()  # far beyond L2
        y = torch.empty_like(x)
        # copy_ may go to the copy engine; an elementwise kernel streams at the SMs' rate.
        for fn in (lambda: y.copy_(x), lambda: torch.mul(x, 1.0, out=y)):
            best = max(best, 2 * x.numel() * 2 / time_fn(fn, reps=1, iters=20))
        x = y = None  # free both before the next size (the lambdas hold these cells)
    return best


def time_fn(fn, reps: int, iters: int = 25) -> float:
    """Median seconds per call of fn, with fn called ``reps`` times inside one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn() if reps == 1 else fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


class Pools:
    """``copies`` independent batches of B requests of length L, each in its own slot range."""

    def __init__(self, B, L, copies, r, label_dtype, dev, seed=0):
        torch.manual_seed(seed)
        self.B, self.L, self.copies = B, L, copies
        S = B * L * copies + 1
        self.k = torch.randn(S, HKV, D, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(S, HKV, D, device=dev, dtype=torch.bfloat16)
        self.k[:, :, :16] *= 4  # a few strong channels, as post-RoPE K has
        self.channels = torch.stack([torch.randperm(D, device=dev)[:r] for _ in range(HKV)]).int()
        self.scale = torch.tensor([0.05], device=dev)
        lab = torch.gather(self.k, 2, self.channels.long()[None].expand(S, -1, -1)).float()
        if label_dtype == FP8:
            lab = (lab / self.scale).clamp(-448, 448)
        self.labels = lab.to(label_dtype)
        del lab
        rt = torch.arange(1, S, device=dev, dtype=torch.int32).view(copies * B, L)
        self.req_to_token = rt
        self.req_idx = [torch.arange(c * B, (c + 1) * B, device=dev, dtype=torch.int32) for c in range(copies)]
        self.seq_lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        self.q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)

    def dense_views(self, c):
        """Contiguous [B, H, L, D] views for SDPA (slots of copy c are laid out in order)."""
        lo = 1 + c * self.B * self.L
        n = self.B * self.L
        k = self.k[lo: lo + n].view(self.B, self.L, HKV, D).transpose(1, 2)
        v = self.v[lo: lo + n].view(self.B, self.L, HKV, D).transpose(1, 2)
        return k, v


def sdpa_fn(p: Pools):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    # Decode has one query per head, so a group's G query heads can stand as G query rows of its
    # KV head (no mask needed): the fused kernels then see equal head counts and read K/V once.
    q = p.q.view(p.B, HKV, HQ // HKV, D)
    views = [p.dense_views(c) for c in range(p.copies)]
    best = None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def fn(i=0, backend=backend):
            with sdpa_kernel([backend]):
                return sdpa(q, views[i][0], views[i][1])
        try:
            t = time_fn(fn, p.copies)
        except Exception as e:  # a backend that refuses this shape
            print(f"  sdpa {backend.name}: unavailable ({type(e).__name__})", file=sys.stderr)
            continue
        if best is None or t < best[0]:
            best = (t, backend.name)
    return best


def bench_case(B, L, dev, bw, r_list, k_list, modes, fp8, stages, quick, tuning: KernelTuning,
               with_sdpa=True):
    kv_bytes = B * L * HKV * D * 2 * 2
    copies = max(1, math.ceil(MIN_BYTES_PER_GRAPH / kv_bytes))
    rows = []
    p = Pools(B, L, copies, max(r_list), torch.bfloat16, dev)
    ws = DecodeWorkspace(B, HQ, HKV, D, L, max(max(k_list(L)), 1), device=dev)
    sm = 1 / math.sqrt(D)
    t_sdpa, backend = (sdpa_fn(p) if with_sdpa else None) or (float("nan"), "none")
    t_dense = time_fn(lambda i=0: ops.dense_decode(p.q, p.k, p.v, p.req_to_token, p.req_idx[i], p.seq_lens,
                                                   sm, ws, out=p.out, impl="triton", tuning=tuning), copies)
    base = dict(batch=B, ctx=L, kv_bytes=kv_bytes)
    rows.append(dict(base, variant=f"sdpa[{backend}]", us=t_sdpa * 1e6, bytes=kv_bytes))
    rows.append(dict(base, variant="ours-dense", us=t_dense * 1e6, bytes=kv_bytes))
    best_dense = min(t_sdpa if t_sdpa == t_sdpa else 1e9, t_dense)
    for label_dtype in ([torch.bfloat16, FP8] if fp8 else [torch.bfloat16]):
        for r in r_list:
            if label_dtype == FP8 and r != 16:
                continue
            labels = p.labels[:, :, :r].contiguous()
            if label_dtype == FP8:
                labels = (labels.float() / p.scale).clamp(-448, 448).to(FP8)
            ch = p.channels[:, :r].contiguous()
            for k in k_list(L):
                if k >= L:
                    continue
                for mode in modes:
                    if label_dtype == FP8 and mode != "group_max":
                        continue
                    sel_rows = HQ if mode == "per_head" else HKV
                    lab_b = B * L * HKV * r * labels.element_size()
                    kv_sel = B * sel_rows * k * D * 2 * 2
                    floor_bytes = lab_b + kv_sel

                    # one k for the whole batch
                    args = DSDecodeArgs(torch.full_like(p.seq_lens, k), k, mode, tuning=tuning)

                    def ds(i=0, stage="all", args=args):
                        return parts.ds_decode_stage(p.q, p.k, p.v, labels, p.scale, ch, p.req_to_token,
                                                     p.req_idx[i], p.seq_lens, sm, args, ws, out=p.out,
                                                     stage=stage)
                    t = time_fn(ds, copies)
                    row = dict(base, variant=f"ds-{mode}", r=r, k=k, label=str(label_dtype).split(".")[-1],
                               us=t * 1e6, bytes=floor_bytes, label_bytes=lab_b, kv_sel_bytes=kv_sel,
                               speedup=best_dense / t, floor_us=floor_bytes / bw * 1e6)
                    if stages:
                        t_score = time_fn(lambda i=0: ds(i, "score"), copies)
                        t_hist = time_fn(lambda i=0: ds(i, "hist"), copies)
                        ws.hist.zero_()  # score/hist-only runs leave their histogram counts behind
                        t_sel = time_fn(lambda i=0: ds(i, "select"), copies)
                        ds(0, "select")
                        t_att = time_fn(lambda i=0: ds(i, "attend"), copies)
                        row.update(score_us=t_score * 1e6, select_us=(t_sel - t_score) * 1e6,
                                   hist_us=(t_hist - t_score) * 1e6, attend_us=t_att * 1e6)
                    rows.append(row)
    for row in rows:
        row["bw_frac"] = row["bytes"] / (row["us"] / 1e6) / bw
    p = ws = None  # the closures above hold these cells: emptying them frees the pools
    torch.cuda.empty_cache()
    return rows


def fits(B, L, dev, copies_bytes=MIN_BYTES_PER_GRAPH):
    need = max(B * L * HKV * D * 4, copies_bytes) * 1.6 + B * HQ * L * 2
    free, _ = torch.cuda.mem_get_info(dev)
    return need < free * 0.8


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 3, 8, 32])
    ap.add_argument("--ctx", type=int, nargs="*", default=[4096, 16384, 65536, 131072, 262144])
    ap.add_argument("--quick", action="store_true", help="bs 3 at 64K and 128K only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--tuning", default=None, help="JSON dict overriding KernelTuning's defaults")
    ap.add_argument("--sweep", action="store_true", help="time launch-parameter variants at bs3 64K")
    ap.add_argument("--sweep-file", default=None,
                    help="JSON list of KernelTuning overrides to time instead of the built-in sweep")
    ap.add_argument("--sweep-cases", default="3x65536,8x16384",
                    help="comma-separated BxL cases for the sweep; a trailing 'fp8' uses fp8 labels")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("doublesparse.bench.attention needs a CUDA GPU")
    tuning = KernelTuning.from_dict(json.loads(args.tuning)) if args.tuning else KernelTuning()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    warm = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(200):  # about a second of work, so clocks are up before the first case
        warm @ warm
    torch.cuda.synchronize()
    del warm
    print(f"# {torch.cuda.get_device_name(dev)}  copy bandwidth {bw / 1e12:.2f} TB/s  tuning {tuning}")
    if args.sweep or args.sweep_file:
        variants = SWEEP
        if args.sweep_file:
            with open(args.sweep_file) as f:
                variants = json.load(f)
        return sweep(dev, bw, tuning, variants, args.sweep_cases, args.json)
    cases = [(3, 65536), (3, 131072)] if args.quick else [(b, l) for l in args.ctx for b in args.batch]
    all_rows = []
    t0 = time.time()
    for B, L in cases:
        if not fits(B, L, dev):
            print(f"skip bs{B} {L}: does not fit")
            continue
        key = B == 3
        rows = bench_case(
            B, L, dev, bw,
            r_list=[16, 32] if key else [16],
            k_list=(lambda L: sorted({L // 16, 1024, 4096})) if key else (lambda L: [L // 16]),
            modes=["group_max", "per_head"] if key or L >= 65536 else ["group_max"],
            fp8=key, stages=key, quick=args.quick, tuning=tuning)
        for row in rows:
            print(format_row(row), flush=True)
        all_rows += rows
    summary = summarize(all_rows, bw)
    print(json.dumps(summary, indent=1))
    print(f"# {time.time() - t0:.0f} s")
    result = dict(summary=summary, rows=all_rows, tuning=tuning.asdict(), copy_bw=bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        write_markdown(args.md, result)


SWEEP = [{}, {"score_block_n": 128}, {"score_block_n": 512}, {"score_programs_per_sm": 16},
         {"score_programs_per_sm": 4}, {"score_warps": 8, "score_block_n": 512}, {"score_stages": 1},
         {"select_block_n": 2048}, {"select_block_n": 512}, {"select_programs_per_sm": 8},
         {"attn_programs_per_sm": 8}, {"attn_stages": 3}, {"attn_block_n": 32}]


def sweep(dev, bw, base: KernelTuning, variants, cases, json_path=None):
    """Time DS (total and per stage) under each override of ``base``; dense once per case."""
    out = []
    # Built before any timing: a removed or misspelt knob fails here.
    tunings = [base.replace(**var) for var in variants]
    parsed = []
    for c in cases.split(","):
        fp8 = c.endswith("fp8")
        B, L = (int(x) for x in c.removesuffix("fp8").split("x"))
        parsed.append((B, L, fp8))
    for B, L, fp8 in parsed:
        for var, tuning in zip(variants, tunings):
            try:
                rows = bench_case(B, L, dev, bw, [16], lambda L: [L // 16], ["group_max"], fp8, True, True,
                                  tuning, with_sdpa=False)
            except Exception as e:  # a variant that does not compile or launch: report, go on
                print(f"sweep {json.dumps(var)} bs{B} L={L}: FAILED {type(e).__name__}: {e}"[:400], flush=True)
                continue
            dense_us = next(r["us"] for r in rows if r["variant"] == "ours-dense")
            for ds in rows:
                if ds["variant"] != "ds-group_max":
                    continue
                rec = dict(tuning=var, batch=B, ctx=L, label=ds["label"], dense_us=dense_us,
                           **{k: ds.get(k) for k in ("us", "score_us", "hist_us", "select_us", "attend_us",
                                                     "floor_us", "speedup")})
                out.append(rec)
                _dump_sweep(json_path, bw, base.asdict(), out)
                parts = (f"[score {ds['score_us']:.1f} select {ds['select_us']:.1f} "
                         f"(hist {ds['hist_us']:.1f}) attend {ds['attend_us']:.1f}] " if "score_us" in ds else "")
                print(f"sweep {json.dumps(var):<90} bs{B} L={L} {ds['label'][:5]}: dense {dense_us:7.1f} "
                      f"ds {ds['us']:6.1f} x{ds['speedup']:.2f} {parts}floor {ds['floor_us']:.1f}",
                      flush=True)


def _dump_sweep(json_path, bw, base, rows):
    # Rewritten after every row, so a run cut short by a time limit keeps what it measured.
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(command="python -m doublesparse.bench.attention " + " ".join(sys.argv[1:]),
                           date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                           copy_bw=bw, base_tuning=base, rows=rows), f, indent=1)


def format_row(r):
    extra = ""
    if "k" in r:
        extra = f" r={r['r']:<2} k={r['k']:<6} {r['label']:<13} x{r['speedup']:.2f} floor {r['floor_us']:.1f}us"
        if "score_us" in r:
            extra += f" [score {r['score_us']:.1f} select {r['select_us']:.1f} attend {r['attend_us']:.1f}]"
    return f"bs{r['batch']:<3} L={r['ctx']:<7} {r['variant']:<28} {r['us']:9.1f} us  {r['bw_frac']:.2f} bw{extra}"


def summarize(rows, bw):
    def pick(variant, B, L, **kw):
        for r in rows:
            if r["variant"] == variant and r["batch"] == B and r["ctx"] == L and all(r.get(a) == b for a, b in kw.items()):
                return r
        return None

    s = {}
    ratios = []
    for r in rows:
        if r["variant"] == "ours-dense" and r["ctx"] >= 16384:
            sd = next(x for x in rows if x["variant"].startswith("sdpa") and x["batch"] == r["batch"] and x["ctx"] == r["ctx"])
            ratios.append(sd["us"] / r["us"])
    s["dense_over_sdpa_min_16k"] = min(ratios) if ratios else None
    for key, L, lab in (("ds_speedup_64k_bs3", 65536, "bfloat16"), ("ds_speedup_128k_bs3", 131072, "bfloat16"),
                        ("ds_fp8_speedup_128k_bs3", 131072, "float8_e4m3fn")):
        r = pick("ds-group_max", 3, L, r=16, k=L // 16, label=lab)
        s[key] = r["speedup"] if r else None
    r = pick("ds-group_max", 3, 65536, r=16, k=4096, label="bfloat16")
    s["ds_floor_fraction_64k"] = (r["floor_us"] / r["us"]) if r else None
    s["select_share_64k"] = (r["select_us"] / r["us"]) if r and "select_us" in r else None
    s["command"] = "python -m doublesparse.bench.attention " + " ".join(sys.argv[1:])
    s["date"] = time.strftime("%Y-%m-%d")
    s["device"] = torch.cuda.get_device_name() + f", copy bandwidth {bw / 1e12:.2f} TB/s"
    return s


def write_markdown(path, result):
    s = result["summary"]
    lines = [f"# Attention decode benchmark ({s['device']})", "",
             f"Command: `{s['command']}`  ", f"Date: {s['date']}  ",
             f"Launch parameters: `{json.dumps(result['tuning'])}`", "",
             "One decode step of one layer, Llama-3.1-8B shapes (32 q / 8 KV heads, d=128, bf16). "
             "Median of CUDA-graph replays. `bw` = essential bytes / time / copy bandwidth "
             "(dense: all K/V; DS: labels + selected K/V = its byte floor). "
             "`x` = speedup over the faster dense (SDPA or ours).", "",
             "## Summary", "", "```json", json.dumps(s, indent=1), "```", "",
             "## All cases", "",
             "| bs | ctx | variant | r | k | labels | us | bw | speedup | floor us | score us | select us | attend us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, k, fmt="{:.1f}": fmt.format(r[k]) if k in r and r[k] is not None else ""
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['variant']} | {r.get('r', '')} | {r.get('k', '')} | "
                     f"{r.get('label', '')} | {r['us']:.1f} | {r['bw_frac']:.2f} | {f(r, 'speedup', '{:.2f}')} | "
                     f"{f(r, 'floor_us')} | {f(r, 'score_us')} | {f(r, 'select_us')} | {f(r, 'attend_us')} |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
