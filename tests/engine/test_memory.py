from types import SimpleNamespace

import pytest
import torch

from doublesparse.config import CPU_DEFAULT_TOTAL_TOKENS, EngineConfig
from doublesparse.engine.memory import KVMemory, OutOfSlots, RowAllocator, SlotAllocator, plan_memory

MC = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)


def test_slot_allocator_no_double_alloc_and_frees_return():
    a = SlotAllocator(10)
    x = a.alloc(4)
    y = a.alloc(6)
    both = torch.cat([x, y])
    assert torch.unique(both).numel() == 10 and int(both.min()) == 1 and int(both.max()) == 10
    assert a.num_free == 0
    with pytest.raises(OutOfSlots, match="asked for 1 KV slots, 0 of 10 free"):
        a.alloc(1)
    a.free(x)
    assert a.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        a.free(x[:1])
    with pytest.raises(ValueError):
        a.free(torch.tensor([0]))           # the padding slot is never freeable
    z = a.alloc(4)
    assert sorted(z.tolist()) == sorted(x.tolist())


def test_row_allocator():
    r = RowAllocator(2)
    a, b = r.alloc(), r.alloc()
    assert {a, b} == {1, 2}
    with pytest.raises(OutOfSlots):
        r.alloc()
    r.free(a)
    with pytest.raises(ValueError):
        r.free(a)
    assert r.alloc() == a


def test_plan_sizes_and_bytes():
    cfg = EngineConfig(max_total_tokens=100, max_running_requests=4)
    p = plan_memory(cfg, MC, torch.float16, torch.device("cpu"), max_ctx=64, heavy_channel_num=2)
    assert p.max_total_tokens == 100 and p.num_slots == 101
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2
    assert p.label_bytes_per_token == 2 * 2 * 2 * 2
    assert "100 tokens" in p.describe()
    p2 = plan_memory(EngineConfig(), MC, torch.float32, torch.device("cpu"), 64, 0)
    assert p2.max_total_tokens == CPU_DEFAULT_TOTAL_TOKENS and p2.label_bytes_per_token == 0


@pytest.mark.parametrize("label", ["bf16", "fp8"])
def test_kv_memory_assign_release(label):
    cfg = EngineConfig(max_total_tokens=20, max_running_requests=2, ds_label_dtype=label)
    plan = plan_memory(cfg, MC, torch.float32, torch.device("cpu"), max_ctx=16, heavy_channel_num=3)
    mem = KVMemory(plan, "cpu")
    assert mem.k[0].shape == (21, 2, 8) and mem.label[1].shape == (21, 2, 3)
    assert mem.label[0].dtype == (torch.bfloat16 if label == "bf16" else torch.float8_e4m3fn)
    assert mem.label_scale[0].shape == (1,) and mem.label_scale[0].dtype == torch.float32
    row = mem.rows.alloc()
    slots = mem.assign(torch.full((5,), row), torch.arange(5), 5)
    assert torch.equal(mem.req_to_token[row, :5].long(), slots)
    assert int(mem.req_to_token[0].abs().sum()) == 0          # padding row untouched
    more = mem.assign(torch.full((2,), row), torch.arange(5, 7), 2)
    assert mem.slots.num_used == 7 and not set(more.tolist()) & set(slots.tolist())
    mem.release(row, 7)
    assert mem.slots.num_used == 0 and mem.rows.num_free == 2
    assert mem.nbytes > 0


def test_prefill_reserve_covers_chunk_and_repeated_kv():
    import torch
    from doublesparse.config import EngineConfig
    from doublesparse.engine.memory import prefill_reserve_bytes
    from doublesparse.models.loader import load_config

    mc = load_config("llama-3.1-8b", load_format="dummy")
    cfg = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", chunked_prefill_size=4096)
    got = prefill_reserve_bytes(cfg, mc, torch.bfloat16, 131072)
    # 4096 tokens x (4*4096 + 6144 + 3*14336) x 2 B, plus K and V of 131072 tokens over 32 heads
    assert got == 4096 * (4 * 4096 + 6144 + 3 * 14336) * 2 + 2 * 32 * 131072 * 128 * 2
