"""Where an fp8 K/V cache loses accuracy, on the embedded SmolLM2 and the eval text: K and V value
distributions per layer, and perplexity / KL / top-1 of fp8 variants that differ in one thing each
(which of K and V is quantized, the scale, the format, the prefill, the q/K rotation).

    python benchmarks/fp8_kv_error.py --output FILE.json [--window-len 4096] [--decode-len 512]
        [--num-windows 4] [--variants e4m3 e4m3-k ...]

Each window's first ``window_len - decode_len`` tokens are prefilled through the variant's cache
(attending to K/V as it holds them, as the engine's prefill does; ``-rawchunk``: to the unquantized
values, as vLLM and SGLang attend to a chunk's own K/V), then the rest are decoded in one forward
against the quantized prefix and their own quantized K/V, each scored on its successor; KL and
top-1 against the float32 cache. The quantization is the kernels' (``quantize_kv``: ``x / scale``
clamped, rounded to nearest even, read back times the scale); dense attention in float32 (SDPA), so
it measures the cache's rounding alone. Scales: 1.0 (the engine's default without checkpoint
scales), ``-cal`` per layer amax / max of the format on 2048 tokens of the calibration text,
``-head`` the same per KV head. ``-rot``: q and K rotated by Hadamard blocks of D before K is
stored (attention/k_rotation.py, the engine's default with fp8, with or without Double Sparsity,
whose labels stay unrotated), ``-rotds``: the earlier Double Sparsity form (the packaged config's
r = 16 label channels in their own block). ``-sinkN``: each sequence's first N tokens kept unrounded
(the attention sinks, whose scores every softmax shares). Writes the figures as JSON
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "bf16": torch.bfloat16}
VARIANTS = ("e4m3", "e4m3-k", "e4m3-v", "e4m3-cal", "e4m3-head", "e4m3-rawchunk", "e5m2", "e5m2-cal",
            "e4m3-rot", "e4m3-rotds", "e5m2-rot", "e4m3-rot-sink4", "e4m3-rot-sink16", "bf16")


class Cache:
    """One variant's rounding of K and V: ``fmt`` plus flags parsed from the variant's name."""

    def __init__(self, name: str, amax: dict, rot_full, rot_ds):
        fmt, *flags = name.split("-")
        self.name, self.dtype = name, FORMATS[fmt]
        self.k = "v" not in flags
        self.v = "k" not in flags
        self.raw_chunk = "rawchunk" in flags
        # "-sinkN": a sequence's first N tokens kept unrounded (the attention sinks)
        self.sink = next((int(f[4:]) for f in flags if f.startswith("sink")), 0)
        self.rot = rot_full if "rot" in flags else rot_ds if "rotds" in flags else None
        top = torch.finfo(self.dtype).max if self.dtype != torch.bfloat16 else None
        per = "head" if "head" in flags else "layer" if "cal" in flags else None
        self.scales = {}
        for layer, (ka, va) in amax.items():   # [Hkv] each
            if per is None or top is None:
                self.scales[layer] = (torch.ones(1), torch.ones(1))
            elif per == "layer":
                self.scales[layer] = (ka.max().reshape(1) / top, va.max().reshape(1) / top)
            else:
                self.scales[layer] = (ka[:, None] / top, va[:, None] / top)

    def round(self, layer: int, k, v):
        from doublesparse.kernels.reference import quantize_kv
        ks, vs = self.scales[layer]

        def rt(x, s):
            if self.dtype == torch.bfloat16:
                return x.to(torch.bfloat16).float()
            y = quantize_kv(x / s, self.dtype, torch.ones(1)).float() * s
            return torch.cat([x[:self.sink], y[self.sink:]]) if self.sink else y
        return (rt(k, ks) if self.k else k), (rt(v, vs) if self.v else v)


def _sdpa(q, k, v, mask=None):
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    causal = mask is None
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal,
                                          enable_gqa=True)[0].transpose(0, 1)


class Attn:
    """Prefill (``prefix`` None: records the raw K/V, attends through the cache) or decode against
    the recorded prefix, both through ``cache`` (None: float32)."""

    def __init__(self, cache: Cache | None, prefix: dict | None = None):
        self.cache, self.prefix, self.k, self.v = cache, prefix, {}, {}

    def forward(self, layer, q, k, v, batch=None):
        c = self.cache
        if c is not None and c.rot is not None:
            from doublesparse.attention.k_rotation import rotate
            q, k = rotate(q, k, c.rot[layer])
        if self.prefix is None:
            self.k[layer], self.v[layer] = k, v
            if c is not None and not c.raw_chunk:
                k, v = c.round(layer, k, v)
            return _sdpa(q, k, v)
        pk, pv = self.prefix[layer]
        K, V = torch.cat([pk, k]), torch.cat([pv, v])
        if c is not None:
            K, V = c.round(layer, K, V)
        P, T = pk.shape[0], q.shape[0]
        mask = torch.arange(P + T)[None, :] <= (P + torch.arange(T))[:, None]
        return _sdpa(q, K, V, mask)


def run_variant(model, windows, decode_len: int, cache: Cache | None):
    """(log-probs [tokens, V] per window, targets per window)."""
    from doublesparse.attention.batch import ForwardBatch
    out = []
    for w in windows:
        x = torch.tensor(w)
        P = len(w) - decode_len
        with torch.inference_mode():
            pre = Attn(cache)
            model(x[:P], torch.arange(P), ForwardBatch(attn=pre, logits_indices=torch.tensor([P - 1])))
            dec = Attn(cache, {layer: (pre.k[layer], pre.v[layer]) for layer in pre.k})
            logits = model(x[P:-1], torch.arange(P, len(w) - 1), ForwardBatch(attn=dec, mode="decode")).float()
        out.append((logits.log_softmax(-1), x[P + 1:]))
    return out


def calibration_amax(model, tokenizer, n: int) -> dict:
    """Per layer ``(K amax [Hkv], V amax [Hkv])`` over the first n tokens of the calibration text."""
    from doublesparse.attention.batch import ForwardBatch
    from doublesparse.texts import CALIBRATION_PLAYS, encode, read_texts
    ids = [t for txt in read_texts(None, CALIBRATION_PLAYS) for t in encode(tokenizer, txt)][:n]
    rec = Attn(None)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(n), ForwardBatch(attn=rec, logits_indices=torch.tensor([n - 1])))
    return {layer: (rec.k[layer].abs().amax(dim=(0, 2)), rec.v[layer].abs().amax(dim=(0, 2))) for layer in rec.k}


def distributions(model, window) -> list[dict]:
    """Per layer, of K and V over one window: amax, median |x|, the share below e4m3's smallest
    normal (2^-6, where it keeps fewer than 3 mantissa bits at scale 1) and the RMS relative error
    of e4m3 rounding over the values above it."""
    from doublesparse.attention.batch import ForwardBatch
    rec = Attn(None)
    n = len(window)
    with torch.inference_mode():
        model(torch.tensor(window), torch.arange(n), ForwardBatch(attn=rec, logits_indices=torch.tensor([n - 1])))
    rows = []
    for layer in sorted(rec.k):
        row = {"layer": layer}
        for name, x in (("k", rec.k[layer]), ("v", rec.v[layer])):
            a = x.abs().float().flatten()
            big = a[a >= 2 ** -6]
            rel = (big.to(torch.float8_e4m3fn).float() - big) / big
            row[name] = {"amax": float(a.max()), "median": float(a.median()),
                         "below_min_normal": float((a < 2 ** -6).float().mean()),
                         "rms_rel_err_normal": float(rel.pow(2).mean().sqrt())}
        rows.append(row)
    return rows


def table(doc: dict) -> list[str]:
    out = [(f"fp8 K/V variants: {doc['num_windows']} windows of {doc['window_len']} tokens of the eval text, "
            f"the last {doc['decode_len'] - 1} scored ({doc['tokens']} tokens); float32 cache ppl "
            f"{doc['ppl_float32']:.3f}."), "",
           "| variant | ppl | vs float32 | KL | top-1 |", "|---|---|---|---|---|"]
    for name, r in doc["variants"].items():
        out.append(f"| {name} | {r['ppl']:.3f} | {100 * r['ppl_rel']:+.2f} % | {r['kl']:.4f} | {r['top1']:.3f} |")
    out += ["", "Values of the first window, per layer (min - max over layers):", "",
            "| | amax | median abs | below 2^-6 | e4m3 RMS rel. error (above 2^-6) |", "|---|---|---|---|---|"]
    for n in ("k", "v"):
        rng = {f: [r[n][f] for r in doc["distributions"]] for f in doc["distributions"][0][n]}
        out.append(f"| {n.upper()} | {min(rng['amax']):.3g} - {max(rng['amax']):.3g} | {min(rng['median']):.3g} - "
                   f"{max(rng['median']):.3g} | {100 * min(rng['below_min_normal']):.1f} - "
                   f"{100 * max(rng['below_min_normal']):.1f} % | {100 * min(rng['rms_rel_err_normal']):.2f} - "
                   f"{100 * max(rng['rms_rel_err_normal']):.2f} % |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--window-len", type=int, default=4096)
    p.add_argument("--decode-len", type=int, default=512)
    p.add_argument("--num-windows", type=int, default=4)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    from doublesparse.attention.k_rotation import rotation_matrices
    from doublesparse.channels import load_channels, packaged_config_path
    from doublesparse.eval.cli import build_parser, eval_windows
    from doublesparse.models import load_model, load_tokenizer

    t0 = time.time()
    model, tok = load_model(None, progress=False), load_tokenizer(None)
    c = model.config
    L, Hkv, D = int(c.num_layers), int(c.num_kv_heads), int(c.head_dim)
    windows = eval_windows(build_parser().parse_args(["-o", "x"]), tok, a.window_len, a.num_windows)
    amax = calibration_amax(model, tok, 2048)
    ch = load_channels(packaged_config_path(c.name), c, "qk", 16, "group_max")
    rot_full, rot_ds = rotation_matrices(L, Hkv, D), rotation_matrices(L, Hkv, D, ch)
    base = run_variant(model, windows, a.decode_len, None)
    n = sum(t.numel() for _, t in base)
    nll0 = -sum(float(lp.gather(1, t[:, None]).sum()) for lp, t in base) / n
    doc = {"model": c.name, "window_len": a.window_len, "decode_len": a.decode_len, "num_windows": a.num_windows,
           "tokens": n, "ppl_float32": math.exp(nll0), "distributions": distributions(model, windows[0]),
           "variants": {}}
    for name in a.variants:
        got = run_variant(model, windows, a.decode_len, Cache(name, amax, rot_full, rot_ds))
        nll = -sum(float(lp.gather(1, t[:, None]).sum()) for lp, t in got) / n
        kl = sum(float(F.kl_div(lp, b, log_target=True, reduction="sum")) for (lp, _), (b, _) in zip(got, base)) / n
        top1 = sum(int((lp.argmax(-1) == b.argmax(-1)).sum()) for (lp, _), (b, _) in zip(got, base)) / n
        doc["variants"][name] = {"ppl": math.exp(nll), "ppl_rel": math.exp(nll - nll0) - 1, "kl": kl, "top1": top1}
        print(f"{name}: ppl {math.exp(nll):.3f} ({100 * (math.exp(nll - nll0) - 1):+.2f} %) KL {kl:.4f} "
              f"top-1 {top1:.3f}", file=sys.stderr, flush=True)
    doc["seconds"] = round(time.time() - t0, 1)
    from run import git_commit, machine_name  # benchmarks/run.py, beside this script
    doc.update(command="python benchmarks/fp8_kv_error.py " + " ".join(sys.argv[1:] if argv is None else argv),
               commit=git_commit(), machine=machine_name(), date=time.strftime("%Y-%m-%d"))
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=1)
    print("\n".join(table(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
