"""Shared by the DS-Offload backend tests (tests/attention/test_offload*.py): pools of a kernel case
and a decode run of in-GPU Double Sparsity beside DS-Offload on the same inputs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from doublesparse.attention import DSParams, create_backend
from doublesparse.attention.batch import ForwardBatch
from doublesparse.attention.offload import OffloadDSBackend
from doublesparse.attention.offload_hot import HotSet
from doublesparse.kernels.reference import quantize_kv
from doublesparse.kernels.workspace import DecodeWorkspace

from kernel_utils import make_case


def memory(c, max_new, layers=1, kv_dtype=None, scales=(0.05, 0.02)):
    """Pools of a case with room for ``max_new`` more tokens per request (fresh copies); layer l's
    labels are layer 0's rolled by l slots, so that the layers select differently. ``kv_dtype``
    an fp8 dtype: the K/V pools hold the case's values quantized with per-layer ``scales``
    (k's, v's; layer l's are those times l + 1), as the engine's fp8 memory does."""
    B = c.q.shape[0]
    S0, H, D = c.k_cache.shape
    kv_dtype = kv_dtype or c.k_cache.dtype
    extra = B * max_new
    grow = lambda t: torch.cat([t, torch.zeros(extra, *t.shape[1:], dtype=t.dtype)])  # noqa: E731
    ctx = c.req_to_token.shape[1] + max_new
    rt = torch.zeros(c.req_to_token.shape[0], ctx, dtype=torch.int32)
    rt[:, :c.req_to_token.shape[1]] = c.req_to_token
    esize = torch.empty((), dtype=kv_dtype).element_size()
    plan = SimpleNamespace(num_kv_heads=H, head_dim=D, kv_dtype=kv_dtype, num_layers=layers,
                           latent=False, kv_bytes_per_token=2 * H * D * esize,
                           label_bytes_per_token=H * c.label_cache.shape[2] * 2)
    L = range(layers)
    ks = [torch.tensor([scales[0] * (i + 1)]) for i in L]
    vs = [torch.tensor([scales[1] * (i + 1)]) for i in L]
    return SimpleNamespace(k=[grow(quantize_kv(c.k_cache, kv_dtype, ks[i])) for i in L],
                           v=[grow(quantize_kv(c.v_cache, kv_dtype, vs[i])) for i in L],
                           k_scale=ks, v_scale=vs,
                           label=[grow(c.label_cache.roll(i, 0)) for i in L],
                           label_scale=[c.label_scale.clone() for _ in L], req_to_token=rt, plan=plan), S0


def run(seq_lens, k, capacity, impl, fetch="reuse", steps=4, seed=3, sink=1, recent=2, mode="group_max",
        heads=(9, 3), prefetch="none", layers=1, sparse=True, kv_dtype=None):
    """Decode ``steps`` tokens for every request through in-GPU DS and through DS-Offload on the same
    inputs (``kv_dtype``: the pools', host store's and hot set's; default float32); returns both
    backends and the per-step outputs."""
    c = make_case(seq_lens, *heads, 16, r=4, dtype=torch.float32, seed=seed)
    Hkv = heads[1]
    ds = DSParams(k, mode, 0, sink, recent)
    B, Hq, D = c.q.shape
    outs = ([], [])
    backends = []
    for which in range(2):
        mem, S0 = memory(c, steps, layers, kv_dtype)
        ws = None
        if impl == "triton":  # few splits: the interpreter's time goes by program count
            ws = DecodeWorkspace(B, Hq, Hkv, D, mem.req_to_token.shape[1], k, device="cpu", max_splits=2,
                                 layer_select=mode == "layer")
        kw = dict(memory=mem, num_q_heads=Hq, head_dim=D, impl=impl, workspace=ws,
                  channels=c.channels[None].expand(layers, -1, -1))
        if which == 0 and fetch == "full-kv":
            be = create_backend("dense", use_double_sparsity=False, **kw)
        elif which == 0:
            be = create_backend("double_sparsity", use_double_sparsity=True, ds=ds, **kw)
        else:
            units = 1 if mode == "layer" else Hkv   # whole tokens, or one row per KV head
            hot = HotSet(layers, mem.req_to_token.shape[0], capacity, units, Hkv * D // units, mem.k[0].shape[0],
                         mem.plan.kv_dtype, "cpu")
            be = OffloadDSBackend(ds=ds, hot=hot, fetch=fetch, prefetch=prefetch, **kw)
        backends.append(be)
        g = torch.Generator().manual_seed(seed + 100)
        lens = c.seq_lens.clone()
        for t in range(steps):
            slots = S0 + torch.arange(B) * steps + t
            mem.req_to_token[c.req_idx.long(), lens.long()] = slots.int()
            lens = lens + 1
            batch = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=lens.clone(), out_slots=slots,
                                 ds_sparse=sparse)
            for layer in range(layers):
                q = torch.randn(B, Hq, D, generator=g)
                kn, vn = torch.randn(B, Hkv, D, generator=g), torch.randn(B, Hkv, D, generator=g)
                outs[which].append(be.forward(layer, q, kn, vn, batch))
    return backends, outs
