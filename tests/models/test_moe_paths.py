"""The MoE layer's Triton expert paths (decode path, grouped GEMM; under the interpreter on CPU)
give the PyTorch path's logits in the engine (chunked prefill, then decode), float32."""

import pytest
import torch

from conftest import DEVICE
from doublesparse.engine import Engine
from doublesparse.kernels.tuning import KernelTuning
from doublesparse.testing import tiny_family

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(m, tuning, graphs: bool = False):
    logits = []
    orig = m.forward
    m.forward = lambda *a: logits.append(orig(*a)) or logits[-1]
    try:
        e = Engine(model=m, device=DEVICE, max_total_tokens=512, max_running_requests=4, chunked_prefill_size=7,
                   disable_cuda_graph=not graphs, cuda_graph_max_bs=4, kernel_tuning=tuning, progress=False)
        assert bool(e.parts.runner.graphs) == graphs
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (11, 4, 6)]
        out = e.generate(prompts, {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 3})
    finally:
        del m.forward
    return [r["token_ids"] for r in out], logits


def _same_as(m, want_tuning: KernelTuning, *tunings: KernelTuning) -> None:
    """Each of ``tunings`` gives ``want_tuning``'s tokens and logits (float32: summation order only)."""
    want_tokens, want = _run(m, want_tuning)
    for tuning in tunings:
        tokens, got = _run(m, tuning)
        assert tokens == want_tokens
        assert len(got) == len(want) > 3
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])  # DeepSeek: a shared expert
def test_triton_expert_paths_match_pytorch(arch):
    m = tiny_family(arch, max_position_embeddings=512).to(DEVICE)
    dec = KernelTuning(fused_moe=True, moe_decode_max_tokens=64)
    _same_as(m, KernelTuning(fused_moe=False),
             dec,                                                    # the decode path throughout
             dec.replace(moe_fuse_shared=False),                     # DeepSeek's shared MLP apart
             KernelTuning(fused_moe=True),                           # the grouped GEMM (the default)
             KernelTuning(fused_moe=True, fused_moe_routing=False))  # its routing as device ops


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_decode_path_in_cuda_graphs(arch):
    """Decode replayed from graphs (the decode path's counters made by the warm-up) == eager."""
    m = tiny_family(arch, max_position_embeddings=512).to(DEVICE).to(torch.bfloat16)
    for t in (KernelTuning(), KernelTuning(moe_decode_max_tokens=64)):  # grouped GEMM, decode path
        eager, _ = _run(m, t)
        replayed, _ = _run(m, t, graphs=True)
        assert replayed == eager


def test_mla_one_launch_steps_match_pytorch():
    """DeepSeek's absorbed query, latent row and value half in one launch each (fused_mla, under the
    interpreter on CPU) give the separate ops' tokens and logits, prefill chunks and decode."""
    m = tiny_family("deepseek_v2", max_position_embeddings=512).to(DEVICE)
    base = KernelTuning(fused_moe=False, fused_mla=False)
    _same_as(m, base, base.replace(fused_mla=True))


def test_qk_norm_in_the_fused_rope_store_matches_pytorch():
    """Qwen3's per-head q / k norms inside the fused RoPE + KV store (under the interpreter on CPU)
    give the separate norms' tokens and logits."""
    m = tiny_family("qwen3_moe", max_position_embeddings=512).to(DEVICE)
    assert m.config.qk_norm
    base = KernelTuning(fused_moe=False, fused_rope_store=False)
    _same_as(m, base, base.replace(fused_rope_store=True))
