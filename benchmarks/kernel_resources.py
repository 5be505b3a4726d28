"""Compile the Triton DS decode kernels for sm_90 on a machine without a GPU and print their registers.

    python benchmarks/kernel_resources.py [--tuning FILE.json] [--block-n 64]
    python benchmarks/kernel_resources.py --select [--consts '{"LOOP_STAGES": 2}']
    python benchmarks/kernel_resources.py --histogram
    python benchmarks/kernel_resources.py --sass DIR
    python benchmarks/kernel_resources.py --families

Uses Triton's own compiler and the cuobjdump its NVIDIA backend ships (no GPU needed). The shapes
are Llama-3.1-8B's (32 q / 8 KV heads, d 128, r 16, group_max, bf16 labels); pointer and stride
arguments are marked 16-divisible, as Triton specializes them at run time for these shapes. The
constexprs, warps and stages are the ones the launchers (kernels/triton/launch.py, ds_launch.py)
derive from a ``KernelTuning`` (``--tuning FILE.json``: a JSON object of field: value, as
``--kernel-tuning``; default: the defaults) on an H200's 132 SMs: the mma score
(``score_impl`` "mma", ds_score.py) and the sparse attention at 3 x 64K, the select phases
(``select_impl`` "triton", ds_select.py) at 16 x 32K (one part). On a GPU the defaults run the
CUDA C++ score and select (kernels/cuda/) instead, which this does not compile. For the score it
also counts the asynchronous copies (cp.async) in the PTX. ``--select``: the three top-k select
phases with their SASS instruction and barrier counts; ``--consts`` overrides constexprs of
select_kernel. ``--histogram``: SASS instructions of a bare ``tl.histogram`` of 4096 keys per
program (4 warps) at 256 down to 16 bins, per 32 keys a thread handles. ``--families``: the
kernels of the MoE experts (Mixtral top-2, top-8), the latent attention (16 to 128 heads per program) and
DS-Offload's host gather (D 64 / 128 / 576, the launcher's program size and 32 entries),
at their launchers' settings.
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

from doublesparse.kernels.triton import decode_attn, ds_score, ds_select
from doublesparse.kernels.tuning import KernelTuning
from doublesparse.kernels.workspace import SELECT_MAX_PROGS

NSM = 132  # an H200's SMs
HKV, G, R = 8, 4, 16  # Llama-3.1-8B, r = 16

PTRS = dict(q_ptr="*bf16", label_ptr="*bf16", scale_ptr="*fp32", scores_ptr="*fp16", k_cache_ptr="*bf16",
            v_cache_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16")


def compile_sm90(fn, consts, ptrs=None, **opts):
    names = fn.arg_names
    types = {**PTRS, **(ptrs or {})}
    sig = {n: "constexpr" if n in consts else types.get(n, "*i32") if n.endswith("_ptr")
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def score_mma(t: KernelTuning, block_n: int | None = None, B: int = 3, L: int = 65536):
    """score_mma_kernel as ds_launch._score_mma launches it for B x L (block_n: override the tile)."""
    block_c = HKV * R
    bn = block_n or max(16, min(t.mma_block_n, 16384 // block_c))
    P = max(1, min(_cdiv(t.mma_programs_per_sm * NSM, B), _cdiv(L, bn)))
    return compile_sm90(ds_score.score_mma_kernel, dict(
        HKV=HKV, G=G, R=R, MODE=2, LABEL_FP8=False, LABEL_KIND=0, NUM_PROGS=P, BLOCK_N=bn, BLOCK_C=block_c,
        HKV_P=HKV, G_P=G, DOT_F32=False), num_warps=t.mma_warps, num_stages=1), bn


def sparse_attn(t: KernelTuning, B: int = 3, L: int = 65536):
    """decode_attn_kernel over a selection of k = L/16, as ds_launch's attention step launches it."""
    rows = B * HKV
    bn = t.attn_block_n_many_rows if rows >= NSM else t.attn_block_n
    dense = min(64, _cdiv(t.attn_programs_per_sm * NSM, rows), _cdiv(L, bn))
    splits = max(1, min(64, _cdiv(t.sparse_attn_programs_per_sm * NSM, rows), max(_cdiv(L // 16, bn), dense)))
    return compile_sm90(decode_attn.decode_attn_kernel, dict(
        G=G, D=128, PER_HEAD=False, HAS_SEL=True, NUM_SPLITS=splits, BLOCK_H=16, BLOCK_N=bn, BLOCK_D=128,
        DOT_F32=False),
        num_warps=t.attn_warps, num_stages=t.sparse_attn_stages), bn, splits


def select_phase(t: KernelTuning, phase: int, consts: dict | None = None, B: int = 16, L: int = 32768):
    """ds_select.select_kernel's phase as ds_launch._select launches it for B x L (Triton select)."""
    rows = B * HKV
    if phase == 1:
        block, per_sm, loop_stages, max_progs = t.hist_block_n, t.hist_programs_per_sm, t.select_loop_stages, None
    else:
        block, per_sm, max_progs = t.select_block_n, t.select_programs_per_sm, SELECT_MAX_PROGS
        loop_stages = t.select_loop_stages if phase == 2 else t.compact_loop_stages
    P = max(1, min(_cdiv(per_sm * NSM, rows), _cdiv(L, block)))
    P = min(P, max_progs) if max_progs else P
    c = dict(PHASE=phase, NUM_PROGS=P, BLOCK_N=block, LOOP_STAGES=loop_stages,
             MAX_PROGS=SELECT_MAX_PROGS)
    c.update(consts or {})
    return compile_sm90(ds_select.select_kernel, c, num_warps=t.select_warps, num_stages=t.select_stages)


def select_phases(t: KernelTuning, consts: dict):
    names = ds_select.select_kernel.arg_names
    unknown = sorted(set(consts) - set(names))
    if unknown:
        raise SystemExit(f"select_kernel has no parameters {unknown}")
    for phase in (1, 2, 3):
        k = select_phase(t, phase, consts)
        ins = sass(k)
        print(f"{ds_select.PHASE_NAMES[phase]} {json.dumps(consts)}: {resources(k)}, {len(ins)} SASS "
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


def dump_sass(t: KernelTuning, out_dir: str):
    """The sm_90 SASS of the separate Triton DS kernels (score_mma_kernel, decode_attn_kernel, the
    three select phases), one file each, so that two trees (or two
    tunings) can be compared: run it with each tree first on PYTHONPATH, then diff the directories."""
    os.makedirs(out_dir, exist_ok=True)
    kernels = {"score_mma": score_mma(t)[0]}
    kernels["decode_attn"] = sparse_attn(t)[0]
    for phase in (1, 2, 3):
        kernels[f"select_phase{phase}"] = select_phase(t, phase)
    for name, k in kernels.items():
        with open(os.path.join(out_dir, name + ".sass"), "w") as f:
            f.write("\n".join(sass(k)) + "\n")
        print(f"{name}: {len(sass(k))} SASS instructions -> {out_dir}/{name}.sass")


def families():
    """Registers and stack of the MoE, latent-attention and host-gather kernels (see module doc)."""
    from doublesparse.kernels.triton import host_gather, latent_attn, moe

    bf16 = dict(x_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16", rows_ptr="*i64", wt_ptr="*fp32", o_ptr="*fp32",
                q_ptr="*bf16", kv_ptr="*bf16", src_k_ptr="*bf16", src_v_ptr="*bf16", dst_k_ptr="*bf16",
                dst_v_ptr="*bf16", src_row_ptr="*i64", dst_row_ptr="*i64", head_ptr="*i64", valid_ptr="*i8")
    for topk in (2, 8):
        k = compile_sm90(moe._gate_up_kernel, dict(K=topk, BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64), bf16,
                         num_warps=4)
        print(f"moe gate_up (top-{topk}, 4 warps): {resources(k)}")
    k = compile_sm90(moe._down_kernel, dict(BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64), bf16, num_warps=4)
    print(f"moe down (4 warps): {resources(k)}")
    for bh in (16, 32, 64, 128):  # 16: DeepSeek-V2-Lite's heads; 128: DeepSeek-V2's in one program
        k = compile_sm90(latent_attn.latent_attn_kernel, dict(DN=512, DR=64, HAS_SEL=True, NUM_SPLITS=8,
                         BLOCK_H=bh, BLOCK_N=32, DOT_F32=False), bf16, num_warps=8, num_stages=2)
        print(f"latent_attn ({bh} heads per program, DS selection, 8 warps): {resources(k)}")
    for d in (64, 128, 576):
        bd = triton.next_power_of_2(d)
        for be in sorted({min(host_gather.MAX_ENTRIES, max(2, host_gather.ELEMS_PER_PROGRAM // bd)), 32}):
            k = compile_sm90(host_gather.copy_rows_kernel, dict(D=d, BLOCK_E=be, BLOCK_D=bd), bf16, num_warps=4)
            print(f"host gather D={d}, {be} entries per program (4 warps): {resources(k)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tuning", metavar="FILE.json", default=None,
                    help="KernelTuning overrides (JSON object of field: value) the launch geometry follows")
    ap.add_argument("--block-n", type=int, default=None, help="the mma score's tile (default: from the tuning)")
    ap.add_argument("--select", action="store_true")
    ap.add_argument("--consts", default="{}", help="JSON constexprs of select_kernel for --select")
    ap.add_argument("--histogram", action="store_true")
    ap.add_argument("--sass", metavar="DIR", help="write the separate DS kernels' SASS to DIR (to diff two trees)")
    ap.add_argument("--families", action="store_true", help="the MoE, latent-attention and host-gather kernels")
    a = ap.parse_args()
    t = KernelTuning.from_json(a.tuning) if a.tuning else KernelTuning()
    if a.families:
        families()
        return
    if a.sass:
        dump_sass(t, a.sass)
        return
    if a.select or a.histogram:
        if a.select:
            select_phases(t, json.loads(a.consts))
        if a.histogram:
            histogram_cost()
        return
    k, bn = score_mma(t, a.block_n)
    print(f"score_mma_kernel block_n={bn}, {t.mma_warps} warps: {resources(k)}, "
          f"cp.async in PTX: {len(re.findall(r'cp[.]async', k.asm['ptx']))}")
    k, bn, splits = sparse_attn(t)
    print(f"decode_attn_kernel (sparse, block {bn}, {splits} splits, {t.sparse_attn_stages} stages): "
          f"{resources(k)}")


if __name__ == "__main__":
    main()
