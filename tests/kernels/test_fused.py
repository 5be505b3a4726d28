"""Fused layer kernels (kernels/triton/fused.py) against their references, and the model's fused
path against its PyTorch path.

On CPU the kernels run under TRITON_INTERPRET=1, whose fp32 -> bf16/fp8 casts do not round to
nearest (a bf16 result can be one ulp off), so CPU comparisons allow two ulps where casts happen;
on a GPU the exact ones are exact (RoPE is launched without FMA contraction).
"""

import pytest
import torch

from conftest import DEVICE
from doublesparse.kernels import ops
from doublesparse.kernels import reference as ref
from doublesparse.kernels.triton import fused_launch
from doublesparse.kernels.tuning import KernelTuning

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
EXACT = DEVICE == "cuda"


def _gen(*xs):
    return torch.Generator().manual_seed(abs(hash(xs)) % (2**31))


def _close(got, want, exact=EXACT):
    if exact:
        assert torch.equal(got.float(), want.float()), (got.float() - want.float()).abs().max()
    else:
        # two bf16 ulps: a rounded input (the residual) can carry one into the next rounding
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)


def _rand(g, *shape, dtype=BF16):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


# ---------------------------------------------------------------- RMSNorm (+ residual add)
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("n", [576, 4096])
@pytest.mark.parametrize("with_res", [False, True])
def test_rms_norm(t, n, with_res):
    g = _gen(t, n, with_res)
    wide = _rand(g, t, n + 32)
    x = wide[:, :n]                                   # strided rows: the launcher takes any row stride
    w = (1 + 0.2 * torch.randn(n, generator=g)).to(BF16).to(DEVICE)
    if with_res:
        res = _rand(g, t, n)
        out, new_res = ops.add_rms_norm(x, res, w, 1e-5, impl="triton")
        exp, exp_res = ref.add_rmsnorm_ref(x, res, w, 1e-5)
        _close(new_res, exp_res)
        assert new_res.dtype == BF16 and new_res.is_contiguous()
    else:
        out = ops.rms_norm(x, w, 1e-5, impl="triton")
        exp = ref.rmsnorm_ref(x, w, 1e-5)
    assert out.dtype == BF16 and out.shape == (t, n)
    # fp32 sums in another order: rstd may differ in its last bits, so one bf16 ulp even on a GPU
    _close(out, exp, exact=False)


# ---------------------------------------------------------------- SiLU and mul
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("i", [64, 1100])
def test_silu_mul(t, i):
    g = _gen(t, i)
    x = _rand(g, t, 2 * i) * 3
    out = ops.silu_mul(x, impl="triton")
    assert out.shape == (t, i) and out.dtype == BF16
    _close(out, ref.silu_mul_ref(x), exact=False)   # exp differs in its last bits


# ---------------------------------------------------------------- log-sum-exp merge (split prefill)
@pytest.mark.parametrize("h,n,d", [(9, 1, 64), (4, 37, 128), (2, 130, 64)])
def test_lse_merge_matches_softmax_over_the_union(h, n, d):
    """Two partials of softmax attention over disjoint key sets, merged, equal the attention over
    all keys (fp32 reference), and the PyTorch merge of prefill._split_prefix."""
    g = _gen(h, n, d)
    q = torch.randn(h, n, d, generator=g)
    k = torch.randn(h, 50, d, generator=g) * 2
    v = torch.randn(h, 50, d, generator=g)

    def part(ks, vs):
        s = q @ ks.transpose(1, 2)
        return torch.softmax(s, -1) @ vs, torch.logsumexp(s, -1)

    o1, l1 = part(k[:, :20], v[:, :20])
    o2, l2 = part(k[:, 20:], v[:, 20:])
    full = torch.softmax(q @ k.transpose(1, 2), -1) @ v
    wide = torch.full((h, n + 3, d), float("nan"))       # strided rows: a view, as cuDNN's may be
    wide[:, :n] = o1
    o1b, o2b = wide[:, :n].to(BF16).to(DEVICE), o2.to(BF16).to(DEVICE)
    out = fused_launch.lse_merge(o1b, o2b, l1.to(DEVICE), l2.to(DEVICE))
    assert out.dtype == BF16 and out.shape == (h, n, d) and not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), full, rtol=2e-2, atol=2e-2)
    m = torch.maximum(l1, l2)[..., None]
    w1, w2 = torch.exp(l1[..., None] - m), torch.exp(l2[..., None] - m)
    torch_merge = ((o1b.float().cpu() * w1 + o2b.float().cpu() * w2) / (w1 + w2)).to(BF16)
    _close(out.cpu(), torch_merge, exact=False)
    with pytest.raises(ValueError):
        fused_launch.lse_merge(o1b, o2b[:1], l1.to(DEVICE), l2.to(DEVICE))


# ---------------------------------------------------------------- RoPE + KV / label store
def _rope_case(t, hq, hkv, d, r, label_dtype, seed):
    g = _gen(t, hq, hkv, d, seed)
    w = (hq + 2 * hkv) * d
    qkv = _rand(g, t, w + 8)[:, :w]                   # the merged GEMM output, padded rows
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.randint(0, 500, (t,), generator=g).to(DEVICE)
    ang = torch.arange(512)[:, None].float() * torch.rand(d // 2, generator=g)[None]
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    S = t + 9
    slots = (torch.randperm(S - 1, generator=g)[:t] + 1).to(DEVICE)
    channels = torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(hkv)]).int().to(DEVICE)
    # poisoned pools: every slot not written must keep its sentinel
    pools = [torch.full((S, hkv, d), 7.0, dtype=BF16, device=DEVICE) for _ in range(2)]
    lab = None if label_dtype is None else torch.full((S, hkv, r), 7.0, device=DEVICE).to(label_dtype)
    scale = torch.tensor([0.03], device=DEVICE)
    return (pos, q, k, v, cos, sin), pools, lab, scale, slots, channels


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("hq,hkv,d,r", [(9, 3, 64, 16), (32, 8, 128, 32)])
@pytest.mark.parametrize("label_dtype", [None, BF16, FP8])
def test_rope_store(t, hq, hkv, d, r, label_dtype):
    inputs, pools, lab, scale, slots, ch = _rope_case(t, hq, hkv, d, r, label_dtype, 0)
    exp_pools = [p.clone() for p in pools]
    exp_lab = None if lab is None else lab.clone()
    return_k = t != 3
    qo, ko = ops.rope_store(*inputs, *pools, slots, lab, scale, ch, return_k=return_k, impl="triton")
    qe, ke = ref.rope_store_ref(*inputs, *exp_pools, slots, exp_lab, scale, ch)
    assert qo.shape == (t, hq, d) and qo.is_contiguous() and qo.dtype == BF16
    _close(qo, qe)
    if return_k:
        assert ko.shape == (t, hkv, d) and ko.is_contiguous()
        _close(ko, ke)
    else:
        assert ko is None
    _close(pools[0], exp_pools[0])
    assert torch.equal(pools[1], exp_pools[1])        # v is copied, no arithmetic
    unwritten = torch.ones(pools[0].shape[0], dtype=torch.bool, device=DEVICE)
    unwritten[slots] = False
    assert bool((pools[0][unwritten] == 7).all())
    if lab is None:
        return
    assert bool((lab[unwritten].float() == 7).all())
    got, want = lab[slots].float(), exp_lab[slots].float()
    if label_dtype == BF16:
        # the label is the cached k's heavy channels, bit for bit, on CPU too
        own = torch.gather(pools[0][slots].float(), 2, ch.long()[None].expand(t, -1, -1))
        assert torch.equal(got, own)
        _close(got, want)
    elif EXACT:
        assert torch.equal(got, want)
    else:
        # the interpreter's fp32 -> e4m3 rounds off by up to one binade (as in test_kernels)
        assert bool(((got - want).abs() <= want.abs() * 0.5 + 0.02).all())


@pytest.mark.parametrize("t", [1, 6])
@pytest.mark.parametrize("label_dtype", [BF16, FP8])
def test_rope_store_with_qk_norm(t, label_dtype):
    """Qwen3's per-head q / k RMSNorm inside the fused launch: q, the pools and the labels as the
    norms (each rounded to bf16), then RoPE and the store, give them; the label is the cached k's."""
    inputs, pools, lab, scale, slots, ch = _rope_case(t, 9, 3, 64, 16, label_dtype, 4)
    g = torch.Generator().manual_seed(11)
    norm = ((torch.rand(64, generator=g) + 0.5).to(DEVICE, BF16), (torch.rand(64, generator=g) + 0.5).to(DEVICE, BF16),
            1e-6)
    exp_pools, exp_lab = [p.clone() for p in pools], lab.clone()
    qo, ko = ops.rope_store(*inputs, *pools, slots, lab, scale, ch, return_k=True, impl="triton", qk_norm=norm)
    qe, ke = ref.rope_store_ref(*inputs, *exp_pools, slots, exp_lab, scale, ch, qk_norm=norm)
    _close(qo, qe)
    _close(ko, ke)
    _close(pools[0], exp_pools[0])
    assert torch.equal(pools[1], exp_pools[1])
    # the label is the launch's own cached k's heavy channels (bf16: bit for bit; fp8: that over
    # the scale, within the interpreter's e4m3 rounding); near-zero values of the reference's
    # slightly different norm can differ in sign, so the comparison is with the launch's own k
    got = lab[slots].float()
    own = torch.gather(pools[0][slots].float(), 2, ch.long()[None].expand(t, -1, -1))
    if label_dtype == BF16:
        assert torch.equal(got, own)
    else:
        want = (own / scale).clamp(-448, 448).to(FP8).float()
        assert bool(((got - want).abs() <= want.abs() * 0.5 + 0.02).all())
    with pytest.raises(ValueError, match="norm weights"):
        fused_launch.rope_store(*inputs, *pools, slots, qk_norm=(norm[0][:8], norm[1], 1e-6))


@pytest.mark.parametrize("t", [5, 2048])
def test_rope_alone_is_rope_store_bit_for_bit(t):
    """The standalone RoPE (what a backend that stores K itself runs: DS-Offload) gives the fused
    RoPE + store's q and k bit for bit, and the pool gets that k: both round the fp32 rotation
    once, without FMA contraction. Else the two paths' tokens part after a few steps."""
    if t > 5 and DEVICE == "cpu":
        pytest.skip("interpreter time")
    inputs, pools, _, _, slots, _ = _rope_case(t, 32, 8, 128, 16, None, 3)
    pos, q, k, v, cos, sin = inputs
    qo, ko = ops.rope(pos, q, k, cos, sin, impl="triton")
    qf, kf = ops.rope_store(*inputs, *pools, slots, None, None, None, return_k=True, impl="triton")
    qe, ke = ops.rope(pos, q, k, cos, sin, impl="torch")
    for a, b in ((qo, qf), (ko, kf), (pools[0][slots], ko)):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    # the reference too where the conversion to bf16 rounds to nearest (the interpreter's truncates)
    _close(qo, qe)
    _close(ko, ke)


def test_rope_store_torch_path_is_rope_then_store():
    """ops' reference path == the unfused model path (rope, then store_kv), bit for bit."""
    inputs, pools, lab, scale, slots, ch = _rope_case(5, 9, 3, 64, 16, BF16, 1)
    exp_pools, exp_lab = [p.clone() for p in pools], lab.clone()
    qo, ko = ops.rope_store(*inputs, *pools, slots, lab, scale, ch, return_k=True, impl="torch")
    pos, q, k, v, cos, sin = inputs
    qe, ke = ops.rope(pos, q, k, cos, sin, impl="torch")
    ops.store_kv(*exp_pools, ke, v.contiguous(), slots, exp_lab, scale, ch, impl="torch")
    assert torch.equal(qo, qe) and torch.equal(ko, ke)
    assert torch.equal(pools[0], exp_pools[0]) and torch.equal(pools[1], exp_pools[1])
    assert torch.equal(lab, exp_lab)


def test_bad_arguments_raise_value_error():
    inputs, pools, lab, scale, slots, ch = _rope_case(3, 9, 3, 64, 16, FP8, 2)
    pos, q, k, v, cos, sin = inputs
    with pytest.raises(ValueError, match="label_scale"):
        fused_launch.rope_store(*inputs, *pools, slots, lab, None, ch)
    with pytest.raises(ValueError, match="slots"):
        fused_launch.rope_store(*inputs, *pools, slots[:2], lab, scale, ch)
    with pytest.raises(ValueError, match="cos/sin"):
        fused_launch.rope_store(pos, q, k, v, cos[:, :4], sin[:, :4], *pools, slots)
    with pytest.raises(ValueError, match="k_cache"):
        fused_launch.rope_store(*inputs, pools[0][:, :2], pools[1][:, :2], slots)
    x = torch.zeros(3, 64, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused_launch.rms_norm(x, torch.ones(32, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        fused_launch.rms_norm(x, torch.ones(64, device=DEVICE), 1e-5, x.float())
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        fused_launch.silu_mul(torch.zeros(3, 65, dtype=BF16, device=DEVICE))


# ---------------------------------------------------------------- GEMV (small decode projections)
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(m, n, k, bias):
    if DEVICE == "cpu" and bias and n * k > 37 * 100:
        pytest.skip("interpreter time: the bias epilogue is one add per output; (37, 100) covers it")
    g = _gen(m, n, k, bias)
    wide = _rand(g, m, k + 8)
    x = wide[:, :k]                                   # strided rows
    w = _rand(g, n, k)
    b = _rand(g, n) if bias else None
    y = fused_launch.gemv(x, w, b)
    exp = x.float() @ w.float().T + (b.float() if bias else 0)
    assert y.dtype == BF16 and y.shape == (m, n)
    # fp32 sums in another order, rounded once to bf16
    torch.testing.assert_close(y.float(), exp, rtol=1e-2, atol=2e-2)


def test_linear_dispatch():
    """ops.linear is F.linear except where the GEMV takes a CUDA decode projection."""
    g = _gen("linear")
    x, w = _rand(g, 2, 64), _rand(g, 32, 64)
    want = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(ops.linear(x, w).float(), want.float(), rtol=1e-2, atol=2e-2)
    assert not fused_launch.gemv_fits(x.cpu(), w.cpu())
    assert not fused_launch.gemv_fits(_rand(g, 5, 64), w)  # more rows than the kernel takes
    assert not fused_launch.skinny_fits(x.cpu(), w.cpu())
    if DEVICE == "cuda" and fused_launch.pdl_enabled(x.device, KernelTuning()):  # larger weights: the split-K GEMM
        big, x3 = _rand(g, 2048, 4096), _rand(g, 3, 4096)  # 16 MB of weights
        assert not fused_launch.gemv_fits(x3, big) and fused_launch.skinny_fits(x3, big)
        torch.testing.assert_close(ops.linear(x3, big).float(), (x3.float() @ big.float().T), rtol=1e-2, atol=5e-2)
        assert not fused_launch.skinny_fits(_rand(g, 5, 4096), big)  # more rows than skinny_max_rows


@pytest.mark.parametrize("m,n,k,split_k,bias", [(3, 200, 300, 2, False), (1, 64, 128, 1, True),
                                                 (4, 130, 520, 4, True), (16, 70, 129, 3, False),
                                                 (2, 96, 64, 8, False)])  # more K ranges than K tiles
def test_skinny_gemm(m, n, k, split_k, bias):
    """The one-launch split-K GEMM at awkward sizes (N, K not multiples of its tiles; empty K
    ranges), twice on the same counters (the tiles' last programs leave them at zero)."""
    from doublesparse.kernels.triton.fused_launch import _SKINNY_COUNTERS
    g = _gen("skinny", m, n, k, split_k, bias)
    wide = _rand(g, m, k + 8)
    x = wide[:, :k]                                   # strided rows
    w = _rand(g, n, k)
    b = _rand(g, n) if bias else None
    exp = x.float() @ w.float().T + (b.float() if bias else 0)
    for _ in range(2):
        y = fused_launch.skinny_gemm(x, w, b, split_k=split_k)
        assert y.dtype == BF16 and y.shape == (m, n)
        torch.testing.assert_close(y.float(), exp, rtol=1e-2, atol=2e-2)
        assert int(_SKINNY_COUNTERS[x.device].abs().sum()) == 0


def test_skinny_gemm_bad_arguments_raise_value_error():
    x = torch.zeros(2, 64, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        fused_launch.skinny_gemm(x, torch.zeros(8, 32, dtype=BF16, device=DEVICE))
    with pytest.raises(ValueError, match="rows"):
        fused_launch.skinny_gemm(torch.zeros(17, 64, dtype=BF16, device=DEVICE),
                                 torch.zeros(8, 64, dtype=BF16, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        fused_launch.skinny_gemm(x, torch.zeros(8, 64, dtype=BF16, device=DEVICE),
                                 torch.zeros(7, dtype=BF16, device=DEVICE))
    with pytest.raises(ValueError, match="split_k"):
        fused_launch.skinny_gemm(x, torch.zeros(8, 64, dtype=BF16, device=DEVICE), split_k=0)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fused_launch.skinny_gemm(x.float(), torch.zeros(8, 64, device=DEVICE))


def test_gemv_bad_arguments_raise_value_error():
    x = torch.zeros(2, 64, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        fused_launch.gemv(x, torch.zeros(8, 32, dtype=BF16, device=DEVICE))
    with pytest.raises(ValueError, match="rows"):
        fused_launch.gemv(torch.zeros(5, 64, dtype=BF16, device=DEVICE), torch.zeros(8, 64, dtype=BF16, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        fused_launch.gemv(x, torch.zeros(8, 64, dtype=torch.float32, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        fused_launch.gemv(x, torch.zeros(8, 64, dtype=BF16, device=DEVICE), torch.zeros(7, dtype=BF16, device=DEVICE))


# ---------------------------------------------------------------- the model's fused path
def _tiny_model(qk_norm: bool):
    import dataclasses

    from doublesparse.models import ModelConfig
    from doublesparse.models.llama import LlamaModel
    from doublesparse.models.loader import CONFIGS_DIR

    c = ModelConfig.from_json(CONFIGS_DIR / "tiny-llama.json")
    c = dataclasses.replace(c, qk_norm=qk_norm, attention_bias=qk_norm)  # also Qwen2's qkv bias
    m = LlamaModel(c, device=DEVICE, dtype=torch.float32, max_positions=256)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * r if "norm" in name else 0.1 * r)
    return m.eval().requires_grad_(False)


def _run(m, ds: bool, graphs: bool = False, heavy: int = 64, tuning: KernelTuning = KernelTuning()):
    from doublesparse.engine import Engine

    logits = []
    orig = m.forward
    m.forward = lambda *a: logits.append(orig(*a)) or logits[-1]
    try:
        e = Engine(model=m, device=DEVICE, max_total_tokens=512, max_running_requests=4,
                   chunked_prefill_size=7, disable_cuda_graph=not graphs, cuda_graph_max_bs=4,
                   enable_double_sparsity=ds, ds_heavy_token_num=heavy, ds_sparse_decode_threshold=0,
                   kernel_tuning=tuning, progress=False)
        assert bool(e.parts.runner.graphs) == graphs
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (11, 4)]
        out = e.generate(prompts, {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 3})
    finally:
        del m.forward
    return [r["token_ids"] for r in out], logits


@pytest.mark.parametrize("qk_norm,ds", [(False, False), (False, True), (True, True)])
def test_model_fused_path_matches_pytorch_path(qk_norm, ds):
    """Fused norms / SiLU-mul / RoPE + store (chunked prefill with a cached prefix, then decode)
    give the logits of the PyTorch ops; float32, so only summation order differs."""
    m = _tiny_model(qk_norm)
    switches = ("fused_norm", "fused_silu_mul", "fused_rope_store")
    plain_tokens, plain = _run(m, ds, tuning=KernelTuning(**dict.fromkeys(switches, False)))
    fused_tokens, fused = _run(m, ds, tuning=KernelTuning(**dict.fromkeys(switches, True)))
    assert fused_tokens == plain_tokens
    assert len(fused) == len(plain) > 3
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("ds", [False, True])
def test_model_fused_path_in_cuda_graphs(ds):
    """Decode replayed from graphs (fused kernels, packed graph inputs) == eager decode; with
    k = 8 the DS requests decode sparsely over labels written by the fused RoPE + store."""
    m = _tiny_model(False)
    eager, _ = _run(m, ds, graphs=False, heavy=8)
    replayed, _ = _run(m, ds, graphs=True, heavy=8)
    assert replayed == eager


# ---------------------------------------------------------------- compiles for a GPU (on CPU)
_COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from doublesparse.kernels.triton import fused

def comp(fn, consts, ptrs=(), scalars=(), aligned=False, div16=(), **opts):
    """``aligned``: pointers and strides 16-divisible, as Triton specializes them at run time for
    aligned tensors (what the register checks below need to see); ``div16``: int arguments so
    specialized too (sizes that are multiples of 16 at run time: what lets a K loop pipeline)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else dict(ptrs).get(n, "*bf16") if n.endswith("_ptr")
           else dict(scalars).get(n, "i32") for n in names}
    c = {(names.index(k),): v for k, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if aligned and (n.endswith("_ptr") or n.startswith("stride_")) or n in div16}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)

rope_ptrs = dict(pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", slots_ptr="*i64", channels_ptr="*i32",
                 scale_ptr="*fp32", label_ptr="*fp8e4nv")
for hq, hkv, d, r, label, kout in ((9, 3, 64, 16, True, True), (32, 8, 128, 1, False, False)):
    comp(fused.rope_store_kernel, dict(HQ=hq, HKV=hkv, HALF=d // 2, R=r, BLOCK_HQ=triton.next_power_of_2(hq),
         BLOCK_HKV=triton.next_power_of_2(hkv), BLOCK_D2=d // 2, BLOCK_R=triton.next_power_of_2(r),
         HAS_K_OUT=kout, HAS_LABEL=label, LABEL_FP8=label, QK_NORM=label, KV_FP8=False, FP8_MAX=0.0, FP8_MANT=0,
         FP8_BIAS=0, INTERPRET=False), rope_ptrs, dict(norm_eps="fp32"), num_warps=4, enable_fp_fusion=False)
# fp8 K/V pools (--kv-cache-dtype): the fused RoPE store, the store and the attention over them
from doublesparse.kernels.triton import store as store_mod
for fp8, (fmax, mant, bias) in (("*fp8e4nv", (448.0, 3, 7)), ("*fp8e5", (57344.0, 2, 15))):
    kv8 = dict(k_cache_ptr=fp8, v_cache_ptr=fp8, k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    q8 = dict(KV_FP8=True, FP8_MAX=fmax, FP8_MANT=mant, FP8_BIAS=bias, INTERPRET=False)
    comp(fused.rope_store_kernel, dict(HQ=9, HKV=3, HALF=32, R=16, BLOCK_HQ=16, BLOCK_HKV=4, BLOCK_D2=32,
         BLOCK_R=16, HAS_K_OUT=True, HAS_LABEL=True, LABEL_FP8=True, QK_NORM=False, **q8), dict(rope_ptrs, **kv8),
         dict(norm_eps="fp32"), num_warps=4, enable_fp_fusion=False)
    comp(store_mod.store_kv_kernel, dict(D=128, R=16, BLOCK_T=16, BLOCK_D=128, BLOCK_R=16, HAS_LABEL=True,
         LABEL_FP8=True, **q8), dict(kv8, slots_ptr="*i32", channels_ptr="*i32", scale_ptr="*fp32",
         label_ptr="*fp8e4nv"), num_warps=4)
# bf16 K/V with fp8 labels (the default on sm_89+): the labels' quantize branch alone
comp(store_mod.store_kv_kernel, dict(D=128, R=16, BLOCK_T=16, BLOCK_D=128, BLOCK_R=16, HAS_LABEL=True, LABEL_FP8=True,
     KV_FP8=False, FP8_MAX=0.0, FP8_MANT=0, FP8_BIAS=0, INTERPRET=False), dict(slots_ptr="*i32",
     channels_ptr="*i32", scale_ptr="*fp32", label_ptr="*fp8e4nv", k_scale_ptr="*fp32", v_scale_ptr="*fp32"),
     num_warps=4)
for res in (True, False):
    comp(fused.rmsnorm_kernel, dict(HAS_RES=res, BLOCK_N=1024), scalars=dict(eps="fp32"), num_warps=4)
comp(fused.silu_mul_kernel, dict(BLOCK=1024), num_warps=4)
comp(fused.lse_merge_kernel, dict(BLOCK_N=32, BLOCK_D=128), dict(lse1_ptr="*fp32", lse2_ptr="*fp32"), num_warps=4)
# programmatic dependent launch (pdl.py); the GEMV loads its weights before it waits
comp(fused.rmsnorm_kernel, dict(HAS_RES=True, BLOCK_N=1024, PDL=True), scalars=dict(eps="fp32"), num_warps=4,
     launch_pdl=True)
comp(fused.silu_mul_kernel, dict(BLOCK=1024, PDL=True), num_warps=4, launch_pdl=True)
from doublesparse.kernels.triton import gemv
for bias in (False, True):
    comp(gemv.gemv_kernel, dict(M=3, HAS_BIAS=bias, BLOCK_N=8, BLOCK_K=1024, PDL=True), num_warps=4, launch_pdl=True)

from doublesparse.kernels.triton import ds_score, ds_score_rows
i32 = dict(channels_ptr="*i32", req_to_token_ptr="*i32", req_idx_ptr="*i32", seq_lens_ptr="*i32",
           hist_ptr="*i32", rowinfo_ptr="*i32", counts_ptr="*i32", sel_ptr="*i32", sel_slot_ptr="*i32",
           scores_ptr="*fp16", scale_ptr="*fp32", k_ptr="*i32")
for mode, label in ((2, "*bf16"), (0, "*fp8e4nv"), (1, "*bf16")):
    comp(ds_score.score_mma_kernel, dict(HKV=8, G=4, R=16, MODE=mode, LABEL_FP8=label != "*bf16", LABEL_KIND=0,
         NUM_PROGS=8, BLOCK_N=64, BLOCK_C=128, HKV_P=8, G_P=4, DOT_F32=False),
         dict(i32, q_ptr="*bf16", label_ptr=label), dict(sm_scale="fp32"), num_warps=4, num_stages=1)
from doublesparse.kernels.triton import ds_select
for phase, name in ds_select.PHASE_NAMES.items():
    k = comp(ds_select.select_kernel, dict(PHASE=phase, NUM_PROGS=4, BLOCK_N=1024, LOOP_STAGES=1, MAX_PROGS=16),
             i32, num_warps=4)
    assert k.name == name, (k.name, name)  # each phase is its own kernel in a profile
from doublesparse.kernels.triton import decode_attn
for per_head in (False, True):  # over the selection, each request's own k (top-p: each row's)
    comp(decode_attn.decode_attn_kernel, dict(G=4, D=128, PER_HEAD=per_head, HAS_SEL=True, NUM_SPLITS=8, BLOCK_H=16,
         BLOCK_N=64, BLOCK_D=128, DOT_F32=False, ROW_KS=per_head),
         dict(i32, part_o_ptr="*fp32", part_lse_ptr="*fp32", row_ks_ptr="*i32"), dict(sm_scale="fp32"), num_warps=4)
for fp8 in ("*fp8e4nv", "*fp8e5"):  # over an fp8 K/V pool
    comp(decode_attn.decode_attn_kernel, dict(G=4, D=128, PER_HEAD=False, HAS_SEL=True, NUM_SPLITS=8, BLOCK_H=16,
         BLOCK_N=64, BLOCK_D=128, DOT_F32=False, ROW_KS=False, KV_FP8=True),
         dict(i32, part_o_ptr="*fp32", part_lse_ptr="*fp32", row_ks_ptr="*i32", k_cache_ptr=fp8, v_cache_ptr=fp8,
              k_scale_ptr="*fp32", v_scale_ptr="*fp32"), dict(sm_scale="fp32"), num_warps=4)
# float32 caches (the tests' references on a GPU): the IEEE-product branches
comp(decode_attn.decode_attn_kernel, dict(G=4, D=64, PER_HEAD=False, HAS_SEL=True, NUM_SPLITS=8, BLOCK_H=16,
     BLOCK_N=64, BLOCK_D=64, DOT_F32=False, ROW_KS=False),
     dict(i32, part_o_ptr="*fp32", part_lse_ptr="*fp32", row_ks_ptr="*i32", q_ptr="*fp32", k_cache_ptr="*fp32",
          v_cache_ptr="*fp32"), dict(sm_scale="fp32"), num_warps=4)
from doublesparse.kernels.triton import ds_topp
comp(ds_topp.topp_mass_kernel, dict(NUM_PROGS=8, BLOCK_N=1024), dict(i32, part_ptr="*fp32"), num_warps=4)
comp(ds_topp.topp_keep_kernel, dict(NUM_PROGS=8, P_P=8, K_P=512), dict(i32, part_ptr="*fp32", out_slot_ptr="*i32",
     row_k_ptr="*i32"), dict(top_p="fp32"), num_warps=8)

# Kernels no GPU has run yet, at their launchers' settings: compiled, and (where Triton ships
# cuobjdump) without a stack, i.e. without spilled registers.
import os, re, subprocess, tempfile
def no_spill(k):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return k
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    stack = [int(x) for x in re.findall(r"STACK:(\d+)", out)]
    assert stack and max(stack) == 0, (k.name, out)
    assert k.metadata.shared <= 227 * 1024, (k.name, k.metadata.shared)  # an sm_90 block's most
    return k
from doublesparse.kernels.triton import host_gather, latent_attn, moe
moe_ptrs = dict(rows_ptr="*i64", bexp_ptr="*i32", wt_ptr="*fp32", o_ptr="*fp32")
for topk in (2, 8):  # Mixtral, Qwen3-MoE / DeepSeek-V2
    no_spill(comp(moe._gate_up_kernel, dict(K=topk, BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64), moe_ptrs, num_warps=4, aligned=True))
no_spill(comp(moe._down_kernel, dict(BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64), moe_ptrs, num_warps=4, aligned=True))
# the one-launch routing layout, the top-k sum (with and without the shared experts' add), the router
for e, topk in ((128, 8), (64, 6), (256, 8)):
    no_spill(comp(moe._moe_align_kernel, dict(BLOCK_M=moe.BLOCK_M, BLOCK_E=e, ROWS=moe._ALIGN_ROWS,
                  SLOTS=moe._ALIGN_SLOTS), dict(ids_ptr="*i64", rows_ptr="*i64", bexp_ptr="*i32"), num_warps=4))
    from doublesparse.kernels.triton import moe_route
    no_spill(comp(moe_route._moe_route_kernel, dict(K=topk, KP=triton.next_power_of_2(topk), BLOCK_E=e, RENORM=True),
                  dict(logits_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64"), dict(scale="fp32"), num_warps=4))
for add in (False, True):
    no_spill(comp(moe._moe_sum_kernel, dict(K=8, HAS_ADD=add, BLOCK_H=1024), dict(o_ptr="*fp32"), num_warps=4))
# MLA's steps around attention at DeepSeek-V2(-Lite)'s shapes and the launchers' tiles: bf16 without
# spills; float32 (the tests' models on a GPU) compiled
from doublesparse.kernels.triton import mla_proj
mla = dict(pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32")
for dt, check in (("*bf16", no_spill), ("*fp32", lambda k: k)):
    ptrs = dict(mla, q_ptr=dt, kv_ptr=dt, wuk_ptr=dt, nw_ptr=dt, qo_ptr=dt, lat_ptr=dt)
    check(comp(mla_proj.mla_absorb_kernel, dict(DN=128, R=512, HALF=32, NH=16, BLOCK_R=512, BLOCK_HALF=32,
               BT=mla_proj._BT, BC=mla_proj._BC, BK=mla_proj._BK, LT=4), ptrs, dict(eps="fp32", q_scale="fp32"),
               num_warps=4))
    check(comp(mla_proj.mla_unabsorb_kernel, dict(R=512, DV=128, BT=mla_proj._BT, BC=mla_proj._BC, BK=mla_proj._BK),
               dict(a_ptr=dt, wuv_ptr=dt, o_ptr=dt), num_warps=8))
f32 = dict(moe_ptrs, x_ptr="*fp32", w_ptr="*fp32", h_ptr="*fp32")  # float32 weights: the IEEE-product branch
comp(moe._gate_up_kernel, dict(K=2, BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64), f32, num_warps=4)
comp(moe._down_kernel, dict(BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64), f32, num_warps=4)
# the decode expert path at its defaults: Qwen3-30B-A3B (top-8) and DeepSeek-V2-Lite (top-6, shared
# experts' sum) from 1 to 64 tokens (the routed-id tile TKP: 8 .. 512); hidden and intermediate
# sizes are multiples of 16 there, so the K loops pipeline (cp.async into shared memory)
from doublesparse.kernels.triton import moe_decode
from doublesparse.kernels.tuning import KernelTuning
t = KernelTuning()
dec_ptrs = dict(ids_ptr="*i64", wt_ptr="*fp32", o_ptr="*fp32", cnt_ptr="*i32")
for topk, tkp in ((8, 8), (8, 512), (6, 8), (6, 512)):  # DeepSeek-V2-Lite: its 2 shared experts in the launches
    dec = dict(K=topk, TKP=tkp, SHARED_MLP=topk == 6, ALIGNED=True, STAGES=t.moe_decode_stages, DOT_F32=False, PDL=True)
    gu = no_spill(comp(moe_decode.moe_decode_gate_up_kernel, dict(dec, BLOCK_N=t.moe_gate_up_block_n,
             BLOCK_K=t.moe_decode_block_k), dec_ptrs, num_warps=t.moe_decode_warps, aligned=True,
             div16=("H", "I", "Is"), launch_pdl=True))
    down = no_spill(comp(moe_decode.moe_decode_down_kernel, dict(dec, HAS_SHARED=topk == 8, BLOCK_N=t.moe_down_block_n,
             BLOCK_K=t.moe_decode_block_k, BLOCK_T=16), dec_ptrs, num_warps=t.moe_decode_warps, aligned=True,
             div16=("H", "I", "Is"), launch_pdl=True))
    for k in (gu, down):  # its weight tiles stream through shared memory, several K steps ahead
        assert "cp.async" in k.asm["ptx"] and k.metadata.shared >= 2 * 16 * t.moe_decode_block_k * 2, k.name
for has_sel, bh in ((False, 16), (True, 16), (True, 64)):  # V2-Lite's 16 heads; the most per program
    no_spill(comp(latent_attn.latent_attn_kernel, dict(DN=512, DR=64, HAS_SEL=has_sel, NUM_SPLITS=8, BLOCK_H=bh,
              BLOCK_N=32, DOT_F32=False), dict(req_to_token_ptr="*i32", req_idx_ptr="*i32", seq_lens_ptr="*i32",
              sel_ptr="*i32", part_o_ptr="*fp32", part_lse_ptr="*fp32", k_ptr="*i32"),
              dict(sm_scale="fp32"), num_warps=8, num_stages=2, aligned=True))
from doublesparse.kernels.triton import skinny
comp(skinny.skinny_gemm_kernel, dict(HAS_BIAS=False, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, STAGES=2, DOT_F32=False),
     dict(x_ptr="*fp32", w_ptr="*fp32", b_ptr="*fp32", y_ptr="*fp32", part_ptr="*fp32", cnt_ptr="*i32"), num_warps=4)
comp(latent_attn.latent_attn_kernel, dict(DN=512, DR=64, HAS_SEL=False, NUM_SPLITS=8, BLOCK_H=16, BLOCK_N=16,
     DOT_F32=False), dict(req_to_token_ptr="*i32", req_idx_ptr="*i32", seq_lens_ptr="*i32", sel_ptr="*i32",
     part_o_ptr="*fp32", part_lse_ptr="*fp32", k_ptr="*i32", q_ptr="*fp32", kv_ptr="*fp32"),
     dict(sm_scale="fp32"), num_warps=8, num_stages=1)
gather_ptrs = dict(src_row_ptr="*i64", dst_row_ptr="*i64", head_ptr="*i64", valid_ptr="*i8", k_scale_ptr="*fp32",
                  v_scale_ptr="*fp32")
copy = dict(MODE=host_gather.COPY, FP8_MAX=0.0, FP8_MANT=0, FP8_BIAS=0, INTERPRET=False)
for d in (64, 128, 576):  # DS-Offload's gather between page-locked host memory and the device
    bd = triton.next_power_of_2(d)
    be = min(host_gather.MAX_ENTRIES, max(2, host_gather.ELEMS_PER_PROGRAM // bd))
    no_spill(comp(host_gather.copy_rows_kernel, dict(D=d, BLOCK_E=be, BLOCK_D=bd, **copy), gather_ptrs,
                  num_warps=4, aligned=True))
# fp8 K/V (--kv-cache-dtype): whole-token rows of 8 heads of 128 (and per-head rows) moved as fp8,
# and a store's bf16 rows quantized into an fp8 host store
for fp8, (fmax, mant, bias) in (("*fp8e4nv", (448.0, 3, 7)), ("*fp8e5", (57344.0, 2, 15))):
    pools8 = dict(src_k_ptr=fp8, src_v_ptr=fp8, dst_k_ptr=fp8, dst_v_ptr=fp8)
    for d in (128, 1024):
        be = min(host_gather.MAX_ENTRIES, max(2, host_gather.ELEMS_PER_PROGRAM // d))
        no_spill(comp(host_gather.copy_rows_kernel, dict(D=d, BLOCK_E=be, BLOCK_D=d, **copy),
                      dict(gather_ptrs, **pools8), num_warps=4, aligned=True))
        no_spill(comp(host_gather.copy_rows_kernel, dict(D=d, BLOCK_E=be, BLOCK_D=d, MODE=host_gather.QUANTIZE,
                      FP8_MAX=fmax, FP8_MANT=mant, FP8_BIAS=bias, INTERPRET=False),
                      dict(gather_ptrs, dst_k_ptr=fp8, dst_v_ptr=fp8), num_warps=4, aligned=True))
'''


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernel tests compile them for real")
def test_kernels_compile_for_sm90():
    """The interpreter skips Triton's front-end type checks (e.g. a name bound in both branches of
    a runtime `if` with two shapes); compiling for sm_90 (no GPU needed) runs them."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("Triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
