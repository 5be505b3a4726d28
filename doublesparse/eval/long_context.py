"""Long-context accuracy: text fidelity and RULER-style tasks at 16K and 32K, dense vs DS settings.

    python -m doublesparse.eval.long_context -o OUT --model-path qwen2.5-coder-1.5b --device cuda \\
        [--lengths 16384 32768] [--parts text ruler] [--samples-per-task 4] [--settings ...]
        [--kv-cache-dtypes auto fp8_e4m3]

Per context length: (1) text: ``--num-windows`` windows of the eval plays (concatenated), the
last ``--decode-len - 1`` tokens decoded and scored (perplexity, KL(dense || DS), top-1 agreement,
:mod:`.measure`); (2) the tasks of :mod:`.ruler`, ``--samples-per-task`` prompts each, answered
greedily, scored 0-100. Prefill is dense and shared by every setting; only the decode goes through
each setting's kernels (:mod:`.driver`). Settings, in the order they run: dense, the engine's
default, group_sum with 4 sink + 32 recent tokens, the default under the top-p budget (p 0.9 and
0.98); with ``--kv-cache-dtypes`` each of them once per K/V cache dtype (the engine's
``--kv-cache-dtype``: fp8 K/V alone is ``dense/kv:fp8_e4m3``, Double Sparsity with it the default's
name with ``/kv:fp8_e4m3``), each cache prefilled through itself. Each (part, length, setting) unit runs only while its estimated time fits ``--budget-s``;
``results.json`` and ``table.md`` are rewritten after every unit, ``plot.png`` after each part.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from doublesparse.version import __version__

from . import driver, long_report, measure, ruler
from .cli import load_model_for_eval, channel_source, eval_windows, model_point, recorded_layer_modes
from .retrieval import decode_text
from doublesparse.config import KV_CACHE_DTYPES

from .settings import BASELINE, DENSE, Setting, default_setting, top_p_variants, with_kv

SETTING_KEYS = ("dense", "default", "group_sum", "top_p")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m doublesparse.eval.long_context",
        description=__doc__.splitlines()[0],
    )
    a = p.add_argument
    a("--output-dir", "-o", required=True)
    a(
        "--model-path",
        default=None,
        help="model file/dir or name (default: the embedded SmolLM2)",
    )
    a("--tiny", action="store_true", help="built-in tiny random model (smoke runs)")
    a(
        "--channels",
        default=None,
        help="channel config (default: the packaged one, else weight-based)",
    )
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    a("--impl", default="auto", choices=["auto", "triton", "torch"])
    a(
        "--lengths",
        type=int,
        nargs="+",
        default=[16384, 32768],
        help="context lengths in tokens",
    )
    a("--parts", nargs="+", default=["text", "ruler"], choices=["text", "ruler"])
    a("--settings", nargs="+", default=list(SETTING_KEYS), choices=SETTING_KEYS)
    a(
        "--kv-cache-dtypes",
        nargs="+",
        default=["auto"],
        choices=KV_CACHE_DTYPES,
        help="the settings once per K/V cache dtype, in this order (dense with the model's cache, "
        "the reference, runs first in any case)",
    )
    a(
        "--text",
        nargs="+",
        default=None,
        metavar="FILE",
        help="eval text (default: the eval plays)",
    )
    a("--num-windows", type=int, default=2)
    a(
        "--decode-len",
        type=int,
        default=256,
        help="the last decode_len - 1 tokens of a window are scored",
    )
    a("--tasks", nargs="+", default=list(ruler.TASKS), choices=ruler.TASKS)
    a("--samples-per-task", type=int, default=4)
    a(
        "--max-new-tokens",
        type=int,
        default=0,
        help="cap on each task's greedy tokens (0: the task's own)",
    )
    a("--seed", type=int, default=0, help="seed of the task prompts")
    a(
        "--budget-s",
        type=float,
        default=540.0,
        help="wall seconds by which all is written",
    )
    a("--quiet", action="store_true")
    return p


def plan(keys, head_dim: int, max_context: int, layer_modes=(), device: str = "cpu",
         k_bias: bool = False, point=None, kvs=("auto",)) -> list[Setting]:
    """The settings named by ``keys`` (see ``--settings``), dense first; the default with the
    label dtype the engine picks on ``device`` (``k_bias``: the model's K projection has a bias);
    each once per K/V cache dtype of ``kvs`` (:func:`.settings.with_kv`)."""
    default = default_setting(head_dim, max_context, layer_modes, device, k_bias, point)
    out = {
        "dense": [DENSE],
        "default": [default],
        "group_sum": [replace(BASELINE, num_sink=4, num_recent=32)],
        "top_p": top_p_variants(default),
    }
    return with_kv([s for k in SETTING_KEYS if k in keys for s in out[k]], dict.fromkeys(kvs))


class RulerRunner:
    """Samples of one length prefilled once per K/V cache dtype (dense: driver.PoolSet); :meth:`run`
    answers all greedily with one setting and returns ``{task: points 0-100}`` (answers kept in
    ``self.answers``)."""

    def __init__(
        self,
        model,
        tokenizer,
        samples: list[ruler.Sample],
        device="cpu",
        impl="auto",
        max_new_tokens: int = 0,
    ):
        self.model, self.tokenizer, self.samples = model, tokenizer, samples
        self.cap = max_new_tokens or 1 << 30
        self.steps = min(self.cap, max(s.gen_tokens for s in samples))
        max_ctx = max(len(s.ids) for s in samples) + self.steps
        self.pools = driver.PoolSet(model, [list(s.ids[:-1]) for s in samples], max_ctx, device=device, impl=impl)
        self.pools.get("auto")
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop = set(getattr(model.config, "eos_token_ids", ()) or ()) | (
            {eos} if isinstance(eos, int) else set()
        )
        self.answers: dict[str, list[dict]] = {}

    def run(self, s: Setting, channels_for, heavy_ctx: int) -> dict:
        ch = channels_for(s) if s.kind == "ds" else None
        pools = self.pools.get(s.kv)
        if ch is not None:
            pools.relabel(ch, s.label)
        new = driver.greedy(
            self.model,
            pools,
            s,
            ch,
            [x.ids[-1] for x in self.samples],
            self.steps,
            s.k_for(heavy_ctx),
        )
        per: dict[str, list[float]] = {}
        answers = []
        for x, toks in zip(self.samples, new):
            toks = toks[: min(x.gen_tokens, self.cap)]
            cut = next((i for i, t in enumerate(toks) if t in self.stop), len(toks))
            text = decode_text(self.tokenizer, toks[:cut]).strip()
            sc = ruler.score(text, x.answers)
            per.setdefault(x.task, []).append(sc)
            answers.append(
                {
                    "task": x.task,
                    "index": x.index,
                    "prompt_tokens": len(x.ids),
                    "expected": list(x.answers),
                    "answer": text,
                    "score": sc,
                }
            )
        self.answers[s.name] = answers
        return {t: 100 * sum(v) / len(v) for t, v in per.items()}


def run(args) -> dict:
    t0 = time.time()
    deadline = t0 + args.budget_s - 10
    say = (
        (lambda m: None)
        if args.quiet
        else (lambda m: print(f"[{time.time() - t0:6.1f}s] {m}", flush=True))
    )
    model, tok = load_model_for_eval(args)
    c = model.config
    ctx = int(getattr(c, "max_position_embeddings", 4096))
    dims = (int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim))
    channels_for, source = channel_source(args, model)
    point = model_point(args, model)
    settings = plan(args.settings, dims[3], ctx, recorded_layer_modes(args, model), args.device,
                    bool(getattr(model.config, "attention_bias", False)), point, args.kv_cache_dtypes)
    lengths = sorted({min(n, ctx) for n in args.lengths})
    res = {
        "tool": f"doublesparse {__version__} eval.long_context",
        "model": c.name,
        "channels": source,
        "device": args.device
        + (
            f" ({torch.cuda.get_device_name()})"
            if args.device.startswith("cuda")
            else ""
        ),
        "argv": sys.argv[1:],
        "lengths": lengths,
        "num_windows": args.num_windows,
        "decode_len": args.decode_len,
        "tasks": args.tasks,
        "samples_per_task": args.samples_per_task,
        "seed": args.seed,
        "settings": [s.name for s in settings],
        "kv_cache_dtypes": list(dict.fromkeys(args.kv_cache_dtypes)),
        "default_setting": next((s.name for s in settings if s.kind == "ds"), None),
        "operating_point": point.as_dict(),
        "text": {},
        "ruler": {},
        "ruler_answers": {},
        "skipped": [],
        "errors": [],
    }
    spent: dict[str, tuple[int, float]] = {}
    prefill_rate = None

    def unit(kind: str, n: int, s: Setting, fn) -> None:
        prev = spent.get(
            kind
        )  # (length, seconds) of the last unit of this kind: scaled to n
        est = prev[1] * n / prev[0] if prev else 0.0
        if time.time() + 1.3 * est > deadline:
            res["skipped"].append(f"{kind} {n} {s.name}")
            say(f"{kind} {n} {s.name}: skipped (out of time)")
            return
        t = time.time()
        try:
            msg = fn(s)
        except Exception as e:  # noqa: BLE001 - one failing setting must not lose the run
            res["errors"].append(f"{kind} {n} {s.name}: {type(e).__name__}: {e}")
            msg = f"FAILED {type(e).__name__}: {e}"
        spent[kind] = (n, time.time() - t)
        say(f"{kind} {n} {s.name}: {msg} ({time.time() - t:.1f}s)")
        long_report.write(args.output_dir, res)

    for n in lengths:
        if "text" in args.parts and time.time() < deadline:
            windows = eval_windows(args, tok, n, args.num_windows)
            t_pre = time.time()
            text = measure.TextRunner(
                model, windows, args.decode_len, channels_for, args.device, 0, args.impl
            )
            # seconds per prefilled token (x length: attention grows with it), for the task prompts
            prefill_rate = (time.time() - t_pre) / (len(windows) * n * n)
            say(f"text {n}: {len(windows)} windows prefilled")
            out = res["text"].setdefault(str(n), {})

            def text_unit(s, text=text, out=out, n=n):
                r = text.run(s)
                avg_k = r.extra.get("avg_k")
                out[s.name] = {
                    "ppl": r.ppl,
                    "kl": r.kl,
                    "top1": r.top1,
                    "tokens": r.tokens,
                    "avg_k": avg_k,
                    "ppl_pct_ci95": r.extra.get("ppl_pct_ci95"),
                    "bytes_per_step": s.bytes_per_step(
                        n, *dims, k=avg_k if s.top_p else None
                    ),
                }
                return f"ppl {r.ppl:.3f} KL {r.kl:.4f} top1 {r.top1:.3f}"

            for s in settings:
                unit("text", n, s, text_unit)
            del text
        plen = min(n, ctx - max(ruler.GEN_TOKENS[t] for t in args.tasks))
        est = (
            prefill_rate * len(args.tasks) * args.samples_per_task * plen * plen
            if prefill_rate
            else 0.0
        )
        if "ruler" in args.parts and time.time() + 1.5 * est > deadline:
            res["skipped"].append(f"ruler {n} (prefill estimate {est:.0f}s)")
            say(f"ruler {n}: skipped (prefill estimate {est:.0f}s, out of time)")
        elif "ruler" in args.parts:
            samples = ruler.make_samples(
                tok,
                [plen],
                args.tasks,
                args.samples_per_task,
                args.seed,
                texts=None
                if not args.text
                else [Path(f).read_text() for f in args.text],
            )
            rr = RulerRunner(
                model, tok, samples, args.device, args.impl, args.max_new_tokens
            )
            say(f"ruler {n}: {len(samples)} prompts of <= {plen} tokens prefilled")
            out = res["ruler"].setdefault(str(n), {})

            def ruler_unit(s, rr=rr, out=out, n=n):
                out[s.name] = pts = rr.run(s, channels_for, n)
                res["ruler_answers"].setdefault(str(n), {})[s.name] = rr.answers[s.name]
                return " ".join(f"{t} {v:.0f}" for t, v in pts.items())

            for s in settings:
                unit("ruler", n, s, ruler_unit)
            del rr
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        long_report.write(args.output_dir, res, with_plot=True)
    res["elapsed_s"] = round(time.time() - t0, 1)
    # plot.png was drawn after the last length
    return long_report.write(args.output_dir, res)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    res = run(args)
    print(
        f"wrote results.json, table.md{', plot.png' if res.get('plot') else ''} to {args.output_dir}/"
    )
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
