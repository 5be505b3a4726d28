"""Vectorised torch dequantizers for llama.cpp's GGML block formats.

A quantized GGUF tensor is a run of fixed-size blocks (32 or 256 weights each); these functions
turn the raw bytes into float32 weights with whole-tensor torch ops, on whatever device the bytes
are on, so a GPU dequantizes its own weights while loading. The block layouts follow ggml's
``block_q*`` structs (all little-endian); ``gguf.quants.dequantize`` (numpy) is the reference the
tests compare against, and types without a torch version here fall back to it.

    dequantize(raw uint8 [..., row_bytes], qtype, out=None) -> float32 [..., row_elems]
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

_CHUNK_BLOCKS = (
    1 << 16
)  # blocks per pass: bounds the temporaries (16.7M weights for K-quants)

# Each kernel writes block weights into ``o`` (float32 [N, block]) from raw blocks ``b`` (uint8
# [N, block_bytes]): quants are converted straight into ``o`` and scaled in place there, which
# on CPU halves the passes over memory compared with building the result from temporaries.


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[N, 2] uint8 -> [N, 1] float32 (ggml_half)."""
    return b.contiguous().view(torch.float16).float()


def _put_nibbles(o: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Legacy blocks: low nibbles of ``qs`` [N, 16] are weights 0..15, high nibbles 16..31."""
    o[:, :16].copy_(qs & 0x0F)
    o[:, 16:].copy_(qs >> 4)
    return o


def _bits(qh: torch.Tensor, n: int) -> torch.Tensor:
    """[N, n // 8] uint8 little-endian bit field -> [N, n] uint8 of 0/1 (bit j of the field)."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], n)


def _q4_0(b, o):
    _put_nibbles(o, b[:, 2:18]).sub_(8).mul_(_f16(b[:, 0:2]))


def _q4_1(b, o):
    _put_nibbles(o, b[:, 4:20]).mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))


def _q5_0(b, o):
    _put_nibbles(o, b[:, 6:22]).add_(_bits(b[:, 2:6], 32), alpha=16).sub_(16).mul_(
        _f16(b[:, 0:2])
    )


def _q5_1(b, o):
    _put_nibbles(o, b[:, 8:24]).add_(_bits(b[:, 4:8], 32), alpha=16)
    o.mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))


def _q8_0(b, o):
    o.copy_(b[:, 2:34].contiguous().view(torch.int8)).mul_(_f16(b[:, 0:2]))


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K block header -> per-sub-block scale ``d * sc`` and offset ``dmin * m``, each
    [N, 4, 2, 1] float32 (sub-block 2i + j). The 12 packed bytes hold 8 six-bit scales and 8
    six-bit mins (ggml's ``get_scale_min_k4``: sub-blocks 4..7 borrow their top two bits from
    bytes 0..7)."""
    s = b[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return (d * sc).view(-1, 4, 2, 1), (dmin * mn).view(-1, 4, 2, 1)


def _put_k_low_bits(o: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K quants [N, 128] -> ``o`` viewed [N, 4, 2, 32]: 64-weight chunk i stores
    sub-block 2i in the low nibbles of its 32 bytes and sub-block 2i + 1 in the high ones."""
    o4, q = o.view(-1, 4, 2, 32), qs.reshape(-1, 4, 32)
    o4[:, :, 0].copy_(q & 0x0F)
    o4[:, :, 1].copy_(q >> 4)
    return o4


def _q4_k(b, o):
    scale, offset = _k_scales(b)
    _put_k_low_bits(o, b[:, 16:144]).mul_(scale).sub_(offset)


def _q5_k(b, o):
    scale, offset = _k_scales(b)
    o4 = _put_k_low_bits(o, b[:, 48:176])
    # qh byte l holds the fifth bit of weight l of every sub-block: bit j for sub-block j.
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 4, 2, 1)
    o4.add_((b[:, 16:48].view(-1, 1, 1, 32) >> shifts) & 1, alpha=16).mul_(scale).sub_(
        offset
    )


def _q6_k(b, o):
    # Per 128-weight half h: bytes ql[64h:64h+64], qh[32h:32h+32]; quarter j of the half takes
    # the low (j = 0, 1) or high (j = 2, 3) nibble of ql's first (j even) or second 32 bytes,
    # plus bits 2j, 2j+1 of qh as bits 4, 5; each 16 weights have their own int8 scale.
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(
        1, 1, 4, 1
    )
    high = ((qh >> shifts) & 3) << 4
    q = torch.cat([(ql & 0x0F) | high[:, :, 0:2], (ql >> 4) | high[:, :, 2:4]], dim=2)
    o.view(-1, 2, 4, 32).copy_(q.view(torch.int8) - 32)  # 6-bit values: 0..63 fit int8
    scale = b[:, 192:208].contiguous().view(torch.int8).float() * _f16(b[:, 208:210])
    o.view(-1, 16, 16).mul_(scale.unsqueeze(-1))


def _q2_k(b, o):
    # 16 sub-blocks of 16: byte i of scales[16] holds sub-block i's scale (low nibble) and min
    # (high nibble); weight l of quarter j of half h is bits 2j, 2j+1 of qs[32h + l].
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    scale, offset = (
        (d * (sc & 0x0F)).view(-1, 16, 1),
        (dmin * (sc >> 4)).view(-1, 16, 1),
    )
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(
        1, 1, 4, 1
    )
    o.view(-1, 2, 4, 32).copy_((b[:, 16:80].view(-1, 2, 1, 32) >> shifts) & 3)
    o.view(-1, 16, 16).mul_(scale).sub_(offset)


def _q3_k(b, o):
    # Like Q2_K's quants, plus a high bit from hmask (bit 4h + j of hmask[l]; clear means -4);
    # 16 six-bit scales (offset by 32): low nibbles from bytes 0..7 (high nibbles for scales
    # 8..15), top two bits from bytes 8..11.
    s = b[:, 96:108]
    i = torch.arange(16, device=b.device)
    nib = (s[:, i % 8] >> (4 * (i // 8)).to(torch.uint8)) & 0x0F
    top = (s[:, 8 + i % 4] >> (2 * (i // 4)).to(torch.uint8)) & 3
    scale = _f16(b[:, 108:110]) * ((nib | (top << 4)).view(torch.int8) - 32).float()
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(
        1, 1, 4, 1
    )
    low = (b[:, 32:96].view(-1, 2, 1, 32) >> shifts) & 3
    hbit = (
        b[:, 0:32].view(-1, 1, 1, 32)
        >> torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 2, 4, 1)
    ) & 1
    o.view(-1, 2, 4, 32).copy_((low | (hbit << 2)).view(torch.int8) - 4)
    o.view(-1, 16, 16).mul_(scale.unsqueeze(-1))


_TORCH_DEQUANT = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
_FLOAT_VIEWS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
TORCH_TYPES = frozenset(_TORCH_DEQUANT) | frozenset(_FLOAT_VIEWS)
"""Types dequantized in torch; any other type ``gguf`` can read goes through its numpy reference."""


def dequantize(
    raw: torch.Tensor, qtype: T, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Raw GGUF tensor bytes ``uint8 [..., row_bytes]`` -> float32 ``[..., row_elems]``.

    Runs on ``raw``'s device. ``out`` (any float dtype, ``[..., row_elems]``, on the same device)
    receives the result chunk by chunk, so the float32 copy of a large tensor never exists whole.
    """
    qtype = T(qtype)
    if raw.dtype != torch.uint8:
        raise TypeError(f"dequantize expects raw uint8 bytes, got {raw.dtype}")
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    lead, row_bytes = tuple(raw.shape[:-1]), raw.shape[-1]
    if row_bytes % block_bytes:
        raise ValueError(
            f"{qtype.name}: row of {row_bytes} bytes is not a whole number of "
            f"{block_bytes}-byte blocks"
        )
    shape = (*lead, row_bytes // block_bytes * block)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=raw.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if qtype in _FLOAT_VIEWS:
        out.copy_(raw.contiguous().view(_FLOAT_VIEWS[qtype]).reshape(shape))
        return out
    blocks, flat = raw.reshape(-1, block_bytes), out.view(-1, block)
    fn = _TORCH_DEQUANT.get(qtype)
    for lo in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[lo : lo + _CHUNK_BLOCKS]
        dst = flat[lo : lo + chunk.shape[0]]
        if fn is None:
            from gguf.quants import dequantize as np_dequantize

            ref = np_dequantize(chunk.cpu().numpy(), qtype)
            dst.copy_(torch.from_numpy(np.ascontiguousarray(ref)).reshape(-1, block))
        elif dst.dtype == torch.float32:
            fn(chunk, dst)
        else:  # scale in float32, round once into the destination's dtype
            tmp = torch.empty(dst.shape, dtype=torch.float32, device=dst.device)
            fn(chunk, tmp)
            dst.copy_(tmp)
    return out
