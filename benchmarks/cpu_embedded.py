"""The embedded default on a CPU: our decode vs Hugging Face transformers' ``generate``, side by
side, and the engine's load time.

    python benchmarks/cpu_embedded.py --output FILE.json [--runs 3] [--new-tokens 64]

One process loads both models from the embedded SmolLM2-135M GGUF (ours through the engine with
its defaults: Double Sparsity on, float32; transformers through ``gguf_file=``, float32, SDPA),
builds the default prompt of ``doublesparse generate`` (~6K tokens, chat-templated), and then
alternates the two for ``--runs`` rounds: each decodes ``--new-tokens`` tokens greedily from the
same prompt ids (no early stop). Decode tokens/s of a run = (tokens - 1) / (time from the first
token to the last); prefill is timed apart. transformers runs once per thread count of
``--hf-threads`` ("all" = torch's default; our engine picks its own: all threads for prefill,
one per decoding request); ``hf_decode_tok_s`` is the best of them. Load time: a fresh
``python -m doublesparse.generate``-style process builds the engine ``--runs`` times after one
warm-up build (so the converted-weights cache exists), timed inside the process.

``--float-weights-too``: a second engine built with ``disable_cpu_packed_weights`` (decode
through the float32 weights, bit-exact) joins every round, so the packed copies' speed-up and
their greedy tokens against float32 are measured side by side (``float_decode_tok_s``,
``greedy_tokens_equal_float``, ``greedy_prefix_equal_float``).

Writes ``{"summary": {...}, "runs": [...], "load_runs": [...], "texts": {...}}``; the summary
holds medians: ``decode_tok_s``, ``hf_decode_tok_s`` (and per thread count), ``prefill_tok_s``,
``hf_prefill_tok_s``, ``load_s``, ``decode_over_hf``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_LOAD_PROBE = ("import time; t=time.perf_counter(); from doublesparse.engine import Engine; "
               "from doublesparse.config import EngineConfig; t1=time.perf_counter(); "
               "Engine(EngineConfig(enable_double_sparsity=True), progress=False); "
               "print(time.perf_counter()-t1)")


def load_times(runs: int) -> list[float]:
    """Seconds to build the default engine in a fresh process (imports excluded), after a warm-up."""
    out = []
    for i in range(runs + 1):
        res = subprocess.run([sys.executable, "-c", _LOAD_PROBE], capture_output=True, text=True, check=True)
        if i:
            out.append(float(res.stdout.strip().splitlines()[-1]))
    return out


def ours(engine, ids: list[int], n: int) -> dict:
    from doublesparse.engine import SamplingParams

    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    engine.flush_cache()  # every round is a first request (the prefix cache would skip its prefill)
    rid = engine.add_request(ids, sp)
    t0 = time.perf_counter()
    stamps, cpu, toks = [], [], []
    while True:
        outs = [o for o in engine.step() if o.request_id == rid]
        now, c = time.perf_counter(), time.process_time()
        for o in outs:
            stamps += [now] * len(o.new_token_ids)
            cpu += [c] * len(o.new_token_ids)
            toks += o.new_token_ids
        if any(o.finished for o in outs):
            break
    return _rates(t0, stamps, cpu, len(ids), toks)


def hf(model, ids: list[int], n: int, threads: int | None) -> dict:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t, self.cpu, self.toks, self.first = [], [], [], True

        def put(self, value):
            if self.first:  # generate hands the prompt over first
                self.first = False
                return
            self.t.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.toks += value.flatten().tolist()

        def end(self):
            pass

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        s = Stamps()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           streamer=s, pad_token_id=0)
    finally:
        torch.set_num_threads(old)
    return _rates(t0, s.t, s.cpu, len(ids), s.toks)


def _rates(t0: float, stamps: list[float], cpu: list[float], prompt: int, toks: list[int]) -> dict:
    """Wall-clock rates, and the process's CPU time per decoded token (all its threads): on a
    shared machine the wall clock depends on the other processes, CPU time much less."""
    n = len(stamps)
    return {"prompt_tokens": prompt, "new_tokens": n, "prefill_s": stamps[0] - t0,
            "prefill_tok_s": prompt / (stamps[0] - t0),
            "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else None,
            "decode_cpu_ms_per_tok": 1e3 * (cpu[-1] - cpu[0]) / (n - 1) if n > 1 else None, "token_ids": toks}


def table(doc: dict) -> list[str]:
    """Markdown lines: the runs, then the first run's answers."""
    s = doc["summary"]

    def f(v):
        return "" if v is None else f"{v:.2f}"

    head = (f"Prompt {s['prompt_tokens']} tokens, {s['new_tokens']} new tokens (greedy), {s['runs']} rounds; "
            f"decode {f(s['decode_tok_s'])} tok/s vs transformers {f(s.get('hf_decode_tok_s'))} tok/s "
            f"(best thread count); load {f(s['load_s'])} s.")
    if s.get("float_decode_tok_s") is not None:
        head += (f" With the float32 weights (--disable-cpu-packed-weights): decode {f(s['float_decode_tok_s'])} tok/s; "
                 f"greedy tokens equal to them for the first {s['greedy_prefix_equal_float']} of {s['new_tokens']}.")
    out = [head, "",
           "| round | impl | threads | prefill tok/s | decode tok/s | decode CPU ms/token |", "|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        out.append(f"| {r['round']} | {r['impl']} | {r.get('threads', 'engine')} | {f(r['prefill_tok_s'])} | "
                   f"{f(r['decode_tok_s'])} | {f(r.get('decode_cpu_ms_per_tok'))} |")
    out += ["", "Load runs (s): " + ", ".join(f(x) for x in doc["load_runs"]), ""]
    for k, v in doc.get("texts", {}).items():
        out += [f"{k}: {v!r}", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--float-weights-too", action="store_true",
                   help="also run the engine with --disable-cpu-packed-weights in every round")
    p.add_argument("--hf-threads", default="1,all",
                   help="comma-separated thread counts for transformers; 'none': measure ours only")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from doublesparse.assets import smollm2_gguf_path
    from doublesparse.config import EngineConfig
    from doublesparse.engine import Engine
    from doublesparse.generate import build_parser, build_prompt

    loads = load_times(a.runs)
    engine = Engine(EngineConfig(enable_double_sparsity=True), progress=False)
    exact = (Engine(EngineConfig(enable_double_sparsity=True, disable_cpu_packed_weights=True), progress=False)
             if a.float_weights_too else None)
    ids = build_prompt(engine.tokenizer, build_parser().parse_args([]), engine.max_context_len)
    threads = [] if a.hf_threads == "none" else [None if t == "all" else int(t) for t in a.hf_threads.split(",")]
    if threads:
        gguf = smollm2_gguf_path()
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    runs = []
    for i in range(a.runs):
        runs.append({"round": i, "impl": "doublesparse", **ours(engine, ids, a.new_tokens)})
        if exact is not None:
            runs.append({"round": i, "impl": "doublesparse-float", **ours(exact, ids, a.new_tokens)})
        for t in threads:
            runs.append({"round": i, "impl": "transformers", "threads": t or torch.get_num_threads(),
                         **hf(model, ids, a.new_tokens, t)})

    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    mine = [r for r in runs if r["impl"] == "doublesparse"]
    per_thread = {str(t or torch.get_num_threads()): med([r for r in runs if r["impl"] == "transformers" and
                                                          r["threads"] == (t or torch.get_num_threads())],
                                                         "decode_tok_s") for t in threads}
    theirs = [r for r in runs if r["impl"] == "transformers"]
    cpu_ms = {str(t or torch.get_num_threads()): med([r for r in theirs if r["threads"] == (t or torch.get_num_threads())],
                                                     "decode_cpu_ms_per_tok") for t in threads}
    best_hf = max((v for v in per_thread.values() if v is not None), default=None)
    summary = {"decode_tok_s": med(mine, "decode_tok_s"), "hf_decode_tok_s": best_hf,
               "hf_decode_tok_s_by_threads": per_thread, "prefill_tok_s": med(mine, "prefill_tok_s"),
               "hf_prefill_tok_s": med(theirs, "prefill_tok_s"), "load_s": statistics.median(loads),
               "prompt_tokens": len(ids), "new_tokens": a.new_tokens, "runs": a.runs,
               "torch_threads": torch.get_num_threads(),
               "decode_cpu_ms_per_tok": med(mine, "decode_cpu_ms_per_tok"), "hf_decode_cpu_ms_per_tok_by_threads": cpu_ms}
    summary["decode_over_hf"] = summary["decode_tok_s"] / best_hf if best_hf else None
    texts = {"doublesparse": engine.tokenizer.decode(mine[0]["token_ids"])}
    flt = [r for r in runs if r["impl"] == "doublesparse-float"]
    if flt:
        summary["float_decode_tok_s"] = med(flt, "decode_tok_s")
        summary["float_decode_cpu_ms_per_tok"] = med(flt, "decode_cpu_ms_per_tok")
        a_, b_ = mine[0]["token_ids"], flt[0]["token_ids"]
        summary["greedy_tokens_equal_float"] = a_ == b_
        summary["greedy_prefix_equal_float"] = next((j for j, (x, y) in enumerate(zip(a_, b_)) if x != y), len(a_))
        texts["doublesparse-float"] = engine.tokenizer.decode(b_)
    if theirs:
        summary["greedy_tokens_equal_hf"] = all(r["token_ids"] == theirs[0]["token_ids"] for r in mine)
        texts["transformers"] = engine.tokenizer.decode(theirs[0]["token_ids"])
    for r in runs:
        r.pop("token_ids")
    doc = {"summary": summary, "runs": runs, "load_runs": loads, "texts": texts}
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
