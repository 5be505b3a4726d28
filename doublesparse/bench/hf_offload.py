"""``python -m doublesparse.bench.hf_offload``: the Hugging Face transformers peer of an offloaded KV
cache, ``generate(..., cache_implementation="offloaded")``, timed per decode step over a list of
context lengths under a time budget.

The model is transformers' own class for the config (``LlamaForCausalLM`` for the Llama family),
built from one of our configs (a shipped name such as ``llama-3.1-8b-1m``, or a config.json; no hub
access) with transformers' random initialisation, on CUDA in bf16 (float32 on CPU). Its cache is
what ``generate`` builds for ``cache_implementation="offloaded"``: ``DynamicCache(config=...,
offloading=True)``, which keeps every layer's K/V in host memory and, at each layer of each forward,
copies the next layer's whole K/V to the GPU on a side stream, appends the new tokens (a
concatenation: a fresh copy) and copies the layer's whole K/V back to host memory.

For each length L (increasing) and ``--batch-size`` B:

1. fill the cache with L tokens per sequence: ``--fill prefill`` runs B random prompts through the
   model in chunks of ``--prefill-chunk`` tokens (the cache offloads as it grows);
   ``--fill random`` writes random K/V ``[B, Hkv, L, D]`` into each layer through the cache's own
   update (so it is offloaded exactly as a prefill leaves it) without running the model: the
   decode step does not depend on the values, and it reaches lengths whose offloaded prefill takes
   hours;
2. time ``--decode-steps`` greedy steps (one token per sequence each, the logits of the last
   position only, the device synchronised around each step); report their median in ms.

A length is run only if its K/V fits the host's available memory and its time, projected from the
previous length at least linearly, fits ``--budget-s`` (and what is left of ``--total-budget-s``,
the cap on the whole sweep); a run that passes its budget stops at its next chunk or step. The
sweep stops at the first length that does not finish, and the summary names the longest that did. ``--result-json`` is rewritten after every length, so a run killed
from outside keeps the lengths it finished.

On CPU (``--device cpu``, e.g. ``--tiny``: the shipped ``tiny-llama`` config) transformers'
offloading cannot run (it needs CUDA streams) and the K/V already lives in host memory: the cache is
the plain ``DynamicCache`` and the result says ``"cache": "dynamic"``.

    python -m doublesparse.bench.hf_offload --model-path llama-3.1-8b-1m --fill random \\
        --lengths 32768 65536 131072 262144 524288 --decode-steps 8 --budget-s 240 --result-json r.json
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

TINY = "tiny-llama"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.hf_offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="llama-3.1-8b", help="a shipped config name or a config.json")
    p.add_argument("--tiny", action="store_true", help=f"the shipped {TINY!r} config (CPU tests)")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192], help="context lengths, increasing")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--fill", choices=("prefill", "random"), default="prefill")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--budget-s", type=float, default=240.0, help="time allowed per length (fill + decode)")
    p.add_argument("--total-budget-s", type=float, default=None,
                   help="time allowed for the whole sweep after the model is built (default: no cap)")
    p.add_argument("--cache", choices=("offloaded", "dynamic"), default="offloaded",
                   help="transformers' cache_implementation (dynamic: the whole cache on the device)")
    p.add_argument("--attn-implementation", default="sdpa")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    return p


def hf_config(model_path: str):
    """transformers' config for one of our configs, by name or path (no hub access)."""
    from transformers import AutoConfig

    from ..models.loader import resolve_model_path
    _, path = resolve_model_path(model_path, "dummy")
    d = json.loads(Path(path).read_text())
    d.pop("_name_or_path", None)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int, attn_implementation: str = "sdpa"):
    """transformers' causal LM for ``config`` with its random initialisation, built on ``device``
    (initialised there: an 8B model on the GPU in seconds), eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, **{key: dtype})
    return model.eval().requires_grad_(False)


def new_cache(config, kind: str, device: torch.device):
    """-> (cache, kind actually used): what ``generate`` builds for ``cache_implementation=kind``."""
    from transformers import DynamicCache

    if kind == "offloaded" and device.type == "cuda":
        return DynamicCache(config=config, offloading=True), "offloaded"
    return DynamicCache(config=config), "dynamic"


def _forward_keys(model) -> tuple[str, str]:
    """The names forward takes the cache and the logits count by (they changed across versions)."""
    params = inspect.signature(model.forward).parameters
    cache = "cache" if "cache" in params else "past_key_values"
    keep = "logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep"
    return cache, keep


class OverBudget(Exception):
    pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(deadline: float) -> None:
    if time.perf_counter() > deadline:
        raise OverBudget


def fill_prefill(model, cache, ids: torch.Tensor, chunk: int, deadline: float) -> torch.Tensor:
    """Prefill ``ids`` [B, L] int64 chunk by chunk; -> the greedy next tokens [B, 1] int64."""
    cache_key, keep_key = _forward_keys(model)
    for s in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, s:s + chunk], use_cache=True, **{cache_key: cache, keep_key: 1})
        _sync(ids.device)  # the deadline counts finished work, not work queued on the device
        _check(deadline)
    return out.logits[:, -1].argmax(-1, keepdim=True)


def fill_random(model, cache, batch: int, length: int, gen: torch.Generator, deadline: float) -> None:
    """Random K/V [B, Hkv, L, D] (std 1, the model's dtype) into every layer through the cache's
    update, in layer order as a prefill writes them."""
    c = model.config.get_text_config(decoder=True)
    hkv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    p = next(model.parameters())
    for layer in range(c.num_hidden_layers):
        k, v = (torch.randn(batch, hkv, length, d, generator=gen, device=p.device, dtype=p.dtype) for _ in range(2))
        cache.update(k, v, layer)
        del k, v
        _sync(p.device)
        _check(deadline)


def decode(model, cache, tok: torch.Tensor, steps: int, deadline: float) -> tuple[list[float], list[int]]:
    """``steps`` greedy decode steps from ``tok`` [B, 1]; -> (each step's ms, sequence 0's tokens)."""
    cache_key, keep_key = _forward_keys(model)
    device = tok.device
    times, out_ids = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=tok, use_cache=True, **{cache_key: cache, keep_key: 1})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        out_ids.append(int(tok[0, 0]))
        _check(deadline)
    return times, out_ids


def kv_bytes(config, batch: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of the K/V of ``batch`` sequences of ``length`` tokens over all layers."""
    c = config.get_text_config(decoder=True)
    hkv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * batch * length * hkv * d * torch.empty((), dtype=dtype).element_size()


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def projected_s(prev: dict | None, length: int) -> float:
    """A lower bound on the next length's time: the last finished one's, scaled linearly (the
    decode step streams the whole cache; an offloaded prefill grows faster than linearly)."""
    if prev is None or prev.get("status") != "ok":
        return 0.0
    return prev["elapsed_s"] * length / prev["length"]


def run_length(model, config, args, device, length: int, cache_kind: str, budget_s: float) -> dict:
    """Fill and decode at one length; a dict with ``status`` "ok", "over_budget" or "error"."""
    gen = torch.Generator(device=device).manual_seed(args.seed + length)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    res = {"length": length}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    cache, res["cache"] = new_cache(config, cache_kind, device)
    try:
        with torch.inference_mode():
            if args.fill == "prefill":
                ids = torch.randint(0, vocab, (args.batch_size, length), generator=gen, device=device)
                tok = fill_prefill(model, cache, ids, args.prefill_chunk, deadline)
            else:
                fill_random(model, cache, args.batch_size, length, gen, deadline)
                tok = torch.randint(0, vocab, (args.batch_size, 1), generator=gen, device=device)
            _sync(device)
            res["fill_s"] = time.perf_counter() - t0
            times, res["tokens"] = decode(model, cache, tok, args.decode_steps, deadline)
        res.update(status="ok", step_ms=times, median_step_ms=statistics.median(times))
    except OverBudget:
        res["status"] = "over_budget"
    except torch.OutOfMemoryError as e:
        res.update(status="error", error=f"out of device memory: {str(e).splitlines()[0]}")
    except RuntimeError as e:  # pinned or pageable host memory
        if "out of memory" not in str(e) and "can't allocate" not in str(e):
            raise
        res.update(status="error", error=f"out of host memory: {str(e).splitlines()[0]}")
    res["elapsed_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        res["peak_device_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # pinned host blocks the offloaded copies left
            torch._C._host_emptyCache()
    return res


def summarize(doc: dict) -> dict:
    done = [r for r in doc["results"] if r["status"] == "ok"]
    last = done[-1] if done else None
    return {"longest_length": last["length"] if last else None,
            "median_step_ms": last["median_step_ms"] if last else None,
            "batch_size": doc["batch_size"], "cache": last["cache"] if last else None,
            "device_name": doc["device_name"], "budget_s": doc["budget_s"]}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(b <= a for a, b in zip(args.lengths, args.lengths[1:])):
        parser.error("--lengths must be increasing")
    for name in ("batch_size", "decode_steps", "prefill_chunk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.lengths) < 1:
        parser.error("--lengths must be >= 1")
    import transformers

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model_path = TINY if args.tiny else args.model_path
    config = hf_config(model_path)
    t0 = time.perf_counter()
    model = build_model(config, device, dtype, args.seed, args.attn_implementation)
    _sync(device)
    cmd = "python -m doublesparse.bench.hf_offload " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = {"command": cmd, "model": model_path, "architecture": type(model).__name__, "device": str(device),
           "device_name": _device_name(device), "dtype": str(dtype).removeprefix("torch."),
           "cache_implementation": args.cache, "attn_implementation": model.config._attn_implementation,
           "transformers": transformers.__version__, "torch": torch.__version__, "fill": args.fill,
           "prefill_chunk": args.prefill_chunk, "batch_size": args.batch_size, "decode_steps": args.decode_steps,
           "budget_s": args.budget_s, "total_budget_s": args.total_budget_s, "build_s": time.perf_counter() - t0,
           "results": []}
    sweep_end = time.perf_counter() + (args.total_budget_s if args.total_budget_s is not None else float("inf"))
    max_pos = getattr(config, "max_position_embeddings", None)
    host_kv = args.cache == "offloaded" or device.type == "cpu"  # where the K/V lives between layers
    prev = None
    for length in args.lengths:
        budget = min(args.budget_s, sweep_end - time.perf_counter())
        need, avail = kv_bytes(config, args.batch_size, length, dtype), host_available_bytes()
        if max_pos and length + args.decode_steps > max_pos:
            res = {"length": length, "status": "skipped",
                   "reason": f"past the config's {max_pos} positions (llama-3.1-8b-1m has 1M)"}
        elif host_kv and avail is not None and need > 0.9 * avail:
            res = {"length": length, "status": "skipped",
                   "reason": f"K/V {need / 2**30:.1f} GiB > 90% of available host memory {avail / 2**30:.1f} GiB"}
        elif projected_s(prev, length) > budget:
            res = {"length": length, "status": "skipped",
                   "reason": f"projected >= {projected_s(prev, length):.0f} s > budget {max(budget, 0):.0f} s left"}
        else:
            res = run_length(model, config, args, device, length, args.cache, budget)
        res["kv_gib"] = need / 2**30
        doc["results"].append(res)
        doc["summary"] = summarize(doc)
        ms = f"{res['median_step_ms']:.1f} ms/step" if res.get("median_step_ms") is not None else res.get("reason", "")
        print(f"[hf_offload] L={length} B={args.batch_size}: {res['status']} {ms} "
              f"({res.get('elapsed_s', 0):.1f} s, cache {res.get('cache', '-')})", flush=True)
        if args.result_json:
            Path(args.result_json).write_text(json.dumps(doc, indent=2))
        if res["status"] != "ok":
            break
        prev = res
    s = doc.get("summary") or summarize(doc)
    print(f"[hf_offload] longest finished within {args.budget_s:.0f} s: L={s['longest_length']} "
          f"({s['median_step_ms'] and round(s['median_step_ms'], 1)} ms/step) on {doc['device_name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
