"""Which part of the model each tensor-parallel rank holds, and slicing full tensors into it.

Layout (Megatron-style, as SGLang and vLLM shard the same families):
  * query heads: rank r holds the contiguous block ``[r * Hq/tp, (r+1) * Hq/tp)``; KV heads split
    the same way when ``Hkv >= tp``, else each KV head is replicated on ``tp / Hkv`` consecutive
    ranks (rank r holds KV head ``r // (tp / Hkv)``), so a rank's query heads always attend
    over its own KV heads and each rank keeps its own K/V, label pools and top-k selection;
  * qkv / gate-up projections are column-parallel (a rank's output rows), o / down projections
    row-parallel (its input columns; their partial outputs are summed with an all-reduce);
  * each routed expert's FFN is split the same way (every rank holds every expert, a slice of its
    intermediate width; the router is replicated), which keeps the expert kernels unchanged;
  * embedding and LM head rows are split over the vocabulary in blocks of ``ceil(V / tp)``, the
    last rank's block padded with zero rows;
  * latent attention (MLA): the query heads split as above (``q_proj`` / ``q_b_proj`` rows,
    ``kv_b_proj`` rows, ``o_proj`` columns of a rank's heads); the latent projection, its norm and
    the latent pool (one 576-wide "KV head") are replicated, so every rank stores every token's
    latent and attends its own heads over it. Double Sparsity on MLA selects once per token for
    all heads, which the split would make a per-rank choice: it runs with ``--tp-size 1`` only.
Intermediate widths need not divide evenly (:func:`split`); head counts must.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s part ``[lo, hi)`` of ``n`` items over ``size`` ranks (sizes differ by at most 1)."""
    return n * rank // size, n * (rank + 1) // size


def vocab_block(vocab_size: int, size: int) -> int:
    """Rows of every rank's embedding / LM-head shard: ``ceil(V / tp)``."""
    return -(-vocab_size // size)


def check_tp(config, size: int, double_sparsity: bool = False) -> None:
    """ValueError saying why ``config`` cannot run on ``size`` ranks (with Double Sparsity when
    ``double_sparsity``)."""
    c = config
    if getattr(c, "mla", None) is not None and double_sparsity and size > 1:
        raise ValueError(f"{c.name}: Double Sparsity on latent attention (MLA) selects one set of tokens for all "
                         f"query heads, which --tp-size {size} splits over ranks; run it with --tp-size 1, or "
                         "--tp-size with dense decode (--no-enable-double-sparsity)")
    if c.num_q_heads % size:
        raise ValueError(f"--tp-size {size} does not divide the {c.num_q_heads} query heads of {c.name}")
    if c.num_kv_heads % size and size % c.num_kv_heads:
        raise ValueError(f"--tp-size {size} and the {c.num_kv_heads} KV heads of {c.name}: one must divide "
                         "the other (KV heads are split, or replicated when fewer than ranks)")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: its query heads ``[q_lo, q_hi)`` and KV heads ``[kv_lo, kv_hi)``
    of the full model ``config``."""

    config: object
    rank: int
    size: int

    @property
    def q_range(self) -> tuple[int, int]:
        n = self.config.num_q_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    @property
    def kv_range(self) -> tuple[int, int]:
        hkv, tp = self.config.num_kv_heads, self.size
        if hkv >= tp:
            n = hkv // tp
            return self.rank * n, (self.rank + 1) * n
        h = self.rank // (tp // hkv)
        return h, h + 1

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1: KV heads split, no copies)."""
        return max(1, self.size // self.config.num_kv_heads)

    def local_config(self):
        """The ModelConfig of this rank's part: its heads and intermediate widths; the vocabulary
        (the LM head gathers full logits) and everything else as the full model's."""
        c = self.config
        q0, q1 = self.q_range
        k0, k1 = self.kv_range
        lo, hi = split(c.intermediate_size, self.size, self.rank)
        moe = c.moe
        if moe is not None:
            mlo, mhi = split(moe.intermediate_size, self.size, self.rank)
            moe = dataclasses.replace(moe, intermediate_size=mhi - mlo)
        return dataclasses.replace(c, num_q_heads=q1 - q0, num_kv_heads=k1 - k0,
                                   intermediate_size=hi - lo, moe=moe)

    # ------------------------------------------------------------------------- tensors
    def _heads(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The q | k | v rows (dim 0) or the q columns (dim 1) of this rank's heads."""
        c, D = self.config, self.config.head_dim
        q0, q1 = self.q_range
        if dim == 1:
            return t[:, q0 * D: q1 * D]
        k0, k1 = self.kv_range
        q, k, v = t.split([c.q_size, c.kv_size, c.kv_size], dim=0)
        return torch.cat([q[q0 * D: q1 * D], k[k0 * D: k1 * D], v[k0 * D: k1 * D]])

    def _latent_heads(self, t: torch.Tensor, owner: str, mla) -> torch.Tensor:
        """An MLA projection's part of this rank's query heads: rows of q (per head
        ``qk_head_dim``) and of ``kv_b_proj`` (per head ``dn + dv``), columns of ``o_proj``
        (per head ``dv``)."""
        q0, q1 = self.q_range
        nh = self.config.num_q_heads
        if owner == "o_proj":
            return t.reshape(t.shape[0], nh, mla.v_head_dim)[:, q0:q1].reshape(t.shape[0], -1)
        return t.reshape(nh, -1, *t.shape[1:])[q0:q1].reshape(-1, *t.shape[1:])

    def _ffn_rows(self, t: torch.Tensor, experts: int, blocks: int = 1) -> torch.Tensor:
        """Gate | up rows -> this rank's slice of each intermediate block. Experts' ``w13``
        ``[E * 2 * I, H]`` holds per expert gate rows then up rows; a gated MLP of ``blocks``
        merged experts (shared experts) holds all gate rows ``[blocks * I]`` then all up rows."""
        H = t.shape[1:]
        inter = t.shape[0] // (2 * experts * blocks)
        lo, hi = split(inter, self.size, self.rank)
        return t.reshape(experts, 2, blocks, inter, *H)[:, :, :, lo:hi].reshape(-1, *H)

    def _ffn_cols(self, t: torch.Tensor, blocks: int = 1) -> torch.Tensor:
        """Down columns ``[rows, blocks * I]`` -> this rank's slice of each block's I."""
        inter = t.shape[1] // blocks
        lo, hi = split(inter, self.size, self.rank)
        return t.reshape(t.shape[0], blocks, inter)[:, :, lo:hi].reshape(t.shape[0], -1)

    def _vocab(self, t: torch.Tensor) -> torch.Tensor:
        V, s = t.shape[0], vocab_block(t.shape[0], self.size)
        out = t.new_zeros(s, *t.shape[1:])
        lo, hi = self.rank * s, min((self.rank + 1) * s, V)
        if hi > lo:
            out[: hi - lo] = t[lo:hi]
        return out

    def tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full model's parameter ``name`` (names of
        :class:`~doublesparse.models.LlamaModel` and the MoE models); replicated tensors (norms,
        router) come back as they are."""
        leaf = name.rsplit(".", 2)
        owner, last = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
        moe, mla = self.config.moe, getattr(self.config, "mla", None)
        if owner in ("embed_tokens", "lm_head"):
            return self._vocab(full)
        if mla is not None and owner in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            return self._latent_heads(full, owner, mla)
        if owner == "qkv_proj":
            return self._heads(full, 0)
        if owner == "o_proj":
            return self._heads(full, 1)
        shared = moe.num_shared_experts if moe is not None and ".shared." in name else 1
        if owner == "gate_up_proj":
            return self._ffn_rows(full, 1, shared)
        if owner == "down_proj":
            return self._ffn_cols(full, shared)
        if last == "w13" and moe is not None:
            return self._ffn_rows(full, moe.num_experts)
        if last == "w2" and moe is not None:
            return self._ffn_cols(full)
        return full

    def channels(self, channels: torch.Tensor) -> torch.Tensor:
        """Heavy channels ``[L, Hkv, r]`` of the full model -> this rank's KV heads ``[L, Hkv_local, r]``."""
        k0, k1 = self.kv_range
        return channels[:, k0:k1]
