"""The routed-expert MLP: softmax router -> top-k experts per token -> weighted sum (+ shared experts).

Expert weights are stored stacked as two 2-D parameters, ``w13: [E * 2I, H]`` (per expert: gate
rows then up rows) and ``w2: [E * H, I]``, so loaders fill them by row ranges like any merged
projection; the forward views them as ``[E, 2I, H]`` / ``[E, H, I]``.

Two expert paths behind one call (:func:`run_experts`):
  * PyTorch (CPU, and CUDA prefill chunks): tokens sorted by expert, one GEMM pair per expert
    that received tokens. It reads the per-expert counts on the host.
  * Triton, through ``ops.moe_experts`` (CUDA; ``KernelTuning.fused_moe``): steps of at most
    ``moe_decode_max_tokens`` tokens (default 0: the grouped GEMM measured faster) take the decode path (kernels/triton/moe_decode.py: one
    program per expert x N tile, each touched expert's weights streamed once, the weighted sum in
    the down launch, the shared experts as one more expert of both launches), larger ones up to
    GROUPED_MAX_ASSIGNMENTS the grouped GEMM (kernels/triton/moe.py). No host syncs either way, so
    a decode step stays graph-capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ops
from ..kernels.tuning import DEFAULT_TUNING, KernelTuning
from .layers import GatedMLP, fused_impl
from .moe_config import MoEConfig


def route(logits: torch.Tensor, moe: MoEConfig, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, K]`` float32, expert ids ``[T, K]`` int64).

    Softmax over all experts in float32; group-limited routing masks every expert outside the
    ``topk_groups`` groups whose best expert scores highest; then top-k, optionally renormalised,
    times ``routed_scaling_factor``. Device ops only (no host sync). Plain greedy top-k is
    ``ops.moe_route`` with ``impl`` (``fused_impl``'s; None: the PyTorch ops), one launch on the
    Triton path."""
    if not (moe.topk_method == "group_limited_greedy" and moe.num_groups > 1):
        return ops.moe_route(logits, moe.top_k, moe.norm_topk_prob, moe.routed_scaling_factor, impl=impl or "torch")
    probs = logits.float().softmax(dim=-1)
    T, E, G = probs.shape[0], probs.shape[1], moe.num_groups
    best = probs.view(T, G, E // G).amax(dim=-1)                          # [T, G]
    keep = torch.zeros_like(best, dtype=torch.bool)
    keep.scatter_(1, best.topk(moe.topk_groups, dim=-1).indices, True)
    probs = probs.masked_fill(~keep.repeat_interleave(E // G, dim=1), 0.0)
    weights, ids = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; weights: [T, K] float; ids: [T, K] int64
    -> ``sum_k weights[t, k] * down(silu(gate) * up)(x[t])`` of expert ``ids[t, k]``, [T, H] in x's
    dtype (accumulated in float32). Syncs with the device once (the per-expert counts)."""
    T, K = ids.shape
    E, two_i = w13.shape[0], w13.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    tok = order // K
    xs = x.index_select(0, tok)
    out = torch.empty(T * K, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(xs[start:start + n], w13[e]).split(two_i // 2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    scaled = out.float() * weights.reshape(-1)[order, None].float()
    y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, scaled)
    return y.to(x.dtype)


# Above this many (token, expert) assignments (a prefill chunk) the per-expert cuBLAS GEMMs of
# the PyTorch path beat the grouped kernel's 16-row blocks, and a host sync costs nothing there.
GROUPED_MAX_ASSIGNMENTS = 1024


def _plain(mlp: GatedMLP | None) -> bool:
    """Whether a shared-experts MLP is plain weights the Triton expert kernels can read."""
    return mlp is not None and all(p.bias is None and p.packed is None for p in (mlp.gate_up_proj, mlp.down_proj))


def run_experts(x, w13, w2, weights, ids, tuning: KernelTuning = DEFAULT_TUNING, shared_mlp: GatedMLP | None = None,
                decode: bool = False) -> torch.Tensor:
    """The expert sum of :func:`experts_torch` (+ ``shared_mlp(x)``, the shared experts); where
    ``tuning.fused_moe`` allows (CUDA by default) through the Triton paths for decode-sized
    batches and whenever a CUDA graph is being captured (no host syncs), the shared experts' MLP
    in the same launches where ``tuning.moe_fuse_shared`` and their weights allow."""
    impl = fused_impl(tuning.fused_moe, x)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if impl is not None and (ids.numel() <= GROUPED_MAX_ASSIGNMENTS or capturing):
        if tuning.moe_fuse_shared and _plain(shared_mlp):
            return ops.moe_experts(x, w13, w2, weights, ids, None, shared_mlp.gate_up_proj.weight,
                                   shared_mlp.down_proj.weight, impl="triton", tuning=tuning)
        shared = shared_mlp(x, tuning, decode) if shared_mlp is not None else None
        return ops.moe_experts(x, w13, w2, weights, ids, shared, impl="triton", tuning=tuning)
    y = experts_torch(x, w13, w2, weights, ids)
    return y if shared_mlp is None else y + shared_mlp(x, tuning, decode)


class SparseMoE(nn.Module):
    """Router + routed experts (+ always-on shared experts). Parameters: ``gate.weight [E, H]``,
    ``w13 [E * 2I, H]``, ``w2 [E * H, I]``, and ``shared.{gate_up_proj,down_proj}.weight``."""

    def __init__(self, hidden: int, moe: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.moe, self.hidden = moe, hidden
        E, inter = moe.num_experts, moe.intermediate_size
        self.gate = nn.Linear(hidden, E, bias=False, device=device, dtype=dtype)
        self.w13 = nn.Parameter(torch.empty(E * 2 * inter, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(E * hidden, inter, device=device, dtype=dtype))
        self.shared = (GatedMLP(hidden, inter * moe.num_shared_experts, device=device, dtype=dtype)
                       if moe.num_shared_experts else None)

    def router(self, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, K] float32, ids [T, K] int64)."""
        w = self.gate.weight
        logits = F.linear(x.float(), w.float()) if self.moe.router_fp32 else F.linear(x, w)
        impl = fused_impl(tuning.fused_moe, x) if tuning.fused_moe_routing else None
        return route(logits, self.moe, impl)

    def forward(self, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING, decode: bool = False) -> torch.Tensor:
        """x: [T, H] -> [T, H]; ``decode``: as in :class:`~doublesparse.models.layers.Linear`."""
        E, inter = self.moe.num_experts, self.moe.intermediate_size
        weights, ids = self.router(x, tuning)
        return run_experts(x, self.w13.view(E, 2 * inter, self.hidden), self.w2.view(E, self.hidden, inter),
                           weights, ids, tuning, self.shared, decode)

    def extra_repr(self) -> str:
        m = self.moe
        return (f"experts={m.num_experts}, top_k={m.top_k}, intermediate={m.intermediate_size}, "
                f"shared={m.num_shared_experts}")
