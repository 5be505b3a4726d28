"""Model hyper-parameters, read from a Hugging Face ``config.json`` or from GGUF metadata.

One frozen :class:`ModelConfig` describes every member of the Llama family we run (Llama 2/3/3.x,
Mistral, Qwen2/2.5, Qwen3); the per-family differences are flags (``attention_bias``, ``qk_norm``)
rather than subclasses, so the model code has a single path. The MoE and MLA families (Mixtral,
Qwen3-MoE, DeepSeek-V2) add their parts as the optional ``moe`` / ``mla`` fields (:mod:`.moe_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .moe_config import (
    MOE_HF_ARCHITECTURES,
    MLAConfig,
    MoEConfig,
    family_num_params,
    mla_from_hf,
    moe_from_hf,
)

# HF ``architectures`` entry -> our architecture key.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    **MOE_HF_ARCHITECTURES,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(set(HF_ARCHITECTURES.values())))
# GGUF ``general.architecture`` values we can read. Mistral GGUFs are written as "llama".
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _unsupported(name: str) -> ValueError:
    return ValueError(
        f"unsupported model architecture {name!r}; supported: "
        f"{', '.join(sorted(HF_ARCHITECTURES))} (model_type {', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def _normalize_rope_scaling(rs: dict | None) -> dict | None:
    """Canonical form ``{"rope_type": ..., **params}``; ``None`` for plain RoPE.

    HF has spelt the type as both ``type`` and ``rope_type`` and, since transformers 5, folds
    ``rope_theta`` into ``rope_parameters``; we keep theta separately.
    """
    if not rs:
        return None
    rs = {k: v for k, v in rs.items() if k not in ("rope_theta", "type")} | {
        "rope_type": rs.get("rope_type", rs.get("type", "default"))
    }
    kind = rs["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        if "factor" not in rs:
            raise ValueError(f"linear rope_scaling needs 'factor': {rs}")
    elif kind == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in need if k not in rs]
        if missing:
            raise ValueError(f"llama3 rope_scaling lacks {missing}: {rs}")
    elif kind != "freq_factors":  # freq_factors: per-frequency divisors stored in a GGUF (rope_freqs)
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
    return rs


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "mixtral" | "qwen3_moe" | "deepseek_v2"
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, {"rope_type": "linear", "factor": f} or {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}. Excluded from hashing (dicts do not hash).
    rope_scaling: dict | None = field(default=None, hash=False, compare=True)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"  # dtype the checkpoint was trained/saved in (informational)
    sliding_window: int | None = None  # Mistral v0.1; enforced by the attention backend, not the model
    moe: MoEConfig | None = None  # routed experts (Mixtral, Qwen3-MoE, DeepSeek-V2): models/moe_config.py
    mla: MLAConfig | None = None  # latent attention (DeepSeek-V2); then num_kv_heads 1, head_dim = latent width

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(self.architecture)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    # ---- derived values -------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Width of the projected queries, ``num_q_heads * head_dim``."""
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the projected keys (= values), ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        if self.moe is not None or self.mla is not None:
            return family_num_params(self)
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.qkv_size + self.q_size * h
        attn += self.qkv_size if self.attention_bias else 0
        attn += 2 * d if self.qk_norm else 0
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token takes across all layers (MLA: one latent row, no separate V)."""
        return (1 if self.mla is not None else 2) * self.num_layers * self.kv_size * dtype_bytes

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str | None = None) -> "ModelConfig":
        """From a parsed HF ``config.json``; raises ``ValueError`` for other architectures."""
        archs = d.get("architectures") or []
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None:
            if archs:
                raise _unsupported(archs[0])
            mt = d.get("model_type")
            if mt not in SUPPORTED_ARCHITECTURES:
                raise _unsupported(str(mt))
            arch = mt
        n_q = d["num_attention_heads"]
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling") or rope_params or None
        eos = d.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        window = d.get("sliding_window") if d.get("use_sliding_window", arch == "mistral") else None
        moe = moe_from_hf(arch, d) if arch in MOE_HF_ARCHITECTURES.values() else None
        mla = mla_from_hf(d) if arch == "deepseek_v2" else None
        if mla is not None:  # the pool holds one latent row per token, attended by every query head
            rope_scaling, head_dim, n_kv = None, mla.latent_dim, 1
        else:
            head_dim = d.get("head_dim") or d["hidden_size"] // n_q
            n_kv = d.get("num_key_value_heads") or n_q
        return cls(
            architecture=arch,
            name=name or d.get("_name_or_path") or arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_q_heads=n_q,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if arch.startswith(("qwen", "deepseek")) else 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            sliding_window=window,
            moe=moe,
            mla=mla,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        default_name = path.parent.name if path.name == "config.json" else path.stem
        return cls.from_hf_dict(d, name=d.get("_name_or_path") or default_name)

    @classmethod
    def from_gguf(cls, reader, rope_freqs: tuple[float, ...] | None = None) -> "ModelConfig":
        """From a ``gguf.GGUFReader``'s metadata (``{arch}.*`` keys, e.g. ``llama.block_count``).

        ``rope_freqs`` are llama.cpp's per-frequency RoPE divisors (the ``rope_freqs.weight`` tensor
        that llama-3.1 conversions carry instead of rope_scaling metadata).
        """
        def get(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        arch = get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
        p = arch + "."
        n_q = int(get(p + "attention.head_count"))
        n_kv = get(p + "attention.head_count_kv", n_q)
        hidden = int(get(p + "embedding_length"))
        head_dim = get(p + "attention.key_length") or get(p + "rope.dimension_count") or hidden // n_q
        vocab = get(p + "vocab_size")
        if vocab is None:
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else None
        rope_scaling = None
        kind = get(p + "rope.scaling.type")
        if rope_freqs is not None:
            rope_scaling = {"rope_type": "freq_factors", "factors": tuple(float(x) for x in rope_freqs)}
        elif kind == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get(p + "rope.scaling.factor"))}
        elif kind not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling {kind!r}")
        eos = [get("tokenizer.ggml.eos_token_id")]
        eot = get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos:
            eos.append(eot)
        return cls(
            architecture=arch,
            name=get("general.name") or arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get(p + "feed_forward_length")),
            num_layers=int(get(p + "block_count")),
            num_q_heads=n_q,
            num_kv_heads=int(n_kv),
            head_dim=int(head_dim),
            rms_norm_eps=float(get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get(p + "rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get(p + "context_length", 4096)),
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            attention_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
            qk_norm=any(t.name == "blk.0.attn_q_norm.weight" for t in reader.tensors),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos if e is not None),
            torch_dtype="float32",
        )
