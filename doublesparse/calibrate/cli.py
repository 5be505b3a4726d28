"""``doublesparse calibrate``: rank each layer's head channels on real text, write a channel config.

    python -m doublesparse.calibrate [--output cfg.json] [--model-path P] [--text FILE ...]
        [--num-samples 12] [--seq-len 2048] [--device cpu] [--cpu-threads 0] [--recall-samples 4]
        [--modes group_sum group_max]

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

from .channels import META_KEY, MODES, save_config
from .pipeline import RECALL_SAMPLES, build_config
from .recall import CANDIDATES
from .texts import CALIBRATION_PLAYS, read_texts


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
    p.add_argument("--recall-samples", type=nonnegative_int, default=RECALL_SAMPLES,
                   help="windows on which each selection mode's attention recall is measured to choose "
                        "every layer's mode (0: record no modes)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(CANDIDATES),
                   help="selection modes a layer may get (default: the two that read the same bytes; "
                        "per_head reads num_q_heads / num_kv_heads times the K/V)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


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
    meta = {
        "texts": [str(t) for t in args.text] if args.text else list(CALIBRATION_PLAYS),
        "tool": f"doublesparse {doublesparse.__version__}",
        "command": "doublesparse calibrate " + " ".join(shlex.quote(a) for a in (argv_for_meta or [])),
        "device": str(args.device),
    }
    cfg = build_config(model, tokenizer, texts, args.num_samples, args.seq_len, args.device,
                       progress=not args.quiet, cpu_threads=getattr(args, "cpu_threads", 0),
                       recall_samples=getattr(args, "recall_samples", RECALL_SAMPLES),
                       candidates=tuple(getattr(args, "modes", None) or CANDIDATES), meta=meta)
    if args.output is None:
        args.output = str(default_output(cfg[META_KEY]["model"]))
    save_config(cfg, args.output)
    m = cfg[META_KEY]
    sel = m.get("selection")
    if sel:
        counts = {k: sel["per_layer"].count(k) for k in dict.fromkeys(sel["per_layer"])}
        print("selection modes: " + ", ".join(f"{k} x{n}" for k, n in counts.items())
              + "; mean recall " + ", ".join(f"{k} {v:.4f}" for k, v in sel["recall_mean"].items())
              + f", chosen {sel['recall_chosen_mean']:.4f}", file=sys.stderr)
    print(f"calibrated {m['model']} on {m['tokens_per_layer']} tokens in {m['seconds']:.1f}s "
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
