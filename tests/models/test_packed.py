"""Weight-only packed copies of the linear layers (models/packed.py): int4 for 4-bit grids, bf16
elsewhere, against the plain PyTorch reference; the Linear layer uses int4 copies in decode forwards
only and bf16 ones in all; a row's result does not depend on its batch; the engine packs the
models it loads on CPU unless told not to."""

import pytest
import torch

from doublesparse.models.layers import Linear
from doublesparse.models.packed import pack_linears, pack_weight, reference_weight

pytestmark = pytest.mark.usefixtures("one_thread")


def _grid(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """A weight whose groups of 32 are 16-level grids, as a GGUF Q4_1 tensor dequantizes to."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 3], q[..., 17] = 0, 15                       # Q4_1 maps each group's min / max to 0 / 15
    step = torch.rand(N, K // 32, 1, generator=g) * 0.02 + 1e-3
    lo = torch.randn(N, K // 32, 1, generator=g) * 0.1
    w = (q * step + lo).view(N, K)
    w[0, :32] = 0.25                                    # a group of equal weights (step 0)
    return w


def _check(p, w, T, seed=1):
    x = torch.randn(T, w.shape[1], generator=torch.Generator().manual_seed(seed))
    ref = x.bfloat16().float() @ reference_weight(w).T
    y = p.matmul(x)
    assert y.shape == (T, w.shape[0]) and y.dtype == torch.float32
    # the kernels round their output to bf16 (8 bits): the rest is the summation order
    torch.testing.assert_close(y, ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("N,K,T", [(37, 96, 1), (9, 64, 3), (130, 160, 5), (16, 32, 16)])
def test_int4_for_grids_matches_reference(N, K, T):
    w = _grid(N, K)
    p = pack_weight(w)
    assert p.kind == "int4"
    # the grid is kept: only its scale and offset are rounded to bf16
    assert (reference_weight(w) - w).abs().max() <= 2 ** -8 * w.abs().max()
    _check(p, w, T)


@pytest.mark.parametrize("N,K,T", [(37, 96, 1), (11, 50, 3)])
def test_bf16_elsewhere_matches_reference(N, K, T):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.05
    p = pack_weight(w)
    assert p.kind == "bf16"
    assert torch.equal(reference_weight(w), w.bfloat16().float())
    _check(p, w, T)
    near = _grid(16, 64)
    near[5, 7] += 0.3 * (near[5, :32].amax() - near[5, :32].amin()) / 15    # off the grid
    assert pack_weight(near).kind == "bf16"


def test_linear_uses_the_int4_copy_in_decode_forwards_only():
    lin = Linear(64, 48, bias=True)
    lin.weight.data = _grid(48, 64)
    lin.bias.data = torch.randn(48)
    pack_linears(torch.nn.Sequential(lin))
    assert lin.packed.kind == "int4"
    x = torch.randn(3, 64)
    full = torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert torch.equal(lin(x), full)                                       # prefill: float weights
    small = lin(x, decode=True)
    torch.testing.assert_close(small, lin.packed.matmul(x) + lin.bias, rtol=0, atol=0)
    assert not torch.equal(small, full)


def test_bf16_copy_serves_every_forward():
    lin = Linear(64, 40)
    lin.weight.data = torch.randn(40, 64)
    pack_linears(torch.nn.Sequential(lin))
    assert lin.packed.kind == "bf16"
    x = torch.randn(37, 64)
    assert torch.equal(lin(x), lin.packed.matmul(x)) and torch.equal(lin(x, decode=True), lin(x))


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_a_rows_result_does_not_depend_on_the_other_rows(kind):
    # what makes greedy decode independent of the batch a request shares
    w = _grid(48, 64) if kind == "int4" else torch.randn(48, 64)
    p = pack_weight(w)
    assert p.kind == kind
    x = torch.randn(41, 64)
    alone = torch.cat([p.matmul(x[i:i + 1]) for i in range(41)])
    for m in (2, 5, 16, 17, 33, 41):
        assert torch.equal(p.matmul(x[:m]), alone[:m]), m


def test_engine_packs_what_it_loads_on_cpu_unless_disabled(monkeypatch):
    from doublesparse.config import EngineConfig
    from doublesparse.engine import setup

    seen = []
    monkeypatch.setattr("doublesparse.models.load_model", lambda *a, **k: seen.append(k["packed"]) or None)
    monkeypatch.setattr("doublesparse.models.load_tokenizer", lambda *a, **k: None)
    cpu = torch.device("cpu")
    setup.load(EngineConfig(), cpu, False)
    setup.load(EngineConfig(disable_cpu_packed_weights=True), cpu, False)
    setup.load(EngineConfig(), torch.device("meta"), False)
    assert seen == [True, False, False]


def test_decode_weight_bytes_count_the_packed_copies():
    # bench_one_batch's byte floor: decode reads the packed copies
    from doublesparse.bench.one_batch import weight_bytes
    from doublesparse.testing import tiny_llama

    m = tiny_llama()
    floats = weight_bytes(m)
    pack_linears(m)
    packed = sum(x.packed.nbytes for x in m.modules() if getattr(x, "packed", None) is not None)
    assert weight_bytes(m) == floats - sum(
        x.weight.numel() * 4 for x in m.modules() if getattr(x, "packed", None) is not None) + packed


def test_head_copy_recomputes_its_largest_logits_in_float32():
    # a bf16 LM head copy (exact_top) with a bias: each row's 16 largest are x @ W.T + b in float32
    lin = Linear(64, 500, bias=True, exact_top=16)
    g = torch.Generator().manual_seed(4)
    lin.weight.data, lin.bias.data = torch.randn(500, 64, generator=g), torch.randn(500, generator=g) * 3
    pack_linears(torch.nn.Sequential(lin))
    assert lin.packed.kind == "bf16"
    x = torch.randn(7, 64, generator=g)
    y, ref = lin(x, decode=True), x @ lin.weight.T + lin.bias
    top = ref.topk(3, dim=-1).indices
    torch.testing.assert_close(y.gather(1, top), ref.gather(1, top), rtol=0, atol=1e-4)
    assert torch.equal(y.argmax(-1), ref.argmax(-1))
    rest = torch.ones_like(y, dtype=torch.bool).scatter(1, y.topk(16, dim=-1).indices, False)
    assert (y - ref)[rest].abs().max() > 1e-3          # the others stay bf16-rounded
