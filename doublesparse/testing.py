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

    def vocab_bytes(self) -> list[bytes]:
        """Each id's exact bytes (for grammars and logprobs); specials have none. NUL is left out
        too: grammar engines take an empty-or-NUL token as text-free."""
        return [b""] + [bytes([i]) for i in range(1, 256)] + [b""] * self.num_specials


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


class ChatByteTokenizer(ByteTokenizer):
    """:class:`ByteTokenizer` with a minimal chat template that renders tools (Hermes style: the
    tools' JSON in the system turn), for server tests of chat, tools and constrained decoding."""

    chat_template = "<|role|>content per turn; tools as JSON in a <tools> block"

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True,
                            tools: list | None = None, **_: object):
        import json

        text = f"<tools>{json.dumps(tools)}</tools>\n" if tools else ""
        for m in messages:
            calls = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>"
                            for c in m.get("tool_calls") or ())
            text += f"<|{m['role']}|>{m.get('content') or ''}{calls}\n"
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


def tiny_family_hf_config(arch: str, vocab_size: int = ByteTokenizer.vocab_size,
                          max_position_embeddings: int = 4096) -> dict:
    """A Hugging Face ``config.json`` dict of a toy member of an MoE / MLA family ("mixtral",
    "qwen3_moe", "deepseek_v2"): 2 layers, hidden 64, 4 query heads, awkward expert counts; the
    DeepSeek one has YaRN RoPE, group-limited routing, a shared expert and a dense first layer."""
    d = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
         "bos_token_id": ByteTokenizer.bos_token_id, "eos_token_id": ByteTokenizer.eos_token_id,
         "tie_word_embeddings": False, "torch_dtype": "float32", "model_type": arch}
    if arch == "mixtral":
        d.update(architectures=["MixtralForCausalLM"], num_key_value_heads=2, num_local_experts=5,
                 num_experts_per_tok=2, rope_theta=1e6)
    elif arch == "qwen3_moe":
        d.update(architectures=["Qwen3MoeForCausalLM"], num_key_value_heads=2, head_dim=16, num_experts=6,
                 num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], rope_theta=1e6)
    elif arch == "deepseek_v2":
        d.update(architectures=["DeepseekV2ForCausalLM"], num_key_value_heads=4, n_routed_experts=8,
                 num_experts_per_tok=3, moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
                 topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                 kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                 rope_theta=1e4, rope_scaling={"type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                                               "mscale": 0.707, "mscale_all_dim": 0.707,
                                               "original_max_position_embeddings": max_position_embeddings // 8})
    else:
        raise ValueError(f"no tiny config for {arch!r}")
    return d


def tiny_family(arch: str, seed: int = 0, max_position_embeddings: int = 4096):
    """The production model class of ``arch`` at :func:`tiny_family_hf_config` with
    :func:`init_tiny_weights`-style seeded weights (float32, CPU, eval mode)."""
    from .models import model_class

    config = ModelConfig.from_hf_dict(tiny_family_hf_config(arch, max_position_embeddings=max_position_embeddings),
                                      name=f"tiny-{arch}")
    model = model_class(config.architecture)(config, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.ones(p.shape) if name.endswith("norm.weight") else torch.zeros(p.shape))
            else:
                sharp = 4.0 if name == "lm_head.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 * sharp / p.shape[1] ** 0.5))
    return model.eval().requires_grad_(False)


def random_channel_stats(config, seed: int = 0) -> dict:
    """Random calibration statistics of a model config, as ``calibrate.stats`` gives them:
    ``q``/``qk`` [L, Hq, D], ``k`` [L, Hkv, D], and the group sums / maxima ``*_kv``, ``*_kvmax``."""
    g = torch.Generator().manual_seed(seed)
    L, hq, hkv, d = config.num_layers, config.num_q_heads, config.num_kv_heads, config.head_dim
    stats = {"q": torch.rand(L, hq, d, generator=g), "k": torch.rand(L, hkv, d, generator=g),
             "qk": torch.rand(L, hq, d, generator=g)}
    for t in ("q", "qk"):
        grp = stats[t].view(L, hkv, hq // hkv, d)
        stats[t + "_kv"], stats[t + "_kvmax"] = grp.sum(2), grp.amax(2)
    return stats


def random_channel_config(config, modes=(), seed: int = 0) -> dict:
    """A channel config (the calibration file's dict) from :func:`random_channel_stats`, with
    ``modes[i]`` recorded as layer i's selection mode."""
    from . import channels as ch

    cfg = ch.stats_to_config(random_channel_stats(config, seed), {"model": config.name})
    for i, m in enumerate(modes):
        cfg[ch.mode_key(i)] = m
    return cfg
