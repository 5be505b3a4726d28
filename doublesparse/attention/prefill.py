"""Dense prefill attention for one request segment, through torch SDPA.

``prefill_sdpa(q, k, v, prefix_len, scale, mask)``: queries ``q [Hq, n, D]`` at positions
``prefix_len ..``, keys/values ``[Hkv, prefix_len + n, D]`` (the cached prefix, then the segment's
own tokens). Causal: query i sees keys ``0 .. prefix_len + i``.

Backends on CUDA, measured on an H200 (Llama-3.1-8B
heads, bf16). Whole prompts (no prefix, top-left causal) run 1.7x faster on cuDNN than on flash
(595 vs 344 TFLOPS at 32K; 586 vs 310 at 8K). But torch keeps one built cuDNN execution graph per
problem shape, in a per-thread map it never shrinks (aten's cudnn/MHA.cpp), and recent torch puts
cuDNN first on Hopper by itself: an engine whose prompt lengths varied kept ~400 KB of host heap
per request on an H100, and none with one prompt length (``python -m doublesparse.bench.heap``,
``--fixed-len``), as such a cache would. So no
call reaches cuDNN by torch's own order: every call names its backends, and cuDNN sees only rows
rounded up to :func:`bucket` (16 lengths an octave, at most 1/16 padding), from
``CudnnShapes.min_rows`` rows, and only ``KernelTuning.cudnn_graphs`` distinct shapes a backend
(:class:`CudnnShapes`); any other call runs on flash. Padding is exact: a causal call's padded
queries and keys come after every real one (no real query sees them) and its padded output rows
are dropped; an unmasked call pads only its queries. A chunk after a prefix is one lower-right
``CausalBias`` call, which torch dispatches to flash (343 TFLOPS), else the memory-efficient
kernel. Backends switched off globally (``torch.backends.cuda.enable_*_sdp(False)``) stay off.

``KernelTuning.prefill_split_prefix``: a chunk after a prefix as two calls that return their log-sum-exp, the chunk
against the prefix (no mask) and the chunk against itself (top-left causal), merged exactly, so that
both halves run on cuDNN. Measured on the H200: a
4096-token chunk after 28K cached tokens 6.06 -> 4.67 ms per layer, 8192 after 24K 11.3 -> 7.66 ms;
bench_one_batch prefill of 3 x 60K tokens 12.8 -> 11.7 s with 4096-token chunks, 12.5 -> 10.3 s
with 16384. cuDNN builds a graph per new shape (40-80 ms; about 1 s for the first split call of a
process, which ``warmup`` takes at start-up), so by default (``None``) the split runs on CUDA for
chunks of at least ``SPLIT_MIN_TOKENS`` tokens: full chunks, whose (chunk, prefix) shapes recur.
True: wherever the inputs allow (CPU included: tests); False: never. On CUDA only for bf16/fp16
inputs with cuDNN enabled, and only where the backend's :class:`CudnnShapes` takes both calls'
shapes (else one masked call on flash). So that the prefix call's key lengths recur whatever a
cached prefix's length, it stops at ``CudnnShapes.split_point`` (a multiple of ``SPLIT_ALIGN`` or
of 1/32-1/64 of the prefix) and the causal call takes the rest of the prefix as leading rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..kernels import parts
from ..kernels.tuning import DEFAULT_TUNING, KernelTuning

CUDNN_MIN_TOKENS = 1024
SPLIT_MIN_TOKENS = 4096
SPLIT_ALIGN = 1024
_CUDNN_FIRST = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH)
_NO_CUDNN = _CUDNN_FIRST[1:]


def bucket(n: int) -> int:
    """``n`` rounded up to one of 16 lengths an octave (powers of two stay): at most n / 16 more."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 5)
    return -(-n // step) * step


class CudnnShapes:
    """Which problem shapes this backend lets cuDNN build a graph for: at most ``cap`` of them,
    each with at least ``min_rows`` query rows (fewer rows: flash, whose cost there is small and
    whose lengths vary most). ``align``: the split path's prefix call covers the prefix up to a
    multiple of this (or of 1/32-1/64 of the prefix, if more), so its key lengths recur too.
    ``any_device``: take CPU calls too (tests of the padding)."""

    def __init__(self, cap: int, min_rows: int = CUDNN_MIN_TOKENS, align: int = SPLIT_ALIGN,
                 any_device: bool = False):
        self.cap, self.min_rows, self.align, self.any_device = cap, min_rows, align, any_device
        self._taken: set[tuple] = set()

    def __len__(self) -> int:
        return len(self._taken)

    def rows(self, q, n: int, kv_len: int, causal: bool, heads: int, kv_heads: int) -> int | None:
        """The rows a call of ``heads`` x ``n`` query rows (q's dtype, head dim and device) against
        ``kv_len`` keys of ``kv_heads`` heads is padded to for cuDNN, or None: it runs on flash."""
        if not (q.is_cuda or self.any_device) or not _fused_gqa(q) or n < self.min_rows:
            return None
        if q.is_cuda and not torch.backends.cuda.cudnn_sdp_enabled():
            return None
        nb = bucket(n)
        key = (causal, heads, kv_heads, nb, nb if causal else kv_len, q.shape[-1], q.dtype)
        if key not in self._taken:
            if len(self._taken) >= self.cap:
                return None
            self._taken.add(key)
        return nb

    def split_point(self, prefix_len: int) -> int:
        """Where the split path's unmasked prefix call stops: ``prefix_len`` rounded down to a
        multiple of ``align`` (or of 1/32-1/64 of it, if more). At most 64 values below 64 x align,
        32 an octave above; the rest of the prefix joins the causal call."""
        step = max(self.align, 1 << max(0, prefix_len.bit_length() - 6))
        return prefix_len - prefix_len % step


def prefill_sdpa(q, k, v, prefix_len: int, scale: float, mask=None,
                 tuning: KernelTuning = DEFAULT_TUNING, shapes: CudnnShapes | None = None) -> torch.Tensor:
    """q: [Hq, n, D]; k, v: [Hkv, prefix_len + n, D]; mask: the segment's lower-right CausalBias when
    it has a prefix (built here if None); shapes: what cuDNN may take (None: nothing).
    Returns [Hq, n, D] in q's dtype."""
    if prefix_len:
        plan = _split_plan(q, k.shape[0], prefix_len, shapes) if use_split(q, tuning.prefill_split_prefix) else None
        if plan is not None:
            return _split_prefix(q, k, v, scale, *plan)
        if mask is None:
            mask = causal_lower_right(q.shape[1], k.shape[1])
        return _sdpa(q, k, v, mask, scale)
    return _sdpa(q, k, v, None, scale, shapes)


def _fused_gqa(q) -> bool:
    """Whether flash / cuDNN take this call with fewer K/V heads than query heads (enable_gqa):
    half-precision inputs with a head dim they support. Measured as fast as repeating K/V."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def repeat_kv(q, k, v):
    g = q.shape[0] // k.shape[0]
    return k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)


def _pad_rows(x, rows: int):
    """x [H, n, D] -> [H, rows, D], contiguous, zeros after row n."""
    return F.pad(x, (0, 0, 0, rows - x.shape[1])) if rows > x.shape[1] else x.contiguous()


def _sdpa(q, k, v, mask, scale, shapes: CudnnShapes | None = None):
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
        with _backend_order(_NO_CUDNN, q):
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                  enable_gqa=gqa)[0]
    n = q.shape[1]
    rows = shapes.rows(q, n, n, True, q.shape[0], k.shape[0]) if shapes is not None else None
    if rows is None:
        with _backend_order(_NO_CUDNN, q):
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                                  enable_gqa=gqa)[0]
    q, k, v = _pad_rows(q, rows), _pad_rows(k, rows), _pad_rows(v, rows)
    with _backend_order(_CUDNN_FIRST, q):
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                           enable_gqa=gqa)[0]
    return o[:, :n]


def _enabled(b) -> bool:
    return {SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
            SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
            SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
            SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}[b]()


def _backend_order(order, q):
    """Only ``order``'s backends, in its order, for a CUDA call (CPU calls: torch's choice)."""
    if not q.is_cuda:
        return contextlib.nullcontext()
    order = [b for b in order if _enabled(b)]  # never re-enable what the user switched off
    if not order:  # the user left only backends outside ``order``: theirs
        return contextlib.nullcontext()
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without set_priority: the named backends, torch's order
        return sdpa_kernel(order)


def use_split(q, split_prefix: bool | None) -> bool:
    if split_prefix is False:
        return False
    if not q.is_cuda:
        return bool(split_prefix)  # CPU: only when forced (tests); one call is the fast path there
    if split_prefix is None and q.shape[1] < SPLIT_MIN_TOKENS:
        return False
    # The private cuDNN op skips SDPA's input checks: only the inputs cuDNN is known to take.
    return _fused_gqa(q) and torch.backends.cuda.cudnn_sdp_enabled()


def _split_plan(q, kv_heads: int, prefix_len: int, shapes: CudnnShapes | None):
    """(keys of the unmasked prefix call, its rows, rows of the causal call) for the split, or
    None: no split. The causal call takes the chunk and the prefix past the first call's keys.
    On CUDA both calls must be cuDNN's (on flash one masked call is faster than two); on the CPU
    (tests) the split runs, padded where ``shapes`` takes CPU calls."""
    Hq, n = q.shape[0], q.shape[1]
    if shapes is None:
        return None if q.is_cuda else (prefix_len, None, None)
    p1 = shapes.split_point(prefix_len)
    r1 = shapes.rows(q, Hq // kv_heads * n, p1, False, kv_heads, kv_heads) if p1 else None
    r2 = shapes.rows(q, prefix_len - p1 + n, prefix_len - p1 + n, True, Hq, Hq)
    if q.is_cuda and ((p1 and r1 is None) or r2 is None):
        return None
    return p1, r1, r2


def warmup(device, dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
           tuning: KernelTuning = DEFAULT_TUNING, shapes: CudnnShapes | None = None) -> None:
    """Take the split path's one-time start-up cost (about 1 s on the H200) now, not in the first
    long request's time to first token. No-op where the split would not run."""
    q = torch.randn(num_q_heads, SPLIT_MIN_TOKENS, head_dim, device=device, dtype=dtype)
    if shapes is None or not use_split(q, tuning.prefill_split_prefix):
        return
    k = torch.randn(num_kv_heads, 2 * SPLIT_MIN_TOKENS, head_dim, device=device, dtype=dtype)
    prefill_sdpa(q, k, k, SPLIT_MIN_TOKENS, head_dim ** -0.5, tuning=tuning, shapes=shapes)


def _split_prefix(q, k, v, scale, p1: int, rows1: int | None, rows2: int | None):
    """q [Hq, n, D] after k, v [Hkv, L, D]'s first L - n: the chunk against keys [0, p1) with no
    mask, then against keys [p1, L) causally (the keys before the chunk as leading rows whose
    output is dropped), merged by log-sum-exp."""
    Hq, n, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    q = q.contiguous()  # once, for both calls
    # The chunk against itself is causal by query position, which folding would break: repeat its
    # keys (the chunk's own n and the prefix's last L - n - p1, not the whole prefix) over the group.
    k2, v2 = k[:, p1:], v[:, p1:]
    if G > 1:
        k2, v2 = repeat_kv(q, k2, v2)
    o2, lse2 = sdpa_with_lse(q, k2, v2, True, scale, rows2, lead=k2.shape[1] - n)
    if not p1:
        return o2
    # The chunk against the prefix has no mask, so the G query heads of one KV head fold into its
    # query rows (query head h uses KV head h // G): one call over Hkv heads, no K/V repeated.
    o1, lse1 = sdpa_with_lse(q.view(Hkv, G * n, D), k[:, :p1], v[:, :p1], False, scale, rows1)
    o1, lse1 = o1.reshape(Hq, n, D), lse1.reshape(Hq, n, 1)
    if q.is_cuda:
        # One Triton pass instead of ~8 PyTorch elementwise ops: ~15 ms less kernel time per 32K
        # prompt in 16384-token chunks, measured on an H200.
        return parts.lse_merge(o1, o2, lse1[..., 0].contiguous(), lse2[..., 0].contiguous())
    # CPU: softmax over the union of the two key sets = the two partial softmaxes weighted by their mass
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def sdpa_with_lse(q, k, v, causal: bool, scale, rows: int | None = None, lead: int = 0):
    """(out [H, n, D], natural-log log-sum-exp [H, n, 1] float32) of softmax(q k^T * scale) v,
    equal head counts. lead (causal only): q's rows sit at keys lead.., the call's first ``lead``
    rows are zeros whose output is dropped. rows: pad the call's rows (and a causal call's keys,
    lead + n == L) to this many for cuDNN (see :class:`CudnnShapes`); None: flash. CPU: the flash
    CPU kernel (tests), padded as asked."""
    H, n, _ = q.shape
    cudnn = rows is not None
    assert not lead or causal, "lead rows only for a causal call"
    assert not causal or k.shape[1] == lead + n, (q.shape, k.shape, lead)
    total = lead + n
    rows = total if rows is None else rows
    assert rows >= total, (rows, total)
    # contiguous BHSD (the engine's q is a transposed [n, H, D] view, and the private ops are not
    # known to take every stride pattern the public dispatcher accepts): one copy that also pads
    q = F.pad(q, (0, 0, lead, rows - total)) if rows > n else q.contiguous()
    k, v = (_pad_rows(k, rows), _pad_rows(v, rows)) if causal else (k.contiguous(), v.contiguous())
    if not q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, scale=scale)
    elif cudnn:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q[None], k[None], v[None], None, True, 0.0, causal, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q[None], k[None], v[None], 0.0, causal, False, scale=scale)
    out, lse = res[0][0], res[1].reshape(H, -1)
    if out.shape[1] != n:
        out, lse = out[:, lead:total].contiguous(), lse[:, lead:total]
    return out, lse.float().reshape(H, n, 1)
