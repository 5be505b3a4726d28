"""Model family + loaders against Hugging Face transformers (CPU, float32).

References: transformers' own Llama/Mistral/Qwen2/Qwen3 classes. SmolLM2 is compared on the
embedded Q4_1 GGUF, which both sides dequantize identically, so differences are pure arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from doublesparse.attention.batch import ForwardBatch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub

from doublesparse.models import (  # noqa: E402
    CausalAttention, ModelConfig, forward_sequence, greedy_generate,
    load_config,
    load_model, load_tokenizer, model_class, read_chat_template, shipped_configs,
)
from doublesparse.models.loader import CONFIGS_DIR  # noqa: E402
from doublesparse.models.layers import rope_inv_freq  # noqa: E402

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# ---- SmolLM2 (embedded GGUF) vs transformers ---------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from doublesparse.assets import smollm2_gguf_path

    path = smollm2_gguf_path()
    ours = load_model(None, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True).eval()
    tok = load_tokenizer(None)
    return ours, hf, tok


def _prompt_ids(tok, n=None):
    """The chat-formatted prompt (~70 tokens), or its first ``n`` tokens."""
    msgs = [{"role": "user", "content": "Write a short poem about the sea, the wind, the gulls and an old "
                                        "lighthouse keeper who counts the ships at night and writes their "
                                        "names in a big leather book."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor(ids if isinstance(ids[0], int) else ids[0])
    assert len(ids) >= 64
    return ids if n is None else ids[:n]


def test_smollm2_config(smollm2):
    c = smollm2[0].config
    assert (c.architecture, c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == \
        ("llama", 30, 9, 3, 64, 576)
    assert c.tie_word_embeddings and c.group_size == 3 and c.kv_size == 192
    assert smollm2[0].lm_head.weight is smollm2[0].embed_tokens.weight


def test_smollm2_logits_match_hf(smollm2):
    ours, hf, tok = smollm2
    ids = _prompt_ids(tok)
    with torch.inference_mode():
        a = forward_sequence(ours, ids)
        b = hf(ids[None]).logits[0].float()
    diff = (a - b).abs().max().item()
    print(f"SmolLM2 {len(ids)} tokens: max |logit diff| = {diff:.2e} (max |logit| {b.abs().max():.1f})")
    assert a.dtype == torch.float32 and a.shape == b.shape
    assert diff < 2e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_smollm2_greedy_matches_hf(smollm2):
    ours, hf, tok = smollm2
    ids = _prompt_ids(tok)
    mine = greedy_generate(ours, ids, 32, eos_token_ids=ours.config.eos_token_ids).tolist()
    with torch.inference_mode():
        out = hf.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)
    theirs = out[0, len(ids):].tolist()
    print("greedy:", repr(tok.decode(mine)))
    assert mine == theirs


def test_logits_indices_select_rows(smollm2):
    ours, _, tok = smollm2
    ids = _prompt_ids(tok, 24)
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        full = ours(ids, pos, ForwardBatch(attn=CausalAttention()))
        idx = torch.tensor([0, 5, len(ids) - 1])
        some = ours(ids, pos, ForwardBatch(attn=CausalAttention(), logits_indices=idx))
    assert some.shape == (3, ours.config.vocab_size)
    torch.testing.assert_close(some, full[idx], rtol=1e-4, atol=1e-4)


def test_chat_template_and_tokenizer(smollm2):
    tok = smollm2[2]
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert read_chat_template(None) == tok.chat_template
    assert load_tokenizer("tiny-llama") is None  # shipped config: dummy weights, no tokenizer


def test_gguf_tokenizer_cache_matches_the_gguf(tmp_path, monkeypatch):
    """The cached tokenizer folder is written once, verified, and then encodes like the GGUF one."""
    from doublesparse.models import loader

    monkeypatch.setenv("DOUBLESPARSE_CACHE", str(tmp_path))
    first = load_tokenizer(None)                   # built from the GGUF, saved and verified
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert (entry / "ok").is_file()
    second = load_tokenizer(None)                  # read from the cache folder
    text = "ROMEO. But soft! what light through yonder window breaks? 4711 \u00e9\n"
    assert second.encode(text) == first.encode(text)
    assert loader._fingerprint(second) == loader._fingerprint(first)
    (entry / "tokenizer.json").write_text("{ broken")  # a damaged entry falls back to the GGUF ...
    assert load_tokenizer(None).encode(text) == first.encode(text)
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [entry.name]  # ... and is rewritten
    assert (entry / "ok").is_file() and json.loads((entry / "tokenizer.json").read_text())


# ---- tiny models of every architecture vs transformers --------------------------------------------

def _tiny_hf_dict(arch: str, **over) -> dict:
    d = json.loads((CONFIGS_DIR / "tiny-llama.json").read_text())
    d.update(architectures=[HF_CLASSES[arch]], model_type=arch)
    if arch == "mistral":
        d["sliding_window"] = 16  # shorter than the test sequence, so the window matters
    if arch == "qwen3":
        d["tie_word_embeddings"] = True
    d.update(over)
    return d


def _save_random_hf(arch: str, folder, seed=0, shard=False, **over):
    """Build transformers' model from the tiny config, randomise every tensor, save safetensors."""
    d = _tiny_hf_dict(arch, **over)
    cfg = transformers.AutoConfig.for_model(arch, **{k: v for k, v in d.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # Non-trivial norms and biases, so a mis-mapped tensor cannot hide behind 1s and 0s.
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    hf.save_pretrained(str(folder), max_shard_size="100KB" if shard else "5GB")
    return hf


def _ids(n, vocab=512, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_arch_matches_hf(arch, tmp_path):
    hf = _save_random_hf(arch, tmp_path, shard=arch == "llama")
    if arch == "llama":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(str(tmp_path), progress=False)
    c = ours.config
    assert c.architecture == arch
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.sliding_window == (16 if arch == "mistral" else None)
    ids = _ids(40)
    with torch.inference_mode():
        a = forward_sequence(ours, ids)
        b = hf(ids[None]).logits[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_kv_cached_greedy_equals_recompute(tmp_path):
    """The cached test backend (with a sliding window shorter than the run) agrees with full recompute."""
    _save_random_hf("mistral", tmp_path)
    m = load_model(str(tmp_path), progress=False)
    ids = _ids(8)
    a = greedy_generate(m, ids, 20, use_cache=True)
    b = greedy_generate(m, ids, 20, use_cache=False)
    assert a.tolist() == b.tolist() and len(a) == 20


def test_bf16_weights(tmp_path):
    """bf16 weights: float32 logits out, close to the float32 model; RoPE table stays float32."""
    _save_random_hf("qwen3", tmp_path)
    f32 = load_model(str(tmp_path), progress=False)
    bf16 = load_model(str(tmp_path), dtype="bfloat16", progress=False)
    assert bf16.dtype == torch.bfloat16 and bf16.rope.cos.dtype == torch.float32
    ids = _ids(16)
    a, b = forward_sequence(f32, ids), forward_sequence(bf16, ids)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert f32.to(torch.bfloat16).rope.cos.dtype == torch.float32


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_dummy_weights_into_hf(arch, tmp_path):
    """Our seeded dummy init, copied into transformers' model through the HF name map."""
    from doublesparse.models.weights import hf_weight_map

    (tmp_path / "config.json").write_text(json.dumps(_tiny_hf_dict(arch)))
    ours = load_model(str(tmp_path), load_format="dummy", seed=3, progress=False)
    again = load_model(str(tmp_path / "config.json"), load_format="dummy", seed=3, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), again.parameters()))
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    params = dict(ours.named_parameters(remove_duplicate=False))
    sd = {}
    for hf_name, (name, lo, hi) in hf_weight_map(ours.config).items():
        sd[hf_name] = params[name] if lo is None else params[name][lo:hi]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if ours.config.tie_word_embeddings else set())
    ids = _ids(24)
    with torch.inference_mode():
        torch.testing.assert_close(forward_sequence(ours, ids), hf(ids[None]).logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "linear", "factor": 4.0},
])
def test_rope_scaling_matches_hf(scaling, tmp_path):
    hf = _save_random_hf("llama", tmp_path, rope_scaling=scaling, max_position_embeddings=1024)
    ours = load_model(str(tmp_path), progress=False)
    assert ours.config.rope_scaling["rope_type"] == scaling.get("rope_type", scaling.get("type"))
    ref = hf.model.rotary_emb.inv_freq.float()
    mine = rope_inv_freq(ours.config)
    assert not torch.allclose(mine, rope_inv_freq(dataclasses.replace(ours.config, rope_scaling=None)))
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0)
    # Positions far past the original context, where the scaled bands differ from plain RoPE.
    ids, pos = _ids(32), torch.arange(600, 632)
    with torch.inference_mode():
        a = ours(ids, pos, ForwardBatch(attn=CausalAttention()))
        b = hf(ids[None], position_ids=pos[None]).logits[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _write_gguf(hf, arch: str, path):
    """Write transformers' tiny model as llama.cpp's converter would (names, metadata, q/k permutation)."""
    import gguf

    from doublesparse.models.weights import hf_to_gguf_name

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)

    def permute(t, n_head):  # llama.cpp's reorder of rotate-half rows into interleaved pairs
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = permute(t, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = permute(t, c.num_key_value_heads)
        w.add_tensor(hf_to_gguf_name(name), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_loader_matches_hf(arch, tmp_path):
    hf = _save_random_hf(arch, tmp_path / "hf")
    _write_gguf(hf, arch, tmp_path / "tiny.gguf")
    ours = load_model(str(tmp_path / "tiny.gguf"), progress=False)
    c = ours.config
    assert (c.architecture, c.attention_bias, c.qk_norm, c.tie_word_embeddings) == \
        (arch, arch == "qwen2", arch == "qwen3", arch == "qwen3")
    ids = _ids(40)
    with torch.inference_mode():
        torch.testing.assert_close(forward_sequence(ours, ids), hf(ids[None]).logits[0], rtol=1e-4, atol=1e-4)


# ---- configs ------------------------------------------------------------------------------------

def test_shipped_configs():
    names = shipped_configs()
    for n in ("llama-3.1-8b", "mistral-7b-v0.1", "qwen2.5-7b", "longchat-7b-v1.5-32k", "tiny-llama"):
        assert n in names
    l31 = load_config("llama-3.1-8b", "dummy")
    assert (l31.num_kv_heads, l31.group_size, l31.rope_scaling["rope_type"]) == (8, 4, "llama3")
    assert abs(l31.num_params / 1e9 - 8.03) < 0.01
    lc = load_config("longchat-7b-v1.5-32k", "dummy")
    assert lc.rope_scaling == {"rope_type": "linear", "factor": 8.0} and lc.max_position_embeddings == 32768
    q = load_config("qwen2.5-7b", "dummy")
    assert q.attention_bias and q.num_kv_heads == 4 and q.sliding_window is None
    assert load_config("mistral-7b-v0.1", "dummy").sliding_window == 4096


def test_config_from_transformers5_dict():
    d = _tiny_hf_dict("llama")
    d.pop("rope_theta")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    d["eos_token_id"] = [2, 7]
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 5e5 and c.rope_scaling is None and c.eos_token_ids == (2, 7)
    assert c.q_size == 64 and c.kv_size == 32 and c.qkv_size == 128


# ---- loader errors ------------------------------------------------------------------------------

def test_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model("/nonexistent/model/dir")
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        load_model("tiny-llama")
    with pytest.raises(FileNotFoundError, match="no config for dummy model 'nope'"):
        load_model("nope", load_format="dummy")


def test_unsupported_architecture(tmp_path):
    d = _tiny_hf_dict("llama", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_model(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "architectures"})
    with pytest.raises(ValueError, match="unsupported model architecture 'bert'"):
        model_class("bert")


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_hf_dict("llama")))
    with pytest.raises(ValueError, match=f"{tmp_path}.*holds no model weights"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_random_hf("llama", tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor.*model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path), progress=False)


def test_bad_and_truncated_gguf(tmp_path):
    from doublesparse.assets import smollm2_gguf_path

    bad = tmp_path / "bad.gguf"
    bad.write_text("this is not a gguf file")
    with pytest.raises(ValueError, match="bad.gguf is not a GGUF file"):
        load_model(str(bad))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(str(bad))
    trunc = tmp_path / "t" / "trunc.gguf"
    trunc.parent.mkdir()
    with open(smollm2_gguf_path(), "rb") as src, open(trunc, "wb") as dst:
        dst.write(src.read(4 << 20))
    with pytest.raises(ValueError, match="trunc.gguf (is truncated|is not a readable GGUF)"):
        load_model(str(trunc.parent))  # a folder holding one GGUF resolves to it
    header_only = tmp_path / "header.gguf"
    shutil.copyfile(trunc, header_only)
    with open(header_only, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError, match="header.gguf is not a readable GGUF"):
        load_model(str(header_only))
    with pytest.raises(ValueError, match="several GGUF files"):
        load_model(str(tmp_path))
