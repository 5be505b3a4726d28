"""Prefill attention (attention/prefill.py): GQA-native SDPA calls, the backend order and the
split-prefix path give the float32 reference's answer, for whole prompts and for chunks after a
cached prefix."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from conftest import DEVICE
from doublesparse.attention import prefill
from doublesparse.kernels.tuning import KernelTuning


def _reference(q, k, v, prefix, scale):
    # q [Hq, n, D], k/v [Hkv, L, D]; query i sits at position prefix + i
    g = q.shape[0] // k.shape[0]
    k, v = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = q.float() @ k.transpose(1, 2) * scale
    n, L = q.shape[1], k.shape[1]
    allowed = torch.arange(L, device=q.device)[None, :] <= prefix + torch.arange(n, device=q.device)[:, None]
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("n,prefix,split", [(37, 0, False), (53, 91, False), (53, 91, True), (53, 91, None), (1, 40, True),
                                             (53, 20, True)])
def test_sdpa_matches_reference(dtype, hq, hkv, d, n, prefix, split, padded):
    tuning = KernelTuning(prefill_split_prefix=split)
    # padded: the calls cuDNN may take (on a GPU: does) padded to their bucket, from 16 rows on
    shapes = prefill.CudnnShapes(64, min_rows=16, align=32, any_device=True) if padded else None
    g = torch.Generator(device="cpu").manual_seed(hq * 1000 + n + prefix)
    L = n + prefix
    q = torch.randn(hq, n, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(hkv, L, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(hkv, L, d, generator=g).to(DEVICE, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    mask = causal_lower_right(n, L) if prefix else None
    out = prefill.prefill_sdpa(q, k, v, prefix, d ** -0.5, mask, tuning, shapes)
    if prefix:  # the engine passes q as a transposed [n, Hq, D] view, and may leave the mask to us
        qt = q.transpose(0, 1).contiguous().transpose(0, 1)
        got = prefill.prefill_sdpa(qt, k, v, prefix, d ** -0.5, tuning=tuning, shapes=shapes)
        assert (got.float() - out.float()).abs().max().item() < tol
    assert out.shape == (hq, n, d) and out.dtype == dtype
    exp = _reference(q, k, v, prefix, d ** -0.5)
    assert (out.float() - exp).abs().max().item() < tol


def test_bucket_bounds_the_lengths():
    assert [prefill.bucket(n) for n in (1, 16, 17, 31, 32, 33, 1024, 1025, 2047, 4096, 5000)] == \
        [1, 16, 17, 31, 32, 34, 1024, 1088, 2048, 4096, 5120]
    for n in range(1, 70000, 7):
        b = prefill.bucket(n)
        assert n <= b <= n + n / 16 and prefill.bucket(b) == b
    # 16 lengths an octave: what bounds cuDNN's graphs for prompts of any length
    assert len({prefill.bucket(n) for n in range(4097, 8193)}) == 16


def test_cudnn_shapes_takes_at_most_cap():
    q = lambda dtype=torch.bfloat16: torch.empty(8, 1, 64, dtype=dtype)  # noqa: E731
    s = prefill.CudnnShapes(2, min_rows=16, any_device=True)
    assert s.rows(q(), 15, 15, True, 8, 2) is None                    # too few rows
    assert s.rows(q(torch.float32), 40, 40, True, 8, 2) is None       # not a type cuDNN takes
    assert s.rows(q(), 37, 37, True, 8, 2) == 38
    assert s.rows(q(), 38, 38, True, 8, 2) == 38 and len(s) == 1      # the same bucket, the same graph
    assert s.rows(q(), 148, 500, False, 2, 2) == 152                  # folded: 2 heads x 148 rows
    assert s.rows(q(), 100, 100, True, 8, 2) is None and len(s) == 2  # full: new shapes go to flash
    assert s.rows(q(), 37, 37, True, 8, 2) == 38                      # a taken one still runs
    assert prefill.CudnnShapes(8).rows(q(), 4096, 4096, True, 8, 2) is None  # CPU: never cuDNN


def test_split_point_recurs():
    s = prefill.CudnnShapes(8)
    assert [s.split_point(p) for p in (0, 1000, 1024, 5000, 65535, 65536, 70000, 500_000)] == \
        [0, 0, 1024, 4096, 64512, 65536, 69632, 499712]
    points = {s.split_point(p) for p in range(0, 1 << 20, 97)}
    assert len(points) <= 64 + 32 * 4   # below 64K: multiples of 1024; then 32 an octave
    assert all(p - s.split_point(p) < max(1024, p / 32) for p in range(0, 1 << 20, 97))


@pytest.mark.parametrize("causal,rows,lead", [(True, None, 0), (True, 64, 0), (False, None, 0), (False, 80, 0),
                                              (True, None, 13), (True, 80, 13)])
def test_sdpa_with_lse_padded(causal, rows, lead):
    """On a GPU rows=None is the flash op, rows the padded cuDNN op; on the CPU both the flash CPU
    kernel, padded as asked: out and log-sum-exp as the unpadded float32 answer."""
    g = torch.Generator(device="cpu").manual_seed(7 + int(causal))
    H, n, D = 5, 51, 64
    L = lead + n if causal else 77
    q, k, v = (torch.randn(H, m, D, generator=g).to(DEVICE, torch.bfloat16) for m in (n, L, L))
    out, lse = prefill.sdpa_with_lse(q, k, v, causal, D ** -0.5, rows, lead=lead)
    s = q.float() @ k.float().transpose(1, 2) * D ** -0.5
    if causal:  # query i sits at key lead + i
        s = s.masked_fill(torch.ones(n, L, dtype=torch.bool, device=q.device).triu(1 + lead), float("-inf"))
    assert out.shape == (H, n, D) and lse.shape == (H, n, 1) and lse.dtype == torch.float32
    assert (out.float() - torch.softmax(s, -1) @ v.float()).abs().max().item() < 2e-2
    assert (lse - torch.logsumexp(s, -1, keepdim=True)).abs().max().item() < 2e-2
