"""Does the server's sampled attention recall agree with the offline eval's on the same text?

    python -m doublesparse.bench.recall_agreement [--model-path M] [--device cuda] \\
        --window-len 2048 --decode-len 256 --num-windows 4 --result-json out.json

Online: the engine's own stack (``build_parts``: operating point, channels, pools, backend, the
recall probe) prefills the first ``window_len - decode_len`` tokens of each held-out window
(``doublesparse eval``'s windows: ``split_windows`` over the eval plays), then decodes the rest one
step at a time, teacher-forced, with the probe sampling every step (``--ds-recall-sample-interval
1``) and every window (``--ds-recall-sample-rows`` = the windows): each step measures one layer,
in turn. Offline: ``doublesparse eval``'s text runner (eval/measure.py) on the same model, windows
and Double Sparsity settings (the engine's channels, per-layer modes, k, sink/recent tokens,
label dtype, top-p budget), with attention fidelity on every decoded token.

Both sides report, per layer, the share of the exact attention the selection captured, averaged
over query heads (the probe's recall; the eval's ``attn_mass``). The eval's ``recall`` column
divides that share by the true top-k's share; it is reported beside, not compared (it is a
different quantity: above the share by the mass the best k tokens miss).

Writes JSON: the settings both sides ran, per layer the online mean and sample count and the
offline means, and ``summary``: ``recall_agreement_abs`` = |online - offline| of the means over
layers (offline over every decoded token), ``matched_abs`` (offline on exactly the sampled
(layer, window, position) triples), ``max_layer_abs`` (the largest per-layer difference over
layers with at least 8 samples), the online mean's gap to the eval's top-k-normalised recall, and
``one_k``: whether the engine planned one k over the decoded span (the eval's driver decodes every
token at one k; where the ratio budget moves, the offline side takes the largest).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import torch

from ..attention.budget import DENSE as DENSE_K
from ..config import KV_CACHE_DTYPES, EngineConfig
from ..engine.memory import LABEL_TORCH_DTYPES
from ..engine.setup import build_parts
from ..eval.measure import FidelityObserver, TextRunner, split_windows
from ..eval import driver
from ..eval.settings import Setting
from . import emit_result
from ..texts import EVAL_PLAYS, encode, read_texts
from ..version import __version__
from .adaptive import PREFILL_CHUNK

MIN_LAYER_SAMPLES = 8


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.recall_agreement",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--tiny", action="store_true", help="the tiny random Llama and a byte tokenizer (CPU tests)")
    p.add_argument("--device", default=None)
    p.add_argument("--window-len", type=int, default=2048)
    p.add_argument("--decode-len", type=int, default=256)
    p.add_argument("--num-windows", type=int, default=4)
    p.add_argument("--ds-heavy-token-min", type=int, default=None, help="default: the operating point's")
    p.add_argument("--ds-sparse-decode-threshold", type=int, default=0,
                   help="sparse decode from this length (default 0: whenever longer than k, as the eval)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="both sides' K/V cache")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--result-json", default=None)
    return p


def _windows(args, tokenizer) -> list[list[int]]:
    ids = [t for txt in read_texts(None, EVAL_PLAYS) for t in encode(tokenizer, txt)]
    return split_windows(ids, args.window_len, args.num_windows)


@torch.inference_mode()
def online(parts, windows: list[list[int]], decode_len: int) -> tuple[list[tuple], set]:
    """Teacher-forced decode of ``windows`` as one batch with the probe on every step. Returns
    the samples ``(layer, window, position, recall, rel_error)`` (position: the decoded token's;
    the step attends to ``position + 1`` tokens) and the k each sparse row planned."""
    m, runner, probe = parts.memory, parts.runner, parts.recall
    rows = [m.rows.alloc() for _ in windows]
    window_of = {r: i for i, r in enumerate(rows)}
    prefix = len(windows[0]) - decode_len
    for row, w in zip(rows, windows):
        for a in range(0, prefix, PREFILL_CHUNK):
            runner.prefill([row], [a], [w[a:min(prefix, a + PREFILL_CHUNK)]], [False])
    got: list[tuple] = []
    add = probe.stats.add
    t = prefix

    def record(layer, row, recall, error, **kw):
        got.append((layer, window_of[row], t, recall, error))
        add(layer, row, recall, error, **kw)

    probe.stats.add = record
    ks_seen: set = set()
    try:
        for t in range(prefix, len(windows[0]) - 1):
            ks, _ = parts.backend.decode_plan([t + 1] * len(windows))
            ks_seen.update(int(k) for k in (ks or []) if k != DENSE_K)
            runner.decode(rows, [w[t] for w in windows], [t] * len(windows))
            if parts.device.type == "cuda":
                torch.cuda.synchronize(parts.device)
            probe.collect()             # this step's results: every sample below is position t's
    finally:
        probe.stats.add = add
    for row in rows:
        m.release(row, len(windows[0]) - 1)
    return got, ks_seen


def engine_setting(parts, k: int, kv: str = "auto") -> Setting:
    """The eval's Setting for what the engine decodes with: its r, per-layer modes, sink and
    recent tokens, label dtype, top-p budget and K/V cache dtype ``kv``, at the one k ``k`` (see
    :func:`run`)."""
    ds, b = parts.ds, parts.ds.policy.budget
    label = next(n for n, d in LABEL_TORCH_DTYPES.items() if d == parts.plan.label_dtype)
    L = parts.plan.num_layers
    modes = tuple(ds.mode_of(i) for i in range(L))
    return Setting("ds", "qk", modes[0], int(parts.backend.channels.shape[-1]), b.ratio or 1.0,
                   num_sink=ds.num_sink, num_recent=ds.num_recent, label=label, k_min=k, k_max=k,
                   top_p=b.top_p, top_p_min=ds.top_p_min_k if b.top_p else 0,
                   layer_modes=modes if len(set(modes)) > 1 else (), kv=kv)


def _mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def run(args) -> dict:
    t0 = time.time()
    W = args.num_windows
    cfg = EngineConfig(model_path=args.model_path, device=args.device, context_length=args.window_len,
                       max_running_requests=W, max_total_tokens=W * args.window_len + 64,
                       disable_cuda_graph=args.disable_cuda_graph, enable_double_sparsity=True,
                       ds_heavy_token_min=args.ds_heavy_token_min,
                       ds_sparse_decode_threshold=args.ds_sparse_decode_threshold,
                       ds_recall_sample_interval=1, ds_recall_sample_rows=W, kv_cache_dtype=args.kv_cache_dtype)
    model, tok = None, None
    if args.tiny:
        from ..testing import ByteTokenizer, tiny_llama
        model, tok = tiny_llama(max_position_embeddings=args.window_len, device=args.device or "cpu"), ByteTokenizer()
    parts = build_parts(cfg, model=model, tokenizer=tok, progress=False) if model is not None else \
        build_parts(cfg, progress=False)
    model, tok = parts.model, tok or parts.tokenizer
    if any(parts.ds.mode_of(i) == "layer" for i in range(parts.plan.num_layers)):
        raise SystemExit("the engine selects in the 'layer' mode, which the offline eval's selection "
                         "(eval/driver.py) does not model")
    windows = _windows(args, tok)
    samples, ks = online(parts, windows, args.decode_len)
    if not samples:
        raise SystemExit("no sampled step: the windows decode densely (raise --window-len or lower k)")
    k = max(ks)
    if len(ks) > 1:  # the ratio budget moved within the decoded span; the eval's driver has one k
        print(f"warning: the engine's k took {sorted(ks)}; the offline side uses {k} for every token "
              "(--ds-heavy-token-min at or above the largest gives one k)", file=sys.stderr)
    setting = engine_setting(parts, k, args.kv_cache_dtype)
    channels = parts.backend.channels.detach().clone()
    L, device = parts.plan.num_layers, parts.device
    t_online = time.time() - t0
    del parts
    gc.collect()  # the probe and the backend refer to each other
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # the eval's text runner (dense prefill, then every token through the decode driver) without
    # its dense scoring run: perplexity and KL are not compared here
    runner = TextRunner(model, windows, args.decode_len, lambda _: channels, device)
    obs = FidelityObserver(L, 1, 256 if device.type == "cuda" else 64, per_row=True)
    with torch.inference_mode():
        for pool_set, inputs, _, _ in runner.groups:
            pools = pool_set.get(setting.kv)
            pools.relabel(channels, setting.label)
            driver.decode_tokens(model, pools, setting, channels, inputs, setting.k_for(args.window_len),
                                 observer=obs)
    off_recall, off_err = obs.means()
    off_mass = obs.mass_means()
    # the eval's batch is request-major: window i's decoded token j is row i * (decode_len - 1) + j
    per = args.decode_len - 1
    prefix = args.window_len - args.decode_len
    offline_at: dict = {}
    for layer, chunks in obs.per_row.items():
        for rows, rec, mass in chunks:
            for r, a, b in zip(rows.tolist(), rec.tolist(), mass.tolist()):
                offline_at[(layer, r // per, prefix + r % per)] = (a, b)

    on_layers = [[s[3] for s in samples if s[0] == i] for i in range(L)]
    on_err = [[s[4] for s in samples if s[0] == i] for i in range(L)]
    matched = [[offline_at[s[:3]][1] for s in samples if s[0] == i and s[:3] in offline_at] for i in range(L)]
    layers = []
    for i in range(L):
        layers.append({"samples": len(on_layers[i]), "online": _mean(on_layers[i]),
                       "online_rel_error": _mean(on_err[i]), "offline": off_mass[i],
                       "offline_matched": _mean(matched[i]), "offline_recall_topk": off_recall[i],
                       "offline_rel_error": off_err[i]})
    on = _mean([x["online"] for x in layers])
    offm = _mean([x["offline"] for x in layers if x["online"] is not None])
    offmt = _mean([x["offline_matched"] for x in layers if x["online"] is not None])
    offr = _mean([x["offline_recall_topk"] for x in layers if x["online"] is not None])
    big = [abs(x["online"] - x["offline"]) for x in layers if x["samples"] >= MIN_LAYER_SAMPLES]
    summary = {"recall_agreement_abs": abs(on - offm), "online_recall": on, "offline_recall": offm,
               "matched_abs": abs(on - offmt) if offmt is not None else None,
               "max_layer_abs": max(big) if big else None,
               "offline_recall_topk": offr, "online_vs_recall_topk_abs": abs(on - offr),
               "online_samples": len(samples), "offline_tokens": int(obs.count.max()), "one_k": len(ks) == 1}
    return {"tool": f"doublesparse {__version__} bench.recall_agreement", "argv": sys.argv[1:],
            "model": getattr(model.config, "name", None), "device": str(device),
            "window_len": args.window_len, "decode_len": args.decode_len, "num_windows": W,
            "setting": setting.name, "engine_k": sorted(ks), "k": k, "layers": layers, "summary": summary,
            "seconds_online": t_online, "seconds": time.time() - t0}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    emit_result(run(args), args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
