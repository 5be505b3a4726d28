"""``python -m doublesparse.bench_one_batch``: latency of one static batch, SGLang-style.

Random prompt ids, one prefill of the whole batch, then ``output_len - 1`` decode steps through the
same model runner / backends / CUDA graphs as the engine. On CUDA the decode loop uses the engine's
overlap schedule (the next step is launched before this step's tokens are read), so a step's
latency is the time between consecutive token reads; ``--disable-overlap-schedule`` gives
SGLang's one-step-at-a-time loop (host work added to every step). Prints SGLang's lines, plus per decode
step the bytes it must read (weights + KV, or weights + labels + selected KV) and the fraction of
a copy bandwidth measured here at start. ``--result-json`` writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time

import torch

from ..api import calibrate_on_demand, start_ranks
from ..cli_common import Parser, UsageError, run_main
from ..config import SchedulerConfig
from ..config_flags import add_cli_args
from ..engine.scheduler import Scheduler
from ..kernels.transfer import to_device, to_host_async


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="doublesparse bench-one-batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, nargs="+", default=[1024])
    p.add_argument("--output-len", type=int, nargs="+", default=[16])
    p.add_argument("--result-json", help="write all numbers here")
    p.add_argument("--log-decode-step", type=int, default=0,
                   help="print every N-th decode step too (the first 5 are always printed)")
    p.add_argument("--skip-warmup", action="store_true")
    p.add_argument("--warmup-input-len", type=int, default=None,
                   help="prompt length of the warm-up run (default: the smallest --input-len, as SGLang). "
                        "A short one still compiles the Triton kernels and fills their on-disk cache, so a "
                        "process's first prefill does not pay for them, at a fraction of the time")
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help="size of the bandwidth probe copy")
    p.add_argument("--profile", action="store_true",
                   help="after the benchmark: time the decode graph replay alone (GPU time, no host "
                        "work) and print a per-kernel table of one decode step (torch.profiler)")
    p.add_argument("--profile-json", default=None, help="with --profile: write the kernel table here")
    p.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                   help="how the prompts get into the KV cache: a real prefill, or random K/V and "
                        "label values written straight into the pools (decode timing only, at a "
                        "fraction of the time; prefill numbers are then absent)")
    p.add_argument("--skip-unfit", action="store_true",
                   help="skip the (batch, input, output) cases that do not fit the KV pool or the "
                        "context instead of stopping")
    add_cli_args(p)
    return p


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large copy (read + write counted), on the benchmark device."""
    if device.type != "cuda":
        nbytes = min(nbytes, 1 << 28)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    iters = 10 if device.type == "cuda" else 3
    _sync(device)
    if device.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            b.copy_(a)
        e.record()
        e.synchronize()
        sec = s.elapsed_time(e) / 1e3
    else:
        t = time.perf_counter()
        for _ in range(iters):
            b.copy_(a)
        sec = time.perf_counter() - t
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()  # or the KV pool sizing (free memory) would miss these bytes
    return 2 * nbytes * iters / sec


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: all parameters except an untied input embedding
    (decode gathers B rows of it); a CPU linear layer with a packed copy (models/packed.py, which
    decode multiplies by) counts the copy's bytes instead of its weight's."""
    from ..models.layers import Linear
    packed = {id(m.weight): m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None}
    total = 0
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, prm in model.named_parameters():
        if "embed_tokens" in name and not tied:
            continue
        p = packed.get(id(prm))
        total += p.nbytes if p is not None else prm.numel() * prm.element_size()
    for name, buf in model.named_buffers():
        if buf.is_floating_point() is False and buf.dtype in (torch.uint8, torch.int8):
            total += buf.numel() * buf.element_size()  # packed quantised weights, if any
    return total


def prefill_chunked(runner, rows: list[int], ids: list[list[int]], chunk: int) -> list[int]:
    """Prefill every request, at most ``chunk`` tokens per forward (the engine's own scheduler
    cuts the chunks); returns each request's first greedy token."""
    sched = Scheduler(SchedulerConfig(len(rows), chunk), 1 << 62, 1 << 62)
    for i, r in enumerate(ids):
        sched.add(str(i), len(r), 1)
    first: dict[int, int] = {}
    while len(first) < len(rows):
        plan = sched.schedule()
        idx = [int(c.rid) for c in plan.prefill]
        logits = runner.prefill([rows[i] for i in idx], [c.start for c in plan.prefill],
                                [ids[i][c.start:c.end] for i, c in zip(idx, plan.prefill)],
                                [c.last for c in plan.prefill])
        done = [i for i, c in zip(idx, plan.prefill) if c.last]
        for i, t in zip(done, logits.argmax(-1).tolist()):
            first[i] = t
            sched.finish(str(i))
    return [first[i] for i in range(len(rows))]


def _decode_sync(runner, rows, nxt, input_len, steps, dev):
    """SGLang's loop: each step's inputs built, launched and its tokens read before the next.
    Yields each step's latency (s)."""
    for i in range(steps):
        _sync(dev)
        t = time.perf_counter()
        logits = runner.decode(rows, nxt, [input_len + i] * len(rows))
        nxt = logits.argmax(-1).tolist()
        _sync(dev)
        yield time.perf_counter() - t


def _decode_overlapped(runner, rows, nxt, input_len, steps, dev):
    """The engine's overlap schedule (engine.py): step i+1 is launched, its input ids taken from
    step i's argmax on the device, before step i's tokens are read, so the host's work for a step
    runs while the GPU computes the one before. Yields the time between consecutive token reads,
    the per-token latency a streaming client sees. CUDA only."""
    B = len(rows)
    tok = to_device(torch.tensor(nxt, dtype=torch.int64), dev)
    pending = None
    _sync(dev)
    last = time.perf_counter()
    for i in range(steps + 1):
        ready = None
        if i < steps:
            tok = runner.decode(rows, tok, [input_len + i] * B).argmax(-1)
            _, ready = to_host_async(tok)
        if pending is not None:
            pending.synchronize()  # the previous step's tokens are on the host
            now = time.perf_counter()
            yield now - last
            last = now
        pending = ready


def unfit(parts, bs: int, input_len: int, output_len: int) -> str | None:
    """Why a case cannot run on these pools, or None."""
    need = bs * (input_len + output_len)
    free = parts.memory.slots.admission_free  # DS-Offload's device tier is extra
    if need > free:
        return (f"batch {bs} x ({input_len}+{output_len}) = {need} tokens does not fit the KV pool "
                f"({free} free); raise --max-total-tokens")
    if input_len + output_len > parts.max_context_len:
        return (f"input_len + output_len = {input_len + output_len} exceeds the context "
                f"{parts.max_context_len}; pass --context-length or shorter lengths")
    if bs > parts.plan.max_reqs:
        return f"batch {bs} exceeds --max-running-requests {parts.plan.max_reqs}"
    return None


def _label_dtype(plan) -> str | None:
    """The label pool's dtype as resolved on this device (``--ds-label-dtype auto``), e.g.
    "float8_e4m3fn"; None without labels."""
    return str(plan.label_dtype).removeprefix("torch.") if plan.heavy_channel_num else None


def fill_random(parts, seed: int) -> None:
    """Random K, V and label values in every slot of the pools (a prompt's cache, for timing)."""
    g = torch.Generator(device=parts.device).manual_seed(seed)
    m = parts.memory
    tier = getattr(m, "device_tier_pools", ())  # DS-Offload's (engine/offload_memory.py)
    for pool in (*m.k, *m.v, *tier, *(x for x in m.label if x is not None)):
        for chunk in pool.split(1 << 16):  # bounded float32 temporaries (the pools fill the GPU)
            # converted on the device: a host pool (DS-Offload) then receives half the bytes
            chunk.copy_(torch.randn(chunk.shape, generator=g, device=parts.device, dtype=torch.float32)
                        .clamp_(-4, 4).to(chunk.dtype))


def assign_prompts(parts, rows: list[int], input_len: int) -> None:
    """Give each row ``input_len`` slots (whatever they hold) as if its prompt had been prefilled."""
    for r in rows:
        parts.memory.assign(torch.full((input_len,), r, dtype=torch.int64),
                            torch.arange(input_len, dtype=torch.int64), input_len)


def run_case(parts, bs: int, input_len: int, output_len: int, seed: int, log_every: int,
             bw: float | None, wbytes: int, verbose: bool = True, chunk: int = 1 << 30,
             profile=None, overlap: bool = False, fill: str = "prefill") -> dict:
    runner, mem, dev = parts.runner, parts.memory, parts.device
    why = unfit(parts, bs, input_len, output_len)
    if why:
        raise SystemExit(why)
    g = torch.Generator().manual_seed(seed)
    V = parts.model.config.vocab_size
    ids = torch.randint(0, V, (bs, input_len), generator=g).tolist()
    rows = [mem.rows.alloc() for _ in range(bs)]
    for r in rows:  # DS-Offload's device tier takes the requests that fit, as the engine's admission
        mem.admit_row(r, input_len + output_len)
    say = print if verbose else (lambda *a, **k: None)
    try:
        _sync(dev)
        t = time.perf_counter()
        if fill == "random":
            assign_prompts(parts, rows, input_len)
            nxt = [int(x[-1]) for x in ids]
        else:
            nxt = prefill_chunked(runner, rows, ids, chunk)
        _sync(dev)
        prefill_lat = time.perf_counter() - t
        if fill != "random":
            say(f"Prefill. latency: {prefill_lat:6.5f} s, throughput: {bs * input_len / prefill_lat:9.2f} token/s")
        lats, step_bytes, sparse = [], [], []
        off = getattr(parts.backend, "fetch_stats", None)  # DS-Offload's hot-set counters
        off0, all_lens = off() if off else None, []
        steps = _decode_overlapped if overlap else _decode_sync
        for i, lat in enumerate(steps(runner, rows, nxt, input_len, output_len - 1, dev)):
            lens = [input_len + i + 1] * bs
            all_lens.append(lens)
            lats.append(lat)
            step_bytes.append(wbytes + parts.backend.decode_bytes(lens))
            sparse.append(any(parts.sparse_rows(lens)))
            if i < 5 or (log_every and i % log_every == 0):
                # exactly SGLang's line (parsers match it); bytes go to the summary and the JSON
                say(f"Decode.  latency: {lat:6.5f} s, throughput: {bs / lat:9.2f} token/s")
        if profile is not None and lats:
            prof = profile(rows, [0] * bs, [input_len + output_len - 1] * bs)
        if off:
            from .offload import describe, offload_step_stats
            offload = offload_step_stats(parts.backend, off0, off(), all_lens)
            say(describe(offload))
    finally:
        for r in rows:
            mem.release(r, mem.req_to_token_host[r].count_nonzero().item())
    if fill == "random":  # no prefill ran: no prefill numbers
        prefill_lat = 0.0
    res = dict(batch_size=bs, input_len=input_len, output_len=output_len, decode_overlapped=overlap,
               weight_bytes=wbytes, fill=fill, prefill_latency=prefill_lat,
               prefill_throughput=bs * input_len / prefill_lat if prefill_lat else None,
               decode_latencies=lats,
               decode_step_bytes=step_bytes, sparse_steps=sum(sparse), decode_steps=len(lats))
    if off:
        res["offload"] = offload
    if lats:
        med = statistics.median(lats)
        med_bytes = statistics.median(step_bytes)
        res.update(median_decode_latency=med, median_decode_throughput=bs / med,
                   median_step_bytes=med_bytes, achieved_bandwidth=med_bytes / med,
                   bandwidth_fraction=(med_bytes / med / bw) if bw else None)
        say(f"Decode.  median latency: {med:6.5f} s, median throughput: {bs / med:9.2f} token/s")
        frac = f" = {med_bytes / med / bw * 100:.1f}% of copy bandwidth" if bw else ""
        say(f"Decode.  median step bytes: {med_bytes / 1e6:.2f} MB (weights {wbytes / 1e6:.2f} MB), "
            f"achieved {med_bytes / med / 1e9:.2f} GB/s{frac}; sparse steps {sum(sparse)}/{len(lats)}")
    if profile is not None and lats:
        res["profile"] = prof
    total = prefill_lat + sum(lats)
    res.update(total_latency=total, total_throughput=bs * (input_len + output_len) / total if total else None)
    if fill != "random":
        say(f"Total. latency: {total:6.5f} s, throughput: {bs * (input_len + output_len) / total:9.2f} token/s")
    return res


def main(argv: list[str] | None = None) -> int:
    return run_main("doublesparse bench-one-batch", _main, argv)


def _main(argv: list[str]) -> int:
    from ..preflight import check_engine_config, engine_config_from_cli

    args = build_parser().parse_args(argv)
    for flag in ("batch_size", "input_len", "output_len"):
        bad = [v for v in getattr(args, flag) if v < 1]
        if bad:
            raise UsageError(f"--{flag.replace('_', '-')} {bad[0]}: must be >= 1")
    max_bs = max(args.batch_size)
    cfg = engine_config_from_cli(args, max_running_requests=args.max_running_requests or max_bs,
                                 cuda_graph_max_bs=args.cuda_graph_max_bs or max_bs)
    check_engine_config(cfg)
    if cfg.tp_size > 1 and args.fill == "random":
        raise UsageError("--fill random fills this process's pools only; with --tp-size > 1 leave it out "
                         "(the prompts are prefilled on every rank)")
    if cfg.cpu_threads:  # loading and sampling too, not only the engine's steps
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.max_total_tokens is None and not cfg.resolved_device.startswith("cuda"):
        need = max(b * (i + o) for b, i, o in itertools.product(args.batch_size, args.input_len, args.output_len))
        cfg = cfg.replace(max_total_tokens=need)
    dev = torch.device(cfg.resolved_device)
    bw = copy_bandwidth(dev, args.copy_bytes)
    print(f"copy bandwidth: {bw / 1e9:.1f} GB/s ({dev})")
    tp = None
    if cfg.tp_size > 1:  # ranks 1.. in their own processes; pools, bytes and floor below are rank 0's
        tp = start_ranks(cfg)
        print(f"tensor parallel: {cfg.tp_size} ranks; weights, pools and step bytes below are per rank")
    try:
        return _bench(args, argv, cfg, dev, bw, tp)
    except BaseException as e:
        if tp is not None:  # ranks may wait in a collective rank 0 will never join: stop them now
            tp.abort(e)
        raise
    finally:
        if tp is not None:  # the other ranks stop and this process leaves the group
            tp.close()


def _bench(args, argv, cfg, dev, bw, tp) -> int:
    from ..engine.setup import build_parts
    parts = build_parts(cfg, progress=True, tp=tp, calibrate=calibrate_on_demand)
    print(parts.plan.describe())
    if parts.ds is not None:
        print(f"Double Sparsity: k={parts.ds.k_max}, r={parts.plan.heavy_channel_num}, "
              f"labels {_label_dtype(parts.plan)}, mode={parts.ds.mode}; channels: {parts.channel_source}")
    else:
        print(f"attention: {parts.backend.name} (dense decode)")
    wbytes = weight_bytes(parts.model)
    # As in the engine: on CUDA, step i+1 is launched before step i's tokens are read.
    overlap = dev.type == "cuda" and not cfg.disable_overlap_schedule
    print("decode: overlap schedule (--disable-overlap-schedule: one step at a time)" if overlap
          else "decode: one step at a time")
    if args.fill == "random":
        print("fill: random K/V/label values in the pools instead of a prefill (decode timing only)")
        fill_random(parts, cfg.seed)
    warm_len, warm_out = args.warmup_input_len or min(args.input_len), min(4, max(args.output_len))
    warm_bs = max((b for b in args.batch_size if not unfit(parts, b, warm_len, warm_out)), default=None)
    if not args.skip_warmup and warm_bs is not None:
        print("Warmup ...")
        run_case(parts, warm_bs, warm_len, warm_out,
                 cfg.seed + 1, 0, bw, wbytes, verbose=False, chunk=cfg.chunked_prefill_size, overlap=overlap,
                 fill=args.fill)
    results = []
    for bs, il, ol in itertools.product(args.batch_size, args.input_len, args.output_len):
        why = unfit(parts, bs, il, ol)
        if why and args.skip_unfit:
            print(f"Skipped. batch size: {bs}, input len: {il}: {why}")
            results.append(dict(batch_size=bs, input_len=il, output_len=ol, skipped=why))
            continue
        print(f"Benchmark. batch size: {bs}, input len: {il}, output len: {ol}")
        profile = None
        if args.profile:
            from .profile_step import profile_decode
            profile = lambda rows, nxt, pos: profile_decode(parts, rows, nxt, pos, args.profile_json)  # noqa: E731
        results.append(run_case(parts, bs, il, ol, cfg.seed, args.log_decode_step, bw,
                                wbytes, chunk=cfg.chunked_prefill_size, profile=profile,
                                overlap=overlap, fill=args.fill))
    if args.result_json:
        cmd = "python -m doublesparse.bench_one_batch " + " ".join(argv)
        out = dict(command=cmd, config=dataclasses.asdict(cfg), device=str(dev), copy_bandwidth=bw,
                   weight_bytes=wbytes, num_layers=parts.model.config.num_layers,
                   channel_source=parts.channel_source,
                   heavy_token_num=parts.ds.k_max if parts.ds else None,
                   heavy_channel_num=parts.plan.heavy_channel_num or None, label_dtype=_label_dtype(parts.plan),
                   kv_cache_dtype=str(parts.plan.kv_dtype).removeprefix("torch."),
                   kv_pool_tokens=parts.plan.max_total_tokens,
                   cuda_graphs=[list(k) for k in sorted(parts.runner.graphs)], kernel_tuning=dataclasses.asdict(cfg.kernel_tuning),
                   results=results)
        with open(args.result_json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results written to {args.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
