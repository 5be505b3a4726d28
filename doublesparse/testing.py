"""A tiny random Llama and a byte tokenizer, for tests and CI smoke runs without a checkpoint.

:func:`tiny_llama` returns the production :class:`~doublesparse.models.LlamaModel` (the same code
the engine, calibration and eval run on real checkpoints) at a small config with seeded random
weights; :class:`ByteTokenizer` maps UTF-8 bytes to ids 0..255 and keeps ids 256.. for specials,
so any text can be fed to it and its ids fit the model's vocabulary.

    model = tiny_llama(max_position_embeddings=512)       # 2 layers, 4 q / 2 kv heads, d16
    logits = model(input_ids [T] int64, positions [T] int64, batch)  # -> [N, vocab] float32
"""

from __future__ import annotations

import torch

from .models import LlamaModel, ModelConfig


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255); ids 256.. are specials (BOS 256, EOS 257, 258/259
    unused). Interface as the engine / calibration / eval use a HF tokenizer's: ``encode``,
    ``decode``, ``bos_token_id``, ``eos_token_id``, ``vocab_size``. No chat template, so
    retrieval prompts use the plain ``User: / Assistant:`` form."""

    bos_token_id, eos_token_id = 256, 257
    num_specials = 4
    vocab_size = 256 + num_specials

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # No BOS by default: the engine calls encode(prompt) and counts the prompt's tokens.
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Specials are always dropped (they have no text); an incomplete or invalid byte
        sequence decodes to U+FFFD, which the engine's detokenizer holds back while streaming."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def tiny_config(vocab_size: int = ByteTokenizer.vocab_size, hidden_size: int = 64,
                intermediate_size: int = 128, num_layers: int = 2, num_q_heads: int = 4,
                num_kv_heads: int = 2, head_dim: int = 16, max_position_embeddings: int = 4096,
                name: str = "tiny-llama", **kw) -> ModelConfig:
    """A Llama :class:`ModelConfig` at toy sizes; the vocabulary covers :class:`ByteTokenizer`.
    Further fields (``rope_theta``, ``tie_word_embeddings``, ...) pass through ``kw``."""
    if vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} does not cover the byte tokenizer's "
                         f"{ByteTokenizer.vocab_size} ids")
    kw.setdefault("bos_token_id", ByteTokenizer.bos_token_id)
    kw.setdefault("eos_token_ids", (ByteTokenizer.eos_token_id,))
    kw.setdefault("torch_dtype", "float32")
    return ModelConfig(architecture="llama", name=name, vocab_size=vocab_size, hidden_size=hidden_size,
                       intermediate_size=intermediate_size, num_layers=num_layers, num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim,
                       max_position_embeddings=max_position_embeddings, **kw)


@torch.no_grad()
def init_tiny_weights(model: LlamaModel, seed: int = 0, logit_scale: float = 4.0) -> None:
    """Seeded weights that make a random model a useful test subject.

    The loaders' dummy init (N(0, 0.02)) gives near-uniform logits, whose greedy argmax can flip
    between numerically equivalent paths (dense vs full-k sparse, chunked prefill, Triton); so
    matrices get ``N(0, 0.6^2 / fan_in)`` (activations keep their scale through the layers) and
    the lm_head is ``logit_scale`` times sharper. Each layer's k rows are scaled by a factor in
    [0.1, 2.1) per channel so heavy-channel rankings (weight-based or calibrated) mean
    something. Norm weights are 1, biases 0. Drawn on the CPU in float32, whatever the model's
    device and dtype, so every device gets the same weights (rounded to its dtype).
    """
    c = model.config
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # a tied lm_head appears once (as the embedding)
        if p.dim() == 1:
            w = torch.ones(p.shape) if name.endswith("norm.weight") else torch.zeros(p.shape)
        else:
            w = torch.randn(p.shape, generator=g) * 0.6 / p.shape[1] ** 0.5
            if name == "lm_head.weight":
                w *= logit_scale
        p.copy_(w)
    for layer in model.layers:
        s = torch.rand(c.kv_size, 1, generator=g) * 2 + 0.1          # [Hkv*D, 1]
        layer.attn.qkv_proj.weight[c.q_size: c.q_size + c.kv_size] *= s.to(model.device, model.dtype)


def tiny_llama(seed: int = 0, dtype=torch.float32, device="cpu", logit_scale: float = 4.0,
               config: ModelConfig | None = None, **config_kw) -> LlamaModel:
    """The real ``LlamaModel`` at :func:`tiny_config` (``config_kw`` overrides sizes) with
    :func:`init_tiny_weights`, in eval mode without gradients, like ``load_model`` returns."""
    config = config or tiny_config(**config_kw)
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    init_tiny_weights(model, seed=seed, logit_scale=logit_scale)
    model = model.to(device=device, dtype=dtype)  # the RoPE table stays float32 (RotaryEmbedding._apply)
    return model.eval().requires_grad_(False)


def tiny_engine(max_position_embeddings: int = 1024, **engine_kw):
    """An :class:`~doublesparse.engine.Engine` (``engine_kw``: EngineConfig fields) on
    :func:`tiny_llama` with the byte tokenizer: a server's ``--engine-factory
    doublesparse.testing:tiny_engine`` (starts in about a second)."""
    from .engine import Engine

    engine_kw.setdefault("progress", False)
    model = tiny_llama(max_position_embeddings=max_position_embeddings)
    return Engine(model=model, tokenizer=ByteTokenizer(), **engine_kw)
