"""``doublesparse eval``: dense vs Double Sparsity through the real decode kernels.

    python -m doublesparse.eval [--output-dir out/] [--small] [--device cuda] [--model-path P]
        [--channels cfg.json] [--window-len N --decode-len M --num-windows W]
        [--retrieval-lens 1024 2048 ...] [--retrieval-depths 0 0.5 1] [--no-text] [--no-retrieval]

Writes ``results.json``, ``table.md`` and ``plot.png`` into the output directory (default: a new
``doublesparse-eval/<date>-<time>`` folder in the current directory) and prints where. Every setting
listed runs on every part; for the full protocol in one time-budgeted run, ordered by
importance, use :mod:`doublesparse.eval.protocol` (``python benchmarks/run.py accuracy`` on a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from doublesparse import preflight
from doublesparse.texts import EVAL_PLAYS, encode, read_texts
from doublesparse.config import KV_CACHE_DTYPES, LABEL_DTYPES
from doublesparse.cli_common import (
    Parser,
    UsageError,
    nonnegative_int,
    positive_int,
    run_main,
    unit_fraction,
)
from doublesparse.channels import (
    default_channels,
    load_channels,
    packaged_config_path,
    read_config,
    recorded_modes,
)
from doublesparse.attention.k_rotation import ROTATION_CHOICES
from doublesparse.engine import operating_point
from doublesparse.engine.operating_point import OperatingPoint
from doublesparse.version import __version__

from . import measure, report, retrieval
from .settings import (
    BASELINE,
    DENSE,
    Setting,
    default_setting,
    grid,
    improvements,
    preset,
    unique,
    with_kv,
)

# (window_len, decode_len, num_windows, retrieval lens, depths, trials per cell); None = model ctx
PRESETS = {
    "small": dict(window_len=1024, decode_len=32, num_windows=1, retrieval_lens=[1024],
                  retrieval_depths=[0.0, 0.5, 1.0], retrieval_trials=1),
    # the full protocol: 8 windows x 255 scored tokens, 20 trials per depth at 2K/4K/8K (GPU)
    "full": dict(window_len=None, decode_len=256, num_windows=8, retrieval_lens=[2048, 4096, 8192],
                 retrieval_depths=[0.0, 0.25, 0.5, 0.75, 1.0], retrieval_trials=20),
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="doublesparse eval", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="model file/dir (default: embedded SmolLM2)")
    p.add_argument("--tiny", action="store_true", help="use the built-in tiny random model (CI smoke run)")
    p.add_argument("--channels", default=None,
                   help="channel config (default: the packaged one for the model, else weight-based)")
    p.add_argument("--output-dir", "-o", default=None,
                   help="folder for results.json, table.md and plot.png "
                        "(default: ./doublesparse-eval/<date>-<time>)")
    p.add_argument("--small", action="store_true", help="CPU/CI preset (few settings, short contexts)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="model dtype (default: loader's: fp32 CPU, bf16 CUDA)")
    p.add_argument("--window-len", type=positive_int, default=None,
                   help="tokens per text window (default: the preset's; full: the model's context)")
    p.add_argument("--decode-len", type=positive_int, default=None,
                   help="last tokens of each window decoded (default: the preset's)")
    p.add_argument("--num-windows", type=positive_int, default=None, help="text windows (default: the preset's)")
    p.add_argument("--batch-windows", type=nonnegative_int, default=0, help="windows per decode forward (0: all)")
    p.add_argument("--retrieval-lens", type=positive_int, nargs="*", default=None,
                   help="retrieval context lengths (default: the preset's)")
    p.add_argument("--retrieval-depths", type=unit_fraction, nargs="*", default=None,
                   help="pass-key depths in [0, 1] (default: the preset's)")
    p.add_argument("--retrieval-trials", type=positive_int, default=None,
                   help="trials per length and depth (default: the preset's)")
    p.add_argument("--retrieval-seed", type=int, default=0,
                   help="seed of the pass keys (runs with different seeds give independent trials)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE", help="eval text (default: eval plays)")
    p.add_argument("--types", nargs="+", default=None, help="override the grid: channel types")
    p.add_argument("--modes", nargs="+", default=None)
    p.add_argument("--rs", type=int, nargs="+", default=None)
    p.add_argument("--k-fracs", type=float, nargs="+", default=None)
    p.add_argument("--settings", nargs="+", default=None, metavar="NAME",
                   help="run only dense, the default and these settings of the preset (names as in the report)")
    p.add_argument("--default-only", action="store_true",
                   help="only dense and the engine's default Double Sparsity setting")
    p.add_argument("--label-dtypes", nargs="+", default=None, choices=LABEL_DTYPES,
                   help="the engine's default setting once with each of these label dtypes, the first "
                        "in the default's place (default: the dtype the engine picks on --device)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=None, choices=KV_CACHE_DTYPES,
                   help="dense and the engine's default once per K/V cache dtype (the engine's "
                        "--kv-cache-dtype; each prefilled through its own cache), in this order; dense with "
                        "the model's cache (auto) runs too, the reference of KL and top-1 (default: auto)")
    p.add_argument("--kv-cache-k-rotation", choices=ROTATION_CHOICES, default="auto",
                   help="the engine's flag: auto rotates q and K per KV head before an fp8 cache stores "
                        "K (Hadamard blocks; docs/accuracy.md), none stores K as it is")
    p.add_argument("--no-text", action="store_true")
    p.add_argument("--no-retrieval", action="store_true")
    p.add_argument("--no-fidelity", action="store_true", help="skip per-layer attention fidelity")
    p.add_argument("--fidelity-stride", type=positive_int, default=1,
                   help="attention fidelity on every n-th decoded token only (it is the costly part)")
    p.add_argument("--quiet", action="store_true")
    return p


def load_model_for_eval(args):
    if args.tiny:
        from doublesparse.testing import ByteTokenizer, tiny_llama
        dtype = getattr(torch, args.dtype) if args.dtype else torch.float32
        return tiny_llama(max_position_embeddings=8192, device=args.device, dtype=dtype), ByteTokenizer()
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
        key = (s.channel_type, s.mode, s.layer_modes, s.r)
        if key not in cache:
            cache[key] = (load_channels(path, c, s.channel_type, s.r, s.layer_modes or s.mode) if path
                          else default_channels(model, s.r, s.channel_type))
        return cache[key]

    return channels_for, (str(path) if path else "weight-based default_channels")


def recorded_layer_modes(args, model) -> tuple[str, ...]:
    """The per-layer selection modes the channel config records (what the engine's default
    runs), or () when it records none."""
    c = model.config
    path = args.channels or packaged_config_path(getattr(c, "name", None))
    return (recorded_modes(read_config(path), int(c.num_layers)) or ()) if path else ()


def model_point(args, model) -> OperatingPoint:
    """The operating point the engine would run for ``model`` with this channel config: the
    config's calibrated one, else the model's shape default."""
    c = model.config
    path = args.channels or packaged_config_path(getattr(c, "name", None))
    raw = read_config(path) if path else None
    L = int(c.num_layers)
    return operating_point.resolve(raw, int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim), L,
                                   recorded_modes(raw, L) if raw else None, getattr(c, "mla", None) is not None)


def settings_for(args, head_dim: int = 64, max_context: int | None = None,
                 layer_modes: tuple[str, ...] = (), k_bias: bool = False, point=None) -> list[Setting]:
    """Dense, the engine's default (with the label dtype the engine picks on ``args.device`` for
    a model with or without a K bias, ``k_bias``; both once per ``--kv-cache-dtypes`` entry), then
    the preset or the ``--types/--modes/--rs/--k-fracs`` grid with the improvement variants of
    group_sum (with the model's cache); each setting once."""
    if any(x is not None for x in (args.types, args.modes, args.rs, args.k_fracs)):
        g = grid(args.types or ("q", "k", "qk"), args.modes or ("per_head", "group_sum", "group_max"),
                 args.rs or (8, 16, 32), args.k_fracs or (1 / 32, 1 / 16, 1 / 8))
        body = g + [BASELINE] + improvements(BASELINE)
    else:
        body = preset("small" if args.small else "full")
    default = default_setting(head_dim, max_context, layer_modes, getattr(args, "device", "cpu"), k_bias, point)
    labels = getattr(args, "label_dtypes", None) or [default.label]
    first = [DENSE] + [replace(default, label=x) for x in dict.fromkeys(labels)]
    first = with_kv(first, dict.fromkeys(getattr(args, "kv_cache_dtypes", None) or ["auto"]))
    if getattr(args, "default_only", False):
        return first
    names = getattr(args, "settings", None)
    if names:
        unknown = set(names) - {s.name for s in body}
        if unknown:
            raise SystemExit(f"unknown settings {sorted(unknown)}; known: {[s.name for s in body]}")
        body = [s for s in body if s.name in names]
    return unique(first + body)


def resolve_lengths(args, ctx: int) -> dict:
    """Window / decode / retrieval sizes from the preset, overridden by the flags; lengths are
    clipped to the model window (retrieval keeps room for the answer)."""
    pr = PRESETS["small" if args.small else "full"]
    val = lambda name: getattr(args, name) if getattr(args, name, None) is not None else pr[name]  # noqa: E731
    lens = [min(n, ctx - retrieval.ANSWER_TOKENS) for n in
            (val("retrieval_lens") or [n for n in (1024, 2048, 4096, 8192) if n <= ctx] or [ctx])]
    return dict(window_len=min(val("window_len") or ctx, ctx), decode_len=val("decode_len"),
                num_windows=val("num_windows"), lens=sorted(set(lens)), depths=val("retrieval_depths"),
                trials=val("retrieval_trials"))


def eval_windows(args, tokenizer, window_len: int, num_windows: int) -> list[list[int]]:
    ids = [t for txt in read_texts(args.text, EVAL_PLAYS) for t in encode(tokenizer, txt)]
    return measure.split_windows(ids, window_len, num_windows)


def run(args, model=None, tokenizer=None) -> dict:
    t0 = time.perf_counter()
    if model is None:
        model, tokenizer = load_model_for_eval(args)
    c = model.config
    ctx = int(getattr(c, "max_position_embeddings", 4096))
    L = resolve_lengths(args, ctx)
    window_len, decode_len, num_windows, lens = L["window_len"], L["decode_len"], L["num_windows"], L["lens"]
    point = model_point(args, model)
    settings = settings_for(args, int(c.head_dim), int(c.max_position_embeddings),
                            recorded_layer_modes(args, model), bool(getattr(c, "attention_bias", False)), point)
    channels_for, source = channel_source(args, model)
    progress = not args.quiet
    dims = (int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim))
    text_res = ret_res = None
    if not args.no_text:
        windows = eval_windows(args, tokenizer, window_len, num_windows)
        res = measure.evaluate_text(model, windows, decode_len, settings, channels_for, device=args.device,
                                    fidelity=not args.no_fidelity, batch_windows=args.batch_windows,
                                    progress=progress, fidelity_stride=args.fidelity_stride,
                                    k_rotation=getattr(args, "kv_cache_k_rotation", "auto"))
        text_res = {r.setting: r for r in res}
    if not args.no_retrieval:
        trials = retrieval.make_trials(tokenizer, lens, L["depths"], L["trials"],
                                       seed=getattr(args, "retrieval_seed", 0))
        ret_res = retrieval.evaluate_retrieval(model, tokenizer, trials, settings, channels_for,
                                               device=args.device, progress=progress,
                                               k_rotation=getattr(args, "kv_cache_k_rotation", "auto"))
    # bytes are quoted at the text window, or at the longest retrieval context without text
    bytes_ctx = window_len if text_res is not None else max(lens)
    # top-p settings: bytes at the tokens measured per row (text only), else at their upper bound
    measured = {s: r.extra["avg_k"] for s, r in (text_res or {}).items() if s.top_p and "avg_k" in r.extra}
    rows = report.rows(settings, lambda s: s.bytes_per_step(bytes_ctx, *dims, k=measured.get(s)), text_res, ret_res)
    name = getattr(c, "name", "model")
    notes = run_notes(name, source, args.device, L, bytes_ctx, text_res is not None, ret_res is not None,
                      getattr(args, "retrieval_seed", 0), any(s.kv != "auto" for s in settings),
                      getattr(args, "kv_cache_k_rotation", "auto"))
    notes.append(f"default: the engine's {point.describe()}")
    title = f"Double Sparsity eval: {name}"
    result = {"tool": f"doublesparse {__version__}", "model": name, "channels": source,
              "operating_point": point.as_dict(),
              "window_len": window_len, "decode_len": decode_len, "num_windows": num_windows,
              "retrieval_lens": lens, "retrieval_depths": L["depths"], "retrieval_trials": L["trials"],
              "retrieval_seed": getattr(args, "retrieval_seed", 0),
              "kv_cache_k_rotation": getattr(args, "kv_cache_k_rotation", "auto"),
              "retrieval_answers": {s.name: v["answers"] for s, v in (ret_res or {}).items()},
              "seconds": round(time.perf_counter() - t0, 1)}
    result = report.write_outputs(args.output_dir, rows, title, notes, result)
    if progress:
        print(report.markdown(rows, title, notes), file=sys.stderr)
    return result


def run_notes(name, source, device, L: dict, bytes_ctx: int, text: bool, ret: bool, seed: int = 0,
              kv: bool = False, k_rotation: str = "auto") -> list[str]:
    """The notes of a run's table; ``kv``: some settings have their own K/V cache dtype."""
    notes = [f"model: {name}; channels: {source}; device: {device}"]
    if text:
        notes.append(f"text: {L['num_windows']} window(s) of {L['window_len']} tokens from the eval plays; "
                     f"the last {L['decode_len'] - 1} tokens decoded (prefix prefilled densely), "
                     f"each scored on its successor")
    if ret:
        notes.append(f"retrieval: context lengths {L['lens']}, depths {L['depths']}, {L['trials']} trial(s) "
                     f"per cell, pass-key seed {seed}; k = k_frac x context")
    notes.append(f"bytes per step at context {bytes_ctx}, K/V and labels as bf16 (labels of '/fp8' settings "
                 f"and K/V of '/kv:fp8_*' settings as fp8, 1 byte); sink/recent capped at "
                 f"k/8 and k/4 (as the engine's default)")
    if kv:
        rot = ("q and K rotated per KV head (Hadamard blocks over all D; Double Sparsity's labels and label "
               "scores unrotated)" if k_rotation != "none" else "K not rotated")
        notes.append("'/kv:...' settings: K/V stored in that dtype (fp8: scale 1.0, the engine's default "
                     f"without checkpoint scales; {rot}, --kv-cache-k-rotation {k_rotation}), prefilled and "
                     "decoded through it; KL and top-1 against dense with the model's cache")
    return notes


def default_output_dir() -> Path:
    """A new folder per run, so runs never overwrite each other."""
    return Path("doublesparse-eval") / time.strftime("%Y%m%d-%H%M%S")


def check_args(args) -> None:
    """Check the flags that name files, folders and devices before the model loads; fills in
    the default output folder."""
    if not args.tiny:
        preflight.check_model_path(args.model_path)
    preflight.check_device(args.device)
    if args.channels:
        preflight.check_json_file(args.channels, "--channels", "give a channel config written by `doublesparse calibrate`, "
                        "or leave the flag out for the packaged or weight-based channels")
    preflight.check_input_files(args.text, "--text")
    if args.no_text and args.no_retrieval:
        raise UsageError("--no-text and --no-retrieval leave nothing to evaluate; drop one of them")
    args.output_dir = str(preflight.check_output_dir(args.output_dir or default_output_dir(), "--output-dir"))


def main(argv: list[str] | None = None) -> int:
    return run_main("doublesparse eval", _main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    result = run(args)
    out = Path(args.output_dir)
    files = [n for n in ("results.json", "table.md", "plot.png") if (out / n).is_file()]
    print(f"doublesparse eval: wrote {', '.join(files)} to {out}/ ({result['seconds']} s)")
    return 0
