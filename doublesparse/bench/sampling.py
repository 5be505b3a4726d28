"""What the sampling step's extras cost on the device: logprobs, penalties, min_p, logit_bias,
min_tokens' masks and grammar masks, against plain sampling, per batch size. One timed step is
what ``engine.request.sample_isolated`` runs for a batch (``sampler.sample_requests``)
plus the copy of its tokens (and logprobs) to the host; the model's forward is not in it.

    python -m doublesparse.bench.sampling [--vocab 128256] [--batch-sizes 1 16 64]
                                          [--iters 30] [--json F] [--md F]

The grammar rows use the embedded SmolLM2 tokenizer's vocabulary (ids past it are masked) with a
JSON-object grammar whose matchers stand inside a string value, its most permissive state;
``json-object`` is ``response_format`` json_object 40 tokens before its budget ends (every step
then also restricts the tokens to those that leave room to close).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from ..engine.sampler import RequestSampling, make_generator, needs_state, sample_requests
from ..engine.sampling_params import SamplingParams

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
CONFIGS = {
    "greedy": {"temperature": 0.0},
    "sampled": SAMPLED,
    "logprobs-5": {**SAMPLED, "logprobs": 5},
    "penalties": {**SAMPLED, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                  "presence_penalty": 0.5},
    "min-p": {**SAMPLED, "min_p": 0.05},
    "json-grammar": {**SAMPLED, "json_schema": '{"type": "object"}'},
    "json-object": {**SAMPLED, "json_object": True, "max_new_tokens": 40},
    "logit-bias-100": {**SAMPLED, "logit_bias": {i: 1.0 for i in range(0, 1000, 10)}},
    "min-tokens": {**SAMPLED, "min_tokens": 1000},
    "all-but-grammar": {**SAMPLED, "logprobs": 5, "repetition_penalty": 1.1,
                        "frequency_penalty": 0.5, "min_p": 0.05},
}


def _grammar(vocab: int):
    from ..engine.grammar import GrammarBackend
    from ..models.loader import load_tokenizer

    tok = load_tokenizer(None)
    return GrammarBackend(tok, vocab, [tok.eos_token_id])


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_config(name: str, B: int, V: int, dev: torch.device, iters: int, grammar) -> float:
    """Median milliseconds of one sampling step of B requests with CONFIGS[name]."""
    g = torch.Generator().manual_seed(B)
    logits = (torch.randn(B, V, generator=g) * 3).to(dev)
    sp = SamplingParams(**{"max_new_tokens": 1024, **CONFIGS[name]})
    reqs = []
    for i in range(B):
        prompt = torch.randint(0, V, (1000,), generator=g).tolist()
        state = RequestSampling(sp, prompt, V, dev, grammar, stop_ids=(0, 1, 2)) \
            if needs_state(sp) else None
        if state is not None and state.matcher is not None:
            state.matcher.accept_string('{"text": "')
        reqs.append(SimpleNamespace(params=sp, sampling=state,
                                    generator=None if sp.greedy else make_generator(i, dev)))
    times = []
    for it in range(iters + 3):
        _sync(dev)
        t0 = time.perf_counter()
        tokens, lp = sample_requests(logits, reqs, grammar)
        tokens.tolist()
        if lp is not None:
            lp.tolist()
        _sync(dev)
        if it >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256, help="logits width (default: Llama 3's)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=30, help="timed steps per cell (default 30)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--md", default=None, help="write a markdown table here")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    grammar = _grammar(a.vocab) if {"json-grammar", "json-object"} & set(a.configs) else None
    rows = [{"config": c, "batch_size": B, "ms": time_config(c, B, a.vocab, dev, a.iters, grammar)}
            for B in a.batch_sizes for c in a.configs]
    base = {r["batch_size"]: r["ms"] for r in rows if r["config"] == "sampled"}
    for r in rows:
        r["over_sampled_ms"] = r["ms"] - base[r["batch_size"]] if base else None
    summary = {f"{r['config']}_bs{r['batch_size']}_ms": round(r["ms"], 4) for r in rows}
    out = {"device": str(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
           "vocab": a.vocab, "iters": a.iters, "rows": rows, "summary": summary}
    table = ["| config | batch | ms / step | over `sampled` (ms) |", "|---|---:|---:|---:|"]
    table += [f"| {r['config']} | {r['batch_size']} | {r['ms']:.3f} | "
              f"{r['over_sampled_ms']:+.3f} |" if r["over_sampled_ms"] is not None else
              f"| {r['config']} | {r['batch_size']} | {r['ms']:.3f} | |" for r in rows]
    print("\n".join(table))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write("\n".join(table) + "\n")
    return out


if __name__ == "__main__":
    main()
