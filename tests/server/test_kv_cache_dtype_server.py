"""/health and the serve startup line show the KV cache's dtype and its size in tokens (a real
engine with an fp8 cache, served in this process; with the recall probe on, which reads the fp8
pool through its scales)."""

import httpx
import pytest

from doublesparse.server.cli import kv_pool_line
from doublesparse.testing import ByteTokenizer, tiny_llama
from server_utils import AUTH, KEY, InProcessServer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def srv():
    from doublesparse.engine import Engine
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig

    e = Engine(model=tiny_llama(seed=0, max_position_embeddings=512), tokenizer=ByteTokenizer(),
               progress=False, max_total_tokens=1024, enable_double_sparsity=True, ds_heavy_token_num=8,
               ds_sparse_decode_threshold=0, max_running_requests=4, ds_recall_sample_interval=2,
               kv_cache_dtype="fp8_e4m3")
    s = InProcessServer(create_app(e, ServerConfig(api_key=KEY)))
    yield s
    s.stop()


def test_health_and_startup_line_show_the_kv_dtype(srv):
    body = {"input_ids": list(range(1, 40)), "stream": False, "return_ds_stats": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(srv.url + "/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    rec = r.json()["meta_info"]["ds_stats"]["attention_recall"]
    assert rec["samples"] >= 1 and 0 < rec["recall_min"] <= rec["recall_mean"] <= 1
    h = srv.health()
    assert h["kv_cache_dtype"] == "float8_e4m3fn" and h["kv_total_tokens"] == 1024
    assert kv_pool_line(h) == "KV pool 1024 tokens (float8_e4m3fn)"
