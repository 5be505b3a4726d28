"""The adaptive budget against the ratio budget on held-out text: perplexity and KV-cache bytes read.

    python -m doublesparse.bench.adaptive [--model-path M] --window-len 8192 --decode-len 256 \\
        --num-windows 8 --warmup-windows 8 [--target-recall 0.95] --result-json out.json

The engine's own stack (``build_parts``: operating point, channels, pools, backend, recall probe,
adaptive budget, CUDA graphs) runs three budgets in turn on the same model: dense, the ratio
default and ``--ds-budget-mode adaptive``. Each prefills the first ``window_len - decode_len``
tokens of each window, then decodes the rest one step at a time, teacher-forced (every request of
the batch feeds its text's next token), scoring each step's prediction of the following one. The
adaptive run first decodes ``--warmup-windows`` other windows, so that its scales have settled
(the sampled recall decides them; ``--recall-sample-interval``, default 1 here, since the
probe's cost is not what is measured), then keeps them moving through the measured windows as a
server would. Bytes: what each step's decode reads from the KV and label pools (the backend's
``decode_bytes``: with the adaptive budget, each layer's scaled k), summed over the measured steps.

Writes JSON: per budget ``ppl``, ``nll``, ``tokens``, ``decode_bytes``; the adaptive run's scales;
``summary``: ``adaptive_bytes_saving_pct`` (100 x (1 - adaptive bytes / ratio bytes)),
``ppl_increase_pct`` of each DS budget over dense, and whether the adaptive budget's perplexity
is no worse than the ratio budget's.

Where the adaptive budget reads more or fewer bytes than the ratio budget, their perplexities are
not comparable, so a fourth run (``ratio_matched``; ``--no-match-bytes`` skips it) is the ratio
budget with its ratio and floor scaled until it reads the adaptive run's bytes (from the ratio
run's label and selected-token bytes); ``summary.adaptive_ppl_increase_cut_pct`` is then 100 x
(1 - the adaptive budget's perplexity increase / the matched ratio budget's).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from . import emit_result
from ..texts import EVAL_PLAYS, encode, read_texts
from ..config import EngineConfig
from ..engine.setup import build_parts
from ..eval.measure import split_windows
from ..version import __version__

PREFILL_CHUNK = 4096


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.adaptive", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--tiny", action="store_true", help="the tiny random Llama and a byte tokenizer (CPU tests)")
    p.add_argument("--device", default=None)
    p.add_argument("--window-len", type=int, default=8192)
    p.add_argument("--decode-len", type=int, default=256)
    p.add_argument("--num-windows", type=int, default=8)
    p.add_argument("--warmup-windows", type=int, default=8)
    p.add_argument("--target-recall", type=float, default=0.95)
    p.add_argument("--recall-sample-interval", type=int, default=1)
    p.add_argument("--ds-heavy-token-min", type=int, default=None,
                   help="both DS budgets' floor (default: the operating point's)")
    p.add_argument("--ds-sparse-decode-threshold", type=int, default=None,
                   help="sparse decode from this length (default: the cost model decides)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--no-match-bytes", dest="match_bytes", action="store_false",
                   help="skip the ratio budget run at the adaptive budget's bytes")
    p.add_argument("--result-json", default=None)
    return p


def _windows(args, tokenizer) -> list[list[int]]:
    ids = [t for txt in read_texts(None, EVAL_PLAYS) for t in encode(tokenizer, txt)]
    return split_windows(ids, args.window_len, args.num_windows + args.warmup_windows)


@torch.inference_mode()
def score(parts, windows: list[list[int]], decode_len: int) -> dict:
    """Prefill, then teacher-forced decode of ``windows`` as one batch; nll of the predictions of
    the last ``decode_len - 1`` tokens and the decode bytes read."""
    m, runner = parts.memory, parts.runner
    rows = [m.rows.alloc() for _ in windows]
    prefix = len(windows[0]) - decode_len
    for row, w in zip(rows, windows):
        for a in range(0, prefix, PREFILL_CHUNK):
            chunk = w[a:min(prefix, a + PREFILL_CHUNK)]
            runner.prefill([row], [a], [chunk], [False])
    nll, n, nbytes, label_bytes = 0.0, 0, 0, 0
    for t in range(prefix, len(windows[0]) - 1):
        toks = [w[t] for w in windows]
        positions = [t] * len(windows)
        logits = runner.decode(rows, toks, positions)
        target = torch.tensor([w[t + 1] for w in windows], device=logits.device)
        nll += float(-logits.float().log_softmax(-1).gather(1, target[:, None]).sum())
        n += len(windows)
        lens = [t + 1] * len(windows)
        nbytes += (parts.backend.decode_bytes(lens) if parts.ds is not None
                   else sum(lens) * m.plan.kv_bytes_per_token)
        if parts.ds is not None:  # every row's labels (the rows decode sparsely at these lengths)
            label_bytes += sum(lens) * m.plan.label_bytes_per_token
    for row in rows:
        m.release(row, len(windows[0]) - 1)  # the last token is only a target
    return {"nll": nll / max(n, 1), "ppl": math.exp(nll / max(n, 1)), "tokens": n, "decode_bytes": nbytes,
            "label_bytes": label_bytes}


def _matched(ds: dict, r: dict, a: dict) -> dict:
    """The ratio budget (run ``r``) with its ratio and floor scaled so that its selected-token
    bytes (all but the labels) bring its total to the adaptive run's (``a``)."""
    f = (a["decode_bytes"] - r["label_bytes"]) / max(1, r["decode_bytes"] - r["label_bytes"])
    return dict(ds, ds_heavy_token_ratio=r["budget"]["ratio"] * f,
                ds_heavy_token_min=max(1, round(r["budget"]["k_min"] * f)))


def run(args) -> dict:
    t0 = time.time()
    base = dict(context_length=args.window_len, max_running_requests=max(args.num_windows, args.warmup_windows),
                max_total_tokens=max(args.num_windows, args.warmup_windows) * args.window_len + 64,
                disable_cuda_graph=args.disable_cuda_graph, device=args.device,
                ds_recall_sample_interval=args.recall_sample_interval)
    ds = dict(enable_double_sparsity=True, ds_heavy_token_min=args.ds_heavy_token_min,
              ds_sparse_decode_threshold=args.ds_sparse_decode_threshold)
    if args.tiny:
        from ..testing import ByteTokenizer, tiny_llama
        model, tok = tiny_llama(max_position_embeddings=args.window_len, device=args.device or "cpu"), ByteTokenizer()
    else:
        model, tok = None, None
    budgets = {"dense": dict(),
               "ratio": ds,
               "adaptive": dict(ds, ds_budget_mode="adaptive", ds_target_recall=args.target_recall)}
    out: dict = {"tool": f"doublesparse {__version__} bench.adaptive", "argv": sys.argv[1:],
                 "window_len": args.window_len, "decode_len": args.decode_len, "num_windows": args.num_windows,
                 "warmup_windows": args.warmup_windows, "target_recall": args.target_recall, "budgets": {}}
    windows = None
    for name in ("dense", "ratio", "adaptive") + (("ratio_matched",) if args.match_bytes else ()):
        kw = budgets[name] if name in budgets else _matched(ds, out["budgets"]["ratio"], out["budgets"]["adaptive"])
        cfg = EngineConfig(model_path=args.model_path, **{**base, **kw})
        parts = build_parts(cfg, model=model, tokenizer=tok if model is not None else None, progress=False)
        model, tok = parts.model, tok or parts.tokenizer
        out.setdefault("model", getattr(model.config, "name", None))
        windows = windows or _windows(args, tok)
        measured, warm = windows[:args.num_windows], windows[args.num_windows:]
        r: dict = {}
        if name == "adaptive" and warm:
            r["warmup"] = score(parts, warm, args.decode_len)
        r.update(score(parts, measured, args.decode_len))
        if parts.adaptive is not None:
            r["budget_scale"] = parts.adaptive.summary()
        if parts.recall is not None:
            r["attention_recall"] = {k: v for k, v in parts.recall.summary().items() if k != "groups"}
        if parts.ds is not None:
            r["heavy_token_num"], r["policy"] = parts.ds.k_max, parts.ds.policy.describe()
            budget = parts.ds.policy.budget
            r["budget"] = {"ratio": budget.ratio, "k_min": budget.k_min, "k_max": budget.k_max}
        out["budgets"][name] = r
        del parts
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    b = out["budgets"]
    out["summary"] = summary(b)
    out["seconds"] = time.time() - t0
    return out


def summary(b: dict) -> dict:
    d, r, a = b["dense"], b["ratio"], b["adaptive"]
    ds = [k for k in ("ratio", "adaptive", "ratio_matched") if k in b]
    inc = {k: 100 * (b[k]["ppl"] / d["ppl"] - 1) for k in ds}
    out = {"adaptive_bytes_saving_pct": 100 * (1 - a["decode_bytes"] / r["decode_bytes"]),
           "ppl_dense": d["ppl"], "ppl_ratio": r["ppl"], "ppl_adaptive": a["ppl"],
           "ppl_increase_pct": inc,
           "adaptive_ppl_no_worse": a["ppl"] <= r["ppl"],
           "bytes_vs_dense": {k: b[k]["decode_bytes"] / d["decode_bytes"] for k in ds},
           "adaptive_scales": a.get("budget_scale", {}).get("scales")}
    if "ratio_matched" in b and inc["ratio_matched"] > 0:
        out["adaptive_ppl_increase_cut_pct"] = 100 * (1 - inc["adaptive"] / inc["ratio_matched"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    emit_result(run(args), args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
