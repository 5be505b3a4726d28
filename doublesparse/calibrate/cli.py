"""``doublesparse calibrate``: rank head channels and choose the operating point on real text, write a channel config.

    python -m doublesparse.calibrate [--output cfg.json] [--model-path P] [--text FILE ...]
        [--num-samples 12] [--seq-len 2048] [--device cpu] [--cpu-threads 0] [--recall-samples 4]
        [--modes group_sum group_max] [--no-operating-point] [--op-kl-target 0.015]
        [--op-seq-len N] [--op-windows 2] [--op-decode-len 128] [--op-full-grid]
        [--from-config cfg.json]

Without ``--output`` the config goes to ``doublesparse-calibrate/<model>-<date>-<time>.json`` in the
current directory; the path is printed. ``--ds-channel-config-path`` of ``generate``/``serve`` reads it.
The operating point (label channels, token budget, selection, sink/recent, top-p) is the cheapest
measured candidate whose KL to dense stays under ``--op-kl-target`` (:mod:`.frontier`);
``--from-config`` measures only that, keeping an existing config's rankings.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from doublesparse import preflight
from doublesparse.cli_common import (
    Parser,
    UsageError,
    nonnegative_int,
    positive_int,
    run_main,
)

from ..channels import META_KEY, MODES, read_config, save_config
from .frontier import DECODE_LEN, KL_TARGET, NUM_WINDOWS, SEQ_LEN_CPU, SEQ_LEN_GPU, OpSettings
from .pipeline import OP_KEY, RECALL_SAMPLES, build_config, point_for_config
from .recall import CANDIDATES
from ..texts import CALIBRATION_PLAYS, read_texts
from ..version import __version__


def positive_float(text: str) -> float:
    """argparse ``type``: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < v < float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return v


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
                   help="windows on which each selection mode's attention recall is measured; its "
                        "per-layer choice is recorded, and is one candidate of the operating point "
                        "(0: none)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(CANDIDATES),
                   help="selection modes a layer may get (default: the two that read the same bytes; "
                        "per_head reads num_q_heads / num_kv_heads times the K/V)")
    p.add_argument("--operating-point", action=argparse.BooleanOptionalAction, default=True,
                   help="after the rankings, measure candidate operating points on held-apart text and "
                        "record the cheapest under --op-kl-target (the engine's default for the model)")
    p.add_argument("--op-kl-target", type=positive_float, default=KL_TARGET,
                   help="KL(dense || DS) in nats per token the point must stay under (0.015: about +1.5 %% "
                        "perplexity)")
    p.add_argument("--op-seq-len", type=positive_int, default=None,
                   help=f"tokens per measured window (default: {SEQ_LEN_GPU} on a GPU, {SEQ_LEN_CPU} on a CPU; "
                        f"capped at the model's context; longer is less conservative for long requests "
                        f"and slower)")
    p.add_argument("--op-windows", type=positive_int, default=NUM_WINDOWS, help="measured windows")
    p.add_argument("--op-decode-len", type=positive_int, default=DECODE_LEN,
                   help="last tokens of each window decoded through the sparse path and scored")
    p.add_argument("--op-full-grid", action="store_true",
                   help="measure every budget candidate, not only up to the cheapest under the target")
    p.add_argument("--from-config", default=None, metavar="CFG.json",
                   help="keep this config's rankings and modes (written by `doublesparse calibrate` on the "
                        "same text) and measure only the operating point")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def op_settings(args) -> OpSettings | None:
    """The operating point's measurement settings, or None with ``--no-operating-point``."""
    if not getattr(args, "operating_point", True):
        return None
    try:
        return OpSettings(getattr(args, "op_kl_target", KL_TARGET), getattr(args, "op_seq_len", None),
                          getattr(args, "op_windows", NUM_WINDOWS), getattr(args, "op_decode_len", DECODE_LEN),
                          getattr(args, "op_full_grid", False))
    except ValueError as e:
        raise UsageError(f"--op-*: {e}") from None


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
        "tool": f"doublesparse {__version__}",
        "command": "doublesparse calibrate " + " ".join(shlex.quote(a) for a in (argv_for_meta or [])),
        "device": str(args.device),
    }
    op = op_settings(args)
    threads = getattr(args, "cpu_threads", 0)
    if getattr(args, "from_config", None):
        cfg = point_for_config(read_config(args.from_config), model, tokenizer, texts, op, args.device,
                               progress=not args.quiet, cpu_threads=threads)
    else:
        cfg = build_config(model, tokenizer, texts, args.num_samples, args.seq_len, args.device,
                           progress=not args.quiet, cpu_threads=threads,
                           recall_samples=getattr(args, "recall_samples", RECALL_SAMPLES),
                           candidates=tuple(getattr(args, "modes", None) or CANDIDATES), meta=meta, op=op)
    if OP_KEY in cfg:
        cfg[OP_KEY]["command"] = meta["command"]
    if args.output is None:
        args.output = str(default_output(cfg[META_KEY]["model"]))
    save_config(cfg, args.output)
    m = cfg[META_KEY]
    if OP_KEY in cfg:
        _print_point(cfg[OP_KEY])
    sel = m.get("selection")
    if sel and not getattr(args, "from_config", None):
        counts = {k: sel["per_layer"].count(k) for k in dict.fromkeys(sel["per_layer"])}
        what = "attention recall's per-layer modes (a candidate)" if OP_KEY in cfg else "selection modes"
        print(f"{what}: " + ", ".join(f"{k} x{n}" for k, n in counts.items())
              + "; mean recall " + ", ".join(f"{k} {v:.4f}" for k, v in sel["recall_mean"].items())
              + f", chosen {sel['recall_chosen_mean']:.4f}", file=sys.stderr)
    print(f"calibrated {m['model']} on {m['tokens_per_layer']} tokens in {m['seconds']:.1f}s "
          f"-> {Path(args.output)}", file=sys.stderr)
    return cfg


def _print_point(rec: dict) -> None:
    c = rec["chosen"]
    met = "under" if rec["target_met"] else "NOT under (none was; the lowest KL is used)"
    print(f"operating point: {c['setting']} ({c['ds_selection_mode']}), {c['bytes_fraction']:.3f} x dense "
          f"bytes, KL {c['kl']:.4f} {met} the target {rec['kl_target']:g}, top-1 {c['top1']:.3f}, "
          f"perplexity {c['ppl_increase_pct']:+.2f} % at {rec['measured_on']['seq_len']} tokens; "
          f"{len(rec['frontier'])} points measured in {rec['measured_on']['seconds']:.0f}s", file=sys.stderr)


def default_output(model_name: str | None) -> Path:
    """A new file per run (named after the model), so runs never overwrite each other."""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in (model_name or "model"))
    return Path("doublesparse-calibrate") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def check_args(args) -> None:
    """Check the flags that name files, folders and devices before the model loads."""
    preflight.check_model_path(args.model_path)
    preflight.check_device(args.device)
    preflight.check_input_files(args.text, "--text")
    if getattr(args, "from_config", None):
        preflight.check_json_file(args.from_config, "--from-config",
                                  "give a channel config written by `doublesparse calibrate`")
        if not getattr(args, "operating_point", True):
            raise UsageError("--from-config measures the operating point; it contradicts --no-operating-point")
    op_settings(args)
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
