"""Engine end-to-end on CPU with the tiny random Llama (doublesparse.testing: the real model code
at toy sizes, fast), plus a few SmolLM2 checks."""

import importlib.util

import pytest
import torch

from doublesparse.attention.batch import ForwardBatch

from doublesparse.engine import Engine, RequestRefused, SamplingParams
from doublesparse.testing import ByteTokenizer, tiny_llama
from model_utils import CausalAttention

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_POS = 512  # small, so that "maximum context length" is easy to exceed


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, max_position_embeddings=MAX_POS)


def engine(model, **kw):
    kw.setdefault("max_total_tokens", 4096)
    # toy models never pay for sparse decode under the cost model: these tests want its kernels
    kw.setdefault("ds_sparse_decode_threshold", 0)
    kw.setdefault("max_running_requests", 8)
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, **kw)


def prompts(n, seed=0, lo=5, hi=60):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@torch.inference_mode()
def recompute_greedy(model, ids, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        t = torch.tensor(ids)
        b = ForwardBatch(attn=CausalAttention(), logits_indices=torch.tensor([len(ids) - 1]))
        tok = int(model(t, torch.arange(len(ids)), b)[0].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def test_dense_matches_full_recompute(model):
    ps = prompts(2, seed=1)
    e = engine(model)
    res = e.generate(ps, {**GREEDY, "max_new_tokens": 12})
    for p, r in zip(ps, res):
        assert r["token_ids"] == recompute_greedy(model, p, 12)
        assert r["meta"]["finish_reason"] == "length" and r["meta"]["completion_tokens"] == 12


@pytest.mark.parametrize("mode", ["group_max", "group_sum", "per_head"])
def test_ds_with_k_at_least_seq_len_equals_dense(model, mode):
    ps = prompts(3, seed=2)
    sp = {**GREEDY, "max_new_tokens": 10}
    dense = engine(model).generate(ps, sp)
    e = engine(model, enable_double_sparsity=True, ds_heavy_token_num=128, ds_selection_mode=mode)
    ds = e.generate(ps, sp)
    assert [r["token_ids"] for r in ds] == [r["token_ids"] for r in dense]
    assert all(r["meta"]["sparse_decode_steps"] == 0 for r in ds)
    assert e.stats()["sparse_decode_steps"] == 0 and e.stats()["decode_steps"] > 0


@pytest.mark.parametrize("ds", [False, True])
def test_mixed_batch_equals_each_alone(model, ds):
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16, ds_heavy_channel_num=8) if ds else {}
    ps = prompts(4, seed=3, lo=3, hi=70)
    sps = [{**GREEDY, "max_new_tokens": n} for n in (6, 14, 3, 10)]
    batched = engine(model, **kw).generate(ps, sps)
    for p, sp, r in zip(ps, sps, batched):
        alone = engine(model, **kw).generate(p, sp)[0]
        assert r["token_ids"] == alone["token_ids"]
    if ds:
        assert any(r["meta"]["sparse_decode_steps"] > 0 for r in batched)


@pytest.mark.parametrize("ds", [False, True])
def test_chunked_prefill_equals_one_shot(model, ds):
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=24) if ds else {}
    ps = prompts(3, seed=4, lo=40, hi=90)
    sp = {**GREEDY, "max_new_tokens": 8}
    one = engine(model, chunked_prefill_size=4096, **kw).generate(ps, sp)
    chunked = engine(model, chunked_prefill_size=7, **kw).generate(ps, sp)
    assert [r["token_ids"] for r in chunked] == [r["token_ids"] for r in one]


def test_chunked_prefill_split_prefix(model):
    """KernelTuning.prefill_split_prefix (chunk vs prefix and chunk vs itself, merged by
    log-sum-exp) generates what one-shot prefill does."""
    from doublesparse.kernels.tuning import KernelTuning
    ps = prompts(3, seed=5, lo=40, hi=90)
    sp = {**GREEDY, "max_new_tokens": 8}
    one = engine(model, chunked_prefill_size=4096).generate(ps, sp)
    chunked = engine(model, chunked_prefill_size=7,
                     kernel_tuning=KernelTuning(prefill_split_prefix=True)).generate(ps, sp)
    assert [r["token_ids"] for r in chunked] == [r["token_ids"] for r in one]


def test_stop_strings_and_stop_ids(model):
    e = engine(model)
    p = "the quick brown fox"
    full = e.generate(p, {**GREEDY, "max_new_tokens": 16})[0]
    text, tok = full["text"], e.tokenizer
    # Byte tokens: ids >= 128 are parts of UTF-8 sequences, so a token need not be one character;
    # bytes that never form one are left out of the text.
    assert len(full["token_ids"]) == 16 and text == tok.decode(full["token_ids"]).replace("\ufffd", "")
    starts = list(range(5, len(text) - 2))
    assert starts, f"no stop string to take from {text!r}: change the prompt"
    stop = text[starts[0]:starts[0] + 3]
    cut = e.generate(p, {**GREEDY, "max_new_tokens": 16, "stop": [stop]})[0]
    assert cut["meta"]["finish_reason"] == "stop" and cut["text"] == text[: text.find(stop)]
    tid = full["token_ids"][3]
    by_id = e.generate(p, {**GREEDY, "max_new_tokens": 16, "stop_token_ids": [tid]})[0]
    i = full["token_ids"].index(tid)
    assert by_id["token_ids"] == full["token_ids"][: i + 1] and by_id["meta"]["finish_reason"] == "stop"
    # the stop token itself is not in the text
    assert by_id["text"] == tok.decode(full["token_ids"][:i]).replace("\ufffd", "")


def test_streaming_deltas_concatenate_to_text(model):
    e = engine(model)
    rid = e.add_request("streaming text", {**GREEDY, "max_new_tokens": 20, "stop": "zz"})
    text, toks, last = "", [], None
    while e.has_unfinished():
        for o in e.step():
            assert o.request_id == rid
            text += o.text
            toks += o.new_token_ids
            last = o
    assert last.finished and last.completion_tokens == len(toks) and last.prompt_tokens == 14
    assert text == last.meta["text"] and len(toks) == 20


def test_refusal_and_waiting(model):
    e = engine(model, max_total_tokens=100, max_running_requests=4)
    with pytest.raises(RequestRefused, match="KV pool"):
        e.add_request(list(range(1, 90)), {"max_new_tokens": 20})
    with pytest.raises(ValueError, match="maximum context length"):
        engine(model, max_total_tokens=10_000).add_request([1] * 500, {"max_new_tokens": 20})
    with pytest.raises(RequestRefused):
        e.generate([[1, 2, 3], list(range(1, 90))], {"max_new_tokens": 20})
    assert not e.has_unfinished()                      # the valid first prompt was not queued
    # two requests that fit only one at a time: the second waits, both complete
    ps = prompts(2, seed=5, lo=40, hi=41)
    res = e.generate(ps, {**GREEDY, "max_new_tokens": 30})
    assert all(r["meta"]["completion_tokens"] == 30 for r in res)
    alone = engine(model).generate(ps[1], {**GREEDY, "max_new_tokens": 30})[0]
    assert res[1]["token_ids"] == alone["token_ids"]
    s = e.stats()
    assert s["kv_used_tokens"] == 0 and s["running"] == 0 and s["waiting"] == 0


def test_abort_frees_slots(model):
    e = engine(model)
    rid = e.add_request([5] * 30, {**GREEDY, "max_new_tokens": 50})
    e.step()
    e.step()
    assert e.stats()["kv_used_tokens"] == 31
    e.abort(rid)
    assert e.stats()["kv_used_tokens"] == 0            # freed at once (no step running)
    outs = e.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, "abort")]
    assert e.stats()["kv_used_tokens"] == 0 and not e.has_unfinished()
    rid2 = e.add_request([5] * 3, {"max_new_tokens": 5})    # aborted while still in the inbox
    e.abort(rid2)
    assert [(o.request_id, o.finish_reason) for o in e.step()] == [(rid2, "abort")]
    assert not e.has_unfinished() and e.step() == []


def test_ds_overrides_and_labels_fp8(model):
    e = engine(model, enable_double_sparsity=True, ds_heavy_token_num=16, ds_label_dtype="fp8",
               ds_num_sink=2, ds_num_recent=2)
    with pytest.raises(ValueError, match="ds_heavy_token_num"):
        e.add_request([1, 2, 3], {"ds_heavy_token_num": 8})
    with pytest.raises(ValueError, match="enable_double_sparsity"):
        e.add_request([1, 2, 3], SamplingParams(enable_double_sparsity=False))
    r = e.generate(prompts(1, seed=6, lo=40, hi=41), {**GREEDY, "max_new_tokens": 5, "ds_heavy_token_num": 16})
    assert r[0]["meta"]["sparse_decode_steps"] == 4
    assert e.parts.memory.label[0].dtype == torch.float8_e4m3fn


def test_sampling_seeded_reproducible(model):
    sp = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_new_tokens": 12, "ignore_eos": True}
    a = engine(model).generate("abc", sp)[0]["token_ids"]
    b = engine(model).generate(["xyz", "abc"], sp)[1]["token_ids"]
    assert a == b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("ds,parts,threshold", [(False, None, 0), (True, None, 0), (True, 2, 0), (True, None, 60)],
                         ids=["dense", "ds", "ds-parts2", "ds-dense-and-sparse-steps"])
def test_cuda_graph_equals_eager(ds, parts, threshold):
    """Decode graphs give eager's tokens: dense, DS, DS in batch parts, and DS whose steps switch
    between the sparse and the dense graphs as requests pass the threshold."""
    m = tiny_llama(seed=0, dtype=torch.bfloat16, device="cuda", max_position_embeddings=MAX_POS)
    kw = dict(device="cuda", enable_double_sparsity=ds, ds_heavy_token_num=16, ds_batch_parts=parts,
              ds_sparse_decode_threshold=threshold)
    ps = prompts(5, seed=7, lo=20, hi=80)
    sp = {**GREEDY, "max_new_tokens": 12}
    eager = engine(m, disable_cuda_graph=True, **kw).generate(ps, sp)
    e = engine(m, cuda_graph_max_bs=8, **kw)
    assert e.parts.runner.graphs
    graph = e.generate(ps, sp)
    assert [r["token_ids"] for r in graph] == [r["token_ids"] for r in eager]


# ------------------------------------------------------------------------- embedded SmolLM2
def _have_smollm2():
    try:
        from doublesparse.assets import smollm2_gguf_path
        smollm2_gguf_path()
        return importlib.util.find_spec("doublesparse.models") is not None
    except Exception:
        return False


@pytest.fixture(scope="module")
def smol():
    if not _have_smollm2():
        pytest.skip("embedded SmolLM2 or doublesparse.models unavailable")
    from doublesparse.models import load_model, load_tokenizer
    return load_model(None, progress=False), load_tokenizer(None)


def test_smollm2_answers_and_ds_equals_dense_when_k_large(smol):
    m, tok = smol
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    sp = {"temperature": 0.0, "max_new_tokens": 8}
    dense = Engine(model=m, tokenizer=tok, max_total_tokens=2048, progress=False).generate(ids, sp)[0]
    assert "paris" in dense["text"].lower()
    ds = Engine(model=m, tokenizer=tok, max_total_tokens=2048, enable_double_sparsity=True,
                ds_heavy_token_num=1024, ds_sparse_decode_threshold=0, progress=False).generate(ids, sp)[0]
    assert ds["token_ids"] == dense["token_ids"]


def test_smollm2_sparse_decode_runs(smol):
    m, tok = smol
    e = Engine(model=m, tokenizer=tok, max_total_tokens=4096, enable_double_sparsity=True,
               ds_heavy_token_num=64, ds_sparse_decode_threshold=0, progress=False)
    text = "The cat sat on the mat. " * 40
    r = e.generate(text, {"temperature": 0.0, "max_new_tokens": 6})[0]
    assert r["meta"]["sparse_decode_steps"] == r["meta"]["decode_steps"] > 0
    assert "weight-based" in e.stats()["channel_source"] or "config" in e.stats()["channel_source"]


# ---------------------------------------------------------------------------------- config / CLI
def test_kernel_tuning_file_flag(tmp_path):
    """--kernel-tuning FILE.json: the file's fields over the defaults, into EngineConfig.kernel_tuning;
    an unknown field is a clear error; the value is frozen, hashable and records as a dict."""
    import argparse
    import dataclasses
    import json

    from doublesparse.config import EngineConfig
    from doublesparse.config_flags import add_cli_args, from_cli_args
    from doublesparse.kernels.tuning import KernelTuning
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"score_impl": "mma", "select_block_n": 512}))
    p = add_cli_args(argparse.ArgumentParser())
    c = from_cli_args(p.parse_args(["--kernel-tuning", str(f)]))
    assert c.kernel_tuning == KernelTuning(score_impl="mma", select_block_n=512)
    assert from_cli_args(p.parse_args([])).kernel_tuning == KernelTuning() == EngineConfig().kernel_tuning
    assert dataclasses.asdict(c)["kernel_tuning"]["score_impl"] == "mma"
    assert hash(c.kernel_tuning) != hash(KernelTuning())
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kernel_tuning.pdl = False
    f.write_text(json.dumps({"ds_persistent": True}))
    with pytest.raises(ValueError, match="unknown kernel tuning keys"):
        KernelTuning.from_json(f)
    with pytest.raises(ValueError, match="unknown kernel tuning keys"):
        KernelTuning().replace(ds_persistent=True)
    with pytest.raises(ValueError, match="select_impl"):
        KernelTuning(select_impl="fast")


def test_config_cli_roundtrip_and_derivations():
    import argparse

    from doublesparse.config import EngineConfig
    from doublesparse.config_flags import add_cli_args, from_cli_args
    p = add_cli_args(argparse.ArgumentParser())
    ns = p.parse_args(["--enable-double-sparsity", "--ds-heavy-token-num", "64", "--ds-label-dtype", "fp8",
                       "--max-total-tokens", "1000", "--disable-cuda-graph", "--attention-backend", "torch"])
    c = from_cli_args(ns)
    assert c.use_double_sparsity and c.ds_heavy_token_num == 64 and c.ds_label_dtype == "fp8"
    assert c.kernel_impl == "torch" and c.resolved_attention_backend == "torch" and c.disable_cuda_graph
    assert from_cli_args(p.parse_args([]), enable_double_sparsity=True).enable_double_sparsity
    assert not from_cli_args(p.parse_args(["--no-enable-double-sparsity"]), enable_double_sparsity=True).enable_double_sparsity
    d = EngineConfig()
    assert d.resolved_attention_backend == "dense" and d.heavy_channel_num(64) == 16
    assert d.k_max(8192) == 512 and d.ds_selection_mode == "auto"
    assert d.selection_mode_fallback == "group_max" and EngineConfig(ds_selection_mode="per_head").selection_mode_fallback == "per_head"
    assert EngineConfig(attention_backend="double_sparsity").use_double_sparsity
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig(attention_backend="dense", enable_double_sparsity=True)
    with pytest.raises(ValueError, match="ds_selection_mode"):
        EngineConfig(ds_selection_mode="nope")
    with pytest.raises(Exception):
        d.seed = 3                                       # frozen


def test_cli_dispatch(capsys):
    from doublesparse.cli import SUBCOMMANDS, main
    assert {"generate", "bench-one-batch", "serve", "calibrate", "eval"} <= set(SUBCOMMANDS)
    assert main([]) == 0 and "bench-one-batch" in capsys.readouterr().out
    assert main(["nope"]) == 2
    SUBCOMMANDS["_missing"] = ("doublesparse._no_such_module:main", "x")
    try:
        assert main(["_missing"]) == 1 and "unavailable" in capsys.readouterr().err
    finally:
        del SUBCOMMANDS["_missing"]


@pytest.mark.parametrize("warmup", [["--skip-warmup"], ["--warmup-input-len", "8"]])
def test_bench_one_batch_dummy(tmp_path, capsys, warmup):
    if importlib.util.find_spec("doublesparse.models") is None:
        pytest.skip("doublesparse.models unavailable")
    from doublesparse.bench import one_batch as bench_one_batch
    from doublesparse.models import shipped_configs
    if "tiny-llama" not in shipped_configs():
        pytest.skip("no tiny-llama dummy config")
    out = tmp_path / "r.json"
    rc = bench_one_batch.main(["--model-path", "tiny-llama", "--load-format", "dummy", "--batch-size", "2",
                               "--input-len", "64", "--output-len", "4", "--enable-double-sparsity",
                               "--ds-heavy-token-num", "16", "--ds-sparse-decode-threshold", "0", *warmup,
                               "--copy-bytes", "1000000",
                               "--result-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    import json
    import re
    assert re.search(r"^Prefill\. latency: \d+\.\d{5} s, throughput: +\d+\.\d{2} token/s$", text, re.M)
    assert re.search(r"^Decode\.  median latency: \d+\.\d{5} s, median throughput: +\d+\.\d{2} token/s$", text, re.M)
    assert re.search(r"^Total\. latency: \d+\.\d{5} s, throughput: +\d+\.\d{2} token/s$", text, re.M)
    assert "weight-based default" in text
    r = json.loads(out.read_text())
    assert r["results"][0]["sparse_steps"] == 3 and r["results"][0]["median_step_bytes"] > r["weight_bytes"]
    # --ds-label-dtype auto: bf16 on CPU, fp8 on GPUs that convert e4m3 in hardware
    from doublesparse.config import EngineConfig
    want = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}[EngineConfig().label_dtype_for("cuda" if torch.cuda.is_available() else "cpu")]
    assert r["label_dtype"] == want and f"labels {want}" in text


@pytest.mark.parametrize("ds", [False, True])
def test_triton_path_matches_reference(model, ds):
    """The engine's calls into the Triton kernels (shapes, dtypes, workspace) on CPU under
    TRITON_INTERPRET=1 (set by conftest), against the PyTorch reference path."""
    import os

    from doublesparse.kernels.workspace import DecodeWorkspace
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (on a GPU, test_fused's CUDA tests "
                    "drive the compiled kernels through the engine)")
    kw = dict(enable_double_sparsity=ds, ds_heavy_token_num=8, max_running_requests=2, max_total_tokens=256)
    ps = prompts(2, seed=8, lo=10, hi=20)
    sp = {**GREEDY, "max_new_tokens": 4}
    ref = engine(model, **kw).generate(ps, sp)
    e = engine(model, **kw)
    c = model.config
    e.parts.backend.impl = "triton"
    e.parts.backend.workspace = DecodeWorkspace(2, c.num_q_heads, c.num_kv_heads, c.head_dim,
                                                e.max_context_len, 8 if ds else 0, device="cpu")
    out = e.generate(ps, sp)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ref]
    if ds:
        assert all(r["meta"]["sparse_decode_steps"] > 0 for r in out)


def test_generate_default_prompt_fits(smol):
    from doublesparse.generate import DEFAULT_QUESTION, build_parser, build_prompt
    _, tok = smol
    args = build_parser().parse_args([])
    ids = build_prompt(tok, args, 8192)
    assert 5500 < len(ids) <= 6400 and isinstance(ids[0], int)
    assert DEFAULT_QUESTION[-40:] in tok.decode(ids)


def test_step_loop_in_background_thread(model):
    """The server's pattern: one thread loops on step(), others add and abort requests."""
    import threading
    import time as _time
    e = engine(model)
    done, stop = {}, threading.Event()

    def loop():
        while not stop.is_set():
            for o in e.step():
                if o.finished:
                    done[o.request_id] = o.finish_reason
            _time.sleep(0.001)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    rids = [e.add_request(p, {**GREEDY, "max_new_tokens": 8}) for p in prompts(5, seed=9)]
    slow = e.add_request([3] * 10, {**GREEDY, "max_new_tokens": 400})
    e.abort(slow)
    deadline = _time.time() + 60
    while len(done) < 6 and _time.time() < deadline:
        _time.sleep(0.01)
    stop.set()
    th.join(5)
    assert all(done.get(r) == "length" for r in rids) and done.get(slow) == "abort"
    assert e.stats()["kv_used_tokens"] == 0


def test_sink_recent_defaults_scale_with_k():
    from doublesparse.config import EngineConfig
    cfg = EngineConfig()
    assert cfg.sink_recent(512) == (4, 32)
    assert cfg.sink_recent(16) == (2, 4)
    assert cfg.sink_recent(1) == (0, 0)
    assert EngineConfig(ds_num_sink=0, ds_num_recent=0).sink_recent(512) == (0, 0)
    with pytest.raises(ValueError, match="exceeds"):
        EngineConfig(ds_num_sink=10, ds_num_recent=10).sink_recent(16)


# ---------------------------------------------------------------------------- prefill schedule
COHORT_PROMPT_LENS = (1, 9, 23, 40, 2)


def _cohort_prompts(vocab=128):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in COHORT_PROMPT_LENS]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ds", [False, True])
def test_cohort_schedule_equals_interleave(model, ds, overlap):
    """Prefill-only steps, 1-token last chunks after a cached prefix, and a 1-token prompt: the
    same greedy tokens as the default schedule, with and without the overlap schedule."""
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16, ds_heavy_channel_num=8) if ds else {}
    ps = _cohort_prompts()
    sps = [{**GREEDY, "max_new_tokens": n} for n in (5, 8, 3, 6, 1)]
    ref = engine(model, chunked_prefill_size=7, **kw).generate(ps, sps)
    e = engine(model, chunked_prefill_size=7, prefill_schedule="cohort", **kw)
    e.overlap = overlap
    out = e.generate(ps, sps)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ref]
    assert e.stats()["kv_used_tokens"] == 0 and e.stats()["kv_reserved_tokens"] == 0
    if ds:
        assert any(r["meta"]["sparse_decode_steps"] > 0 for r in out)


def test_cohort_first_tokens_arrive_together(model):
    e = engine(model, chunked_prefill_size=7, prefill_schedule="cohort")
    rids = [e.add_request(p, {**GREEDY, "max_new_tokens": 4}) for p in _cohort_prompts()]
    steps = []
    while e.has_unfinished():
        steps.append({o.request_id for o in e.step()})
    first = next(i for i, s in enumerate(steps) if s)
    assert steps[first] == set(rids) and first == -(-sum(n - 1 for n in COHORT_PROMPT_LENS) // 7)
    assert all(s == set(rids) for s in steps[first:first + 4])   # then they decode together


def test_cohort_release_waits_for_the_last_prefill_step(model):
    """Overlap schedule: a request whose prefill is in flight when others arrive is not released
    alone (it would then wait through their whole prefill with its first token out); the
    release is planned after that step is collected, so the arrivals join its cohort."""
    e = engine(model, chunked_prefill_size=64, prefill_schedule="cohort")
    e.overlap = True
    ps = _cohort_prompts()
    first = e.add_request(ps[2], {**GREEDY, "max_new_tokens": 3})
    assert e.step() == []          # its prefill is launched (all but the held-back last token)
    assert e.step() == []          # collects that step instead of planning the release
    later = [e.add_request(p, {**GREEDY, "max_new_tokens": 3}) for p in ps[3:]]  # arrived meanwhile
    steps = []
    while e.has_unfinished():
        steps.append({o.request_id for o in e.step()})
    assert next(s for s in steps if s) == {first, *later}


def test_smollm2_cohort_equals_interleave(smol):
    m, tok = smol
    ps = ["The capital of France is", "1, 2, 3, 4,", "The cat sat on the mat. " * 10]
    sp = {**GREEDY, "max_new_tokens": 4}
    for kw in ({}, dict(enable_double_sparsity=True, ds_heavy_token_num=64, ds_sparse_decode_threshold=0)):
        outs = [Engine(model=m, tokenizer=tok, max_total_tokens=512, chunked_prefill_size=16,
                       prefill_schedule=sched, progress=False, **kw).generate(ps, sp)
                for sched in ("interleave", "cohort")]
        assert [r["token_ids"] for r in outs[1]] == [r["token_ids"] for r in outs[0]]
        if kw:   # the long prompt decodes sparsely
            assert outs[1][2]["meta"]["sparse_decode_steps"] == 3


def test_prefill_schedule_flag_reaches_engine_and_server():
    import argparse

    from doublesparse.config_flags import add_cli_args, from_cli_args
    from doublesparse.server.cli import build_parser, engine_kwargs
    p = add_cli_args(argparse.ArgumentParser())
    assert from_cli_args(p.parse_args([])).prefill_schedule == "interleave"
    c = from_cli_args(p.parse_args(["--prefill-schedule", "cohort"]))
    assert c.prefill_schedule == "cohort" and c.scheduler_config().prefill_schedule == "cohort"
    with pytest.raises(SystemExit):
        p.parse_args(["--prefill-schedule", "fifo"])
    ns = build_parser().parse_args(["--prefill-schedule", "cohort"])   # the server's flags
    assert engine_kwargs(ns)["prefill_schedule"] == "cohort"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sched", ["interleave", "cohort"])
def test_prefill_time_counts_every_prefill_step(model, sched, overlap):
    """Every step with a prefill chunk is collected as a prefill step (so its time counts in
    stats()["prefill_time"]), also one that samples no token: a chunk that is not a prompt's last."""
    e = engine(model, chunked_prefill_size=7, prefill_schedule=sched)
    e.overlap = overlap
    planned, collected = [], []
    schedule, collect = e.parts.scheduler.schedule, e._collect
    e.parts.scheduler.schedule = lambda: planned.append(schedule()) or planned[-1]
    e._collect = lambda launched: collected.append(launched.has_prefill) or collect(launched)
    for p in _cohort_prompts():
        e.add_request(p, {**GREEDY, "max_new_tokens": 3})
    while e.has_unfinished():
        e.step()
    assert sum(collected) == sum(bool(plan.prefill) for plan in planned)
    assert sum(collected) >= -(-sum(n - 1 for n in COHORT_PROMPT_LENS) // 7)
