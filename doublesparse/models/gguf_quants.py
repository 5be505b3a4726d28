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
)  # blocks per pass: bounds the int/float temporaries (16.7M weights for K-quants)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[N, 2] uint8 -> [N, 1] float32 (ggml_half)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, 16] uint8 -> [N, 32] uint8: low nibbles are weights 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor, n: int) -> torch.Tensor:
    """[N, n // 8] uint8 little-endian bit field -> [N, n] uint8 of 0/1 (bit j of the field)."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], n)


def _q4_0(b):
    return (_nibbles(b[:, 2:18]).float() - 8) * _f16(b[:, 0:2])


def _q4_1(b):
    return _nibbles(b[:, 4:20]).float() * _f16(b[:, 0:2]) + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)
    return (q.float() - 16) * _f16(b[:, 0:2])


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
    return q.float() * _f16(b[:, 0:2]) + _f16(b[:, 2:4])


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b[:, 0:2])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes -> 8 six-bit scales and 8 six-bit mins, each [N, 8] float32
    (ggml's ``get_scale_min_k4``: sub-blocks 4..7 borrow their top two bits from bytes 0..7)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _k_low_bits(qs: torch.Tensor) -> torch.Tensor:
    """[N, 128] uint8 -> [N, 8, 32]: 64-weight chunk i stores sub-block 2i in the low nibbles of
    its 32 bytes and sub-block 2i + 1 in the high ones."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_low_bits(b[:, 16:144]).float()
    return (d.unsqueeze(-1) * sc.unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(
        -1, 256
    )


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    # qh byte l holds the fifth bit of weight l of every sub-block: bit j for sub-block j.
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1
    q = (_k_low_bits(b[:, 48:176]) | (high << 4)).float()
    return (d.unsqueeze(-1) * sc.unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(
        -1, 256
    )


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [half, -, l]
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 16, 1)
    d = _f16(b[:, 208:210]).unsqueeze(-1)
    low = torch.cat(
        [ql & 0x0F, ql >> 4], dim=2
    )  # [half, 4 quarters, l]: low/high nibble of bytes 0-31/32-63
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(
        1, 1, 4, 1
    )
    high = (qh >> shifts) & 3
    q = (
        low | (high << 4)
    ).float() - 32  # [N, 2, 4, 32]: 128 weights per half, quarter-major
    # Each quarter of 32 weights is two sub-blocks of 16 with their own int8 scale.
    return (d * sc * q.reshape(-1, 16, 16)).reshape(-1, 256)


_TORCH_DEQUANT = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
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
        if fn is not None:
            flat[lo : lo + chunk.shape[0]] = fn(chunk)
        else:
            from gguf.quants import dequantize as np_dequantize

            ref = np_dequantize(chunk.cpu().numpy(), qtype)
            flat[lo : lo + chunk.shape[0]] = torch.from_numpy(
                np.ascontiguousarray(ref)
            ).reshape(-1, block)
    return out
