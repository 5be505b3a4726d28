"""``doublesparse eval``: dense vs Double Sparsity through the real decode kernels.

    python -m doublesparse.eval --output-dir out/ [--small] [--device cuda] [--model-path P]
        [--channels cfg.json] [--window-len N --decode-len M --num-windows W]
        [--retrieval-lens 1024 2048 ...] [--retrieval-depths 0 0.5 1] [--no-text] [--no-retrieval]

Writes ``results.json``, ``table.md`` and ``plot.png`` into the output directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import doublesparse
from doublesparse.calibrate.channels import load_channels, packaged_config_path
from doublesparse.calibrate.texts import EVAL_PLAYS, encode, read_texts
from doublesparse.calibrate.weights import default_channels

from . import measure, report, retrieval
from .settings import Setting, grid, improvements, preset

# (window_len, decode_len, num_windows, retrieval lens, depths, trials per cell); None = model ctx
PRESETS = {
    "small": dict(window_len=1024, decode_len=32, num_windows=1, retrieval_lens=[1024],
                  retrieval_depths=[0.0, 0.5, 1.0], retrieval_trials=1),
    "full": dict(window_len=None, decode_len=256, num_windows=8, retrieval_lens=None,
                 retrieval_depths=[0.0, 0.25, 0.5, 0.75, 1.0], retrieval_trials=2),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="doublesparse eval", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="model file/dir (default: embedded SmolLM2)")
    p.add_argument("--tiny", action="store_true", help="use the built-in tiny random model (CI smoke run)")
    p.add_argument("--channels", default=None,
                   help="channel config (default: the packaged one for the model, else weight-based)")
    p.add_argument("--output-dir", "-o", required=True)
    p.add_argument("--small", action="store_true", help="CPU/CI preset (few settings, short contexts)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: loader's: fp32 CPU, bf16 CUDA)")
    p.add_argument("--window-len", type=int, default=None)
    p.add_argument("--decode-len", type=int, default=None)
    p.add_argument("--num-windows", type=int, default=None)
    p.add_argument("--batch-windows", type=int, default=0, help="windows per decode forward (0: all)")
    p.add_argument("--retrieval-lens", type=int, nargs="*", default=None)
    p.add_argument("--retrieval-depths", type=float, nargs="*", default=None)
    p.add_argument("--retrieval-trials", type=int, default=None)
    p.add_argument("--retrieval-seed", type=int, default=0,
                   help="seed of the pass keys (runs with different seeds give independent trials)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE", help="eval text (default: eval plays)")
    p.add_argument("--types", nargs="+", default=None, help="override the grid: channel types")
    p.add_argument("--modes", nargs="+", default=None)
    p.add_argument("--rs", type=int, nargs="+", default=None)
    p.add_argument("--k-fracs", type=float, nargs="+", default=None)
    p.add_argument("--no-text", action="store_true")
    p.add_argument("--no-retrieval", action="store_true")
    p.add_argument("--no-fidelity", action="store_true", help="skip per-layer attention fidelity")
    p.add_argument("--quiet", action="store_true")
    return p


def _load(args):
    if args.tiny:
        from .tiny import ByteTokenizer, TinyConfig, TinyModel
        return TinyModel(TinyConfig(max_position_embeddings=8192)).to(args.device).eval(), ByteTokenizer()
    from doublesparse.models import load_model, load_tokenizer
    kw = {"device": args.device, "progress": not args.quiet}
    if args.dtype:
        kw["dtype"] = getattr(torch, args.dtype)
    return load_model(args.model_path, **kw), load_tokenizer(args.model_path)


def channel_source(args, model):
    """``channels_for(setting)`` and a description of where channels come from."""
    c = model.config
    path = args.channels or packaged_config_path(getattr(c, "name", None))
    cache: dict = {}

    def channels_for(s: Setting) -> torch.Tensor:
        key = (s.channel_type, s.mode, s.r)
        if key not in cache:
            cache[key] = (load_channels(path, c, s.channel_type, s.r, s.mode) if path
                          else default_channels(model, s.r, s.channel_type))
        return cache[key]

    return channels_for, (str(path) if path else "weight-based default_channels")


def settings_for(args) -> list[Setting]:
    if any(x is not None for x in (args.types, args.modes, args.rs, args.k_fracs)):
        g = grid(args.types or ("q", "k", "qk"), args.modes or ("per_head", "group_sum", "group_max"),
                 args.rs or (8, 16, 32), args.k_fracs or (1 / 32, 1 / 16, 1 / 8))
        return [Setting(kind="dense")] + g + improvements(Setting("ds", "qk", "group_sum", 16, 1 / 16))
    return preset("small" if args.small else "full")


def run(args, model=None, tokenizer=None) -> dict:
    t0 = time.perf_counter()
    if model is None:
        model, tokenizer = _load(args)
    c = model.config
    ctx = int(getattr(c, "max_position_embeddings", 4096))
    pr = PRESETS["small" if args.small else "full"]
    val = lambda name: getattr(args, name) if getattr(args, name) is not None else pr[name]  # noqa: E731
    window_len = min(val("window_len") or ctx, ctx)
    decode_len, num_windows = val("decode_len"), val("num_windows")
    lens = [min(n, ctx - retrieval.ANSWER_TOKENS) for n in
            (val("retrieval_lens") or [n for n in (1024, 2048, 4096, 8192) if n <= ctx] or [ctx])]
    depths, trials_per = val("retrieval_depths"), val("retrieval_trials")
    settings = settings_for(args)
    channels_for, source = channel_source(args, model)
    progress = not args.quiet
    dims = (int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim))
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text_res = ret_res = None
    if not args.no_text:
        ids = [t for txt in read_texts(args.text, EVAL_PLAYS) for t in encode(tokenizer, txt)]
        windows = measure.split_windows(ids, window_len, num_windows)
        res = measure.evaluate_text(model, windows, decode_len, settings, channels_for, device=args.device,
                                    fidelity=not args.no_fidelity, batch_windows=args.batch_windows,
                                    progress=progress)
        text_res = {r.setting: r for r in res}
    if not args.no_retrieval:
        trials = retrieval.make_trials(tokenizer, lens, depths, trials_per,
                                         seed=getattr(args, "retrieval_seed", 0))
        ret_res = retrieval.evaluate_retrieval(model, tokenizer, trials, settings, channels_for,
                                               device=args.device, progress=progress)
    # bytes are quoted at the text window, or at the longest retrieval context without text
    bytes_ctx = window_len if text_res is not None else max(lens)
    rows = report.rows(settings, lambda s: s.bytes_per_step(bytes_ctx, *dims), text_res, ret_res)
    name = getattr(c, "name", "model")
    notes = [f"model: {name}; channels: {source}; device: {args.device}"]
    if text_res is not None:
        notes.append(f"text: {num_windows} window(s) of {window_len} tokens from the eval plays, last "
                     f"{decode_len} decoded (prefix prefilled densely), {decode_len - 1} scored per window")
    if ret_res is not None:
        notes.append(f"retrieval: context lengths {lens}, depths {depths}, {trials_per} trial(s) per "
                     f"cell, pass-key seed {getattr(args, 'retrieval_seed', 0)}; k = k_frac x context")
    notes.append(f"bytes per step at context {bytes_ctx}, K/V/labels as bf16")
    title = f"Double Sparsity eval: {name}"
    (out_dir / "table.md").write_text(report.markdown(rows, title, notes))
    png = report.plot(rows, out_dir / "plot.png", title)
    result = {"tool": f"doublesparse {doublesparse.__version__}", "model": name, "channels": source,
              "window_len": window_len, "decode_len": decode_len, "num_windows": num_windows,
              "retrieval_lens": lens, "retrieval_depths": depths,
              "retrieval_seed": getattr(args, "retrieval_seed", 0), "rows": rows,
              "retrieval_answers": {s.name: v["answers"] for s, v in (ret_res or {}).items()},
              "seconds": round(time.perf_counter() - t0, 1), "plot": str(png) if png else None}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    if progress:
        print(report.markdown(rows, title, notes), file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ValueError as e:
        print(f"doublesparse eval: error: {e}", file=sys.stderr)
        return 2
    return 0
