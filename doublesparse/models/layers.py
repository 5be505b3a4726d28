"""Building blocks shared by the model families: RMSNorm, a bare linear layer, the SiLU-gated MLP,
and the rotary position embedding (rotate-half / NeoX layout, as HF Llama, with linear, llama3 and
per-frequency scaling).

On CUDA the norms (with the residual add) and SiLU-and-mul run as single fused Triton launches
(``KernelTuning.fused_norm`` / ``fused_silu_mul``); on CPU they are the plain PyTorch ops. Each
forward takes the engine's ``tuning`` (the defaults when called outside the engine).

Parameters are allocated with ``torch.empty`` on the target device and dtype and are never
initialised here: a loader always overwrites them (checkpoint or seeded dummy init), and skipping
nn.Linear's kaiming init is what makes building an 8B model take milliseconds instead of minutes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ops
from ..kernels.tuning import DEFAULT_TUNING, KernelTuning
from .config import ModelConfig
from .packed import refine_top


def fused_impl(flag, x: torch.Tensor) -> str | None:
    """The ``ops`` impl a fused kernel (kernels/triton/fused.py) runs with under ``flag`` (a
    ``KernelTuning.fused_*`` value: "auto" = on CUDA tensors, True = also on CPU under the Triton
    interpreter, False = never) for tensor x, or None (the PyTorch ops; the CPU path never changes)."""
    if flag is True:
        return "triton"
    if flag == "auto" and x.is_cuda:
        return "auto"
    return None


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim; statistics in float32, output in x's dtype.

    ``norm(x)`` -> normed; ``norm(x, residual)`` -> ``(norm(x + residual), x + residual)``, the
    pre-norm decoder's residual stream in one launch on CUDA (vLLM's fused_add_rms_norm).
    """

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                tuning: KernelTuning = DEFAULT_TUNING):
        impl = fused_impl(tuning.fused_norm, x) if x.dim() == 2 else None
        if residual is not None:
            if impl is not None:
                return ops.add_rms_norm(x, residual, self.weight, self.eps, impl=impl, tuning=tuning)
            x = x + residual
            return self._norm(x), x
        if impl is not None:
            return ops.rms_norm(x, self.weight, self.eps, impl=impl, tuning=tuning)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or x.dtype == torch.float32:
            # One op instead of ~8 elementwise ones (decode of small models is bound by per-op
            # overhead, on CUDA and CPU alike); in float32 it is the path below, and in bf16 its
            # rounding differs from it only in the last bit.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Round to the activation dtype before the weight multiply, like HF, so bf16 runs agree.
        return self.weight * xf.to(x.dtype)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W: [out, in]`` (the HF layout), uninitialised.

    ``packed``: None, or a weight-only packed copy of W (models/packed.py, CPU models only) that
    CPU forwards multiply by instead of W: an int4 copy in decode forwards (``decode=True``), a
    bf16 copy in every forward. Both kernels give each row the same result whatever the other
    rows are, so a request's greedy tokens do not depend on the batch it decodes in.
    ``exact_top``: for an LM head, how many largest outputs per row a bf16 copy recomputes in
    float32 (``packed.refine_top``). ``forward(exact=True)`` multiplies by W itself (an LM head's
    rows whose every logit is read: prompt logprobs).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None,
                 exact_top: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.exact_top = in_features, out_features, exact_top
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.packed = None

    def forward(self, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING, decode: bool = False,
                exact: bool = False) -> torch.Tensor:
        p = self.packed
        if p is not None and not exact and x.dim() == 2 and x.device.type == "cpu" and (decode or p.kind == "bf16"):
            y = p.matmul(x)
            if self.bias is not None:
                y = y + self.bias
            if self.exact_top and p.kind == "bf16" and self.weight.dtype == torch.float32:
                y = refine_top(y, x, self.weight, self.exact_top, self.bias)
            return y
        return ops.linear(x, self.weight, self.bias, tuning)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up merged into one GEMM ``[2I, H]``."""

    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, device=device, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING, decode: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, tuning, decode)       # [T, 2I]
        impl = fused_impl(tuning.fused_silu_mul, gate_up) if gate_up.dim() == 2 else None
        if impl is not None:
            return self.down_proj(ops.silu_mul(gate_up, impl=impl, tuning=tuning), tuning, decode)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up, tuning, decode)


# ------------------------------------------------------------------ rotary position embedding

def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 after the config's rope scaling."""
    d = config.head_dim
    # float32 exponentiation, as HF does it, so cos/sin match the reference bit-for-bit at fp32.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / rs["factor"]
    if kind == "freq_factors":
        factors = torch.tensor(rs["factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} entries, expected {inv_freq.numel()}")
        return inv_freq / factors
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the original context) are slowed down by `factor`, short ones kept,
        # and the band in between is blended linearly in 1/wavelength.
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        middle = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(middle, blended, out)
    raise ValueError(f"unsupported rope_type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q/k given absolute positions, from a cos/sin table precomputed on the device.

    The table is indexed with ``positions`` (a device gather, no host sync), so the op is safe
    inside CUDA graphs. Positions past ``max_positions`` are out of range: size the table for the
    longest sequence you will run.
    """

    def __init__(self, config: ModelConfig, max_positions: int | None = None, device=None):
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        cos, sin = self._table(device)
        # Not persistent: derived from the config, so it must not appear in state dicts.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, device):
        inv_freq = rope_inv_freq(self.config).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2] float32
        return freqs.cos(), freqs.sin()

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round the table too; rebuild it in float32 instead.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = self._table(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T] int64; q: [T, Hq, D]; k: [T, Hkv, D] -> rotated (q, k), same dtypes.

        The rotation is done in float32 and rounded once, which is at least as accurate as
        rotating in bf16.
        """
        # ops.rope can run one Triton launch on CUDA instead of the PyTorch form's ~20 tiny
        # launches per layer, which set the decode step time of small models (see ops.rope).
        return ops.rope(positions, q, k, self.cos, self.sin)

    def rotate_and_store(self, positions, q, k, v, targets, slots, return_k: bool = False,
                         impl: str = "auto", tuning: KernelTuning = DEFAULT_TUNING, qk_norm=None):
        """RoPE fused with the KV store (one launch on CUDA): rotated k, v and k's label go into
        the pools at ``slots`` [T] int64. targets: ``(k_cache, v_cache, label_cache, label_scale,
        channels, k_scale, v_scale)`` from ``AttentionBackend.store_targets`` (the label entries
        None: no labels; the scales: an fp8 pool's).
        q: [T, Hq, D]; k, v: [T, Hkv, D] (views of the qkv output are fine); qk_norm: None or
        ``(q_weight, k_weight, eps)``, per-head RMSNorm of q and k first, in the same launch.
        Returns the rotated ``(q [T, Hq, D], k [T, Hkv, D] or None unless return_k)``, contiguous."""
        k_cache, v_cache, label_cache, label_scale, channels, k_scale, v_scale = targets
        return ops.rope_store(positions, q, k, v, self.cos, self.sin, k_cache, v_cache, slots,
                              label_cache, label_scale, channels, k_scale, v_scale, return_k=return_k,
                              impl=impl, tuning=tuning, qk_norm=qk_norm)
