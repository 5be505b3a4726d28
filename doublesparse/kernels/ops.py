"""Public kernel entry points. Each dispatches to the Triton kernels (CUDA tensors, or
``impl="triton"`` under ``TRITON_INTERPRET=1`` for tests) or to batched float32 PyTorch
(:mod:`.torch_ops`, the engine's pure-PyTorch CPU path, checked against the references).

The data layout is described in docs/design.md and in :mod:`doublesparse.kernels.reference`.
Launch parameters and kernel choices come in a ``tuning`` argument (:class:`.tuning.KernelTuning`,
the defaults when omitted); the PyTorch path ignores it.
Every function here is free of host syncs on the Triton path, so decode can be captured in a
CUDA graph: lengths are read from device tensors and all buffers come from a :class:`DecodeWorkspace`.

K/V pools may be fp8 (``float8_e4m3fn`` / ``float8_e5m2``, ``--kv-cache-dtype``): every function that
touches them then takes the layer's ``k_scale`` and ``v_scale`` ([1] float32 device tensors; read on
the device, so still no host sync). Stores write ``clamp(x / scale, +-max)`` rounded to nearest even;
readers use ``value * scale``. Labels keep their own dtype and ``label_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import reference as ref
from . import torch_ops
from .tuning import DEFAULT_TUNING, KernelTuning
from .workspace import DecodeWorkspace

__all__ = ["DecodeWorkspace", "DSDecodeArgs", "store_kv", "dense_decode", "attention_lse", "ds_decode", "rope",
           "MODES", "rms_norm", "add_rms_norm", "silu_mul", "rope_store", "linear", "moe_experts",
           "moe_route", "mla_absorb", "mla_unabsorb"]

MODES = ref.MODES


@dataclass(frozen=True)
class DSDecodeArgs:
    """What a Double Sparsity decode call selects with, beside the tensors it reads. The engine's
    backend builds one per step (and selection mode) in its ``plan``; inside a CUDA graph ``k`` is
    the step's static device tensor and the rest are host values that only size and pick launches.

    k: ``[B]`` int32 on q's device, request b's k: it decodes sparsely iff ``seq_lens[b] > k[b]``,
    attending to exactly its k[b] selected tokens, else densely in the same launches (a dense
    request carries any k >= its length, e.g. ``attention.budget.DENSE``). Read on the device only.
    k_max: a host int >= 1, an upper bound of every sparse request's k and at most the workspace's
    ``k_max``; it only sizes the kernels' grids and split-K (the PyTorch path ignores it). Only
    this bound is checked (k lives on the device): the caller must ensure ``1 <= k[b] <= k_max``
    for every sparse request (the kernels cut a larger k[b] to k_max, so that no write leaves the
    workspace; the result is then not the reference's) and ``num_sink + num_recent <= k[b]`` (else
    which forced positions are kept is unspecified).
    mode: the selection mode (:data:`MODES`). num_sink, num_recent: the first and last tokens every
    sparse row selects, inside its k.
    top_p in (0, 1] (0: off): the top-p budget: each selection row (per KV head, or per query head
    in ``per_head`` mode) of a sparse request attends only to the smallest part of its k[b]
    selected tokens whose estimated attention weight (softmax of the label scores over the
    request's tokens other than the forced ones) reaches top_p of the total, with at least
    ``top_p_min_k`` tokens (forced ones included) and every forced token; ties at the threshold
    are kept (``reference.topp_keep_ref``). Decided on the device.
    tuning: the kernels' launch parameters and choices.
    """

    k: torch.Tensor
    k_max: int
    mode: str = "group_max"
    num_sink: int = 0
    num_recent: int = 0
    top_p: float = 0.0
    top_p_min_k: int = 0
    tuning: KernelTuning = DEFAULT_TUNING

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if int(self.k_max) <= 0:
            raise ValueError(f"k_max must be positive, got {self.k_max}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.mode == "layer" and self.top_p > 0:
            raise ValueError("the layer selection mode takes no top-p budget")
        if self.num_sink < 0 or self.num_recent < 0 or self.num_sink + self.num_recent > self.k_max:
            raise ValueError(f"need 0 <= num_sink + num_recent <= k_max, got {self.num_sink} + "
                             f"{self.num_recent} (k_max={self.k_max})")

    def rows(self, a: int, b: int) -> "DSDecodeArgs":
        """The same call for batch rows ``a:b`` (k a view of its rows)."""
        return replace(self, k=self.k[a:b])


def _use_triton(t: torch.Tensor, impl: str) -> bool:
    if impl == "auto":
        return t.is_cuda
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def store_kv(k_cache, v_cache, k, v, slots, label_cache=None, label_scale=None, channels=None,
             k_scale=None, v_scale=None, impl: str = "auto", k_label=None):
    """Write new tokens into the pools, and their K label if ``label_cache`` is given.

    k_cache, v_cache: [S, Hkv, D] (bf16/fp16/fp32, or fp8 with k_scale, v_scale [1] float32);
    k, v: [N, Hkv, D]; slots: [N] int32/int64;
    label_cache: [S, Hkv, r] bf16 | float8_e4m3fn; label_scale: [1] float32 (fp8);
    channels: [Hkv, r] int32. The label is taken from the unquantized ``k_label`` [N, Hkv, D]
    (default k; the unrotated K where k is rotated, attention/k_rotation.py).
    """
    if _use_triton(k, impl):
        from .triton.launch import store_kv as _store
        return _store(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels, k_scale, v_scale,
                      k_label)
    from .triton.common import check_store_args
    check_store_args(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels, k_scale, v_scale, k_label)
    ref.store_ref(k_cache, v_cache, label_cache, label_scale, k, v, slots, channels, k_scale, v_scale, k_label)


def dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale: float,
                 ws: DecodeWorkspace | None = None, out=None, impl: str = "auto",
                 tuning: KernelTuning = DEFAULT_TUNING, k_scale=None, v_scale=None):
    """Exact decode attention over each request's whole cache.

    q: [B, Hq, D]; k_scale, v_scale: an fp8 pool's scales; returns (or fills ``out``) [B, Hq, D]
    in q's dtype.
    """
    if _use_triton(q, impl):
        from .triton.launch import dense_decode as _dense
        return _dense(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out, tuning=tuning,
                      k_scale=k_scale, v_scale=v_scale)
    o = torch_ops.dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale,
                               k_scale, v_scale).to(q.dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o


def attention_lse(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale: float, ws=None, sel=None,
                  k=None, row_ks=None, per_head: bool = False, impl: str = "auto",
                  tuning: KernelTuning = DEFAULT_TUNING, k_scale=None, v_scale=None):
    """Exact decode attention that also gives each query head's log-sum-exp, for measurements
    (the sampled recall: the share of a head's attention on a set of tokens is
    ``exp(lse over the set - lse over the whole cache)``).

    q: [B, Hq, D]; pools, req_to_token, req_idx, seq_lens as in :func:`dense_decode`. ``sel`` None:
    over each request's whole cache. Else ``sel`` [B, R, K] int32 KV slots (R = Hkv, or Hq with
    ``per_head``; a row shared by every head may come as a stride-0 expansion) and ``k`` [B] int32:
    each row attends to its first ``k[b]`` slots (``row_ks`` [B, R] int32: per row). Returns
    ``(out [B, Hq, D], lse [B, Hq] float32, natural log of the sum of exp(sm_scale * q . k))``; out
    in q's dtype on the Triton path, float32 on the PyTorch path. ``ws``: a workspace of at least B
    rows (no Double Sparsity buffers needed)."""
    if _use_triton(q, impl):
        from .triton.launch import attention_lse as _lse
        return _lse(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, sel, k, row_ks, per_head,
                    tuning, k_scale, v_scale)
    return torch_ops.attention_lse(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, sel, k,
                                   row_ks, per_head, k_scale, v_scale)


def ds_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
              seq_lens, sm_scale: float, args: DSDecodeArgs, ws: DecodeWorkspace | None = None, out=None,
              impl: str = "auto", row_counts=None, k_scale=None, v_scale=None, q_label=None):
    """Double Sparsity decode: label scores -> each request's top-k on device -> exact attention
    on those tokens, with a k per request in one batch (and one CUDA graph); ``args``
    (:class:`DSDecodeArgs`) says how each request selects.

    q: [B, Hq, D]; pools (and an fp8 pool's k_scale, v_scale), req_to_token, req_idx, seq_lens as
    in :func:`dense_decode` and :mod:`.reference`; label_cache [S, Hkv, r], label_scale [1]
    float32 (fp8 labels), channels [Hkv, r] int32. ``ws``: a workspace with Double Sparsity
    buffers of at least ``args.k_max`` (``layer_select`` for the layer mode).
    q_label: the query whose ``channels`` entries the label scores read, [B, Hq, D] (default q;
    the unrotated q where q and the K pool are rotated and the labels are not,
    attention/k_rotation.py); the attention reads q.
    row_counts: an optional ``[B, R]`` int32 (R = Hq for ``per_head``, else Hkv) filled with the
    tokens each row attended to (its length where the request decodes densely); for evaluation
    and benchmarks only (on the Triton path it adds device ops after the call).
    Returns (or fills ``out``) [B, Hq, D] in q's dtype.
    """
    if _use_triton(q, impl) and args.mode == "layer":
        from .triton.ds_layer import ds_decode_layer
        o = ds_decode_layer(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
                            seq_lens, sm_scale, args, ws, out, k_scale=k_scale, v_scale=v_scale, q_label=q_label)
        if row_counts is not None:
            _fill_row_counts(row_counts, ws, seq_lens, args)
        return o
    if _use_triton(q, impl):
        from .triton.ds_launch import ds_decode as _ds
        o = _ds(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
                seq_lens, sm_scale, args, ws, out, k_scale=k_scale, v_scale=v_scale, q_label=q_label)
        if row_counts is not None:
            _fill_row_counts(row_counts, ws, seq_lens, args)
        return o
    o = torch_ops.ds_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token,
                            req_idx, seq_lens, sm_scale, args, row_counts, k_scale, v_scale, q_label).to(q.dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o


def _fill_row_counts(row_counts, ws, seq_lens, args: DSDecodeArgs):
    """row_counts [B, R] after a Triton-path ds_decode: the kernels' per-row counts (top-p) or
    each request's k (capped as the kernels cap it), its length where it decodes densely."""
    if args.top_p > 0:
        row_counts.copy_(ws.row_k[: row_counts.shape[0], : row_counts.shape[1]])
        return
    lens, k = seq_lens.long(), args.k.long()
    n = torch.where(lens > k, k.clamp(max=int(args.k_max)), lens)
    row_counts.copy_(n[:, None].expand_as(row_counts))


def rope(positions, q, k, cos, sin, impl: str = "auto"):
    """Rotate-half RoPE. positions: [T] int; q: [T, Hq, D]; k: [T, Hkv, D] (last dim contiguous);
    cos, sin: [max_pos, D/2] float32. Returns new contiguous (q, k) in their dtypes, computed in
    float32 and rounded once."""
    if _use_triton(q, impl):
        from .triton.launch import rope as _rope
        return _rope(positions, q, k, cos, sin)
    return torch_ops.rope(positions, q, k, cos, sin)


# ------------------------------------------------------------- fused layer steps
# One launch each on the Triton path (kernels/triton/fused.py); the "torch" path is the float32
# reference. The model's CPU path does not call these (it keeps its own PyTorch ops, whose
# results the CPU tests pin); the model calls them on CUDA (models/layers.py, models/llama.py).

def linear(x, weight, bias=None, tuning: KernelTuning = DEFAULT_TUNING):
    """``F.linear``; on CUDA a decode step's projections of a few rows run through Triton instead:
    small weights through the GEMV (kernels/triton/gemv.py), larger ones through the one-launch
    split-K GEMM (kernels/triton/skinny.py). x: [T, K]; weight: [N, K]."""
    if x.is_cuda:
        from .triton.fused_launch import gemv, gemv_fits, skinny_fits, skinny_gemm
        if gemv_fits(x, weight, tuning):
            return gemv(x, weight, bias, tuning=tuning)
        if skinny_fits(x, weight, tuning):
            return skinny_gemm(x, weight, bias, tuning=tuning)
    return torch.nn.functional.linear(x, weight, bias)


def rms_norm(x, weight, eps: float, impl: str = "auto", tuning: KernelTuning = DEFAULT_TUNING):
    """x: [T, N]; weight: [N] -> ``x / rms(x) * weight`` [T, N] in x's dtype (fp32 statistics)."""
    if _use_triton(x, impl):
        from .triton.fused_launch import rms_norm as _norm
        return _norm(x, weight, eps, tuning=tuning)
    return ref.rmsnorm_ref(x, weight, eps)


def add_rms_norm(x, residual, weight, eps: float, impl: str = "auto", tuning: KernelTuning = DEFAULT_TUNING):
    """x, residual: [T, N] -> ``(rmsnorm(x + residual) * weight, x + residual)``, both in x's
    dtype; the sum is rounded before the statistics (= the unfused add, then norm)."""
    if _use_triton(x, impl):
        from .triton.fused_launch import rms_norm as _norm
        return _norm(x, weight, eps, residual, tuning=tuning)
    return ref.add_rmsnorm_ref(x, residual, weight, eps)


def silu_mul(x, impl: str = "auto", tuning: KernelTuning = DEFAULT_TUNING):
    """x: [T, 2I] (gate | up) -> ``silu(gate) * up`` [T, I] in x's dtype, fp32 math rounded once."""
    if _use_triton(x, impl):
        from .triton.fused_launch import silu_mul as _silu_mul
        return _silu_mul(x, tuning=tuning)
    return ref.silu_mul_ref(x)


def rope_store(positions, q, k, v, cos, sin, k_cache, v_cache, slots, label_cache=None,
               label_scale=None, channels=None, k_scale=None, v_scale=None, return_k: bool = False,
               impl: str = "auto", tuning: KernelTuning = DEFAULT_TUNING, qk_norm=None):
    """RoPE of q and k fused with :func:`store_kv` of the rotated k (and its label) and v;
    ``qk_norm = (q_weight [D], k_weight [D], eps)``: each head of q and k RMS-normed first (Qwen3).

    positions, slots: [T] int; q: [T, Hq, D]; k, v: [T, Hkv, D] (views of the qkv GEMM output
    are fine, last dim contiguous); cos, sin: [max_pos, D/2] float32; pools as in store_kv.
    Returns ``(q_rot [T, Hq, D], k_rot [T, Hkv, D] or None unless return_k)``, contiguous, in
    q's dtype; the pools get exactly what ``store_kv(rope(q, k)[1], v)`` writes.
    """
    if _use_triton(q, impl):
        from .triton.fused_launch import rope_store as _rope_store
        return _rope_store(positions, q, k, v, cos, sin, k_cache, v_cache, slots, label_cache,
                           label_scale, channels, return_k, tuning=tuning, k_scale=k_scale, v_scale=v_scale,
                           qk_norm=qk_norm)
    from .triton.common import check_store_args
    check_store_args(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels, k_scale, v_scale)
    qr, kr = ref.rope_store_ref(positions, q, k, v, cos, sin, k_cache, v_cache, slots, label_cache,
                                label_scale, channels, k_scale, v_scale, qk_norm=qk_norm)
    return qr, (kr if return_k else None)


def moe_experts(x, w13, w2, weights, ids, shared=None, shared_w13=None, shared_w2=None, impl: str = "auto",
                tuning: KernelTuning = DEFAULT_TUNING):
    """The routed experts of an MoE layer (+ the shared experts' output ``shared``, or their MLP
    ``shared_w13`` / ``shared_w2``, if given).

    x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; weights: [T, K] float;
    ids: [T, K] int; shared: [T, H] or None; shared_w13: [2Is, H] and shared_w2: [H, Is] or None
    -> [T, H] in x's dtype. On the Triton path steps of at most ``tuning.moe_decode_max_tokens``
    tokens run the decode path (kernels/triton/moe_decode.py: one launch pair, the sum, ``shared``
    and the shared MLP fused), larger ones the grouped GEMM (moe.py) with the shared MLP through
    :func:`linear` and its output added in the expert sum's launch; both without host syncs. The
    "torch" path is the float32 reference.
    """
    if _use_triton(x, impl):
        from .triton.moe_decode import decode_fits, moe_decode
        if decode_fits(x, ids.shape[1], tuning):
            return moe_decode(x, w13, w2, weights, ids, shared, shared_w13=shared_w13, shared_w2=shared_w2,
                              tuning=tuning)
        from .triton.moe import fused_experts
        add = shared
        if shared_w13 is not None:
            s_out = linear(silu_mul(linear(x, shared_w13, tuning=tuning), impl=impl, tuning=tuning), shared_w2,
                           tuning=tuning)
            add = s_out if shared is None else s_out + shared
        return fused_experts(x, w13, w2, weights, ids, add=add,  # the add inside the expert sum's launch
                             one_launch_layout=tuning.fused_moe_routing)
    return ref.moe_experts_ref(x, w13, w2, weights, ids, shared, shared_w13, shared_w2).to(x.dtype)


def moe_route(logits, top_k: int, renorm: bool, scale: float = 1.0, impl: str = "auto"):
    """An MoE router's greedy top-k: logits [T, E] float -> (weights [T, top_k] float32, ids
    [T, top_k] int64): softmax over E in float32, the top_k largest (descending), divided by their
    sum if ``renorm``, times ``scale``. Triton: one launch (kernels/triton/moe_route.py); PyTorch:
    the device ops, the CPU path of models/moe.py's ``route`` (ties broken as torch.topk breaks them)."""
    if _use_triton(logits, impl):
        from .triton.moe_route import ROUTE_MAX_EXPERTS, route_topk
        if logits.shape[-1] <= ROUTE_MAX_EXPERTS:  # (more experts than one program holds: the ops)
            return route_topk(logits, top_k, renorm, scale)
    w, ids = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return (w * scale if scale != 1.0 else w), ids


def mla_absorb(q, kv, positions, cos, sin, w_uk, norm_weight, eps: float, q_scale: float, impl: str = "auto"):
    """MLA's absorbed query and latent row (models/mla.py). q: [T, nh, dn + dr] (q_proj's output as
    heads); kv: [T, R + dr] (kv_a_proj's output, c_kv | k_rope; RoPE pairs interleaved as in the
    checkpoint); positions [T] int; cos, sin: [P, dr/2] float32; w_uk: [nh, dn, R] (kv_b_proj's key
    half); norm_weight: [R] (kv_a_norm) -> (``[q_nope W_UK | rope(q_rope)] * q_scale`` [T, nh, R + dr],
    ``[rmsnorm(c_kv) | rope(k_rope)]`` [T, 1, R + dr]), RoPE outputs in rotate-half order, float32
    math rounded once to q's dtype. Triton: one launch (kernels/triton/mla_proj.py), at most
    ``latent.MLA_PROJ_MAX_TOKENS`` tokens."""
    if _use_triton(q, impl):
        from .triton.mla_proj import mla_absorb as _absorb
        return _absorb(q, kv, positions, cos, sin, w_uk, norm_weight, eps, q_scale)
    return ref.mla_absorb_ref(q, kv, positions, cos, sin, w_uk, norm_weight, eps, q_scale)


def mla_unabsorb(out, w_uv, impl: str = "auto"):
    """out: [T, nh, >= R] (the latent attention's output); w_uv: [nh, dv, R] (kv_b_proj's value
    half) -> [T, nh * dv] (o_proj's input), float32 sums rounded once. Triton: one launch."""
    if _use_triton(out, impl):
        from .triton.mla_proj import mla_unabsorb as _unabsorb
        return _unabsorb(out, w_uv)
    return ref.mla_unabsorb_ref(out, w_uv)

