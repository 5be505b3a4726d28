"""DS-Offload (attention/offload.py): decode with K/V in a host store and a device hot set gives
exactly in-GPU Double Sparsity's selections and outputs, step after step, with evictions."""

import pytest
import torch

from doublesparse.attention.batch import ForwardBatch

from kernel_utils import make_case
from offload_utils import memory as _memory, run as _run
from doublesparse.attention import DSParams
from doublesparse.attention.offload import OffloadDSBackend
from doublesparse.attention.offload_hot import HotSet
from doublesparse.kernels.host_copy import copy_rows, copy_rows_ref


@pytest.mark.parametrize("mode", ["group_max", "layer"])
def test_offload_equals_in_gpu_ds_torch(mode):
    """Odd batch, GQA 9/3, a request shorter than k (5 < 8: dense from the hot set), lengths not
    multiples of anything; capacity == k forces evictions whenever a selection changes."""
    (_, off), (ref, got) = _run([5, 37, 70], 8, 8, "torch", steps=5, mode=mode)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    s = off.fetch_stats()
    assert s["hits"] > 0 and s["misses"] > 0 and s["steps"] == 5


@pytest.mark.parametrize("mode", ["group_max", "layer"])
def test_next_layer_prefetch_keeps_outputs(mode):
    """Predicting layer l+1's selection from layer l's query and fetching it early changes what is
    resident, never the outputs; the prefetched rows count as host bytes, the fix-ups as misses."""
    (_, off), (ref, got) = _run([5, 37, 70], 8, 9, "torch", steps=3, prefetch="next-layer", layers=2, mode=mode)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s = off.fetch_stats()
    assert s["prefetched"] > 0 and s["hits"] > 0


def test_no_reuse_and_full_kv():
    (_, off), (ref, got) = _run([6, 41], 8, 8, "torch", fetch="no-reuse", steps=3)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert off.fetch_stats()["hits"] == 0
    # full-kv: dense attention over each request's whole K/V, read from the host store
    _, (ref, got) = _run([6, 41], 8, 8, "torch", fetch="full-kv", steps=2)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_hot_set_lookup_and_reset():
    hot = HotSet(1, 3, 4, 2, 8, 50, torch.float32, "cpu")
    hk = torch.randn(50, 2, 8)
    hv = torch.randn(50, 2, 8)
    req = torch.tensor([1, 2])
    slots = torch.tensor([[[10, 11, 12], [20, 21, 22]], [[30, 31, 0], [40, 41, 0]]])
    valid = slots > 0
    for step, want_miss in ((1, 10), (2, 0)):
        hot.tick()
        rows, fetch = hot.lookup(0, req, slots, valid)
        hot.fetch(0, (hk, hv, None, None, 0), slots, rows, fetch, impl="torch")
        assert int(fetch.sum()) == want_miss
        h = torch.arange(2)[None, :, None].expand_as(slots)
        assert torch.equal(hot.k[0][rows.long(), h][valid], hk[slots, h][valid])
        assert (rows[valid] // 4 == req[:, None, None].expand_as(slots)[valid]).all()
    hot.reset_region(1)
    hot.tick()
    rows, fetch = hot.lookup(0, req, slots, valid)
    assert int(fetch[0].sum()) == 6 and int(fetch[1].sum()) == 0
    # a new token replaces the least recently used row of a full set (capacity 4, 3 resident + 2 new)
    hot.tick()
    s2 = torch.tensor([[[13, 14, 10], [23, 24, 20]], [[30, 31, 0], [40, 41, 0]]])
    rows2, fetch2 = hot.lookup(0, req, s2, s2 > 0)
    assert int(fetch2.sum()) == 4 and len(set(rows2[0, 0].tolist())) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")
def test_copy_rows_kernel_matches_reference():
    """The host gather under the interpreter at awkward sizes (5 heads, D 24, 37 entries, some masked)."""
    g = torch.Generator().manual_seed(0)
    src_k, src_v = torch.randn(61, 5, 24, generator=g), torch.randn(61, 5, 24, generator=g)
    dst = [torch.zeros(29, 5, 24) for _ in range(4)]
    src_rows = torch.randint(0, 61, (37,), generator=g)
    dst_rows = torch.randperm(29 * 5, generator=g)[:37] // 5
    heads = torch.randint(0, 5, (37,), generator=g)
    key = dst_rows * 5 + heads  # entries must not share a destination: drop repeated ones
    valid = (torch.rand(37, generator=g) > 0.3) & (torch.bincount(key, minlength=29 * 5)[key] == 1)
    copy_rows(src_k, src_v, dst[0], dst[1], src_rows.int(), dst_rows, heads, valid, impl="triton")
    copy_rows_ref(src_k, src_v, dst[2], dst[3], src_rows, dst_rows, heads, valid)
    assert torch.equal(dst[0], dst[2]) and torch.equal(dst[1], dst[3])
    assert dst[0].abs().sum() > 0


def test_store_of_one_token_copies_every_head():
    """The store's entries at batch size 1: [1, H] expansions, which reshape(-1) turns into stride-0
    views; the kernel must get them contiguous (it read past the one element: an illegal address
    in every CUDA-graph capture at batch 1). On CPU under the interpreter, on CUDA natively."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 3, 24, generator=g).to(dev), torch.randn(1, 3, 24, generator=g).to(dev)
    pool_k, pool_v = torch.zeros(9, 3, 24, device=dev), torch.zeros(9, 3, 24, device=dev)
    slots = torch.tensor([5], device=dev)
    rows = torch.arange(1, device=dev)[:, None].expand(1, 3)
    heads = torch.arange(3, device=dev)[None, :].expand(1, 3)
    ok = torch.ones(1, 3, dtype=torch.bool, device=dev)
    assert rows.reshape(-1).stride() == (0,)    # the trap this guards
    copy_rows(k, v, pool_k, pool_v, rows, slots[:, None].expand(1, 3), heads, ok, impl="triton")
    assert torch.equal(pool_k[5], k[0]) and torch.equal(pool_v[5], v[0])
    assert pool_k[:5].abs().sum() == 0 and pool_k[6:].abs().sum() == 0


def test_gather_launcher_refuses_strided_entries():
    from doublesparse.kernels.triton.host_gather import copy_rows as launch
    t = torch.zeros(4, 2, 8)
    zero = torch.zeros(1, dtype=torch.long).expand(3)
    with pytest.raises(ValueError, match="contiguous"):
        launch(t, t, t, t, zero, zero.contiguous(), zero.contiguous(), torch.ones(3, dtype=torch.int8))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_tiered_copies_route_each_slot(impl):
    """A device tier of 7 slots before a host store of 11: rows come from and go to the tier of
    their slot (host rows at slot - 7), masked entries move nothing; as one flat store would."""
    if impl == "triton" and torch.cuda.is_available():
        pytest.skip("interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")
    from doublesparse.kernels.host_copy import copy_from_tiers, copy_to_tiers
    g = torch.Generator().manual_seed(2)
    flat_k, flat_v = torch.randn(19, 3, 24, generator=g), torch.randn(19, 3, 24, generator=g)
    tiers = (flat_k[7:].clone(), flat_v[7:].clone(), flat_k[:8].clone(), flat_v[:8].clone(), 7)
    tiers[0][0] = tiers[1][0] = 0                       # each tier's padding row
    slots = torch.tensor([[1, 8, 18], [7, 12, 3]])      # [E/3, 3] entries, both tiers in each row
    heads = torch.tensor([[0, 1, 2], [2, 0, 1]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    dst = torch.arange(6).view(2, 3)
    got_k, got_v = torch.zeros(6, 3, 24), torch.zeros(6, 3, 24)
    copy_from_tiers(tiers, got_k, got_v, slots, dst, heads, valid, impl=impl)
    want_k, want_v = torch.zeros(6, 3, 24), torch.zeros(6, 3, 24)
    copy_rows_ref(flat_k, flat_v, want_k, want_v, slots.flatten(), dst.flatten(), heads.flatten(), valid.flatten())
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    new_k, new_v = torch.randn(6, 3, 24, generator=g), torch.randn(6, 3, 24, generator=g)
    copy_to_tiers(new_k, new_v, dst, tiers, slots, heads, valid, impl=impl)
    copy_rows_ref(new_k, new_v, flat_k, flat_v, dst.flatten(), slots.flatten(), heads.flatten(), valid.flatten())
    assert torch.equal(tiers[2][1:], flat_k[1:8]) and torch.equal(tiers[0][1:], flat_k[8:])
    assert torch.equal(tiers[3][1:], flat_v[1:8]) and torch.equal(tiers[1][1:], flat_v[8:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")
@pytest.mark.parametrize("mode,fetch", [("group_max", "reuse"), ("layer", "reuse"), ("group_max", "no-reuse")])
def test_offload_equals_in_gpu_ds_triton(mode, fetch):
    """The Triton decode path (select stage, index translation, the sparse-list attention over the
    hot set) under the interpreter: tiny, two steps."""
    (_, off), (ref, got) = _run([5, 19, 12], 8, 8, "triton", steps=2, seed=5, heads=(6, 2), mode=mode, fetch=fetch)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert off.fetch_stats()["misses"] > 0


def test_offload_refuses_per_head_and_small_hot_set():
    c = make_case([20], 4, 2, 16, r=4, dtype=torch.float32)
    mem, _ = _memory(c, 1)
    kw = dict(memory=mem, num_q_heads=4, head_dim=16, impl="torch", channels=c.channels[None])
    hot = HotSet(1, 4, 8, 2, 16, mem.k[0].shape[0], torch.float32, "cpu")
    with pytest.raises(ValueError, match="per_head"):
        OffloadDSBackend(ds=DSParams(8, "per_head"), hot=hot, **kw)
    with pytest.raises(ValueError, match="hot set"):
        OffloadDSBackend(ds=DSParams(9), hot=hot, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")
def test_dense_step_triton():
    """A step in which no request selects (all no longer than k: the engine's dense graph) reads
    each request's whole cache from the hot set, as the in-GPU dense kernel reads the pool."""
    (_, off), (ref, got) = _run([5, 3, 6], 9, 9, "triton", steps=1, heads=(4, 2), sparse=False)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")
def test_full_kv_and_prefix_gather_triton():
    """full-kv through the dense kernel over the host pools, and the prefill's prefix gather by the
    host-gather kernel, under the interpreter."""
    _, (ref, got) = _run([6, 13], 8, 8, "triton", fetch="full-kv", steps=1, heads=(4, 2))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    (_, off), _ = _run([6], 8, 8, "torch", steps=1)
    off._triton = True
    kp, vp = off.memory.k[0], off.memory.v[0]
    slots = torch.tensor([3, 1, 7, 2, 9])
    q = torch.zeros(1, 9, 16)
    ks, vs = off._gather((kp, vp, None, None, 0), slots, q)
    assert torch.equal(ks, kp[slots].transpose(0, 1)) and torch.equal(vs, vp[slots].transpose(0, 1))


def test_blocked_prefix_prefill_matches_one_call():
    """A chunk after a long cached prefix, the prefix attended to in blocks of 7 tokens merged by
    log-sum-exp, equals one attention call over the whole gathered prefix (float32, to rounding)."""
    from torch.nn.attention.bias import causal_lower_right
    from doublesparse.attention.base import PrefillMeta, PrefillSegment
    (_, off), _ = _run([40], 8, 8, "torch", steps=1)
    m, c_row = off.memory, 0
    row = int((m.req_to_token[:, 0] != 0).nonzero()[c_row])
    P, n = 30, 11
    slots = m.req_to_token[row, :P + n].long()
    kp, vp = m.k[0], m.v[0]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(n, 9, 16, generator=g)
    seg = PrefillSegment(0, n, P, slots, causal_lower_right(n, P + n))
    batch = ForwardBatch(mode="prefill", attn_meta=PrefillMeta((seg,)))
    whole = off.prefill_attention(0, q, kp[slots[P:]], vp[slots[P:]], batch)
    off.prefix_block = 7
    blocked = off.prefill_attention(0, q, kp[slots[P:]], vp[slots[P:]], batch)
    torch.testing.assert_close(blocked, whole, atol=2e-5, rtol=2e-5)


def test_huge_page_host_memory_is_aligned_and_kept_alive():
    import gc

    from doublesparse.engine.host_kv import HUGE_PAGE, HostKVStore, _thp_empty
    t = _thp_empty((1001, 3, 64), torch.bfloat16)
    gc.collect()
    assert t.data_ptr() % HUGE_PAGE == 0 and t.shape == (1001, 3, 64)
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()
    with pytest.raises(ValueError, match="pin_mode"):
        HostKVStore(1, 11, 3, 64, torch.bfloat16, pin=False, pin_mode="mlock")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin_mode", ["register", "register-thp", "cuda-host-alloc"])
def test_copy_rows_through_page_locked_host_memory(pin_mode):
    """On the GPU the kernel reads and writes the page-locked host store directly (no staging)."""
    from doublesparse.engine.host_kv import HostKVStore
    store = HostKVStore(1, 101, 3, 64, torch.bfloat16, pin=True, pin_mode=pin_mode)
    assert store.k[0].is_pinned()
    g = torch.Generator().manual_seed(1)
    store.k[0].copy_(torch.randn(101, 3, 64, generator=g))
    store.v[0].copy_(torch.randn(101, 3, 64, generator=g))
    dk, dv = (torch.zeros(40, 3, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    src = torch.randint(1, 101, (40, 3), generator=g)
    dst = torch.arange(40)[:, None].expand(40, 3)
    heads = torch.arange(3)[None].expand(40, 3)
    ok = torch.rand(40, 3, generator=g) > 0.2
    cuda = [t.cuda() for t in (src, dst, heads, ok)]
    copy_rows(store.k[0], store.v[0], dk, dv, *cuda)                    # host -> device
    torch.cuda.synchronize()
    assert torch.equal(dk.cpu()[ok], store.k[0][src, heads][ok]) and torch.equal(dv.cpu()[ok], store.v[0][src, heads][ok])
    back = HostKVStore(1, 101, 3, 64, torch.bfloat16, pin=True, pin_mode=pin_mode)
    copy_rows(dk, dv, back.k[0], back.v[0], cuda[1], cuda[0], cuda[2], cuda[3])   # device -> host
    torch.cuda.synchronize()
    assert torch.equal(back.k[0][src, heads][ok], store.k[0][src, heads][ok])
