"""Compile DS decode kernels for sm_90 on a machine without a GPU and print their registers.

    python benchmarks/kernel_resources.py [--block-n 64]
    python benchmarks/kernel_resources.py --select [--consts '{"PREFETCH": false}']
    python benchmarks/kernel_resources.py --histogram
    python benchmarks/kernel_resources.py --sass DIR

Uses Triton's own compiler and the cuobjdump its NVIDIA backend ships (no GPU needed). The shapes
are Llama-3.1-8B's (32 q / 8 KV heads, d 128, r 16, group_max); pointer and stride arguments are
marked 16-divisible, as Triton specializes them at run time for these shapes. For the score it
also counts the asynchronous copies (cp.async) in the PTX. ``--select``: the three top-k select
phases at the launch geometry of 16 x 32K (one part), with their SASS instruction and barrier
counts; ``--consts`` sets constexprs of select_kernel (also ones of an older package on
PYTHONPATH). ``--histogram``: SASS instructions of a bare ``tl.histogram`` of 4096 keys per
program (4 warps) at 256 down to 16 bins, per 32 keys a thread handles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
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


def cuobjdump(kernel, flag: str) -> str:
    """The output of the cuobjdump that Triton's NVIDIA backend ships, run on the kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resources(kernel) -> str:
    out = cuobjdump(kernel, "--dump-resource-usage")
    return re.search(r"REG:\d+ STACK:\d+", out).group(0) + f" shared {kernel.metadata.shared} B"


def sass(kernel) -> list[str]:
    """The kernel's sm_90 SASS instructions (opcode and operands), in order."""
    out = cuobjdump(kernel, "-sass")
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", out)]


def select_phases(consts: dict):
    from doublesparse.kernels.triton import ds_topk
    names = ds_topk.select_kernel.arg_names
    unknown = sorted(set(consts) - set(names))
    if unknown:
        raise SystemExit(f"select_kernel has no parameters {unknown}")
    for phase, block, progs in ((1, 4096, 8), (2, 1024, 5), (3, 1024, 5)):
        # The defaults that the package's select_kernel takes (an older one may lack some).
        c = dict(PHASE=phase, NUM_PROGS=progs, BLOCK_N=block, ATOMIC_HIST=True, LOOP_STAGES=1, MAX_PROGS=16,
                 PREFETCH=True)
        c = {**{k: v for k, v in c.items() if k in names}, **consts}
        k = compile_sm90(ds_topk.select_kernel, c, num_warps=4, num_stages=3)
        ins = sass(k)
        print(f"{ds_topk.PHASE_NAMES[phase]} {json.dumps(consts)}: {resources(k)}, {len(ins)} SASS "
              f"instructions, {sum(i.startswith('BAR') for i in ins)} barriers")


@triton.jit
def _histogram_kernel(scores_ptr, h_ptr, n, BLOCK: tl.constexpr, BINS: tl.constexpr, SHIFT: tl.constexpr):
    # The top bits of fp16 scores' bit patterns (the select's keys, without their sign flip).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(scores_ptr + tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK))
    x = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h = tl.histogram(x >> SHIFT, BINS, mask=offs < n)
    tl.atomic_add(h_ptr + tl.arange(0, BINS), h, mask=h > 0, sem="relaxed")


def histogram_cost():
    block, warps = 4096, 4
    for bins in (256, 128, 64, 32, 16):
        k = compile_sm90(_histogram_kernel, dict(BLOCK=block, BINS=bins, SHIFT=16 - bins.bit_length() + 1),
                         num_warps=warps)
        ins = sass(k)
        print(f"tl.histogram, {bins} bins: {len(ins)} SASS instructions, "
              f"{len(ins) / (block // (32 * warps)):.1f} per 32 keys of a thread")


def dump_sass(out_dir: str):
    """The sm_90 SASS of the separate DS kernels (score_mma_kernel, decode_attn_kernel with and
    without its fused merge, the three select phases), one file each, so that two trees can be
    compared: run it with each tree first on PYTHONPATH, then diff the directories."""
    from doublesparse.kernels.triton import ds_topk
    os.makedirs(out_dir, exist_ok=True)
    kernels = {"score_mma": compile_sm90(ds_score.score_mma_kernel, dict(
        HKV=8, G=4, R=16, MODE=2, LABEL_FP8=False, LABEL_KIND=0, NUM_PROGS=176, BLOCK_N=64, BLOCK_C=128,
        HKV_P=8, G_P=4, DOT_F32=False), num_warps=4, num_stages=1)}
    for fuse in (False, True):
        kernels[f"decode_attn_fuse{int(fuse)}"] = compile_sm90(decode_attn.decode_attn_kernel, dict(
            G=4, D=128, PER_HEAD=False, HAS_SEL=True, NUM_SPLITS=22, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128,
            DOT_F32=False, FUSE_MERGE=fuse, BLOCK_S=32), num_warps=4, num_stages=2)
    for phase in (1, 2, 3):
        kernels[f"select_phase{phase}"] = compile_sm90(ds_topk.select_kernel, dict(
            PHASE=phase, NUM_PROGS=5, BLOCK_N=4096 if phase == 1 else 1024, ATOMIC_HIST=True, LOOP_STAGES=1,
            MAX_PROGS=16, PREFETCH=phase > 1), num_warps=4, num_stages=3)
    for name, k in kernels.items():
        with open(os.path.join(out_dir, name + ".sass"), "w") as f:
            f.write("\n".join(sass(k)) + "\n")
        print(f"{name}: {len(sass(k))} SASS instructions -> {out_dir}/{name}.sass")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--select", action="store_true")
    ap.add_argument("--consts", default="{}", help="JSON constexprs for --select")
    ap.add_argument("--histogram", action="store_true")
    ap.add_argument("--sass", metavar="DIR", help="write the separate DS kernels' SASS to DIR (to diff two trees)")
    a = ap.parse_args()
    if a.sass:
        dump_sass(a.sass)
        return
    if a.select or a.histogram:
        if a.select:
            select_phases(json.loads(a.consts))
        if a.histogram:
            histogram_cost()
        return
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
