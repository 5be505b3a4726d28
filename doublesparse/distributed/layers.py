"""Tensor-parallel layers and the conversion of a rank's model into its parallel form.

Every collective here goes through ``torch.distributed`` on the rank group the layer holds
(:class:`Collectives`: NCCL on CUDA, gloo on CPU), never a module-level default, so that one
process may hold models of different groups. NCCL collectives are CUDA-graph capturable, so a
rank's decode graphs contain them (each rank captures the same buckets in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..kernels.tuning import DEFAULT_TUNING, KernelTuning
from ..models.layers import GatedMLP, Linear
from ..models.moe import SparseMoE
from ..models.packed import HEAD_EXACT_TOP
from .shard import Shard, vocab_block


# torch 2.13 renamed all_gather_into_tensor (the older name warns there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Collectives:
    """The model's collectives over one tensor-parallel group: ``rank`` of ``size``; ``group``
    the torch.distributed process group (None: the default group of this process)."""

    rank: int
    size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def min_int(self, n: int, device) -> int:
        """The smallest of each rank's ``n`` (a tensor on ``device``: NCCL reduces GPU tensors)."""
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, C]`` on every rank -> ``[N, size * C]``, rank r's block at columns ``r * C ..``."""
        out = torch.empty(self.size * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], self.size * x.shape[1])


class RowParallelLinear(Linear):
    """A Linear whose input columns are this rank's part: the partial products are summed over
    the ranks (o_proj, down_proj). Takes over the parameters of the Linear it replaces."""

    @classmethod
    def wrap(cls, linear: Linear, comm: Collectives) -> "RowParallelLinear":
        if linear.bias is not None:
            raise ValueError("a row-parallel linear with a bias would add it once per rank")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features, m.exact_top = linear.in_features, linear.out_features, linear.exact_top
        m.weight, m.bias, m.comm = linear.weight, None, comm
        m.packed = None  # the loader packs the rank's slice after filling it (CPU loads)
        return m

    def forward(self, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING, decode: bool = False) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x, tuning, decode))


class ParallelSparseMoE(SparseMoE):
    """SparseMoE over each expert's slice of the intermediate width: the routed and shared
    experts' partial outputs are summed over the ranks in one all-reduce."""

    @classmethod
    def wrap(cls, moe: SparseMoE, comm: Collectives) -> "ParallelSparseMoE":
        # in place: the block keeps its parameters, their names and its shared-expert MLP
        moe.__class__ = cls
        moe.comm = comm
        return moe

    def forward(self, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING, decode: bool = False) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x, tuning, decode))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * s, (rank + 1) * s)`` of the embedding (``s = ceil(V / size)``,
    ``weight: [s, H]``); a token outside them contributes zeros, and the all-reduce sums the
    one rank's row that holds it."""

    def __init__(self, vocab_size: int, hidden: int, comm: Collectives, device=None, dtype=None):
        super().__init__()
        self.vocab_size, self.comm = vocab_size, comm
        s = vocab_block(vocab_size, comm.size)
        self.lo, self.hi = comm.rank * s, min((comm.rank + 1) * s, vocab_size)
        self.weight = nn.Parameter(torch.empty(s, hidden, device=device, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, H]."""
        mine = (ids >= self.lo) & (ids < self.hi)
        x = F.embedding(torch.where(mine, ids - self.lo, 0), self.weight)
        return self.comm.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))


class ParallelLMHead(Linear):
    """The LM head's vocabulary rows of this rank (``[s, H]``, zero rows past V); each rank's
    logits block is gathered so that every rank returns the full ``[N, V]``."""

    def __init__(self, vocab_size: int, hidden: int, comm: Collectives, device=None, dtype=None):
        super().__init__(hidden, vocab_block(vocab_size, comm.size), device=device, dtype=dtype,
                         exact_top=HEAD_EXACT_TOP)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING, decode: bool = False,
                exact: bool = False) -> torch.Tensor:
        return self.comm.gather_columns(super().forward(x, tuning, decode, exact))[:, : self.vocab_size]


def parallelize(model: nn.Module, full_config, comm: Collectives) -> nn.Module:
    """Turn ``model``, built at this rank's :meth:`Shard.local_config`, into its tensor-parallel
    form in place: all-reducing o / down projections and MoE blocks, vocabulary-parallel
    embedding and LM head (tied again when the full model ties them). Parameters keep their
    names (a loader fills them with :meth:`Shard.tensor` slices) and stay uninitialised."""
    c = full_config
    dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    for layer in model.layers:
        layer.attn.o_proj = RowParallelLinear.wrap(layer.attn.o_proj, comm)
        if isinstance(layer.mlp, SparseMoE):
            ParallelSparseMoE.wrap(layer.mlp, comm)
        elif isinstance(layer.mlp, GatedMLP):
            layer.mlp.down_proj = RowParallelLinear.wrap(layer.mlp.down_proj, comm)
        else:
            raise ValueError(f"no tensor-parallel form for {type(layer.mlp).__name__}")
    model.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, comm, device=dev, dtype=dtype)
    model.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, comm, device=dev, dtype=dtype)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.full_config = c
    model.shard = Shard(c, comm.rank, comm.size)
    return model
