"""Weight-only packed copies of the linear layers for CPU decode.

A CPU decode step of a small model reads every weight once to multiply it by a few rows, so its
time is the time to stream the weights from memory: SmolLM2-135M's float32 weights are ~540 MB
per token. The GGUF these models ship as holds them in 4 bits already, and torch has a CPU kernel
that multiplies bf16 activations by int4 weights (groups of 32 along K, a scale and an offset
each) without widening them in memory. So after loading,
each :class:`~doublesparse.models.layers.Linear` of a CPU model gets a packed copy:

* int4, when every group of 32 weights along K is an exact 16-level grid (``min + scale * q``,
  q in 0..15): what a GGUF Q4_1 tensor dequantizes to, so the int4 copy holds the same weights
  (its scale and offset rounded to bf16);
* bf16 otherwise (e.g. SmolLM2's tied Q8_0 embedding as the LM head), through oneDNN's
  prepacked bf16 GEMM where torch has it (AMX / AVX512-BF16 CPUs), else ``F.linear`` in bf16.

Decode forwards multiply by the int4 copies; prefill forwards keep the float weights (a prefill
computes many rows per weight it reads, and the int4 kernel's time grows with the rows). A bf16
copy serves every forward, so the logits of a prompt's last token come from the same copy
whatever the prefill batch. Both kernels give a row the same result
whatever rows share the forward, so a request's tokens do not depend on its batch (the float GEMM
does not promise that, which is why the choice follows the forward's kind, not its size). The
activations are rounded to bf16 for the packed kernels and the outputs come back in the input's
dtype; the residual stream stays in float32. An LM head's bf16 copy rounds the logits to bf16
(steps of 0.125 at |logit| 16-32, so ties are common): :func:`refine_top` recomputes each row's
largest ones in float32 from the float weight rows, which is what greedy decoding and the top
logprobs read. docs/cpu-decode.md gives the speed and accuracy on
the embedded model. :func:`reference_weight` is the plain PyTorch reference of a packed copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32           # int4 group size along K (GGUF's legacy block size)
GRID_TOL = 1e-3      # int4 repack: largest error allowed, in units of the group's step
HEAD_EXACT_TOP = 16  # logits per row an LM head's bf16 copy recomputes in float32 (refine_top)
INT4_ROW_BLOCK = 16  # torch's CPU int4 layout packs weight rows in blocks of this many


def _onednn_bf16() -> bool:
    """Whether oneDNN's bf16 GEMM runs on this CPU (it needs AVX512-BF16, AVX-NE-CONVERT or
    AVX-512 BW/VL/DQ; on an AVX2-only CPU its weight reorder raises)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass
class PackedWeight:
    """A packed copy of a weight ``[N, K]``.

    kind "int4": ``data`` is torch's CPU int4 layout (uint8 ``[N16, K / 2]``, N16 = N rounded up
    to a multiple of 16, the extra rows zero), ``scales`` bf16 ``[K / GROUP, N16, 2]`` (scale,
    offset at code 8: ``w = (q - 8) * scale + offset``).
    kind "bf16": ``data`` the bf16 weight ``[N, K]``, ``scales`` empty; ``prepacked`` its oneDNN
    layout (built here, not stored: it is an opaque tensor), or None where torch lacks oneDNN.
    """

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    prepacked: torch.Tensor | None = None

    def __post_init__(self):
        if self.kind == "bf16" and self.prepacked is None and _onednn_bf16():
            self.prepacked = torch.ops.mkldnn._reorder_linear_weight(self.data, 1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] float -> ``x @ W.T`` [T, N] in x's dtype (computed in bf16, fp32 accumulation)."""
        xb = x.to(torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.data, GROUP, self.scales)
            if y.shape[1] != self.shape[0]:
                y = y[:, :self.shape[0]]
        elif self.prepacked is not None:
            y = torch.ops.mkldnn._linear_pointwise(xb, self.prepacked, None, "none", [], "")
        else:
            y = F.linear(xb, self.data)
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def refine_top(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y: [T, N] float32, ``x @ W.T (+ bias)`` through a bf16 copy; x: [T, K], weight: W [N, K]
    float32, bias: [N] or None. Returns y with each row's k largest entries recomputed from W's
    rows in float32 (a bf16 output is within one bf16 step of the exact value, so the exact
    maximum is among them unless more than k entries sit within two steps of it). Row by row: a
    row's result ignores the other rows."""
    idx = y.topk(min(k, y.shape[1]), dim=-1).indices                     # [T, k]
    exact = (x.to(weight.dtype)[:, None, :] * weight[idx]).sum(-1)       # [T, k]
    if bias is not None:
        exact = exact + bias[idx]
    return y.scatter(1, idx, exact.to(y.dtype))


def _grid_codes(w: torch.Tensor):
    """w: [N, K] float32 -> (codes int32 [N, K], scale [N, K/G], minimum [N, K/G]) when every group
    of GROUP along K is an exact 16-level grid, else None."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int32)
    step = torch.empty(N, K // GROUP)
    lo = torch.empty(N, K // GROUP)
    rows = max(1, (1 << 16) // K)   # row blocks that stay in cache through the passes below
    for r in range(0, N, rows):
        g = w[r:r + rows].view(-1, K // GROUP, GROUP)
        mn, mx = torch.aminmax(g, dim=-1)
        st = (mx - mn).div_(15)
        inv = torch.where(st > 0, st.reciprocal(), torch.zeros_like(st))  # equal weights: q = 0
        c = (g - mn[..., None]).mul_(inv[..., None]).round_().clamp_(0, 15)
        err = torch.addcmul(mn[..., None], c, st[..., None]).sub_(g).abs_().amax(-1)
        if bool((err > GRID_TOL * st).any()):
            return None
        q[r:r + rows] = c.view(-1, K)
        step[r:r + rows], lo[r:r + rows] = st, mn
    return q, step, lo


def quantize(weight: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> ``(kind, codes, scales)``: "int4", int32 codes [N, K] in 0..15 and
    bf16 ``[K / GROUP, N, 2]`` (scale, offset at code 8) when it is a 4-bit grid, else "bf16",
    the bf16 weight [N, K] and an empty scales tensor."""
    w = weight.detach().float()
    N, K = w.shape
    grid = _grid_codes(w) if K % GROUP == 0 else None
    if grid is None:
        return "bf16", w.to(torch.bfloat16).contiguous(), torch.empty(0, dtype=torch.bfloat16)
    q, step, lo = grid
    scales = torch.stack([step, lo + 8 * step], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return "int4", q, scales


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """The packed copy of a float weight [N, K] (int4 when it is a 4-bit grid, else bf16)."""
    kind, q, scales = quantize(weight)
    if kind == "bf16":
        return PackedWeight(kind, q, scales, tuple(weight.shape))
    N, K = q.shape
    pad = -N % INT4_ROW_BLOCK   # zero rows fill the last block
    if pad:
        q = torch.cat([q, q.new_zeros(pad, K)])
        scales = torch.cat([scales, scales.new_zeros(K // GROUP, pad, 2)], 1)
    return PackedWeight(kind, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales, (N, K))


def reference_weight(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that the packed copy of ``weight`` multiplies by (plain PyTorch,
    the reference of :meth:`PackedWeight.matmul`)."""
    kind, q, scales = quantize(weight)
    if kind == "bf16":
        return q.float()
    N, K = q.shape
    s = scales.float().transpose(0, 1)                                   # [N, K / GROUP, 2]
    return ((q.view(N, K // GROUP, GROUP).float() - 8) * s[..., :1] + s[..., 1:]).view(N, K)


def pack_linears(model: nn.Module) -> dict[str, int]:
    """Give every CPU :class:`~doublesparse.models.layers.Linear` of ``model`` its packed copy
    (``module.packed``); the float weights stay (prefill, calibration, the weight cache).
    Returns ``{"int4": n, "bf16": n, "bytes": packed bytes}``. (A Linear is known by its
    ``packed`` slot: layers.py imports this module, so this one does not import it back.)"""
    out = {"int4": 0, "bf16": 0, "bytes": 0}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if hasattr(m, "packed") and isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dim() == 2:
            m.packed = pack_weight(m.weight)
            out[m.packed.kind] += 1
            out["bytes"] += m.packed.nbytes
    return out
