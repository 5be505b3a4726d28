"""MoE and MLA families (Mixtral, Qwen3-MoE, DeepSeek-V2) against Hugging Face transformers (CPU,
float32): logits, greedy decoding, routing, the weight-name map, shipped configs, loader errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub

from doublesparse.models import ModelConfig, greedy_generate, load_config, load_model
from doublesparse.models.mla import yarn_inv_freq
from doublesparse.models.moe import experts_torch, route
from doublesparse.models.moe_config import MoEConfig
from doublesparse.models.simple_attention import forward_sequence
from doublesparse.testing import tiny_family_hf_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v2"]
# DeepSeek-V2 with a low-rank query (V2 proper; V2-Lite has none) and plain greedy routing
DSV2_QLORA = {"q_lora_rank": 24, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "rope_scaling": None,
              "n_shared_experts": 2, "first_k_dense_replace": 0, "num_experts_per_tok": 2}


def _hf_model(d: dict, seed=0):
    cfg = transformers.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # non-trivial norms, so a mis-mapped tensor cannot hide behind 1s
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return hf


def _saved_pair(d: dict, folder):
    hf = _hf_model(d)
    hf.save_pretrained(str(folder))
    return hf, load_model(str(folder), progress=False)


def _ids(n, vocab=260, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[*FAMILIES, "deepseek_v2_qlora"])
def pair(request, tmp_path_factory):
    name = request.param
    d = tiny_family_hf_config(name.removesuffix("_qlora"), max_position_embeddings=512)
    if name == "deepseek_v2_qlora":
        d.update(DSV2_QLORA)
    return name, *_saved_pair(d, tmp_path_factory.mktemp(name))


def test_logits_match_hf(pair):
    name, hf, ours = pair
    assert ours.config.architecture == name.removesuffix("_qlora")
    ids = _ids(80)  # past the tiny DeepSeek's original context (64): YaRN's interpolated band matters
    with torch.inference_mode():
        a = forward_sequence(ours, ids)
        b = hf(ids[None]).logits[0]
    diff = (a - b).abs().max().item()
    assert diff < 1e-4 * max(1.0, b.abs().max().item()), f"{name}: max |logit diff| {diff:.2e}"


def test_greedy_32_tokens_match_hf(pair):
    _, hf, ours = pair
    ids = _ids(11, seed=5)
    mine = greedy_generate(ours, ids, 32)
    hf.generation_config.eos_token_id = None  # 32 tokens whatever comes, as greedy_generate without eos
    with torch.inference_mode():
        ref = hf.generate(ids[None], max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert mine.tolist() == ref.tolist()


def test_routing_matches_hf(pair):
    """Router ids and weights of the last layer on the hidden states HF feeds it."""
    _, hf, ours = pair
    seen = {}
    last = hf.model.layers[-1].mlp
    h = last.register_forward_hook(lambda m, args, out: seen.setdefault("x", args[0]))
    with torch.inference_mode():
        hf(_ids(37, seed=3)[None])
    h.remove()
    x = seen["x"][0].clone()
    with torch.no_grad():
        _, w_ref, ids_ref = last.gate(x)
        w, ids = ours.layers[-1].mlp.router(x)
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.float().gather(1, order_ref.indices))


def test_yarn_inv_freq_matches_hf():
    d = tiny_family_hf_config("deepseek_v2", max_position_embeddings=512)
    hf = _hf_model(d)
    ours = ModelConfig.from_hf_dict(d)
    inv, factor = yarn_inv_freq(ours.mla, ours.rope_theta)
    torch.testing.assert_close(inv, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf.model.rotary_emb.attention_scaling)


@pytest.mark.parametrize("arch", FAMILIES)
def test_dummy_weights_fill_every_hf_tensor(arch, tmp_path):
    """The name map covers transformers' state dict exactly; seeded dummy loads repeat."""
    from doublesparse.models.weights import hf_weight_map

    (tmp_path / "config.json").write_text(json.dumps(tiny_family_hf_config(arch)))
    ours = load_model(str(tmp_path), load_format="dummy", seed=3, progress=False)
    again = load_model(str(tmp_path), load_format="dummy", seed=3, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), again.parameters()))
    hf = _hf_model(tiny_family_hf_config(arch))
    hf.save_pretrained(str(tmp_path / "hf"))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert set(hf_weight_map(ours.config)) == saved


def test_experts_and_group_routing_reference():
    """The sorted-by-expert path against a per-token loop; group-limited routing keeps only the
    best groups' experts; awkward sizes."""
    g = torch.Generator().manual_seed(0)
    T, H, inter, E, K = 13, 24, 10, 6, 3
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    moe = MoEConfig(num_experts=E, top_k=K, intermediate_size=inter, norm_topk_prob=True,
                    topk_method="group_limited_greedy", num_groups=3, topk_groups=2, routed_scaling_factor=0.5)
    logits = torch.randn(T, E, generator=g)
    w, ids = route(logits, moe)
    best = logits.softmax(-1).view(T, 3, 2).amax(-1).topk(2, dim=-1).indices  # [T, 2] kept groups
    assert all(set((ids[t] // 2).tolist()) <= set(best[t].tolist()) for t in range(T))
    torch.testing.assert_close(w.sum(-1), torch.full((T,), 0.5))
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(inter)
            ref[t] += w[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts_torch(x, w13, w2, w, ids), ref, rtol=1e-5, atol=1e-5)


def test_shipped_configs():
    mix = load_config("mixtral-8x7b-v0.1", "dummy")
    assert (mix.moe.num_experts, mix.moe.top_k, mix.num_kv_heads) == (8, 2, 8)
    assert abs(mix.num_params / 1e9 - 46.70) < 0.01
    q = load_config("qwen3-30b-a3b", "dummy")
    assert (q.moe.num_experts, q.moe.top_k, q.qk_norm, q.moe.norm_topk_prob) == (128, 8, True, True)
    assert abs(q.num_params / 1e9 - 30.53) < 0.01
    ds = load_config("deepseek-v2-lite", "dummy")
    assert (ds.num_kv_heads, ds.head_dim, ds.mla.kv_lora_rank, ds.moe.dense_layers) == (1, 576, 512, (0,))
    assert ds.kv_bytes_per_token() == 27 * 576 * 2  # one latent row per token, no separate V
    assert abs(ds.num_params / 1e9 - 15.71) < 0.01
    assert ds.mla.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * torch.tensor(40.0).log().item() + 1) ** 2)


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_model(tiny_family_hf_config("qwen3_moe")).save_pretrained(str(tmp_path))
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight"):
        load_model(str(tmp_path), progress=False)


def test_bad_family_configs():
    d = tiny_family_hf_config("deepseek_v2")
    with pytest.raises(ValueError, match="unsupported rope scaling 'linear' for deepseek_v2"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="n_group=3 does not divide num_experts=8"):
        ModelConfig.from_hf_dict({**d, "n_group": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be in 1..num_experts=6"):
        ModelConfig.from_hf_dict({**tiny_family_hf_config("qwen3_moe"), "num_experts_per_tok": 9})
