"""How fast can one kernel read N bytes on this GPU, as a whole run of memory or as rows
gathered at random? The ceiling the DS stages' byte floors assume (copy bandwidth) is measured on
GB-sized copies; a DS stage moves 25-134 MB (labels, or the selected K/V rows) in one launch.

    python benchmarks/read_ceiling.py [--mb 12,25,50,100,200,400] [--copies 4] [--json OUT.json]

Kernels (Triton, each program reads 16 KB and writes one int): "stream", N contiguous bytes;
"rows R", N bytes as R-byte rows at random row indices of a 2 GiB pool ("sorted": the indices in
increasing order, as a selection of positions in order reads a request's contiguous slots).
Each graph rotates over ``--copies`` disjoint buffers / index sets so the bytes come from DRAM;
median of replays; fraction = bytes / time / the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl

from doublesparse.bench.attention import copy_bandwidth, time_fn


def write_json(path: str | None, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(command="python benchmarks/read_ceiling.py " + " ".join(sys.argv[1:]),
                           date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), rows=rows), f,
                      indent=1)

TILE = 16384  # bytes per program


@triton.jit
def _stream(src, out, N_WORDS: tl.constexpr):
    p = tl.program_id(0)
    w = tl.load(src + p * N_WORDS + tl.arange(0, N_WORDS))
    tl.store(out + p, tl.sum(w, 0))


@triton.jit
def _rows(src, idx, out, ROW_WORDS: tl.constexpr, ROWS: tl.constexpr):
    p = tl.program_id(0)
    r = tl.load(idx + p * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    w = tl.load(src + r[:, None] * ROW_WORDS + tl.arange(0, ROW_WORDS)[None, :])
    tl.store(out + p, tl.sum(tl.sum(w, 1), 0))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="12,25,50,100,200,400", help="comma-separated sizes read per launch (MB)")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--rows", default="512,256,64", help="comma-separated row sizes (bytes) of the gathers")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("read_ceiling.py needs a CUDA GPU")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name(dev)} copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    C = args.copies
    pool = torch.randint(-2**30, 2**30, (2**29,), dtype=torch.int32, device=dev)  # 2 GiB
    out = torch.empty(2**20, dtype=torch.int32, device=dev)
    res = []
    for mb in (int(x) for x in args.mb.split(",")):
        n = mb * 10**6 // TILE * TILE  # whole tiles
        progs = n // TILE
        row = {"mb": n / 1e6}
        bufs = pool[: C * n // 4].view(C, n // 4)

        def stream(i=0):
            _stream[(progs,)](bufs[i], out, N_WORDS=TILE // 4, num_warps=4)
        row["stream"] = time_fn(stream, C)
        for rb in (int(x) for x in args.rows.split(",")):
            nrows = pool.numel() * 4 // rb
            for sort in (False, True):
                idx = torch.stack([torch.randperm(nrows, device=dev)[: n // rb] for _ in range(C)]).to(torch.int32)
                if sort:
                    idx = idx.sort(dim=1).values

                def rows(i=0, idx=idx, rb=rb):
                    _rows[(progs,)](pool, idx[i], out, ROW_WORDS=rb // 4, ROWS=TILE // rb, num_warps=4)
                row[f"rows {rb}" + (" sorted" if sort else "")] = time_fn(rows, C)
        print(f"{row['mb']:7.1f} MB  floor {n / bw * 1e6:7.1f} us", flush=True)
        for name, t in row.items():
            if name != "mb":
                print(f"   {name:16s} {t * 1e6:8.1f} us  {n / t / bw:5.2f} of copy bw", flush=True)
        res.append(dict(bytes=n, copy_bw=bw, us={k: v * 1e6 for k, v in row.items() if k != "mb"}))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
