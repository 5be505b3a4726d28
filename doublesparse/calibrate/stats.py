"""Calibration statistics, gathered by running our own model with a recording attention backend.

The backend sees q and k after RoPE (that is where the model calls ``batch.attn.forward``), adds
per-channel sums of |q|, |k| and |q ⊙ k| for every token of every sample, and delegates the actual
attention to the plain causal prefill backend. Sums are float64 so that 32K+ tokens of fp32
magnitudes add without drift; the means are taken once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


def causal_attention(q, k, v, sm_scale: float | None = None):
    """Fallback causal prefill: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(g, dim=1).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.to(q.dtype), vv.to(q.dtype), is_causal=True, scale=sm_scale)
    return o.transpose(0, 1)


class _LocalCausal:
    def forward(self, layer_id, q, k, v, batch):
        return causal_attention(q, k, v)


def plain_backend():
    """The models package's ``CausalAttention`` if present, else an equivalent local one."""
    try:
        from doublesparse.models.simple_attention import CausalAttention
    except ImportError:
        return _LocalCausal()
    return CausalAttention()


def make_batch(attn, logits_indices):
    try:
        from doublesparse.models.simple_attention import SimpleBatch
    except ImportError:
        return _Batch(attn, logits_indices)
    return SimpleBatch(attn, logits_indices)


@dataclass
class _Batch:
    attn: object
    logits_indices: torch.Tensor


class StatsAttention:
    """Attention backend that records per-channel statistics, then runs ``inner``.

    Accumulators, per layer (float64, summed over tokens):
        q_abs  [Hq, D]  sum |q|        k_abs [Hkv, D]  sum |k|
        qk_abs [Hq, D]  sum |q_h ⊙ k_{h // G}|          tokens: int
    """

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, inner=None):
        self.inner = inner if inner is not None else plain_backend()
        self.G = num_q_heads // num_kv_heads
        z = lambda h: torch.zeros(num_layers, h, head_dim, dtype=torch.float64)  # noqa: E731
        self.q_abs, self.k_abs, self.qk_abs = z(num_q_heads), z(num_kv_heads), z(num_q_heads)
        self.tokens = torch.zeros(num_layers, dtype=torch.long)

    def forward(self, layer_id, q, k, v, batch):
        qf, kf = q.detach().double(), k.detach().double()
        self.q_abs[layer_id] += qf.abs().sum(0).cpu()
        self.k_abs[layer_id] += kf.abs().sum(0).cpu()
        self.qk_abs[layer_id] += (qf * kf.repeat_interleave(self.G, dim=1)).abs().sum(0).cpu()
        self.tokens[layer_id] += q.shape[0]
        return self.inner.forward(layer_id, q, k, v, batch)

    __call__ = forward

    def means(self) -> dict[str, torch.Tensor]:
        """Mean statistics: "q"/"qk" ``[L, Hq, D]``, "k" ``[L, Hkv, D]``, and the per-KV-head
        aggregates the group-shared modes need: "q_kv"/"qk_kv" (sum over the group) and
        "q_kvmax"/"qk_kvmax" (max over the group), ``[L, Hkv, D]``."""
        if int(self.tokens.min()) == 0:
            raise RuntimeError("some layer never called the attention backend; nothing was recorded")
        n = self.tokens.double()[:, None, None]
        out = {"q": self.q_abs / n, "k": self.k_abs / n, "qk": self.qk_abs / n}
        L, hq, D = out["q"].shape
        for t in ("q", "qk"):
            grp = out[t].view(L, hq // self.G, self.G, D)
            out[t + "_kv"] = grp.sum(2)
            out[t + "_kvmax"] = grp.amax(2)
        out["tokens"] = self.tokens.clone()
        return out


def sample_windows(ids: list[int], num_samples: int, seq_len: int) -> list[list[int]]:
    """``num_samples`` disjoint windows of ``seq_len`` tokens spread evenly over ``ids``."""
    need = num_samples * seq_len
    if num_samples <= 0 or seq_len <= 1:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples}, {seq_len}")
    if len(ids) < need:
        raise ValueError(f"calibration text is too short: {len(ids)} tokens, but {num_samples} samples "
                         f"x {seq_len} tokens need {need}; pass more --text files or lower "
                         f"--num-samples / --seq-len")
    slots = len(ids) // seq_len
    starts = [(i * slots // num_samples) * seq_len for i in range(num_samples)]
    return [ids[s: s + seq_len] for s in starts]


@torch.inference_mode()
def collect_stats(model, windows: list[list[int]], device="cpu", progress: bool = True) -> dict:
    """Run every window through ``model`` with a :class:`StatsAttention` and return its means."""
    c = model.config
    rec = StatsAttention(int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim))
    for w in tqdm(windows, desc="calibrate", unit="sample", disable=not progress):
        ids = torch.tensor(w, dtype=torch.long, device=device)
        pos = torch.arange(len(w), dtype=torch.long, device=device)
        # only the last row's logits: the LM head is not needed for the statistics
        batch = make_batch(rec, torch.tensor([len(w) - 1], dtype=torch.long, device=device))
        model(ids, pos, batch)
    return rec.means()
