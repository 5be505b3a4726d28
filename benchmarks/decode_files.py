"""Which package files one decode step runs, and how deep the stack is at the attention call.

    python benchmarks/decode_files.py

The real engine (``doublesparse.Engine``) on the tiny Llama of ``doublesparse.testing`` on the
CPU, Double Sparsity on and every step sparse (k 16 of a 200-token prompt); three steps warm up,
then one step runs under ``sys.setprofile``. Printed: every file of the package that step called
into, and at the DS decode call (``kernels/ops.py:ds_decode``) the package files and frames on the
stack. On a GPU the kernel files differ (Triton launchers for the PyTorch path's torch_ops.py).
"""

from __future__ import annotations

import os
import sys

import doublesparse
from doublesparse.server.fake_engine import tiny_engine

PKG = os.path.dirname(doublesparse.__file__)


def main() -> int:
    eng = tiny_engine(enable_double_sparsity=True, ds_sparse_decode_threshold=0, ds_heavy_token_num=16)
    eng.add_request([1] * 200, {"max_new_tokens": 8, "temperature": 0})
    for _ in range(3):
        eng.step()
    files: set[str] = set()
    at_attention: list[str] = []

    def tracer(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(PKG):
            return
        files.add(os.path.relpath(frame.f_code.co_filename, PKG))
        if not at_attention and frame.f_code.co_name == "ds_decode" and frame.f_code.co_filename.endswith("ops.py"):
            f = frame
            while f:
                if f.f_code.co_filename.startswith(PKG):
                    at_attention.append(f"{os.path.relpath(f.f_code.co_filename, PKG)}:{f.f_code.co_name}")
                f = f.f_back

    sys.setprofile(tracer)
    eng.step()
    sys.setprofile(None)
    print(f"{len(files)} package files run in one decode step:")
    for f in sorted(files):
        print(f"  {f}")
    stack_files = {s.split(':')[0] for s in at_attention}
    print(f"at ops.ds_decode: {len(stack_files)} files, {len(at_attention)} frames on the stack:")
    for s in at_attention:
        print(f"  {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
