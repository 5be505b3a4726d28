"""Compile DS decode kernels for sm_90 on a machine without a GPU and print their registers.

    python benchmarks/kernel_resources.py [--block-n 64]

Uses Triton's own compiler and the cuobjdump its NVIDIA backend ships (no GPU needed). The shapes
are Llama-3.1-8B's (32 q / 8 KV heads, d 128, r 16, group_max); pointer and stride arguments are
marked 16-divisible, as Triton specializes them at run time for these shapes. For the score it
also counts the asynchronous copies (cp.async) in the PTX.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from doublesparse.kernels.triton import decode_attn, ds_score

PTRS = dict(q_ptr="*bf16", label_ptr="*bf16", scale_ptr="*fp32", scores_ptr="*fp16", k_cache_ptr="*bf16",
            v_cache_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16")


def compile_sm90(fn, consts, **opts):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else PTRS.get(n, "*i32") if n.endswith("_ptr")
           else "fp32" if n == "sm_scale" else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n.startswith("stride_")}
    c = {(names.index(k),): v for k, v in consts.items()}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def resources(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return re.search(r"REG:\d+", out).group(0) + f" shared {kernel.metadata.shared} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-n", type=int, default=64)
    a = ap.parse_args()
    k = compile_sm90(ds_score.score_mma_kernel, dict(
        HKV=8, G=4, R=16, MODE=2, LABEL_FP8=False, LABEL_KIND=0, NUM_PROGS=176, BLOCK_N=a.block_n,
        BLOCK_C=128, HKV_P=8, G_P=4, DOT_F32=False), num_warps=4, num_stages=1)
    print(f"score_mma_kernel block_n={a.block_n}: {resources(k)}, "
          f"cp.async in PTX: {len(re.findall(r'cp[.]async', k.asm['ptx']))}")
    k = compile_sm90(decode_attn.decode_attn_kernel, dict(
        G=4, D=128, PER_HEAD=False, HAS_SEL=True, NUM_SPLITS=22, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128,
        DOT_F32=False, FUSE_MERGE=False, BLOCK_S=32), num_warps=4, num_stages=2)
    print(f"decode_attn_kernel (sparse, block 64, 2 stages): {resources(k)}")


if __name__ == "__main__":
    main()
