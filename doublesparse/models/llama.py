"""The Llama family as one module: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (qk-norm).

The model runs on a flat token batch: all requests' new tokens are concatenated into ``[T]`` and
the attention backend (``batch.attn``) owns everything sequence-related (KV cache, masks, sparse
decode). The model itself is position-aware only through RoPE and keeps no state between calls.

The forward contains no host syncs (no ``.item()``, no data-dependent shapes other than the
indexing by ``logits_indices``), so a fixed-shape decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..kernels.tuning import KernelTuning
from .config import ModelConfig
from .layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, fused_impl
from .packed import HEAD_EXACT_TOP


def batch_tuning(batch) -> KernelTuning:
    # the engine's batches carry its kernel tuning; batches built elsewhere (calibration, eval)
    # hold the defaults
    return batch.tuning


def _head_split(head, x: torch.Tensor, exact: tuple[int, ...], tuning, decode: bool) -> torch.Tensor:
    """Logits [N, V] float32 of x [N, H]: rows ``exact`` through the head's own weight (every
    logit of them is read: prompt logprobs), the others as without them, so their values do not
    depend on whether such rows share the forward. Every tensor-parallel rank makes the same
    calls (``exact`` is host data)."""
    n = x.shape[0]
    ex = set(exact)
    rest = [i for i in range(n) if i not in ex]

    def rows(ids: list[int]) -> torch.Tensor:
        # index tensors, not a bool mask (whose indexing syncs), copied pinned and asynchronously
        t = torch.tensor(ids, dtype=torch.int64)
        return t.pin_memory().to(x.device, non_blocking=True) if x.is_cuda else t

    ie = rows(sorted(ex))
    ye = head(x.index_select(0, ie), tuning, decode, exact=True).float()
    if not rest:
        return ye
    io = rows(rest)
    y = torch.empty(n, ye.shape[1], dtype=torch.float32, device=x.device)
    y.index_copy_(0, ie, ye)
    y.index_copy_(0, io, head(x.index_select(0, io), tuning, decode).float())
    return y


def is_decode(batch) -> bool:
    """Whether the forward decodes (one new token per request): CPU linear layers then multiply
    by their packed int4 copies (models/packed.py); prefill forwards keep the float weights."""
    return batch.mode == "decode"


def _fused_store(attn, x: torch.Tensor, tuning: KernelTuning) -> str | None:
    """The ops impl for RoPE fused with the KV (+ label) store (one launch per layer on CUDA,
    ``tuning.fused_rope_store``), or None when the backend must get the rotated k/v itself:
    wrappers that record q/k (calibration, eval) or backends with their own store."""
    if not isinstance(attn, AttentionBackend) or not attn.accepts_stored_kv or attn.impl == "torch":
        return None
    return fused_impl(tuning.fused_rope_store, x)


class LlamaAttention(nn.Module):
    """Merged qkv projection -> (bias) -> (per-head qk RMSNorm) -> RoPE -> backend -> o_proj."""

    def __init__(self, config: ModelConfig, layer_id: int, device=None, dtype=None):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_q_heads, self.num_kv_heads, self.head_dim = c.num_q_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.qkv_proj = Linear(c.hidden_size, c.qkv_size, bias=c.attention_bias, device=device, dtype=dtype)
        self.o_proj = Linear(c.q_size, c.hidden_size, device=device, dtype=dtype)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device=device, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch) -> torch.Tensor:
        """x: [T, H] -> [T, H]; the backend sees contiguous q: [T, Hq, D], k/v: [T, Hkv, D] in the weight dtype
        (fused path: v stays a strided view of the qkv output, k is None at decode)."""
        T, tuning, decode = x.shape[0], batch_tuning(batch), is_decode(batch)
        q, k, v = self.qkv_proj(x, tuning, decode).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_q_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        attn = batch.attn
        impl = _fused_store(attn, x, tuning)
        if impl is not None:
            # One launch: (q/k per-head norms,) rotated q out, rotated k / v / label into the pools;
            # prefill attention also reads the chunk's own k (decode reads only the cache).
            qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q, k = rope.rotate_and_store(positions, q, k, v, attn.store_targets(self.layer_id),
                                         batch.out_slots, return_k=batch.mode == "prefill", impl=impl,
                                         tuning=tuning, qk_norm=qk_norm)
            out = attn.attention(self.layer_id, q, k, v, batch)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            # v is a strided slice of the qkv GEMM output; KV-store kernels want dense rows.
            v = v.contiguous()
            q, k = rope(positions, q, k)
            out = attn.forward(self.layer_id, q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.q_size), tuning, decode)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, device=None, dtype=None):
        super().__init__()
        c = config
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.attn = LlamaAttention(c, layer_id, device=device, dtype=dtype)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, device=device, dtype=dtype)

    def forward(self, x, residual, positions, rope, batch):
        """(x, residual) [T, H] -> (mlp output, residual stream before it), the pre-norm residual
        stream kept apart so each add fuses into the next norm; residual None: x is the input."""
        tuning = batch_tuning(batch)
        if residual is None:
            residual, h = x, self.input_norm(x, tuning=tuning)
        else:
            h, residual = self.input_norm(x, residual, tuning)
        h, residual = self.post_attn_norm(self.attn(h, positions, rope, batch), residual, tuning)
        return self.mlp(h, tuning, is_decode(batch)), residual


def init_decoder(model: "LlamaModel", config: ModelConfig, layer_cls, device, dtype,
                 rope: nn.Module) -> None:
    """A LlamaModel-shaped model's parameters around ``layer_cls`` decoder layers (Llama, the
    MoE families and DeepSeek-V2 share them)."""
    c = model.config = config
    model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, device=device, dtype=dtype,
                                      _weight=torch.empty(c.vocab_size, c.hidden_size, device=device, dtype=dtype))
    model.layers = nn.ModuleList(layer_cls(c, i, device=device, dtype=dtype) for i in range(c.num_layers))
    model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
    model.lm_head = Linear(c.hidden_size, c.vocab_size, device=device, dtype=dtype, exact_top=HEAD_EXACT_TOP)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = rope


class LlamaModel(nn.Module):
    """Causal LM. ``logits = model(input_ids, positions, batch)``.

    Args of ``__init__``: ``max_positions`` sizes the RoPE table (default: the config's
    ``max_position_embeddings``). Parameters are allocated uninitialised on ``device`` in ``dtype``;
    use :func:`doublesparse.models.load_model` to get a model with weights.

    Parameter names (what loaders fill): ``embed_tokens.weight``, ``layers.{i}.input_norm.weight``,
    ``layers.{i}.attn.qkv_proj.{weight,bias}`` (rows: q | k | v), ``layers.{i}.attn.o_proj.weight``,
    ``layers.{i}.attn.{q,k}_norm.weight``, ``layers.{i}.post_attn_norm.weight``,
    ``layers.{i}.mlp.gate_up_proj.weight`` (rows: gate | up), ``layers.{i}.mlp.down_proj.weight``,
    ``norm.weight``, ``lm_head.weight`` (the same Parameter as the embedding when tied).
    """

    def __init__(self, config: ModelConfig, device=None, dtype=torch.float32, max_positions: int | None = None):
        super().__init__()
        init_decoder(self, config, LlamaDecoderLayer, device, dtype,
                     RotaryEmbedding(config, max_positions=max_positions, device=device))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> logits [N, vocab] float32.

        ``batch.attn.forward(layer_id, q, k, v, batch)`` computes attention (on CUDA with an engine
        backend: ``rope.rotate_and_store`` + ``batch.attn.attention``, see ``_fused_store``); ``batch.logits_indices``
        ([N] int64 into the T tokens, or None for all T) selects the rows to project onto the
        vocabulary, which for decode-with-prefill batches skips the expensive lm_head on most tokens.
        """
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, batch)
        idx = batch.logits_indices
        tuning = batch_tuning(batch)
        if fused_impl(tuning.fused_norm, x) is not None:
            # add + norm in one launch over all T rows, then the row selection (rows are independent)
            x, _ = self.norm(x, residual, tuning)
            if idx is not None:
                x = x.index_select(0, idx)
        else:
            x = x + residual
            if idx is not None:
                x = x.index_select(0, idx)
            x = self.norm(x, tuning=tuning)
        exact = batch.exact_logits_rows
        if not exact:
            return self.lm_head(x, tuning, is_decode(batch)).float()
        return _head_split(self.lm_head, x, exact, tuning, is_decode(batch))

    def extra_repr(self) -> str:
        c = self.config
        return f"arch={c.architecture}, params={c.num_params / 1e6:.1f}M, max_positions={self.rope.max_positions}"
