"""Which part of each tensor a tensor-parallel rank holds (no processes: slicing and building only)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from doublesparse.distributed.layers import Collectives
from doublesparse.distributed.loading import build_local, load_shard
from doublesparse.distributed.shard import Shard, check_tp, split
from doublesparse.distributed.steps import RecordingKVMemory, apply_writes, pack, unpack
from doublesparse.attention.batch import ForwardBatch
from doublesparse.engine.memory import KVMemory, MemoryPlan
from doublesparse.models import load_model
from doublesparse.testing import tiny_config, tiny_family, tiny_family_hf_config


def _cat(parts, dim=0):
    return torch.cat(parts, dim)


def test_heads_split_and_replicated():
    c = tiny_config(num_q_heads=4, num_kv_heads=2, head_dim=4, hidden_size=8)
    full = torch.randn(c.qkv_size, 8)
    q, k, v = full.split([c.q_size, c.kv_size, c.kv_size])
    for tp in (2, 4):
        shards = [Shard(c, r, tp) for r in range(tp)]
        parts = [s.tensor("layers.0.attn.qkv_proj.weight", full) for s in shards]
        lc = shards[0].local_config()
        assert lc.num_q_heads == 4 // tp and lc.num_kv_heads == max(1, 2 // tp)
        assert torch.equal(_cat([p[: lc.q_size] for p in parts]), q)
        for r, (s, p) in enumerate(zip(shards, parts)):
            k0, k1 = s.kv_range
            assert torch.equal(p[lc.q_size: lc.q_size + lc.kv_size], k[k0 * 4: k1 * 4])
            assert torch.equal(p[lc.q_size + lc.kv_size:], v[k0 * 4: k1 * 4])
            # a rank's query heads belong to its KV heads
            q0, q1 = s.q_range
            assert k0 <= q0 // c.group_size and (q1 - 1) // c.group_size < k1
        assert [s.kv_range for s in shards] == ([(0, 1), (1, 2)] if tp == 2 else [(0, 1), (0, 1), (1, 2), (1, 2)])
        o = torch.randn(8, c.q_size)
        assert torch.equal(_cat([s.tensor("layers.1.attn.o_proj.weight", o) for s in shards], 1), o)


def test_ffn_experts_vocab_uneven():
    m = tiny_family("mixtral")  # 5 experts of width 80, vocab 260
    c, tp = m.config, 3
    shards = [Shard(c, r, tp) for r in range(tp)]
    E, inter, H = c.moe.num_experts, c.moe.intermediate_size, c.hidden_size
    w13 = m.layers[0].mlp.w13.view(E, 2, inter, H)
    parts = [s.tensor("layers.0.mlp.w13", m.layers[0].mlp.w13) for s in shards]
    widths = [hi - lo for lo, hi in (split(inter, tp, r) for r in range(tp))]
    assert [s.local_config().moe.intermediate_size for s in shards] == widths == [26, 27, 27]
    assert torch.equal(_cat([p.view(E, 2, w, H) for p, w in zip(parts, widths)], 2), w13)
    w2 = m.layers[0].mlp.w2
    assert torch.equal(_cat([s.tensor("layers.0.mlp.w2", w2) for s in shards], 1), w2)
    emb = m.embed_tokens.weight
    rows = [s.tensor("embed_tokens.weight", emb) for s in shards]
    assert all(r.shape[0] == 87 for r in rows) and torch.equal(_cat(rows)[:260], emb)
    assert not _cat(rows)[260:].any()
    gu = torch.randn(2 * 3 * 10, H)  # a gated MLP of 3 merged (shared) experts: gate rows, then up rows
    cs = dataclasses.replace(c, moe=dataclasses.replace(c.moe, num_shared_experts=3))
    got = [Shard(cs, r, 2).tensor("layers.0.mlp.shared.gate_up_proj.weight", gu) for r in range(2)]
    assert torch.equal(got[1], gu.view(2, 3, 10, H)[:, :, 5:].reshape(-1, H))
    down = torch.randn(H, 3 * 10)
    got = [Shard(cs, r, 2).tensor("layers.0.mlp.shared.down_proj.weight", down) for r in range(2)]
    assert torch.equal(got[1], down.view(H, 3, 10)[:, :, 5:].reshape(H, -1))


def test_refusals():
    with pytest.raises(ValueError, match="query heads"):
        check_tp(tiny_config(num_q_heads=4, num_kv_heads=2), 3)
    with pytest.raises(ValueError, match="KV heads"):
        check_tp(tiny_config(num_q_heads=12, num_kv_heads=3), 4)
    with pytest.raises(ValueError, match="MLA"):
        check_tp(tiny_family("deepseek_v2").config, 2, double_sparsity=True)
    check_tp(tiny_family("deepseek_v2").config, 2)   # dense decode splits its heads


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_dummy_shards_are_slices_of_the_tp1_dummy_model(tmp_path, arch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_family_hf_config(arch, max_position_embeddings=256)))
    full = dict(load_model(path, load_format="dummy", seed=3).named_parameters())
    for r in range(2):
        part = load_shard(path, "dummy", None, "cpu", Collectives(r, 2), seed=3)
        for name, p in part.named_parameters():
            assert torch.equal(p, part.shard.tensor(name, full[name])), name
    built = build_local(tiny_config(tie_word_embeddings=True), Collectives(1, 2), "cpu", torch.float32)
    assert built.lm_head.weight is built.embed_tokens.weight


def test_step_messages_round_trip():
    plan = MemoryPlan(1, 2, 4, 0, torch.float32, None, 64, 4, 32)
    src, dst = RecordingKVMemory(plan, "cpu"), KVMemory(plan, "cpu")
    src.set_row_slots(2, 3, torch.tensor([7, 8, 9]))
    src.set_row_slots(1, 0, torch.tensor([4]))
    apply_writes(dst, src.take_writes())
    assert torch.equal(dst.req_to_token, src.req_to_token) and src.take_writes() is None
    i64 = lambda *v: torch.tensor(v)  # noqa: E731
    b = ForwardBatch("prefill", i64(5, 6, 7), i64(0, 1, 0), i64(1, 2, 3), i64(1, 2).int(), i64(2, 1).int(),
                     i64(1, 2), None, rows_host=(1, 2), extend_prefix_lens=(0, 0), extend_lens=(2, 1),
                     k=i64(8, 9).int(), ds_sparse=False)
    meta, packed = pack(b)
    u = unpack(meta, packed, "backend", b.tuning)
    for f in ("input_ids", "positions", "out_slots", "req_idx", "seq_lens", "logits_indices", "k"):
        assert torch.equal(getattr(u, f), getattr(b, f)) and getattr(u, f).dtype == getattr(b, f).dtype, f
    assert (u.attn, u.rows_host, u.extend_lens, u.ds_sparse) == ("backend", (1, 2), (2, 1), False)
    assert isinstance(meta[5], tuple) and np.asarray(meta[7]).tolist() == [2, 1]


def test_llama70b_config_splits_over_8():
    from doublesparse.models import load_config
    c = load_config("llama-3.1-70b", "dummy")
    assert abs(c.num_params / 1e9 - 70.55) < 0.01
    local = Shard(c, 7, 8).local_config()
    assert (local.num_q_heads, local.num_kv_heads, local.intermediate_size) == (8, 1, 3584)


def test_cpu_shards_are_packed_like_the_tp1_model(tmp_path):
    from doublesparse.config import EngineConfig
    from doublesparse.distributed.loading import shard_model
    from doublesparse.distributed.rank import RankContext
    from doublesparse.models.layers import Linear
    from doublesparse.models.packed import GROUP, reference_weight
    from doublesparse.testing import tiny_llama

    def linears(m):
        return {n: x for n, x in m.named_modules() if isinstance(x, Linear)}

    # a --tp-size 2 CPU load packs every rank's linears, as --tp-size 1 does; the flag opts out
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_family_hf_config("mixtral", max_position_embeddings=256)))
    for off in (False, True):
        cfg = EngineConfig(model_path=str(path), load_format="dummy", disable_cpu_packed_weights=off)
        part = RankContext(Collectives(1, 2)).load_model(cfg, torch.device("cpu"), None, False)
        assert all((x.packed is None) == off for x in linears(part).values())
    # weights on 4-bit grids (a GGUF Q4 model): each rank's int4 copy holds its slice of TP 1's
    full = tiny_llama()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for x in linears(full).values():
            N, K = x.weight.shape
            q = torch.randint(0, 16, (N, K // GROUP, GROUP), generator=g).float()
            x.weight.copy_((q * torch.rand(N, K // GROUP, 1, generator=g) - 0.5).view(N, K))
    for r in range(2):
        part = shard_model(full, Collectives(r, 2))
        for name, x in linears(part).items():
            if name == "lm_head":  # tied to the embedding: never a grid, bf16 on either side
                continue
            assert torch.equal(reference_weight(x.weight),
                               part.shard.tensor(name + ".weight", reference_weight(linears(full)[name].weight))), name


def test_packed_cpu_load_decodes_at_tp2(tmp_path):
    # the ranks' packed copies serve their forwards, through the wrapped row-parallel layers too
    from doublesparse.bench import one_batch as bench_one_batch

    out = tmp_path / "r.json"
    rc = bench_one_batch.main(["--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                               "--tp-size", "2", "--batch-size", "2", "--input-len", "40", "--output-len", "3",
                               "--skip-warmup", "--copy-bytes", "1000000", "--result-json", str(out)])
    assert rc == 0 and json.loads(out.read_text())["results"][0]["median_step_bytes"] > 0
