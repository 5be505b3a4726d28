"""Preallocated scratch buffers for decode, shared by every layer of a step.

Allocated once (per engine, or per benchmark case) at the largest batch, context and top-k that
will be used, so the kernels launch with static shapes and can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HIST_BINS = 256  # radix digit of the top-k select: 8 bits, two passes over fp16 score keys
SCORE_PAD = 4096  # >= the select kernels' block: they read whole blocks of a score row
SELECT_MAX_PROGS = 16  # programs per score row in the select's phases 2 and 3, at most
TOPP_MAX_PROGS = 16  # programs per score row of the top-p budget's softmax denominator, at most


@dataclass
class DecodeWorkspace:
    """Scratch for split-K decode and for the Double Sparsity top-k.

    max_batch, num_q_heads, num_kv_heads, head_dim: the largest decode batch and the model's heads.
    max_ctx: the longest sequence (positions) the scores buffer must hold.
    k_max: the largest k of any request (its top-k); 0 disables the Double Sparsity buffers.
    max_splits: the most split-K partitions one (request, head) row is cut into.
    layer_select: also the buffers of the "layer" selection mode (``layer``: a workspace of the
    mode's one virtual KV head, kernels/triton/ds_layer.py), else ``layer`` is None.
    """

    max_batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_ctx: int
    k_max: int = 0
    device: torch.device | str = "cuda"
    max_splits: int = 64
    layer_select: bool = False
    buffers: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("max_batch", "num_q_heads", "num_kv_heads", "head_dim", "max_ctx", "max_splits"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DecodeWorkspace.{name} must be positive, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.k_max < 0:
            raise ValueError("k_max must be >= 0")
        dev = torch.device(self.device)
        B, Hq, D, S = self.max_batch, self.num_q_heads, self.head_dim, self.max_splits
        Hkv = self.num_kv_heads
        self.layer = (DecodeWorkspace(B, Hq // Hkv, 1, Hkv * D, self.max_ctx, self.k_max, dev, 1)
                      if self.layer_select and self.k_max else None)
        if self.layer is not None:
            # KV head h's channels sit at h * D of the virtual head's row: made once, not per step
            self.layer.channel_offsets = torch.arange(Hkv, dtype=torch.int32, device=dev)[:, None] * D
        f32 = dict(dtype=torch.float32, device=dev)
        self.buffers["part_o"] = torch.empty(B, Hq, S, D, **f32)
        self.buffers["part_lse"] = torch.empty(B, Hq, S, **f32)
        if self.k_max:
            i32 = dict(dtype=torch.int32, device=dev)
            # Rows: one per query head (per_head mode) or per KV head (group modes); size for the larger.
            # Padded by SCORE_PAD so the select kernels can read whole blocks past a row's end;
            # rows are a multiple of 8 scores long, so every row starts 16-byte aligned (the CUDA
            # select's vector loads need it).
            row_len = -(-self.max_ctx // 8) * 8 + SCORE_PAD
            self.buffers["scores"] = torch.empty(B, Hq, row_len, dtype=torch.float16, device=dev)
            # hist[0]: high byte of the score keys, kept at zero between steps (its last reader
            # clears it); hist[1 + p]: low byte of the keys inside the chosen high byte, in select
            # program p's slice (overwritten by that program each step).
            self.buffers["hist"] = torch.zeros(1 + SELECT_MAX_PROGS, B, Hq, HIST_BINS, **i32)
            # Per row: [high digit, rank left after the high digit]
            self.buffers["rowinfo"] = torch.zeros(B, Hq, 2, **i32)
            # Per row and select program: keys of its slice whose high byte is above the chosen one.
            self.buffers["counts"] = torch.zeros(B, Hq, SELECT_MAX_PROGS, **i32)
            self.buffers["sel"] = torch.empty(B, Hq, self.k_max, **i32)
            # The cache slots of sel's positions; zero (the padding slot) until written, so a
            # stale entry can never address outside the pool.
            self.buffers["sel_slot"] = torch.zeros(B, Hq, self.k_max, **i32)
            # Top-p budget (ds_topp.py): per row and program the score maximum and the sum of
            # exponentials; the kept slots at the front of each row (zero-initialised like
            # sel_slot) and their number (a dense request's row: its length).
            self.buffers["topp_part"] = torch.zeros(B, Hq, TOPP_MAX_PROGS, 2, **f32)
            self.buffers["topp_slot"] = torch.zeros(B, Hq, self.k_max, **i32)
            self.buffers["row_k"] = torch.zeros(B, Hq, **i32)

    def __getattr__(self, name):
        buffers = self.__dict__.get("buffers", {})
        if name in buffers:
            return buffers[name]
        raise AttributeError(name)

    def rows(self, b0: int, b1: int) -> "DecodeWorkspace":
        """A workspace over batch rows ``b0:b1`` of this one: views of every buffer, no copies.
        Every buffer is indexed by batch row (``hist`` on its second dimension), so launches on
        disjoint row ranges, e.g. two halves of a batch on two streams, never share scratch."""
        if not 0 <= b0 < b1 <= self.max_batch:
            raise ValueError(f"rows({b0}, {b1}) outside a workspace of max_batch {self.max_batch}")
        sub = object.__new__(DecodeWorkspace)
        sub.__dict__.update(self.__dict__, max_batch=b1 - b0,
                            buffers={n: (t[:, b0:b1] if n == "hist" else t[b0:b1])
                                     for n, t in self.buffers.items()},
                            layer=None if self.layer is None else self.layer.rows(b0, b1))
        return sub

    @property
    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in self.buffers.values())
        return own + (self.layer.nbytes if self.layer is not None else 0)
