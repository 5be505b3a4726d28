"""``python -m doublesparse.bench.family_decode``: one static batch's decode step against its byte
floor, for any model family (bench_one_batch's flags and timing, the floor counted per family).

The floor of a decode step is the bytes it must read at least, over the copy bandwidth measured at
start: the weights every step reads (all parameters but the routed experts and the input
embedding), the routed experts the batch actually touches, and the attention cache (dense: every
cached token's K/V, or its latent row for MLA; Double Sparsity: every token's label plus the
selected tokens' rows). Touched experts are counted on ``--floor-steps`` extra decode steps run
eagerly (outside the CUDA graphs) after the timed ones, each router observed by a hook; the
timed steps run exactly as in bench_one_batch.

    python -m doublesparse.bench.family_decode --model-path qwen3-30b-a3b --load-format dummy \\
        --batch-size 8 --input-len 32768 --output-len 64 --fill random --result-json r.json

With ``--profile`` the result also holds one step's kernel table; ``python benchmarks/step_breakdown.py
r.json`` then splits the step by kernel class (attention, experts, router, projections, other).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys

import torch

from . import one_batch as bob
from ..api import calibrate_on_demand
from ..config_flags import from_cli_args


def build_parser():
    p = bob.build_parser()
    p.prog = "python -m doublesparse.bench.family_decode"
    p.add_argument("--floor-steps", type=int, default=8, help="eager decode steps whose routing sets the floor")
    return p


def _moe_layers(model) -> list:
    from ..models.moe import SparseMoE
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def static_weight_bytes(model) -> int:
    """bench_one_batch's weight bytes less the routed experts (counted per step when touched)."""
    routed = sum(m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size()
                 for m in _moe_layers(model))
    return bob.weight_bytes(model) - routed


def attention_bytes(parts, lens: list[int]) -> int:
    """Cache bytes one decode step must read at these lengths (see the module docstring)."""
    p = parts.plan
    if parts.ds is None:
        return sum(lens) * p.kv_bytes_per_token
    return parts.backend.decode_bytes(lens)  # per-layer selection modes and latent rows counted there


def observe_experts(parts, bs: int, input_len: int, steps: int, seed: int) -> list[dict]:
    """Per eager decode step: touched experts per MoE layer and their bytes. The prompts'
    cache is whatever the pools hold (``--fill random``: random values)."""
    layers = _moe_layers(parts.model)
    if not layers or steps <= 0:
        return []
    mem, runner = parts.memory, parts.runner
    seen: dict[int, int] = {}

    def hook(module, args, _out):
        _, ids = module.router(args[0])
        seen[id(module)] = int(torch.unique(ids).numel())

    handles = [m.register_forward_hook(hook) for m in layers]
    rows = [mem.rows.alloc() for _ in range(bs)]
    graphs, runner.graphs = runner.graphs, {}
    out = []
    try:
        bob.assign_prompts(parts, rows, input_len)
        g = torch.Generator().manual_seed(seed)
        nxt = torch.randint(0, parts.model.config.vocab_size, (bs,), generator=g).tolist()
        for i in range(steps):
            seen.clear()
            nxt = runner.decode(rows, nxt, [input_len + i] * bs).argmax(-1).tolist()
            touched = [seen[id(m)] for m in layers]
            per_expert = [3 * m.hidden * m.moe.intermediate_size * m.w13.element_size() for m in layers]
            out.append({"touched": touched, "bytes": sum(t * b for t, b in zip(touched, per_expert))})
    finally:
        runner.graphs = graphs
        for h in handles:
            h.remove()
        for r in rows:
            mem.release(r, mem.req_to_token_host[r].count_nonzero().item())
    return out


def floor(parts, res: dict, bw: float, static: int, observed: list[dict]) -> dict:
    """The case's floor: bytes and seconds per step (median over its decode steps), with the
    median expert bytes of the observed steps."""
    bs, n0 = res["batch_size"], res["input_len"]
    att = [attention_bytes(parts, [n0 + i + 1] * bs) for i in range(res["decode_steps"])]
    experts = statistics.median([o["bytes"] for o in observed]) if observed else 0
    fb = static + experts + statistics.median(att)
    out = {"static_weight_bytes": static, "expert_bytes": experts, "attention_bytes": statistics.median(att),
           "floor_bytes": fb, "floor_s": fb / bw}
    if observed:
        out["touched_experts_mean"] = statistics.mean(statistics.mean(o["touched"]) for o in observed)
    if res.get("median_decode_latency"):
        out["over_floor"] = res["median_decode_latency"] / out["floor_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bs, il, ol = args.batch_size[0], args.input_len[0], args.output_len[0]
    cfg = from_cli_args(args, max_running_requests=args.max_running_requests or bs,
                        cuda_graph_max_bs=args.cuda_graph_max_bs or bs)
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.tp_size > 1:  # its floor observes the routers of one process's model
        raise SystemExit("bench.family_decode runs on one device; for tensor parallelism use "
                         "python -m doublesparse.bench_one_batch --tp-size N")
    if cfg.max_total_tokens is None and not cfg.resolved_device.startswith("cuda"):
        cfg = cfg.replace(max_total_tokens=bs * (il + ol + args.floor_steps))
    from ..engine.setup import build_parts
    dev = torch.device(cfg.resolved_device)
    bw = bob.copy_bandwidth(dev, args.copy_bytes)
    parts = build_parts(cfg, progress=True, calibrate=calibrate_on_demand)
    print(parts.plan.describe())
    wbytes, static = bob.weight_bytes(parts.model), static_weight_bytes(parts.model)
    overlap = dev.type == "cuda" and not cfg.disable_overlap_schedule
    if args.fill == "random":
        bob.fill_random(parts, cfg.seed)
    warm_len = args.warmup_input_len or il
    if not args.skip_warmup and not bob.unfit(parts, bs, warm_len, 4):
        bob.run_case(parts, bs, warm_len, 4, cfg.seed + 1, 0, bw, wbytes, verbose=False,
                     chunk=cfg.chunked_prefill_size, overlap=overlap, fill=args.fill)
    profile = None
    if args.profile:  # the per-kernel table of one step (benchmarks/step_breakdown.py classes it)
        from .profile_step import profile_decode
        profile = lambda rows, nxt, pos: profile_decode(parts, rows, nxt, pos, args.profile_json)  # noqa: E731
    res = bob.run_case(parts, bs, il, ol, cfg.seed, args.log_decode_step, bw, wbytes,
                       chunk=cfg.chunked_prefill_size, overlap=overlap, fill=args.fill, profile=profile)
    observed = observe_experts(parts, bs, il, args.floor_steps, cfg.seed + 2)
    res["floor"] = floor(parts, res, bw, static, observed)
    res["floor"]["observed_steps"] = observed
    f = res["floor"]
    print(f"Floor.  {f['floor_bytes'] / 1e9:.2f} GB/step = {f['floor_s'] * 1e3:.3f} ms "
          f"(weights {static / 1e9:.2f} + experts {f['expert_bytes'] / 1e9:.2f} + cache "
          f"{f['attention_bytes'] / 1e9:.2f} GB); decode / floor {f.get('over_floor', float('nan')):.2f}")
    if args.result_json:
        cmd = "python -m doublesparse.bench.family_decode " + " ".join(sys.argv[1:] if argv is None else argv)
        out = {"command": cmd, "config": dataclasses.asdict(cfg), "device": str(dev), "copy_bandwidth": bw,
               "model": parts.model.config.name, "architecture": parts.model.config.architecture,
               "weight_bytes": wbytes, "channel_source": parts.channel_source,
               "heavy_channel_num": parts.plan.heavy_channel_num or None,
               "cuda_graphs": [list(k) for k in sorted(parts.runner.graphs)], "results": [res]}
        with open(args.result_json, "w") as fh:
            json.dump(out, fh, indent=2)
        print(f"results written to {args.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
