"""DS-Offload over fp8 K/V (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): the host store and the hot
set hold fp8 rows with per-layer scales; stores quantize, fetches move fp8 bytes, attention and
prefill dequantize. Outputs equal in-GPU Double Sparsity's over the same fp8 pools exactly, on the
PyTorch path and (CPU: under the interpreter) the Triton one."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from doublesparse.attention.base import PrefillMeta, PrefillSegment, cached_rows
from doublesparse.attention.batch import ForwardBatch
from doublesparse.kernels import ops
from doublesparse.kernels.reference import dequant_kv

from offload_utils import run

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
interpreter = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")


def _same(ref, got):
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("mode", ["group_max", "layer"])
def test_fp8_offload_equals_in_gpu_fp8_ds_torch(mode, dtype):
    """Evictions at almost every step (capacity == k), a request shorter than k, two layers with
    their own scales: the same outputs as in-GPU DS over fp8 pools; the host store and the hot set
    are fp8, and each miss moves half of bf16's bytes (the same misses: labels select)."""
    (ref_be, off), (ref, got) = run([5, 37, 70], 8, 8, "torch", steps=4, mode=mode, layers=2, kv_dtype=dtype)
    _same(ref, got)
    assert off.memory.k[0].dtype == dtype and off.hot.k[0].dtype == dtype
    # the stores quantized what in-GPU DS's store did, into the same slots
    for layer in range(2):
        assert torch.equal(off.memory.k[layer].view(torch.uint8), ref_be.memory.k[layer].view(torch.uint8))
        assert torch.equal(off.memory.v[layer].view(torch.uint8), ref_be.memory.v[layer].view(torch.uint8))
    (_, bf), _ = run([5, 37, 70], 8, 8, "torch", steps=4, mode=mode, layers=2, kv_dtype=torch.bfloat16)
    s8, s16 = off.fetch_stats(), bf.fetch_stats()
    assert s8["misses"] == s16["misses"] > 0 and s8["hits"] == s16["hits"] > 0
    assert 2 * s8["bytes"] == s16["bytes"]


@pytest.mark.parametrize("mode", ["group_max", "layer"])
def test_fp8_next_layer_prefetch(mode):
    (_, off), (ref, got) = run([5, 37, 70], 8, 9, "torch", steps=3, prefetch="next-layer", layers=2, mode=mode,
                               kv_dtype=E4M3)
    _same(ref, got)
    assert off.fetch_stats()["prefetched"] > 0


def test_fp8_no_reuse_and_full_kv_torch():
    (_, off), (ref, got) = run([6, 41], 8, 8, "torch", fetch="no-reuse", steps=3, kv_dtype=E4M3)
    _same(ref, got)
    assert off.fetch_stats()["hits"] == 0
    _, (ref, got) = run([6, 41], 8, 8, "torch", fetch="full-kv", steps=2, kv_dtype=E5M2)
    _same(ref, got)


@interpreter
@pytest.mark.parametrize("mode,fetch,dtype", [("group_max", "reuse", E4M3), ("layer", "reuse", E5M2),
                                              ("layer", "no-reuse", E4M3)])
def test_fp8_offload_equals_in_gpu_fp8_ds_triton(mode, fetch, dtype):
    """The Triton path under the interpreter: the host-gather kernel quantizes each store into the
    fp8 host store (bit for bit the store kernel's), fetches fp8 rows, and the sparse-list attention
    over the hot set dequantizes with the layer's scales. Tiny, two steps."""
    (ref_be, off), (ref, got) = run([5, 19, 12], 8, 8, "triton", steps=2, seed=5, heads=(6, 2), mode=mode,
                                    fetch=fetch, kv_dtype=dtype)
    _same(ref, got)
    assert torch.equal(off.memory.k[0].view(torch.uint8), ref_be.memory.k[0].view(torch.uint8))
    assert torch.equal(off.memory.v[0].view(torch.uint8), ref_be.memory.v[0].view(torch.uint8))
    assert off.fetch_stats()["misses"] > 0


@interpreter
def test_fp8_dense_step_and_full_kv_triton():
    (_, off), (ref, got) = run([5, 3, 6], 9, 9, "triton", steps=1, heads=(4, 2), sparse=False, kv_dtype=E4M3)
    _same(ref, got)
    _, (ref, got) = run([6, 13], 8, 8, "triton", fetch="full-kv", steps=1, heads=(4, 2), kv_dtype=E4M3)
    _same(ref, got)


@pytest.mark.parametrize("triton", [False, True])
def test_fp8_prefix_gather_dequantizes(triton):
    """A prefix gathered from an fp8 store (torch: index reads; Triton: the host-gather kernel moving
    fp8 rows) reads as the in-GPU prefill reads its fp8 pool (attention/base.py cached_rows)."""
    if triton and torch.cuda.is_available():
        pytest.skip("interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")
    (_, off), _ = run([6], 8, 8, "torch", steps=1, kv_dtype=E4M3)
    off._triton = triton
    m = off.memory
    kp, vp, ks, vs = m.k[0], m.v[0], m.k_scale[0], m.v_scale[0]
    slots = torch.tensor([3, 1, 7, 2, 9])
    for dt in (torch.float32, torch.bfloat16):
        q = torch.zeros(1, 9, 16, dtype=dt)
        k, v = off._gather((kp, vp, None, None, 0), slots, q, (ks, vs))
        assert k.dtype == dt
        assert torch.equal(k, cached_rows(kp, slots, ks, dt).transpose(0, 1))
        assert torch.equal(v, cached_rows(vp, slots, vs, dt).transpose(0, 1))
        assert not torch.equal(k.float(), kp[slots].float().transpose(0, 1))   # the scale was applied


def test_fp8_prefill_reads_what_the_store_holds():
    """A chunk with no cached prefix attends to its own K/V quantized and dequantized (what decode
    will read), as the in-GPU fp8 prefill does; one after a cached prefix attends to the prefix's
    fp8 rows from the store; in blocks it equals the one-call result to rounding."""
    (ref_be, off), _ = run([40], 8, 8, "torch", steps=1, kv_dtype=E4M3)
    m = off.memory
    row = int((m.req_to_token[:, 0] != 0).nonzero()[0])
    g = torch.Generator().manual_seed(9)
    n = 11
    q = torch.randn(n, 9, 16, generator=g)
    k, v = torch.randn(n, 3, 16, generator=g), torch.randn(n, 3, 16, generator=g)
    cold = ForwardBatch(mode="prefill", attn_meta=PrefillMeta((PrefillSegment(0, n, 0, None, None),)))
    assert torch.equal(off.prefill_attention(0, q, k, v, cold), ref_be.prefill_attention(0, q, k, v, cold))
    P = 30
    slots = m.req_to_token[row, :P + n].long()
    seg = PrefillSegment(0, n, P, slots, causal_lower_right(n, P + n))
    hit = ForwardBatch(mode="prefill", attn_meta=PrefillMeta((seg,)))
    kn, vn = dequant_kv(m.k[0][slots[P:]], m.k_scale[0]), dequant_kv(m.v[0][slots[P:]], m.v_scale[0])
    whole = off.prefill_attention(0, q, kn, vn, hit)
    assert torch.equal(whole, ref_be.prefill_attention(0, q, kn, vn, hit))
    off.prefix_block = 7
    torch.testing.assert_close(off.prefill_attention(0, q, kn, vn, hit), whole, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp8_store_into_a_device_tier_and_the_host(impl):
    """The offload store quantizes whole tokens into whichever tier holds each slot, bit for bit
    what ops.store_kv writes into an in-GPU fp8 pool."""
    if impl == "triton" and torch.cuda.is_available():
        pytest.skip("interpreter twin on CPU tensors; on a GPU the CUDA tests cover it")
    (_, off), _ = run([6], 8, 8, "torch", steps=1, kv_dtype=E4M3)
    off._triton = impl == "triton"
    H, D = 3, 16
    host = [torch.zeros(10, H, D, dtype=E4M3) for _ in range(2)]   # slots 5..13 at rows 1..9
    dev = [torch.zeros(5, H, D, dtype=E4M3) for _ in range(2)]     # slots 1..4
    off.tiers = lambda layer: (host[0], host[1], dev[0], dev[1], 4)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, H, D, generator=g) * 9, torch.randn(4, H, D, generator=g)
    slots = torch.tensor([2, 9, 4, 13])
    off.store(0, k, v, slots)
    flat = [torch.zeros(14, H, D, dtype=E4M3) for _ in range(2)]
    ops.store_kv(*flat, k, v, slots, k_scale=off.memory.k_scale[0], v_scale=off.memory.v_scale[0], impl="torch")
    for i in range(2):
        assert torch.equal(dev[i][1:].view(torch.uint8), flat[i][1:5].view(torch.uint8))
        assert torch.equal(host[i][1:].view(torch.uint8), flat[i][5:].view(torch.uint8))
    assert flat[0][slots].float().abs().sum() > 0
