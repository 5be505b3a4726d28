"""Dense prefill attention for one request segment, through torch SDPA.

``prefill_sdpa(q, k, v, prefix_len, scale, mask)``: queries ``q [Hq, n, D]`` at positions
``prefix_len ..``, keys/values ``[Hkv, prefix_len + n, D]`` (the cached prefix, then the segment's
own tokens). Causal: query i sees keys ``0 .. prefix_len + i``.

Backends on CUDA, measured on an H200 (Llama-3.1-8B
heads, bf16). Whole prompts (no prefix, top-left causal) run 1.7x faster on cuDNN than on flash
(595 vs 344 TFLOPS at 32K; 586 vs 310 at 8K). cuDNN builds an execution graph for every new shape
(its cost not yet measured here; ``git show 2fcf640^:benchmarks/prefill_attn_sweep.py`` recorded
first-call times), so
cuDNN goes first only from ``CUDNN_MIN_TOKENS`` query tokens, where one call saves the most;
shorter prompts, whose lengths vary, keep torch's own order (flash first). A chunk after a prefix
is one lower-right ``CausalBias`` call, which torch dispatches to flash (343 TFLOPS), else the
memory-efficient kernel, whatever the backend order. Backends switched off globally
(``torch.backends.cuda.enable_*_sdp(False)``) stay off.

``KernelTuning.prefill_split_prefix``: a chunk after a prefix as two calls that return their log-sum-exp, the chunk
against the prefix (no mask) and the chunk against itself (top-left causal), merged exactly, so that
both halves run on cuDNN. Measured on the H200: a
4096-token chunk after 28K cached tokens 6.06 -> 4.67 ms per layer, 8192 after 24K 11.3 -> 7.66 ms;
bench_one_batch prefill of 3 x 60K tokens 12.8 -> 11.7 s with 4096-token chunks, 12.5 -> 10.3 s
with 16384. cuDNN builds a graph per new shape (40-80 ms; about 1 s for the first split call of a
process, which ``warmup`` takes at start-up), so by default (``None``) the split runs on CUDA for
chunks of at least ``SPLIT_MIN_TOKENS`` tokens: full chunks, whose (chunk, prefix) shapes recur.
True: wherever the inputs allow (CPU included: tests); False: never. On CUDA only for bf16/fp16
inputs with cuDNN enabled.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..kernels import parts
from ..kernels.tuning import DEFAULT_TUNING, KernelTuning

CUDNN_MIN_TOKENS = 16384
_ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
          SDPBackend.MATH)
SPLIT_MIN_TOKENS = 4096


def prefill_sdpa(q, k, v, prefix_len: int, scale: float, mask=None,
                 tuning: KernelTuning = DEFAULT_TUNING) -> torch.Tensor:
    """q: [Hq, n, D]; k, v: [Hkv, prefix_len + n, D]; mask: the segment's lower-right CausalBias when
    it has a prefix (built here if None). Returns [Hq, n, D] in q's dtype."""
    if prefix_len:
        if use_split(q, tuning.prefill_split_prefix):
            return _split_prefix(q, k, v, prefix_len, scale)
        if mask is None:
            mask = causal_lower_right(q.shape[1], k.shape[1])
        return _sdpa(q, k, v, mask, scale)
    return _sdpa(q, k, v, None, scale)


def _fused_gqa(q) -> bool:
    """Whether flash / cuDNN take this call with fewer K/V heads than query heads (enable_gqa):
    half-precision inputs with a head dim they support. Measured as fast as repeating K/V."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def repeat_kv(q, k, v):
    g = q.shape[0] // k.shape[0]
    return k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)


def _sdpa(q, k, v, mask, scale):
    """One causal SDPA call. mask: None (top-left causal, n == L) or a lower-right CausalBias.

    With unequal head counts on CUDA, calls that flash / cuDNN cannot take (e.g. fp32) would fall
    back to the math kernel, which materialises an [n, L] score matrix per head (13 GiB at 60K
    tokens): those repeat K/V over the group instead (G x [L, D] transiently) and keep a fused kernel.
    """
    gqa = k.shape[0] != q.shape[0]
    if q.is_cuda and gqa and not _fused_gqa(q):
        k, v = repeat_kv(q, k, v)
        gqa = False
    if mask is not None:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)[0]
    cudnn_first = q.is_cuda and q.shape[1] >= CUDNN_MIN_TOKENS
    with _backend_order(_ORDER) if cudnn_first else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                              enable_gqa=gqa)[0]


def _enabled(b) -> bool:
    return {SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
            SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
            SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
            SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}[b]()


def _backend_order(order):
    order = [b for b in order if _enabled(b)]  # never re-enable what the user switched off
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without set_priority: its own order, all backends allowed
        return contextlib.nullcontext()


def use_split(q, split_prefix: bool | None) -> bool:
    if split_prefix is False:
        return False
    if not q.is_cuda:
        return bool(split_prefix)  # CPU: only when forced (tests); one call is the fast path there
    if split_prefix is None and q.shape[1] < SPLIT_MIN_TOKENS:
        return False
    # The private cuDNN op skips SDPA's input checks: only the inputs cuDNN is known to take.
    return _fused_gqa(q) and torch.backends.cuda.cudnn_sdp_enabled()


def warmup(device, dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
           tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """Take the split path's one-time start-up cost (about 1 s on the H200) now, not in the first
    long request's time to first token. No-op where the split would not run."""
    q = torch.randn(num_q_heads, SPLIT_MIN_TOKENS, head_dim, device=device, dtype=dtype)
    if not use_split(q, tuning.prefill_split_prefix):
        return
    k = torch.randn(num_kv_heads, 2 * SPLIT_MIN_TOKENS, head_dim, device=device, dtype=dtype)
    prefill_sdpa(q, k, k, SPLIT_MIN_TOKENS, head_dim ** -0.5, tuning=tuning)


def _split_prefix(q, k, v, prefix_len, scale):
    Hq, n, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    q = q.contiguous()  # once, for both calls
    # The chunk against the prefix has no mask, so the G query heads of one KV head fold into its
    # query rows (query head h uses KV head h // G): one call over Hkv heads, no K/V repeated.
    o1, lse1 = sdpa_with_lse(q.view(Hkv, G * n, D), k[:, :prefix_len], v[:, :prefix_len], False, scale)
    o1, lse1 = o1.reshape(Hq, n, D), lse1.reshape(Hq, n, 1)
    # The chunk against itself is causal by query position, which folding would break: repeat the
    # chunk's own K/V (n tokens, not the prefix) over the group.
    k2, v2 = k[:, prefix_len:], v[:, prefix_len:]
    if G > 1:
        k2, v2 = repeat_kv(q, k2, v2)
    o2, lse2 = sdpa_with_lse(q, k2, v2, True, scale)
    if q.is_cuda:
        # One Triton pass instead of ~8 PyTorch elementwise ops: ~15 ms less kernel time per 32K
        # prompt in 16384-token chunks, measured on an H200.
        return parts.lse_merge(o1, o2, lse1[..., 0].contiguous(), lse2[..., 0].contiguous())
    # CPU: softmax over the union of the two key sets = the two partial softmaxes weighted by their mass
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def sdpa_with_lse(q, k, v, causal: bool, scale):
    """(out [H, n, D], natural-log log-sum-exp [H, n, 1] float32) of softmax(q k^T * scale) v,
    equal head counts. CUDA: cuDNN's kernel; CPU: the flash CPU kernel (tests)."""
    H, n, _ = q.shape
    if q.is_cuda:
        # contiguous BHSD: the engine's q is a transposed [n, H, D] view, and the private op is
        # not known to take every stride pattern the public dispatcher accepts
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q[None], k[None], v[None], None, True, 0.0, causal, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, scale=scale)
    out, lse = res[0], res[1]
    return out[0], lse.float().reshape(H, n, 1)
