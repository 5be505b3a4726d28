"""The engine with --enable-ds-offload: K/V in a host store (on CPU a second buffer), labels and
the hot set on the device; greedy tokens equal in-GPU Double Sparsity's, flags are checked."""

import json

import pytest
import torch

from doublesparse.config import EngineConfig
from doublesparse.engine.engine import Engine
from doublesparse.testing import ByteTokenizer, tiny_family, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=1, num_q_heads=9, num_kv_heads=3, max_position_embeddings=1024)


def _engine(model, **kw):
    base = dict(model=model, tokenizer=ByteTokenizer(), progress=False, device="cpu", max_total_tokens=2048,
                enable_double_sparsity=True, ds_heavy_token_num=20, ds_heavy_channel_num=4,
                ds_sparse_decode_threshold=0, chunked_prefill_size=37, disable_radix_cache=True,
                ds_selection_mode="group_max")
    return Engine(**{**base, **kw})


@pytest.mark.parametrize("fetch,prefetch,mode", [("reuse", "none", "group_max"), ("no-reuse", "none", "group_max"),
                                                  ("reuse", "next-layer", "group_max"), ("reuse", "none", "layer"),
                                                  ("reuse", "next-layer", "layer")])
def test_offload_generates_what_in_gpu_ds_generates(model, fetch, prefetch, mode):
    """Three requests (13 < k, 71 and 150 tokens, prefilled in 37-token chunks from the host store)
    decoding together; a hot set of 21 rows (k = 20) evicts at almost every step. In the layer
    mode the hot set holds whole tokens (all KV heads)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (13, 71, 150)]
    sp = {"max_new_tokens": 10, "temperature": 0}
    want = _engine(model, ds_selection_mode=mode).generate(prompts, sp)
    e = _engine(model, enable_ds_offload=True, ds_offload_hot_tokens=21, ds_offload_fetch=fetch,
                ds_offload_prefetch=prefetch, ds_selection_mode=mode)
    assert e.parts.backend.units == (1 if mode == "layer" else 3)
    got = e.generate(prompts, sp)
    assert [w["text"] for w in want] == [x["text"] for x in got]
    s = e.parts.backend.fetch_stats()
    assert s["misses"] > 0 and (s["hits"] > 0) == (fetch == "reuse")
    # finished requests gave their slots and hot rows back
    assert e.parts.memory.slots.num_used == 0
    assert all((t == -1).all() for t in e.parts.backend.hot.tags)


def test_offload_with_the_prefix_cache(model):
    """Prefix hits (two running requests sharing one) and evictions in a 420-slot host store: the
    same greedy tokens as in-GPU DS with its prefix cache, the same hits and evictions."""
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (90, 120, 150)]
    sp = {"max_new_tokens": 8, "temperature": 0}
    ref = _engine(model, disable_radix_cache=False, max_total_tokens=420)
    off = _engine(model, disable_radix_cache=False, max_total_tokens=420, enable_ds_offload=True,
                  ds_offload_hot_tokens=24)
    for i in range(6):
        batch = [docs[i % 3] + [i + 3] * (i + 1), docs[(i + 1) % 3][: 50 + 10 * i] + [7], docs[i % 3] + [9]]
        assert [r["text"] for r in ref.generate(batch, sp)] == [r["text"] for r in off.generate(batch, sp)], i
    a, b = ref.stats(), off.stats()
    assert b["prefix_cache_hit_tokens"] == a["prefix_cache_hit_tokens"] > 500
    assert b["prefix_cache_evicted_tokens"] == a["prefix_cache_evicted_tokens"] > 0
    off.flush_cache()
    assert off.parts.memory.slots.num_used == 0 and all((t == -1).all() for t in off.parts.backend.hot.tags)


def test_device_tier_and_host_requests_in_one_batch(model):
    """With a 300-token device tier, the first requests admitted keep their K/V on the device and
    the rest go to the host store; they decode in the same steps. With the prefix cache, the
    offloaded ones' prompts are cached and the next batch (all in the tier, which its first
    requests left free) starts from them. Tokens equal in-GPU DS's."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (100, 60, 130, 90)]
    sp = {"max_new_tokens": 12, "temperature": 0}
    for cache in (False, True):
        kw = dict(disable_radix_cache=not cache, max_total_tokens=1200)
        ref = _engine(model, **kw)
        off = _engine(model, enable_ds_offload=True, ds_offload_hot_tokens=24, ds_offload_device_tokens=300, **kw)
        mem = off.parts.memory
        assert mem.slots.num_free_device == 300 and off.parts.scheduler.token_capacity == 1200
        for i, batch in enumerate((prompts, [p[:70] + [4, 5] for p in prompts])):
            rids = [off.add_request(x, sp) for x in batch]
            placed, got = {}, {}
            while off.has_unfinished():
                for o in off.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
                for rid in rids:
                    r = off._reqs.get(rid)
                    if r is not None and r.row is not None:
                        placed[rid] = bool(mem.row_on_device[r.row])
            assert [got[r] for r in rids] == [w["token_ids"] for w in ref.generate(batch, sp)]
            if i == 0:
                assert set(placed.values()) == {True, False}, placed   # both tiers in the same steps
            elif cache:   # device-tier requests cache nothing: the tier is free again between batches
                assert all(placed.values()) and off.stats()["prefix_cache_hit_tokens"] > 0
        off.flush_cache()
        assert mem.slots.num_used == 0 and mem.slots.num_free_device == 300 and not mem.promised.any() and not mem.row_on_device.any()


def test_offload_flags():
    cfg = EngineConfig(enable_ds_offload=True)
    assert cfg.use_double_sparsity and not cfg.scheduler_config().disable_radix_cache
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig(enable_ds_offload=True, attention_backend="dense")
    with pytest.raises(ValueError, match="ds_offload_fetch"):
        EngineConfig(enable_ds_offload=True, ds_offload_fetch="sometimes")
    with pytest.raises(ValueError, match="needs --ds-offload-fetch reuse"):
        EngineConfig(enable_ds_offload=True, ds_offload_fetch="no-reuse", ds_offload_prefetch="next-layer")
    with pytest.raises(ValueError, match="gpu_memory_budget_gb"):
        EngineConfig(gpu_memory_budget_gb=0)


def test_offload_refusals(model):
    with pytest.raises(ValueError, match="below the largest top-k"):
        _engine(model, enable_ds_offload=True, ds_offload_hot_tokens=8)
    with pytest.raises(ValueError, match="per_head"):
        _engine(model, enable_ds_offload=True, ds_selection_mode="per_head")
    with pytest.raises(ValueError, match="gpu-memory-budget-gb"):
        _engine(model, gpu_memory_budget_gb=0.0001)
    with pytest.raises(ValueError, match="ds-offload-host-memory-gb"):
        _engine(model, enable_ds_offload=True, ds_offload_host_memory_gb=0.0001)
    with pytest.raises(ValueError, match="MLA"):
        _engine(tiny_family("deepseek_v2", max_position_embeddings=256), enable_ds_offload=True,
                ds_heavy_channel_num=None)
    with pytest.raises(ValueError, match="tp-size 2"):
        EngineConfig(enable_ds_offload=True, tp_size=2)


def test_offload_with_fp8_labels(model):
    """fp8 labels (what ``--ds-label-dtype auto`` picks on recent GPUs) live in the device pool
    of an offloading engine as in in-GPU DS: the same greedy tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (45, 90)]
    sp = {"max_new_tokens": 6, "temperature": 0}
    want = _engine(model, ds_label_dtype="fp8").generate(prompts, sp)
    e = _engine(model, ds_label_dtype="fp8", enable_ds_offload=True, ds_offload_hot_tokens=24)
    assert e.parts.memory.label[0].dtype == torch.float8_e4m3fn
    assert [w["text"] for w in want] == [x["text"] for x in e.generate(prompts, sp)]


@pytest.mark.parametrize("kv,mode,prefetch", [("fp8_e4m3", "group_max", "none"), ("fp8_e4m3", "layer", "next-layer"),
                                               ("fp8_e5m2", "layer", "none")])
def test_offload_with_fp8_kv(model, kv, mode, prefetch):
    """--kv-cache-dtype fp8 with DS-Offload: the host store and the hot set hold fp8 rows (half the
    bytes of the model's dtype each, so half the host -> device bytes per miss) with per-layer
    scales from a file; prompts prefilled in chunks over the host store give in-GPU DS's tokens
    over fp8 pools with the same scales."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (13, 71, 150)]
    sp = {"max_new_tokens": 10, "temperature": 0}
    want = _engine(model, kv_cache_dtype=kv, ds_selection_mode=mode).generate(prompts, sp)
    e = _engine(model, kv_cache_dtype=kv, ds_selection_mode=mode, enable_ds_offload=True, ds_offload_hot_tokens=21,
                ds_offload_prefetch=prefetch)
    dt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    m = e.parts.memory
    assert m.k[0].dtype == m.v[0].dtype == e.parts.backend.hot.k[0].dtype == dt
    assert e.parts.backend.k_rotation is not None   # q/K rotated on both sides (the default with fp8)
    got = e.generate(prompts, sp)
    assert [w["token_ids"] for w in want] == [x["token_ids"] for x in got]
    s = e.parts.backend.fetch_stats()
    row = 2 * m.plan.head_dim * (m.plan.num_kv_heads if mode == "layer" else 1)   # K + V, 1 byte a value
    assert s["misses"] > 0 and s["bytes"] == (s["misses"] + s["prefetched"]) * row


def test_offload_with_fp8_kv_prefix_cache_and_device_tier(model, tmp_path):
    """fp8 K/V with non-unit scales, the prefix cache (hits gathered back from the fp8 store) and a
    device tier (fp8 device pools): in-GPU DS's tokens over fp8 pools. A host-memory bound holds as
    many more tokens as the rows are smaller (4x this float32 model's)."""
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"k_scale": 0.02, "v_scale": [0.01, 0.03]}))
    kw = dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales_path=str(scales), disable_radix_cache=False,
              max_total_tokens=700)
    g = torch.Generator().manual_seed(8)
    docs = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (90, 120)]
    sp = {"max_new_tokens": 8, "temperature": 0}
    ref = _engine(model, **kw)
    off = _engine(model, enable_ds_offload=True, ds_offload_hot_tokens=24, ds_offload_device_tokens=200, **kw)
    assert off.parts.memory.kv_store.device_k[0].dtype == torch.float8_e4m3fn
    assert [float(x) for x in off.parts.memory.v_scale] == pytest.approx([0.01, 0.03])
    for i in range(3):
        batch = [docs[0] + [i + 3] * (i + 1), docs[1][: 60 + 20 * i] + [7], docs[i % 2] + [9]]
        assert [r["token_ids"] for r in ref.generate(batch, sp)] == [r["token_ids"] for r in off.generate(batch, sp)], i
    # (device-tier requests cache nothing: fewer hits than in-GPU DS, all gathered from the host store)
    assert off.stats()["prefix_cache_hit_tokens"] > 0
    from doublesparse.engine.offload_setup import plan_offload_memory
    mc, cpu = model.config, torch.device("cpu")
    bound = dict(ds_offload_host_memory_gb=0.001, max_total_tokens=None)
    f8 = plan_offload_memory(EngineConfig(kv_cache_dtype="fp8_e4m3", **bound), mc, torch.float32, cpu, 512, 4)
    f32 = plan_offload_memory(EngineConfig(**bound), mc, torch.float32, cpu, 512, 4)
    assert f8.kv_dtype == torch.float8_e4m3fn and f8.max_total_tokens + 1 == 4 * (f32.max_total_tokens + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fetch,prefetch,tier,mode,kv", [("reuse", "none", 0, "group_max", "auto"),
                                                         ("reuse", "next-layer", 0, "group_max", "auto"),
                                                         ("no-reuse", "none", 0, "group_max", "auto"),
                                                         ("reuse", "none", 400, "group_max", "auto"),
                                                         ("reuse", "none", 0, "layer", "auto"),
                                                         ("reuse", "next-layer", 400, "layer", "auto"),
                                                         ("reuse", "none", 400, "layer", "fp8_e4m3"),
                                                         ("reuse", "next-layer", 0, "group_max", "fp8_e5m2")])
def test_offload_on_cuda_equals_in_gpu_ds(fetch, prefetch, tier, mode, kv):
    """On the GPU, with CUDA graphs and the overlap schedule: K/V in page-locked host memory, the
    host-gather kernel, the Triton select and attention over the hot set give in-GPU DS's tokens;
    with a 400-token device tier the 40- and 333-token requests keep their K/V on the GPU. fp8 K/V:
    stores quantize into the host store, fetches move fp8 rows, in-GPU DS reads fp8 pools."""
    m = tiny_llama(seed=2, num_q_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=2048,
                   dtype=torch.bfloat16, device="cuda")
    kw = dict(model=m, tokenizer=ByteTokenizer(), progress=False, device="cuda", max_total_tokens=4096,
              enable_double_sparsity=True, ds_heavy_token_num=64, ds_heavy_channel_num=8,
              ds_sparse_decode_threshold=0, chunked_prefill_size=256, disable_radix_cache=True,
              ds_selection_mode=mode, max_running_requests=4, kv_cache_dtype=kv)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 333, 901)]
    sp = {"max_new_tokens": 16, "temperature": 0}
    want = Engine(**kw).generate(prompts, sp)
    e = Engine(**kw, enable_ds_offload=True, ds_offload_hot_tokens=80, ds_offload_fetch=fetch,
               ds_offload_prefetch=prefetch, ds_offload_device_tokens=tier)
    assert e.parts.memory.k[0].device.type == "cpu" and e.parts.memory.k[0].is_pinned()
    got = e.generate(prompts, sp)
    assert [w["text"] for w in want] == [x["text"] for x in got]
    assert e.parts.backend.fetch_stats()["misses"] > 0


def test_offload_with_packed_cpu_weights():
    """A CPU model with packed decode copies (the default of a CPU load) offloads as in-GPU DS."""
    from doublesparse.models.packed import pack_linears

    m = tiny_llama(seed=3, num_q_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    n = pack_linears(m)
    assert n["bf16"] + n["int4"] > 0
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (33, 80)]
    sp = {"max_new_tokens": 6, "temperature": 0}
    want = _engine(m).generate(prompts, sp)
    got = _engine(m, enable_ds_offload=True, ds_offload_hot_tokens=24).generate(prompts, sp)
    assert [w["text"] for w in want] == [x["text"] for x in got]


def test_bench_one_batch_places_requests_in_the_device_tier(tmp_path):
    from doublesparse.bench import one_batch as bench_one_batch
    out = tmp_path / "r.json"
    rc = bench_one_batch.main(["--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                               "--batch-size", "2", "--input-len", "60", "--output-len", "4", "--skip-warmup",
                               "--copy-bytes", "1000000", "--enable-ds-offload", "--ds-offload-device-tokens", "100",
                               "--ds-heavy-token-num", "16", "--ds-selection-mode", "group_max",
                               "--max-total-tokens", "130", "--result-json", str(out)])
    assert rc == 0   # 2 x 64 tokens: one request in the 100-token tier, one in the 130-token store
    off = json.loads(out.read_text())["results"][0]["offload"]
    assert off["device_tier_bytes_per_step"] > 0 and off["host_bytes_per_step"] > 0
