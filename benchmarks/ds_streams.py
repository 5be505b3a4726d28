"""Experiment: one layer's Double Sparsity decode with the batch cut into parts on several streams.

    python benchmarks/ds_streams.py [--cases 16x32768,3x65536,8x16384] [--json OUT.json]
    python benchmarks/ds_streams.py --summarize OUT.json   # rounds and mean per case, variant, tuning

The DS stages are a chain (score -> three select passes -> attend) whose select passes are
latency-bound, not byte-bound (results/attention-h200-notes.md). Independent requests of the
batch could overlap one part's select with another part's byte-bound score or attend. Each
variant cuts the batch into parts (each with its own rows of the workspace, ``ws.rows``), launches
part i on stream i % streams inside one CUDA graph, and joins; timed as bench.attention times DS
(median of graph replays over rotating pool copies). Output equality with the uncut call is
checked first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from doublesparse.attention.double_sparsity import cut_batch
from doublesparse.bench.attention import HKV, HQ, D, MIN_BYTES_PER_GRAPH, Pools, copy_bandwidth, time_fn
from doublesparse.kernels.triton import launch
from doublesparse.kernels.workspace import DecodeWorkspace


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x32768,3x65536,8x16384")
    ap.add_argument("--variants", default="1/1,2/1,2/2,4/2,4/4",
                    help="parts/streams; a trailing s (2/2s) skews the parts: part j's stream waits "
                         "until part j-1's score has run, so one part's select overlaps the next one's score")
    ap.add_argument("--tunings", default="[{}]",
                    help="JSON list of launch.TUNING overrides; each is timed with every variant")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summarize", default=None, metavar="FILE",
                    help="print a result file's times per case, variant and tuning (every round and the mean)")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name(dev)} copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    side = [torch.cuda.Stream() for _ in range(3)]
    out = []
    for case in args.cases.split(","):
        B, L = (int(x) for x in case.split("x"))
        k, r = L // 16, 16
        copies = max(1, math.ceil(MIN_BYTES_PER_GRAPH / (B * L * HKV * D * 4)))
        p = Pools(B, L, copies, r, torch.bfloat16, dev)
        ws = DecodeWorkspace(B, HQ, HKV, D, L, k, device=dev)
        sm = 1 / math.sqrt(D)
        dense_t = time_fn(lambda i=0: launch.dense_decode(p.q, p.k, p.v, p.req_to_token, p.req_idx[i],
                                                          p.seq_lens, sm, ws, out=p.out), copies)
        floor_us = (B * L * HKV * r * 2 + B * HKV * k * D * 4) / bw * 1e6
        print(f"bs{B} L={L}: dense {dense_t * 1e6:.1f} us, DS floor {floor_us:.1f} us", flush=True)
        ref = None
        base = dict(launch.TUNING)
        for tun, var in [(t, v) for t in json.loads(args.tunings) for v in args.variants.split(",")]:
            launch.tuning_overrides(tun)  # checked against the full table, before it is cleared
            launch.TUNING.clear()
            launch.TUNING.update(base, **tun)
            skew = var.endswith("s")  # part j's stream starts when part j-1's score has run
            parts, nstr = (int(x) for x in var.rstrip("s").split("/"))
            rng = cut_batch(B, parts)
            if len(rng) < parts or (skew and nstr != parts):  # skewed: one stream per part
                continue
            subs = [(a, b, ws.rows(a, b)) for a, b in rng]
            scored = [torch.cuda.Event() for _ in subs]

            def ds(i=0):
                main_s = torch.cuda.current_stream()  # the capture stream inside a graph
                streams = [main_s] + side[: nstr - 1]
                for s in streams[1:]:
                    s.wait_stream(main_s)
                def call(j, stage):
                    a, b, w = subs[j]
                    launch.ds_decode(p.q[a:b], p.k, p.v, p.labels, p.scale, p.channels,
                                     p.req_to_token, p.req_idx[i][a:b], p.seq_lens[a:b], sm, k,
                                     "group_max", ws=w, out=p.out[a:b], stage=stage)
                if skew:
                    for j in range(len(subs)):
                        with torch.cuda.stream(streams[j % nstr]):
                            if j:
                                streams[j % nstr].wait_event(scored[j - 1])
                            call(j, "score")
                            scored[j].record()
                    for j in range(len(subs)):
                        with torch.cuda.stream(streams[j % nstr]):
                            call(j, "rest")
                else:
                    for j in range(len(subs)):
                        with torch.cuda.stream(streams[j % nstr]):
                            call(j, "all")
                for s in streams[1:]:
                    main_s.wait_stream(s)

            p.out.fill_(float("nan"))
            ds(0)
            torch.cuda.synchronize()
            o = p.out.float().clone()
            if ref is None:
                ref = o
            err = (o - ref).abs().max().item()
            t = time_fn(ds, copies)
            rec = dict(batch=B, ctx=L, k=k, r=r, parts=parts, streams=nstr, skew=skew, tuning=tun, us=t * 1e6,
                       dense_us=dense_t * 1e6, floor_us=floor_us, speedup=dense_t / t, max_err_vs_uncut=err)
            out.append(rec)
            print(f"  parts {parts} streams {nstr}{' skewed' if skew else ''} {json.dumps(tun)}: {t * 1e6:7.1f} us  x{dense_t / t:.2f}  "
                  f"floor frac {floor_us / (t * 1e6):.2f}  max|diff| {err:.2e}", flush=True)
        launch.TUNING.clear()
        launch.TUNING.update(base)
        del p, ws
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command="python benchmarks/ds_streams.py " + " ".join(sys.argv[1:]),
                           date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                           copy_bw=bw, tuning=launch.TUNING, rows=out), f, indent=1)


def summarize(path):
    """Rows of one result file grouped by (case, parts, streams, skew, tuning): the time of every
    round (tunings listed more than once alternate) and their mean, in µs."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    groups = {}
    for r in rows:
        key = (r["batch"], r["ctx"], r["parts"], r["streams"], r["skew"], json.dumps(r["tuning"], sort_keys=True))
        groups.setdefault(key, []).append(r["us"])
    for (B, L, parts, nstr, skew, tun), us in groups.items():
        print(f"{B} x {L} parts {parts} streams {nstr}{' skewed' if skew else ''} {tun}: "
              f"{' / '.join(f'{u:.1f}' for u in us)} -> mean {sum(us) / len(us):.1f} us")


if __name__ == "__main__":
    main()
