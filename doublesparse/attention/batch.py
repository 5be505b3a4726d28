"""Per-step state handed explicitly to the model and the attention backend (never a global): the
one batch type they read. The engine fills every field; a test, calibration or a plain forward
passes only what it uses (an attention backend and the rows to return logits for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.tuning import DEFAULT_TUNING, KernelTuning


@dataclass
class ForwardBatch:
    """One forward pass.

    mode: "prefill" (T new tokens of B requests, with possible cached prefix) | "decode" (T == B).
    input_ids, positions: [T] int64 (device). out_slots: [T] int64, where the new K/V go.
    req_idx: [B] int32 rows of req_to_token. seq_lens: [B] int32 tokens in cache after this step.
    logits_indices: [N] int64 into the T tokens: whose logits the model returns (None: every token's).
    attn: the AttentionBackend (the model calls ``batch.attn.forward``).
    Prefill only (host ints): rows_host, extend_prefix_lens, extend_lens.
    attn_meta: what ``attn.plan(batch)`` computed for this step (a Double Sparsity decode: each
    layer's ``kernels.ops.DSDecodeArgs``).
    tuning: the engine's kernel launch parameters and choices (the model's fused kernels read it).
    Decode with Double Sparsity: k [B] int32 (device), each request's k, the size of its top-k
    (attention/budget.py DENSE: all its tokens; None: the backend derives them on the device);
    ds_sparse (host): whether the step runs the sparse launches at all.
    exact_logits_rows (host): rows of the N logits computed from the LM head's own weight instead of
    a CPU model's packed copy (models/layers.py): a prompt-logprobs request's, every logit of which
    is read.
    """

    mode: str = "prefill"
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_slots: torch.Tensor | None = None
    req_idx: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    attn: Any = None
    rows_host: tuple[int, ...] = ()
    extend_prefix_lens: tuple[int, ...] = ()
    extend_lens: tuple[int, ...] = ()
    attn_meta: Any = field(default=None, repr=False)
    tuning: KernelTuning = field(default=DEFAULT_TUNING, repr=False)
    k: torch.Tensor | None = None
    ds_sparse: bool = True
    exact_logits_rows: tuple[int, ...] = ()

    @property
    def batch_size(self) -> int:
        return int(self.req_idx.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
