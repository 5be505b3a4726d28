"""Drive the decode kernels for a profiler (ncu) at one shape, eagerly, a few times each.

    ncu --clock-control none -k regex:'score|hist|compact|select|decode_attn|merge' --launch-skip 5 \
        --launch-count 5 --set full python benchmarks/profile_kernels.py [--batch 3 --ctx 65536] [--fp8] \
        [--tuning FILE.json]

Runs ``ds_launch.ds_decode`` (score -> top-k select -> sparse attention) and then
``launch.dense_decode`` ``--iters`` times each on random pools (``doublesparse.bench.attention``'s),
Llama-3.1-8B heads. ``--tuning FILE.json``: a ``KernelTuning`` JSON object (field: value, as
``--kernel-tuning``), e.g. ``{"score_impl": "mma", "select_impl": "triton"}`` to profile the Triton
score and select instead of the CUDA C++ ones (kernels/cuda/, the defaults on a GPU).
``--dump DIR`` also writes the compiled Triton kernels this run launched (TTGIR, PTX, cubin) there.
Under ``TRITON_INTERPRET=1`` it runs on the CPU (a smoke check of the wiring; use a small ``--ctx``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from doublesparse.bench.attention import FP8, HKV, HQ, D, Pools
from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels.triton import (
    decode_attn,
    ds_launch,
    ds_score,
    ds_score_rows,
    ds_select,
    launch,
)
from doublesparse.kernels.tuning import KernelTuning
from doublesparse.kernels.workspace import DecodeWorkspace

TRITON_KERNELS = (ds_score.score_mma_kernel, ds_score_rows.score_kernel, ds_select.select_kernel,
                  decode_attn.decode_attn_kernel, decode_attn.merge_kernel)


def dump(out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    for fn in TRITON_KERNELS:
        if not hasattr(fn, "device_caches"):  # the interpreter compiles nothing
            print(f"{fn.fn.__name__}: not compiled (TRITON_INTERPRET=1)")
            continue
        for dev_cache in fn.device_caches.values():
            for i, kern in enumerate(dev_cache[0].values()):
                name = getattr(kern, "name", fn.fn.__name__)  # the phase's name for select_kernel
                for ext in ("ttgir", "ptx", "cubin"):
                    if ext in kern.asm:
                        mode = "wb" if ext == "cubin" else "w"
                        with open(os.path.join(out_dir, f"{name}.{i}.{ext}"), mode) as f:
                            f.write(kern.asm[ext])
                md = kern.metadata
                print(name, i, "regs", getattr(kern, "n_regs", "?"), "spills",
                      getattr(kern, "n_spills", "?"), "shared", getattr(md, "shared", "?"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--k", type=int, default=None, help="heavy tokens (default ctx / 16)")
    ap.add_argument("--mode", default="group_max")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--dump", metavar="DIR", default=None)
    ap.add_argument("--tuning", metavar="FILE.json", default=None,
                    help="KernelTuning overrides: a JSON object of field: value")
    ap.add_argument("--fp8", action="store_true", help="fp8 (e4m3) labels instead of bf16")
    args = ap.parse_args(argv)
    tuning = KernelTuning.from_json(args.tuning) if args.tuning else KernelTuning()
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        dev = torch.device("cpu")
    else:
        sys.exit("profile_kernels.py needs a CUDA GPU (or TRITON_INTERPRET=1 for a CPU smoke check)")
    B, L = args.batch, args.ctx
    k = args.k or L // 16
    p = Pools(B, L, 1, args.r, FP8 if args.fp8 else torch.bfloat16, dev)
    ws = DecodeWorkspace(B, HQ, HKV, D, L, k, device=dev)
    sm = 1 / math.sqrt(D)
    ds_args = DSDecodeArgs(torch.full_like(p.seq_lens, k), k, args.mode, tuning=tuning)  # one k for the batch
    for _ in range(args.iters):
        ds_launch.ds_decode(p.q, p.k, p.v, p.labels, p.scale, p.channels, p.req_to_token, p.req_idx[0],
                            p.seq_lens, sm, ds_args, ws=ws, out=p.out)
    for _ in range(args.iters):
        launch.dense_decode(p.q, p.k, p.v, p.req_to_token, p.req_idx[0], p.seq_lens, sm, ws, out=p.out,
                            tuning=tuning)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if args.dump:
        dump(args.dump)
    print("done")


if __name__ == "__main__":
    main()
