"""The sampled attention recall in the engine (tiny random Llama on CPU): sampled steps leave the
tokens unchanged, engine.stats() and a request's meta (return_ds_stats) carry the figures."""

from types import SimpleNamespace

import pytest

from doublesparse.engine import Engine
from doublesparse.testing import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
SP = dict(temperature=0.0, ignore_eos=True, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, max_position_embeddings=512)


def engine(model, **kw):
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, max_total_tokens=2048,
                  enable_double_sparsity=True, ds_heavy_token_num=8, ds_sparse_decode_threshold=0,
                  max_running_requests=4, **kw)


def prompts():
    return [list(range(1, 40)), list(range(3, 60, 2)), [7] * 25]


def test_sampled_recall_leaves_tokens_and_reports(model):
    off = engine(model, ds_recall_sample_interval=0)
    on = engine(model, ds_recall_sample_interval=2, ds_recall_sample_rows=2)
    assert off.parts.recall is None and off.stats()["attention_recall"] is None
    ref = off.generate(prompts(), SP)
    got = on.generate(prompts(), [dict(SP, return_ds_stats=True), SP, SP])
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in ref]
    st = on.stats()["attention_recall"]
    assert st["sample_interval"] == 2 and st["sampled_steps"] == st["sparse_decode_steps"] // 2 > 0
    assert 0 < st["samples"] <= 2 * st["sampled_steps"]
    assert 0.0 < st["recall_min"] <= st["recall_mean"] <= 1.0 and st["rel_error_mean"] >= 0
    assert sum(g["count"] for g in st["groups"]) == st["samples"]
    ds = got[0]["meta"]["ds_stats"]
    assert ds["double_sparsity"] and ds["sparse_decode_steps"] == got[0]["meta"]["sparse_decode_steps"]
    assert ds["attention_recall"]["samples"] >= 1
    assert "ds_stats" not in got[1]["meta"]
    assert not on.parts.recall.stats.rows  # every finished request's row was taken


def test_dense_engine_ds_stats(model):
    e = Engine(model=model, tokenizer=ByteTokenizer(), progress=False, max_total_tokens=1024)
    out = e.generate([list(range(1, 20))], dict(SP, return_ds_stats=True))[0]
    assert out["meta"]["ds_stats"] == {"double_sparsity": False, "decode_steps": 11,
                                       "sparse_decode_steps": 0, "attention_recall": None}
    with pytest.raises(ValueError, match="return_ds_stats"):
        e.generate([[1, 2]], dict(SP, return_ds_stats="yes"))


def test_recall_flags():
    import argparse

    from doublesparse.config import EngineConfig
    from doublesparse.config_flags import add_cli_args, from_cli_args
    ns = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--ds-recall-sample-interval", "0", "--ds-recall-sample-rows", "2"])
    cfg = from_cli_args(ns)
    assert cfg.ds_recall_sample_interval == 0 and cfg.ds_recall_sample_rows == 2
    assert EngineConfig().ds_recall_sample_interval == 64
    with pytest.raises(ValueError, match="ds_recall_sample_interval"):
        EngineConfig(ds_recall_sample_interval=-1)
    with pytest.raises(ValueError, match="ds_recall_sample_rows"):
        EngineConfig(ds_recall_sample_rows=0)


def test_runner_replays_the_stash_graph_on_sampled_steps_only(model, monkeypatch):
    """The runner picks each sparse step's graph on the host: the one with the probe's stash on
    the steps the probe samples, the plain one otherwise (graphs faked: CPU); a bucket without a
    stash graph runs a sampled step eagerly."""
    import torch

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            calls.append(self.name)

    e = engine(model, ds_recall_sample_interval=3)
    p = e.parts
    runner = p.runner
    assert p.backend.recall_probe is p.recall
    row = p.memory.rows.alloc()
    prompt = list(range(1, 30))
    runner.prefill([row], [0], [prompt], [False])
    calls, V = [], model.config.vocab_size
    host = torch.zeros(5, 2, dtype=torch.int64)          # _make_inputs' layout, without pinned memory
    event = SimpleNamespace(synchronize=lambda: None, record=lambda stream: None)
    runner._inputs = (host.clone(), host, host.numpy(), host.numpy()[3:].view("int32")[:, :2], event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    logits = torch.zeros(2, V)
    runner.graph_max_bs = 2
    runner.graphs = {(2, False): (Graph("dense"), None, logits, None),
                     (2, True): (Graph("plain"), None, logits, (Graph("stash"), None, logits))}
    n = len(prompt)
    for i in range(6):
        runner.decode([row], [5], [n + i])
    assert calls == ["plain", "plain", "stash", "plain", "plain", "stash"]
    calls.clear()
    runner.graphs[(2, True)] = (Graph("plain"), None, logits, None)
    for i in range(6, 9):
        runner.decode([row], [5], [n + i])
    assert calls == ["plain", "plain"]   # the sampled third step ran eagerly
    assert p.recall.sampled_steps == 3
