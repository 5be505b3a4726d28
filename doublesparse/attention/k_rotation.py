"""An orthogonal rotation of q and K per KV head before an fp8 K/V cache stores K
(``--kv-cache-k-rotation``, on by default with ``--kv-cache-dtype fp8_*``).

Why: an fp8 value keeps 3 (e4m3) or 2 (e5m2) mantissa bits, a relative error of up to 2^-4 / 2^-3
per element whatever the scale. A score ``q . k`` sums ``q_i k_i (1 + e_i)``, so its error is
carried by the few channels where both q and K are large (the outlier channels Double Sparsity
selects by), not averaged over all D. Rotating both by the same orthogonal R (QuaRot's online
rotation after RoPE) leaves every score unchanged, ``(q R) . (k R) = q . k``, and spreads each
outlier over many channels of the stored K, which then round independently. On SmolLM2-135M K
carries almost all of the fp8 error and the rotation removes most of it, while the per-layer
scale (kv_scales.py) changes nothing there: it only moves the range (docs/accuracy.md).

R is Hadamard blocks: a normalised Sylvester Hadamard on each power-of-two part of the binary
decomposition of the width, one block diagonal of width D per head, with or without Double Sparsity.
Double Sparsity's label path stays in the unrotated space: the labels are written from the unrotated
K's label channels ``ch`` [Hkv, r] and the label score reads the unrotated q's, so the selection is
the one over an unrotated cache (labels in their own dtype, from the unquantized K), while the
attention over the selected tokens reads the rotated q and the rotated, quantized K with the full
rotation's accuracy. The backends keep both: ``forward`` rotates q and k and passes the unrotated
ones on as ``q_label`` / ``k_label`` (the store's label source, ``ops.store_kv``, whose kernel reads
the label from it instead of k; the score stage's query, ``ops.ds_decode``, whose score and
attention are separate launches, so no kernel does more work). An earlier form gave the label
channels their own Hadamard block (:func:`rotation_matrices` with ``channels``), which keeps the
label score exact in the rotated space but mixes an outlier only over r channels: on SmolLM2-135M it
left Double Sparsity over fp8 1.03 perplexity points above it over the model's cache at 8K
(docs/accuracy.md); ``benchmarks/fp8_kv_error.py``'s ``-rotds`` variant still measures it.

The pools and every reader of K see only the rotated K (prefill, decode, the recall probe's exact
attention), the labels and every label score the unrotated K and q (decode's selection,
DS-Offload's selection and prefetch, the recall probe's PyTorch re-selection); V and the output
are untouched. R [L, Hkv, D, D] stays a device tensor in the model's dtype, [L, 1, D, D] where
the heads share it (:func:`shared`, the engine's case: then applying it is one GEMM for q and one
for k per layer, over all heads' rows); no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import math

import torch

ROTATION_CHOICES = ("auto", "hadamard", "none")


def hadamard(n: int) -> torch.Tensor:
    """The ``[n, n]`` float32 Sylvester Hadamard matrix over sqrt(n) (orthogonal, symmetric);
    n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard needs a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard_blocks(n: int) -> torch.Tensor:
    """``[n, n]`` float32 orthogonal: block diagonal of :func:`hadamard` on the binary
    decomposition of n, largest first (n = 48: 32 + 16)."""
    out = torch.zeros(n, n)
    o = 0
    while o < n:
        b = 1 << ((n - o).bit_length() - 1)
        out[o:o + b, o:o + b] = hadamard(b)
        o += b
    return out


def rotation_matrices(num_layers: int, num_kv_heads: int, head_dim: int,
                      channels: torch.Tensor | None = None) -> torch.Tensor:
    """R ``[num_layers, num_kv_heads, D, D]`` float32 on the CPU (module docstring): Hadamard
    blocks over all D (the engine's, with or without Double Sparsity). channels:
    ``[num_layers, num_kv_heads, r]`` int label channels for the earlier form with the label
    channels in their own block (measurements only), or None."""
    D = head_dim
    if channels is None:
        return hadamard_blocks(D).expand(num_layers, num_kv_heads, D, D).clone()
    ch = channels.detach().to("cpu", torch.long)
    if tuple(ch.shape[:2]) != (num_layers, num_kv_heads):
        raise ValueError(f"channels {tuple(ch.shape)} do not match {num_layers} layers x {num_kv_heads} KV heads")
    r = ch.shape[-1]
    hr, hc = hadamard_blocks(r), hadamard_blocks(D - r) if r < D else None
    out = torch.zeros(num_layers, num_kv_heads, D, D)
    for layer in range(num_layers):
        for h in range(num_kv_heads):
            sel = ch[layer, h]
            rest = torch.ones(D, dtype=torch.bool)
            rest[sel] = False
            if int(rest.sum()) != D - r:
                raise ValueError(f"layer {layer} head {h}: label channels {sel.tolist()} repeat a channel")
            out[layer, h][sel[:, None], sel[None, :]] = hr
            if hc is not None:
                idx = rest.nonzero().flatten()
                out[layer, h][idx[:, None], idx[None, :]] = hc
    return out


def shared(rot: torch.Tensor) -> torch.Tensor:
    """R ``[L, Hkv, D, D]`` -> ``[L, 1, D, D]`` where every KV head of a layer has the same R (the
    engine's Hadamard blocks), else R unchanged. Compares on R's device: call it once, at set-up."""
    return rot[:, :1].clone() if torch.equal(rot, rot[:, :1].expand_as(rot)) else rot


def rotate(q: torch.Tensor, k: torch.Tensor | None, rot: torch.Tensor):
    """``(q R, k R)`` per KV head: q [T, Hq, D] (query head j uses KV head j // (Hq / Hkv)), k
    [T, Hkv, D] or None, rot [Hkv, D, D] (one layer's R) or [1, D, D] (one R for every head, as
    :func:`shared` leaves it) -> same shapes, contiguous, in q's / k's dtype."""
    T, Hq, D = q.shape
    Hkv = rot.shape[0]
    if Hkv == 1:  # one GEMM each over all heads' rows, no layout copies (a decode step's launches)
        r = rot[0]
        return (q @ r.to(q.dtype)).contiguous(), None if k is None else (k @ r.to(k.dtype)).contiguous()
    # one GEMM per KV head (einsum batches over h; a broadcast matmul would copy R per token)
    qr = torch.einsum("thgd,hde->thge", q.reshape(T, Hkv, Hq // Hkv, D), rot.to(q.dtype)).reshape(T, Hq, D)
    kr = None if k is None else torch.einsum("thd,hde->the", k, rot.to(k.dtype)).contiguous()
    return qr.contiguous(), kr


def resolve(choice: str, kv_fp8: bool, latent: bool, default_scales: bool = True) -> bool:
    """Whether K is rotated: ``auto`` with an fp8 K/V cache at the default scale of 1.0 (not where
    the scales come from a file or the checkpoint: those were measured on unrotated K, and a
    rotated row can have a larger entry than the scale's range was cut to; never for an MLA latent
    pool, whose K is also its V), ``hadamard`` always (refused for a latent pool), ``none`` never."""
    if choice not in ROTATION_CHOICES:
        raise ValueError(f"kv_cache_k_rotation must be one of {ROTATION_CHOICES}, got {choice!r}")
    if choice == "hadamard" and latent:
        raise ValueError("kv_cache_k_rotation=hadamard: an MLA latent pool stores K and V as one "
                         "latent; use auto or none")
    return choice == "hadamard" or (choice == "auto" and kv_fp8 and default_scales and not latent)


def describe(rot: torch.Tensor | None, channels: torch.Tensor | None) -> str:
    """The startup line's words for the rotation in use."""
    if rot is None:
        return "K not rotated"
    D = rot.shape[-1]
    if channels is None:
        return f"q/K rotated (Hadamard blocks of {D})"
    return f"q/K rotated (Hadamard blocks of {D}; labels and label scores unrotated)"
