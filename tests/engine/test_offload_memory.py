"""DS-Offload's memory tier (engine/offload_memory.py): the offload builder injects it, an in-GPU
engine keeps the plain pools, and the tiered allocator routes slots by tier."""

import pytest
import torch

from doublesparse.engine.engine import Engine
from doublesparse.engine.memory import KVMemory, OutOfSlots, SlotAllocator
from doublesparse.engine.offload_memory import OffloadKVMemory, TieredSlotAllocator
from doublesparse.testing import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(**kw):
    m = tiny_llama(seed=1, num_q_heads=4, num_kv_heads=2, max_position_embeddings=256)
    return Engine(model=m, tokenizer=ByteTokenizer(), progress=False, device="cpu", max_total_tokens=300,
                  enable_double_sparsity=True, ds_heavy_token_num=16, ds_heavy_channel_num=4,
                  ds_selection_mode="group_max", max_running_requests=2, **kw)


def test_engines_build_the_memory_of_their_tier():
    plain = _engine().parts
    assert type(plain.memory) is KVMemory and type(plain.memory.slots) is SlotAllocator
    assert plain.scheduler.token_capacity == plain.memory.slots.admission_size == 300
    assert not hasattr(plain.memory, "kv_store")

    off = _engine(enable_ds_offload=True, ds_offload_device_tokens=50).parts
    mem = off.memory
    assert isinstance(mem, OffloadKVMemory) and isinstance(mem.slots, TieredSlotAllocator)
    assert mem.k is mem.kv_store.k and mem.slots.device_tier == 50
    # admission counts the host store only; the device pools are the tier's and the labels
    assert off.scheduler.token_capacity == mem.slots.admission_size == 300
    tier = sum(t.numel() * t.element_size() for t in mem.device_tier_pools)
    labels = sum(t.numel() * t.element_size() for t in mem.label)
    assert tier > 0 and mem.nbytes == tier + labels + mem.req_to_token.numel() * 4
    assert off.backend.tiers(0)[2] is mem.kv_store.device_k[0]


def test_tiered_slot_allocator_keeps_the_tiers_apart():
    a = TieredSlotAllocator(10, device_tier=3)
    assert (a.num_free, a.num_free_device, a.admission_size, a.admission_free) == (10, 3, 7, 7)
    d = a.alloc(2, on_device=True)
    h = a.alloc(7)
    assert sorted(d.tolist()) == [1, 2] and sorted(h.tolist()) == list(range(4, 11))
    with pytest.raises(OutOfSlots, match="asked for 2 device-tier KV slots, 1 of 10 free"):
        a.alloc(2, on_device=True)
    with pytest.raises(OutOfSlots, match="asked for 1 KV slots, 0 of 10 free"):
        a.alloc(1)
    a.free(torch.cat([h[:3], d]))   # mixed frees go back to their own lists
    assert (a.num_free_device, a.admission_free, a.num_used) == (3, 3, 4)
    with pytest.raises(ValueError, match="double free"):
        a.free(d[:1])
