"""Torch GGML dequantizers against gguf's numpy reference, and the GGUF loader on a tiny model
whose tensors are stored in every block type the torch path handles."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as np_dequantize

from doublesparse.models.gguf_quants import TORCH_TYPES, dequantize

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUANT_TYPES = [
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q8_0,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
]
# Byte offsets of each block's ggml_half scale fields, and the largest |scale x quant| product
# of the other fields, so random blocks decode to weights of a chosen size.
_HALVES = {
    T.Q4_0: ([0], 8),
    T.Q4_1: ([0, 2], 16),
    T.Q5_0: ([0], 16),
    T.Q5_1: ([0, 2], 32),
    T.Q8_0: ([0], 128),
    T.Q4_K: ([0, 2], 63 * 15),
    T.Q5_K: ([0, 2], 63 * 31),
    T.Q6_K: ([208], 128 * 32),
    T.Q3_K: ([108], 32 * 4),
    T.IQ4_NL: ([0], 127),
    T.Q2_K: ([80, 82], 15 * 3),
}


def random_blocks(
    rng, qtype: T, shape: tuple[int, ...], weight_scale: float = 1.0
) -> np.ndarray:
    """Raw bytes ``uint8 [*shape[:-1], row_bytes]`` of random blocks for a tensor of ``shape``
    elements: random quants and sub-scales, finite half-precision scales sized so weights stay
    within about ``weight_scale``."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(
        0, 256, (*shape[:-1], shape[-1] // block * nbytes), dtype=np.uint8
    )
    offsets, top = _HALVES[qtype]
    blocks = raw.reshape(-1, nbytes)
    for off in offsets:
        d = (rng.uniform(-1, 1, len(blocks)) * weight_scale / top).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_numpy_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(rng, qtype, (3, 5, block * 7))  # 105 blocks in a 3-d tensor
    ref = np_dequantize(raw, qtype)
    got = dequantize(torch.from_numpy(raw), qtype)
    assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape == (
        3,
        5,
        block * 7,
    )
    np.testing.assert_array_equal(got.numpy(), ref)
    # Into a bf16 destination, and across several internal chunks.
    from doublesparse.models import gguf_quants

    out = torch.empty(ref.shape, dtype=torch.bfloat16)
    old, gguf_quants._CHUNK_BLOCKS = gguf_quants._CHUNK_BLOCKS, 16
    try:
        dequantize(torch.from_numpy(raw), qtype, out=out)
    finally:
        gguf_quants._CHUNK_BLOCKS = old
    torch.testing.assert_close(out, torch.from_numpy(ref).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "qtype,np_dtype", [(T.F32, np.float32), (T.F16, np.float16)], ids=["F32", "F16"]
)
def test_float_types_and_fallback(qtype, np_dtype):
    x = np.random.default_rng(1).standard_normal((7, 13)).astype(np_dtype)
    got = dequantize(torch.from_numpy(x.view(np.uint8).copy()), qtype)
    np.testing.assert_array_equal(got.numpy(), x.astype(np.float32))
    vec = dequantize(
        torch.from_numpy(x[0].view(np.uint8).copy()), qtype
    )  # 1-d (norms, biases)
    assert tuple(vec.shape) == (13,)
    # A type without a torch kernel goes through the numpy reference.
    assert T.IQ4_NL not in TORCH_TYPES
    raw = random_blocks(np.random.default_rng(2), T.IQ4_NL, (2, 96))
    np.testing.assert_array_equal(
        dequantize(torch.from_numpy(raw), T.IQ4_NL).numpy(),
        np_dequantize(raw, T.IQ4_NL),
    )


def test_dequantize_errors():
    with pytest.raises(ValueError, match="whole number of 144-byte blocks"):
        dequantize(torch.zeros(2, 100, dtype=torch.uint8), T.Q4_K)
    with pytest.raises(TypeError, match="raw uint8"):
        dequantize(torch.zeros(2, 144), T.Q4_K)
    with pytest.raises(ValueError, match="out has shape"):
        dequantize(
            torch.zeros(2, 144, dtype=torch.uint8), T.Q4_K, out=torch.empty(2, 255)
        )


# ---- a tiny Qwen2 GGUF with every block type, loaded by us and by transformers -------------------

_MIXED = [
    T.Q4_K,
    T.Q6_K,
    T.Q5_K,
    T.Q8_0,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q2_K,
    T.Q3_K,
    T.F16,
    T.BF16,
]


def write_quantized_qwen2(
    path, seed=0, hidden=256, inter=512, heads=(4, 2), head_dim=64, layers=2, vocab=320
) -> dict[str, T]:
    """A random Qwen2 GGUF (untied output, q/k/v biases) whose matrices cycle through
    :data:`_MIXED`; K-quant rows need multiples of 256 weights. Returns name -> type."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2-quant")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads[0])
    w.add_head_count_kv(heads[1])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(2)
    # A byte-level vocabulary, so transformers can build its tokenizer from the file.
    w.add_tokenizer_model("gpt2")
    w.add_token_list(
        [bytes([i]).decode("latin-1") for i in range(256)]
        + [f"<x{i}>" for i in range(vocab - 256)]
    )
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    types: dict[str, T] = {}

    def matrix(name, shape, qtype, scale=0.1):
        types[name] = qtype
        if qtype in (T.F16, T.BF16):
            x = (rng.standard_normal(shape) * scale).astype(np.float32)
            if qtype == T.F16:
                return w.add_tensor(name, x.astype(np.float16))
            bf = (
                (x.view(np.uint32) >> 16)
                .astype(np.uint16)
                .view(np.uint8)
                .reshape(*shape[:-1], -1)
            )
            return w.add_tensor(name, bf, raw_shape=bf.shape, raw_dtype=T.BF16)
        raw = random_blocks(rng, qtype, shape, scale)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

    def vector(name, n, base=0.0):
        types[name] = T.F32
        w.add_tensor(name, (base + 0.2 * rng.standard_normal(n)).astype(np.float32))

    q, kv = heads[0] * head_dim, heads[1] * head_dim
    matrix("token_embd.weight", (vocab, hidden), T.Q4_K, 1.0)
    matrix("output.weight", (vocab, hidden), T.Q6_K, 0.2)
    vector("output_norm.weight", hidden, 1.0)
    k = 0
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0)
        vector(p + "ffn_norm.weight", hidden, 1.0)
        for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            vector(p + name + ".bias", n)
        for name, shape in (
            ("attn_q", (q, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, q)),
            ("ffn_gate", (inter, hidden)),
            ("ffn_up", (inter, hidden)),
            ("ffn_down", (hidden, inter)),
        ):
            matrix(p + name + ".weight", shape, _MIXED[k % len(_MIXED)])
            k += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def test_quantized_gguf_loads_like_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from doublesparse.models import forward_sequence, load_model

    types = write_quantized_qwen2(tmp_path / "tiny-q.gguf")
    assert set(_MIXED) <= set(types.values())
    ours = load_model(str(tmp_path / "tiny-q.gguf"), progress=False)
    c = ours.config
    assert (c.architecture, c.attention_bias, c.tie_word_embeddings, c.head_dim) == (
        "qwen2",
        True,
        False,
        64,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path),
        gguf_file="tiny-q.gguf",
        dtype=torch.float32,
        local_files_only=True,
    ).eval()
    ids = torch.randint(
        0, c.vocab_size, (37,), generator=torch.Generator().manual_seed(3)
    )
    with torch.inference_mode():
        a, b = forward_sequence(ours, ids), hf(ids[None]).logits[0]
    assert b.std() > 0.1
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
