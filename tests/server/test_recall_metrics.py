"""The sampled attention recall where operators look: /metrics (doublesparse_ds_attention_recall),
/health's decode section and /generate's meta_info (return_ds_stats), served in this process by a
real engine (the tiny random Llama, sampling every other sparse step)."""

import httpx
import pytest

from doublesparse.testing import ByteTokenizer, tiny_llama
from server_utils import AUTH, KEY, InProcessServer, fake_in_process

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def srv():
    from doublesparse.engine import Engine
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig

    e = Engine(model=tiny_llama(seed=0, max_position_embeddings=512), tokenizer=ByteTokenizer(),
               progress=False, max_total_tokens=2048, enable_double_sparsity=True, ds_heavy_token_num=8,
               ds_sparse_decode_threshold=0, max_running_requests=4, ds_recall_sample_interval=2)
    s = InProcessServer(create_app(e, ServerConfig(api_key=KEY)))
    yield s
    s.stop()


def _generate(srv, **kw):
    body = {"input_ids": list(range(1, 50)), "stream": False,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}, **kw}
    r = httpx.post(srv.url + "/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_meta_ds_stats(srv):
    meta = _generate(srv, return_ds_stats=True)["meta_info"]
    ds = meta["ds_stats"]
    assert ds["double_sparsity"] and ds["sparse_decode_steps"] == 15
    rec = ds["attention_recall"]
    assert rec["samples"] >= 1 and 0 < rec["recall_min"] <= rec["recall_mean"] <= 1
    assert "ds_stats" not in _generate(srv)["meta_info"]


def test_metrics_and_health(srv):
    _generate(srv)
    srv.wait_idle()
    text = httpx.get(srv.url + "/metrics", headers=AUTH, timeout=5).text
    assert "# TYPE doublesparse_ds_attention_recall histogram" in text
    count = srv.metric("doublesparse_ds_attention_recall_count")
    assert count >= 1
    assert srv.metric("doublesparse_ds_attention_recall_bucket", 'le="+Inf"') == count
    assert 0 < srv.metric("doublesparse_ds_attention_recall_mean") <= 1
    assert srv.metric("doublesparse_ds_attention_output_rel_error") >= 0
    rec = srv.health()["decode"]["attention_recall"]
    assert rec["sample_interval"] == 2 and rec["samples"] == count
    assert 0 < rec["recall_mean"] <= 1 and any(v is not None for v in rec["layer_groups"].values())


def test_fake_engine_has_no_recall():
    s = fake_in_process()
    try:
        assert "ds_attention_recall" not in httpx.get(s.url + "/metrics", headers=AUTH, timeout=5).text
        assert "attention_recall" not in s.health().get("decode", {})
        r = httpx.post(s.url + "/generate", headers=AUTH, timeout=30,
                       json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_ds_stats": True})
        assert r.status_code == 400 and "return_ds_stats" in r.text
    finally:
        s.stop()
