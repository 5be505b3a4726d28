"""The full accuracy protocol in one time-budgeted run (made for a single GPU call).

    python -m doublesparse.eval.protocol -o OUT [--budget-s 480] [--device cuda] [sizes, see --help]
    python -m doublesparse.eval.protocol --stage-texts .stage/shakespeare   # before, on a networked box
    python -m doublesparse.eval.protocol --replot OUT/results.json          # PNG where matplotlib is

Work runs in order of importance, each unit (one setting of one part) only if its estimated time
still fits before the deadline, and ``results.json`` + ``table.md`` are rewritten after every unit
(``plot.png`` after every part), so a kill loses at most the unit in flight:

  a. text (ppl, KL(dense||DS), top-1): dense, the engine default, plain group_sum (the baseline)
     (the default with the label dtype the engine picks on ``--device``; with ``--label-dtypes bf16
     fp8`` also the default with the other label dtype and its k = ctx/8 with both; with
     ``--kv-cache-dtypes auto fp8_e4m3`` also dense and the default with an fp8 K/V cache, each
     cache prefilled through itself)
  b. retrieval, the same three settings, ``--retrieval-trials`` per (length, depth)
  c. text for the rest: improvement variants, the default's line over r and k, the r/k/type/mode
     grid; then retrieval for the improvement variants
  d. attention fidelity per layer (recall of the true top-k mass, output relative error)

Prefill is dense, so each window / trial is prefilled once and every setting reuses it (see
:mod:`.driver`); only the decode forwards differ between settings.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from doublesparse.config import KV_CACHE_DTYPES, LABEL_DTYPES
from doublesparse.version import __version__

from . import measure, report, retrieval
from .cli import load_model_for_eval, channel_source, eval_windows, model_point, recorded_layer_modes, run_notes
from .settings import BASELINE, DENSE, default_setting, grid, improvements, unique, with_kv

PRIORS = {"text": 2.0, "ret": 2.0, "fid": 5.0}  # s per unit before one is measured (compile included)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m doublesparse.eval.protocol", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--output-dir", "-o")
    a("--stage-texts", metavar="DIR", help="copy the eval plays into DIR and exit (needs the text cache)")
    a("--replot", metavar="RESULTS_JSON", help="redraw plot.png next to a results.json and exit")
    a("--budget-s", type=float, default=480.0, help="wall seconds from --t0 by which all is written")
    a("--t0", type=float, default=None, help="epoch seconds the budget counts from (default: now)")
    a("--reserve-s", type=float, default=15.0, help="kept free at the end for the final write")
    a("--parts", default="abcd", help="subset of a/b/c/d to run")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--dtype", default=None)
    a("--model-path", default=None)
    a("--channels", default=None)
    a("--tiny", action="store_true", help="built-in tiny random model (smoke runs)")
    a("--text", nargs="+", default=None, metavar="FILE")
    a("--window-len", type=int, default=8192)
    a("--decode-len", type=int, default=256, help="the last decode_len - 1 tokens are decoded and scored")
    a("--num-windows", type=int, default=8)
    a("--batch-windows", type=int, default=0)
    a("--retrieval-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    a("--retrieval-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    a("--retrieval-trials", type=int, default=20)
    a("--retrieval-seed", type=int, default=0)
    a("--batch-trials", type=int, default=0)
    a("--types", nargs="+", default=["qk", "k", "q"])
    a("--modes", nargs="+", default=["group_max", "group_sum", "per_head"])
    a("--rs", type=int, nargs="+", default=[16, 8, 32])
    a("--k-fracs", type=float, nargs="+", default=[1 / 16, 1 / 32, 1 / 8])
    a("--label-dtypes", nargs="+", default=["bf16"], choices=LABEL_DTYPES,
      help="with fp8: parts a and b also run the default with the other label dtype (the default's "
           "is the engine's on --device) and its k = ctx/8 with both, right after the first three "
           "settings")
    a("--kv-cache-dtypes", nargs="+", default=["auto"], choices=KV_CACHE_DTYPES,
      help="parts a and b also run dense and the default with each of these K/V cache dtypes besides "
           "auto (the engine's --kv-cache-dtype; each prefilled through its own cache), after the "
           "label variants")
    a("--fidelity-stride", type=int, default=1, help="fidelity on every n-th decoded token")
    a("--impl", default="auto", choices=["auto", "triton", "torch"],
      help="kernels (auto: Triton on CUDA; triton on CPU needs TRITON_INTERPRET=1)")
    return p


def stage_texts(dest: str | Path) -> list[Path]:
    """Copy both editions of every eval play into ``dest`` (point ``DOUBLESPARSE_SHAKESPEARE_DIR``
    at it where there is no network)."""
    from doublesparse.assets import shakespeare_dir
    from doublesparse.texts import EVAL_EDITIONS

    src, dest = shakespeare_dir(), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(src / f"{e}.txt", dest / f"{e}.txt")) for e in EVAL_EDITIONS]


def texts_available(args) -> str | None:
    """None if the eval text can be read without a download, else why not."""
    if args.text:
        missing = [f for f in args.text if not Path(f).is_file()]
        return f"missing --text files {missing}" if missing else None
    from doublesparse.assets import shakespeare_dir
    from doublesparse.texts import EVAL_PLAYS
    try:
        d = shakespeare_dir(download=False)
    except FileNotFoundError as e:
        return str(e)
    missing = [p for p in EVAL_PLAYS if not (d / f"{p}.txt").is_file()]
    return f"plays {missing} not in {d}" if missing else None


class Budget:
    """Deadline bookkeeping: measured seconds per unit kind decide whether the next unit fits."""

    def __init__(self, t0: float, budget_s: float, reserve_s: float):
        self.t0, self.deadline, self.reserve = t0, t0 + budget_s, reserve_s
        self.spent: dict[str, list[float]] = {}

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.deadline - time.time() - self.reserve

    def estimate(self, kind: str) -> float:
        xs = self.spent.get(kind)
        return statistics.median(xs[-5:]) if xs else PRIORS[kind]

    def fits(self, kind: str) -> bool:
        return 1.5 * self.estimate(kind) < self.left()

    def record(self, kind: str, seconds: float) -> None:
        self.spent.setdefault(kind, []).append(seconds)


def log(budget: Budget, msg: str) -> None:
    print(f"[{budget.elapsed():6.1f}s | {max(budget.left(), 0):5.0f}s left] {msg}", flush=True)


def plan_settings(args, head_dim: int, layer_modes: tuple[str, ...] = (), k_bias: bool = False,
                  point=None) -> dict:
    """The setting lists of each part, most important first (the default with the channel
    config's recorded per-layer modes and the label dtype the engine picks on the device, as the
    engine runs it; ``k_bias``: the model's K projection has a bias)."""
    default = default_setting(head_dim, layer_modes=layer_modes, device=args.device, k_bias=k_bias, point=point)
    first = [DENSE, default, BASELINE]
    if "fp8" in args.label_dtypes:
        other = "bf16" if default.label == "fp8" else "fp8"
        wide = replace(default, k_frac=1 / 8)
        first += [replace(default, label=other), wide, replace(wide, label=other)]
    kvs = [kv for kv in getattr(args, "kv_cache_dtypes", None) or () if kv != "auto"]
    first = unique(first + with_kv([DENSE, default], kvs))
    variants = improvements(BASELINE) + [replace(BASELINE, mode="per_head")]
    line = [replace(default, r=r, k_frac=f) for r in args.rs for f in args.k_fracs]
    text_rest = unique(variants + line + grid(args.types, args.modes, args.rs, args.k_fracs))
    text_rest = [s for s in text_rest if s not in first]
    return {"a": first, "b": first, "c_text": text_rest,
            "c_ret": [s for s in unique(variants + line) if s not in first],
            "d": [s for s in unique(first + text_rest) if s.kind == "ds"]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.stage_texts:
        files = stage_texts(args.stage_texts)
        print(f"staged {len(files)} texts ({sum(f.stat().st_size for f in files) / 2**20:.1f} MiB) in "
              f"{args.stage_texts}")
        return 0
    if args.replot:
        import json
        res = json.loads(Path(args.replot).read_text())
        png = report.plot(res["rows"], Path(args.replot).with_name("plot.png"),
                          f"Double Sparsity eval: {res.get('model', 'model')}")
        print(png or "matplotlib missing")
        return 0 if png else 1
    if not args.output_dir:
        build_parser().error("--output-dir is required")
    budget = Budget(args.t0 or time.time(), args.budget_s, args.reserve_s)
    run(args, budget)
    return 0


def run(args, budget: Budget) -> dict:
    args.quiet = True  # no tqdm bars in the console log; we print one line per unit instead
    log(budget, f"doublesparse {__version__}, torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    no_text = texts_available(args)
    if no_text:
        log(budget, f"WARNING: no eval text ({no_text}): text parts a, c-text, d are skipped")
    model, tok = load_model_for_eval(args)
    c = model.config
    ctx = int(getattr(c, "max_position_embeddings", 4096))
    channels_for, source = channel_source(args, model)
    dims = (int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim))
    P = plan_settings(args, dims[3], recorded_layer_modes(args, model), bool(getattr(c, "attention_bias", False)),
                      model_point(args, model))
    L = dict(window_len=min(args.window_len, ctx), decode_len=args.decode_len, num_windows=args.num_windows,
             lens=sorted({min(n, ctx - retrieval.ANSWER_TOKENS) for n in args.retrieval_lens}),
             depths=args.retrieval_depths, trials=args.retrieval_trials)
    log(budget, f"model {c.name} loaded; channels {source}; text {L['num_windows']}x{L['window_len']} "
        f"(decode {L['decode_len'] - 1}); retrieval {L['lens']} x {len(L['depths'])} depths x {L['trials']}; "
        f"settings: a {len(P['a'])}, c-text {len(P['c_text'])}, c-ret {len(P['c_ret'])}, d {len(P['d'])}")
    text_res: dict = {}
    ret_res: dict = {}
    state = {"parts": {}}

    def write(plot=False):
        order = unique(P["a"] + P["c_text"])
        done = [s for s in order if s in text_res or s in ret_res]
        ctx_b = L["window_len"] if text_res else max(L["lens"])
        rows = report.rows(done, lambda s: s.bytes_per_step(ctx_b, *dims), text_res, ret_res)
        notes = run_notes(c.name, source, args.device, L, ctx_b, bool(text_res), bool(ret_res), args.retrieval_seed,
                          any(s.kv != "auto" for s in done))
        notes.append("parts: " + "; ".join(f"{k}: {v}" for k, v in state["parts"].items()))
        result = {"tool": f"doublesparse {__version__} eval.protocol", "model": c.name,
                  "channels": source, "device": args.device, "argv": sys.argv[1:], **L,
                  "default_setting": P["a"][1].name, "baseline_setting": BASELINE.name,
                  "parts": state["parts"], "errors": state.get("errors", []),
                  "elapsed_s": round(budget.elapsed(), 1),
                  "unit_seconds": {k: [round(x, 3) for x in v] for k, v in budget.spent.items()},
                  "retrieval_answers": {s.name: v["answers"] for s, v in ret_res.items()}}
        report.write_outputs(args.output_dir, rows, f"Double Sparsity eval: {c.name}", notes, result, with_plot=plot)

    def units(part: str, kind: str, settings, fn):
        n = 0
        for s in settings:
            if not budget.fits(kind):
                log(budget, f"{part}: out of time before {s.name} (est {budget.estimate(kind):.1f}s)")
                break
            t = time.time()
            try:
                msg = fn(s)
            except Exception as e:  # noqa: BLE001 - one failing setting must not lose the run
                import traceback
                traceback.print_exc()
                state["errors"] = state.get("errors", []) + [f"{part} {s.name}: {type(e).__name__}: {e}"]
                msg = f"FAILED {type(e).__name__}: {e}"
            else:
                n += 1
            budget.record(kind, time.time() - t)
            log(budget, f"{part} {s.name}: {msg} ({time.time() - t:.2f}s)")
            write()
        state["parts"][part] = f"{n}/{len(settings)} settings"
        write(plot=True)

    def text_unit(s):
        r = text.run(s)
        return f"ppl {r.ppl:.3f} KL {r.kl:.4f} top1 {r.top1:.3f}"

    def ret_unit(s):
        r = ret.run(s, channels_for)
        return f"acc {r['acc']:.3f} " + " ".join(f"{n}@{d:g}:{v:.2f}" for (n, d), v in sorted(r["cells"].items()))

    def fid_unit(s):
        obs = measure.FidelityObserver(dims[0], args.fidelity_stride, 256 if args.device.startswith("cuda") else 64)
        r = text.run(s, obs)
        return f"recall {report.nanmean(r.recall):.3f} rel err {report.nanmean(r.rel_err):.3f}"

    text = ret = None
    prefill_rate = None  # s per prefilled token, from the text prefill
    if not no_text and set("acd") & set(args.parts):
        t = time.time()
        windows = eval_windows(args, tok, L["window_len"], L["num_windows"])
        t1 = time.time()
        text = measure.TextRunner(model, windows, L["decode_len"], channels_for, args.device, args.batch_windows,
                                  args.impl)
        text_res = text.results
        prefill_rate = (time.time() - t1) / (len(windows) * (L["window_len"] - L["decode_len"]))
        log(budget, f"text: {len(windows)} windows tokenized and prefilled ({time.time() - t:.1f}s)")
    if text is not None and "a" in args.parts:
        units("a", "text", P["a"], text_unit)
    if "b" in args.parts or "c" in args.parts:
        t = time.time()
        if prefill_rate is not None:  # fewer trials per cell rather than none when time is short
            est = 1.5 * prefill_rate * L["trials"] * len(L["depths"]) * sum(L["lens"])
            if est > budget.left() / 2:
                L["trials"] = max(1, int(L["trials"] * budget.left() / 2 / est))
                log(budget, f"retrieval: prefill estimate {est:.0f}s; cut to {L['trials']} trial(s) per cell")
        trials = retrieval.make_trials(tok, L["lens"], L["depths"], L["trials"], seed=args.retrieval_seed)
        log(budget, f"retrieval: {len(trials)} prompts built ({time.time() - t:.1f}s)")
        ret = retrieval.RetrievalRunner(model, tok, trials, args.device, args.batch_trials, args.impl)
        ret_res = ret.results
        log(budget, f"retrieval: {len(trials)} prompts prefilled ({time.time() - t:.1f}s)")
        if "b" in args.parts:
            units("b", "ret", P["b"], ret_unit)
    if "c" in args.parts:
        if text is not None:
            units("c-text", "text", P["c_text"], text_unit)
        units("c-ret", "ret", P["c_ret"], ret_unit)
    ret = None  # frees the retrieval pools before the fidelity pass
    if text is not None and "d" in args.parts:
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        units("d", "fid", P["d"], fid_unit)
    log(budget, f"done; outputs in {args.output_dir}")
    return state


if __name__ == "__main__":
    sys.exit(main())
