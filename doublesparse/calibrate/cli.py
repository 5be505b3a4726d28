"""``doublesparse calibrate``: rank each layer's head channels on real text, write a channel config.

    python -m doublesparse.calibrate [--output cfg.json] [--model-path P] [--text FILE ...]
        [--num-samples 12] [--seq-len 2048] [--device cpu] [--cpu-threads 0]

Without ``--output`` the config goes to ``doublesparse-calibrate/<model>-<date>-<time>.json`` in the
current directory; the path is printed. ``--ds-channel-config-path`` of ``generate``/``serve`` reads it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import doublesparse
from doublesparse import preflight
from doublesparse.cli_common import (
    Parser,
    UsageError,
    nonnegative_int,
    positive_int,
    run_main,
)

from .channels import save_config, stats_to_config
from .stats import collect_stats, sample_windows
from .texts import CALIBRATION_PLAYS, encode, read_texts, text_hash

STATISTIC = "mean over tokens of |q|, |k|, |q*k| per channel, post-RoPE (k repeated over its group)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="doublesparse calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="model file/dir (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--output", "-o", default=None,
                   help="channel config JSON to write (default: ./doublesparse-calibrate/<model>-<date>-<time>.json)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="calibration text files (default: the fixed calibration plays)")
    p.add_argument("--num-samples", type=positive_int, default=12, help="windows of text to run")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per window")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--cpu-threads", type=nonnegative_int, default=0,
                   help="intra-op threads; 0 (default): per sample, whichever of torch's count and 1 "
                        "measured faster (on a shared machine 1 thread often wins)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def calibrate(model, tokenizer, texts: list[str], num_samples: int, seq_len: int, device="cpu",
              progress: bool = True, cpu_threads: int = 0) -> dict:
    """Statistics over ``num_samples`` windows of ``seq_len`` tokens of the concatenated texts."""
    ids: list[int] = []
    for t in texts:
        ids += encode(tokenizer, t)
    windows = sample_windows(ids, num_samples, seq_len)
    stats = collect_stats(model, windows, device=device, progress=progress, cpu_threads=cpu_threads)
    stats["text_tokens"] = len(ids)
    return stats


def run(args, model=None, tokenizer=None, argv_for_meta=None) -> dict:
    """Calibrate and write ``args.output``; returns the config dict. ``model``/``tokenizer`` may be
    passed in (tests, notebooks); otherwise they are loaded from ``args.model_path``."""
    if model is None or tokenizer is None:
        from doublesparse.models import load_model, load_tokenizer
        model = load_model(args.model_path, progress=not args.quiet) if model is None else model
        tokenizer = load_tokenizer(args.model_path) if tokenizer is None else tokenizer
    if hasattr(model, "to"):
        model = model.to(args.device)
    if hasattr(model, "eval"):
        model.eval()
    texts = read_texts(args.text)
    t0 = time.perf_counter()
    stats = calibrate(model, tokenizer, texts, args.num_samples, args.seq_len, args.device,
                      progress=not args.quiet, cpu_threads=getattr(args, "cpu_threads", 0))
    elapsed = time.perf_counter() - t0
    c = model.config
    meta = {
        "model": getattr(c, "name", None),
        "num_layers": int(c.num_layers), "num_q_heads": int(c.num_q_heads),
        "num_kv_heads": int(c.num_kv_heads), "head_dim": int(c.head_dim),
        "statistic": STATISTIC,
        "group_aggregates": {"_kv": "sum over the KV head's query heads", "_kvmax": "max over them"},
        "texts": [str(t) for t in args.text] if args.text else list(CALIBRATION_PLAYS),
        "text_sha256_16": text_hash(texts), "text_tokens": int(stats["text_tokens"]),
        "num_samples": args.num_samples, "seq_len": args.seq_len,
        "tokens_per_layer": int(stats["tokens"][0]),
        "tool": f"doublesparse {doublesparse.__version__}",
        "command": "doublesparse calibrate " + " ".join(shlex.quote(a) for a in (argv_for_meta or [])),
        "device": str(args.device), "seconds": round(elapsed, 1),
        "threads_per_sample": [int(n) for n in stats.get("threads", [])],
    }
    cfg = stats_to_config(stats, meta)
    if args.output is None:
        args.output = str(default_output(meta["model"]))
    save_config(cfg, args.output)
    print(f"calibrated {meta['model']} on {meta['tokens_per_layer']} tokens in {elapsed:.1f}s "
          f"-> {Path(args.output)}", file=sys.stderr)
    return cfg


def default_output(model_name: str | None) -> Path:
    """A new file per run (named after the model), so runs never overwrite each other."""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in (model_name or "model"))
    return Path("doublesparse-calibrate") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def check_args(args) -> None:
    """Check the flags that name files, folders and devices before the model loads."""
    preflight.check_model_path(args.model_path)
    preflight.check_device(args.device)
    preflight.check_input_files(args.text, "--text")
    out = Path(args.output) if args.output else default_output(None)
    if out.is_dir():
        raise UsageError(f"--output {args.output}: a folder; give the JSON file to write")
    preflight.check_output_dir(out.parent, "--output")


def main(argv: list[str] | None = None) -> int:
    return run_main("doublesparse calibrate", _main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    run(args, argv_for_meta=argv)
    return 0
