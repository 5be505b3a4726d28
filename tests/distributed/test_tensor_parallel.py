"""Tensor parallelism on the CPU (gloo): at tp_size 2 and 3, logits and greedy outputs of Llama
models and two MoE models equal tp_size 1's, dense and with Double Sparsity (a channel config's
per-layer modes too), with an fp8 KV cache too (q/K rotated or not); a rank that dies ends the engine with an error naming it. One 3-rank group
serves every engine of the module (a 2-rank engine runs on its first two ranks)."""

import json
import os
import signal
import time

import pytest

from doublesparse.distributed.group import TPError, TPGroup
from doublesparse.testing import random_channel_config, tiny_family, tiny_llama
from tp_utils import DS, GREEDY, check_same, engine, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def group():
    g = TPGroup(3, "cpu")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(max_position_embeddings=512)


@pytest.mark.parametrize("ds", [False, True], ids=["dense", "ds"])
def test_llama(group, llama, ds):
    check_same(llama, group, 2, overlap=ds, **(DS if ds else {}))


@pytest.mark.parametrize("ds", [False, True], ids=["dense", "ds"])
def test_llama_three_ranks(group, ds):
    # 9 query / 3 KV heads, an intermediate width (100) and a vocabulary (260) that 3 does not divide
    model = tiny_llama(max_position_embeddings=512, num_q_heads=9, num_kv_heads=3, hidden_size=48,
                       intermediate_size=100)
    check_same(model, group, 3, steps=3, extend=False, **(DS if ds else {}))


def test_llama_channel_config_modes(group, llama, tmp_path):
    path = tmp_path / "channels.json"
    path.write_text(json.dumps(random_channel_config(llama.config, modes=("per_head", "group_sum"))))
    check_same(llama, group, 2, steps=3, ds_channel_config_path=str(path), **DS)


@pytest.mark.parametrize("arch,ds", [("mixtral", True), ("qwen3_moe", False)])
def test_moe(group, arch, ds):
    check_same(tiny_family(arch, max_position_embeddings=512), group, 2, steps=3, extend=False,
               **(DS if ds else {}))


def test_latent_attention_dense(group):
    """DeepSeek-V2 (MLA + routed and shared experts, a dense first layer): its 4 query heads split
    over 2 ranks, the latent replicated; prefix-cache hits included (extend)."""
    model = tiny_family("deepseek_v2", max_position_embeddings=512)
    check_same(model, group, 2, steps=3)
    with pytest.raises(ValueError, match="MLA"):
        engine(model, group, 2, **DS)


def test_prompt_logprobs(group, llama):
    """A scoring request's rows take the LM head's second call on every rank: the same prompt
    logprobs and tokens as tp_size 1, beside a request that does not score."""
    ref, par = engine(llama), engine(llama, group, 2)
    try:
        ps = prompts(2, seed=4)
        sps = [{**GREEDY, "max_new_tokens": 2, "prompt_logprobs": 2}, {**GREEDY, "max_new_tokens": 2}]
        a, b = ref.generate(ps, sps), par.generate(ps, sps)
        assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
        assert len(b[0]["prompt_logprobs"]) == len(ps[0])
        for x, y in zip(a[0]["prompt_logprobs"][1:], b[0]["prompt_logprobs"][1:]):
            assert x[0] == pytest.approx(y[0], abs=1e-4)
    finally:
        par.close()


@pytest.mark.parametrize("ds", [False, True], ids=["dense", "ds"])
def test_fp8_kv_cache(group, llama, ds, tmp_path):
    """--kv-cache-dtype fp8 on every rank: each rank's pools hold its KV heads in fp8 with the
    per-layer scales (from a file here, every rank reading it), and TP 2's logits and greedy tokens
    (prefix-cache hits, chunked prefill over fp8 prefixes, sparse decode) equal TP 1's with fp8."""
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": 0.05, "v_scale": [0.02 * (i + 1) for i in range(llama.config.num_layers)]}))
    check_same(llama, group, 2, overlap=ds, kv_cache_dtype="fp8_e4m3", kv_cache_scales_path=str(path),
               **(DS if ds else {}))


@pytest.mark.parametrize("ds", [False, True], ids=["dense", "ds"])
def test_fp8_kv_cache_rotated(group, llama, ds):
    """The default q/K rotation of an fp8 cache at scale 1.0: every rank rotates its own KV heads
    (with Double Sparsity, its labels and label scores unrotated), as TP 1 rotates them."""
    check_same(llama, group, 2, overlap=ds, kv_cache_dtype="fp8_e4m3", **(DS if ds else {}))


def test_dead_rank_is_an_error_not_a_hang(group, llama):
    # the module's last test: it kills a rank of the group the tests above share
    e = engine(llama, group, 2)
    e.generate([[5, 6, 7]], {**GREEDY, "max_new_tokens": 2})
    os.kill(group.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TPError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        e.generate([[5, 6, 7]], {**GREEDY, "max_new_tokens": 2})
    assert time.monotonic() - t0 < 10
    with pytest.raises(TPError):  # the server's reset after a failed step: the engine is dead
        e.fail_running(RuntimeError("step failed"))
    e.close()


