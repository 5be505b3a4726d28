"""The adaptive budget where operators look: /metrics (doublesparse_ds_budget_scale per layer
group, the target) and /health's decode section, served by a real engine (the tiny random Llama,
sampling every sparse step, so the loop moves within a few requests)."""

import httpx
import pytest

from doublesparse.testing import ByteTokenizer, tiny_llama
from server_utils import AUTH, KEY, InProcessServer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def srv():
    from doublesparse.engine import Engine
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig

    e = Engine(model=tiny_llama(seed=0, max_position_embeddings=512), tokenizer=ByteTokenizer(),
               progress=False, max_total_tokens=2048, enable_double_sparsity=True, ds_heavy_token_ratio=0.25,
               ds_heavy_token_min=4, ds_sparse_decode_threshold=0, max_running_requests=4,
               ds_recall_sample_interval=1, ds_budget_mode="adaptive", ds_target_recall=0.9)
    s = InProcessServer(create_app(e, ServerConfig(api_key=KEY)))
    yield s
    s.stop()


def test_budget_scale_in_metrics_and_health(srv):
    for _ in range(2):
        body = {"input_ids": list(range(1, 50)), "stream": False,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        assert httpx.post(srv.url + "/generate", json=body, headers=AUTH, timeout=120).status_code == 200
    srv.wait_idle()
    text = httpx.get(srv.url + "/metrics", headers=AUTH, timeout=5).text
    assert "# TYPE doublesparse_ds_budget_scale gauge" in text
    assert srv.metric("doublesparse_ds_target_recall") == pytest.approx(0.9)
    health = srv.health()["decode"]["budget_scale"]
    assert health["target_recall"] == 0.9 and len(health["scales"]) == 2
    assert health["k_lo"] <= health["k_min"] <= health["k_max"]
    for group, scale in health["layer_groups"].items():
        assert srv.metric("doublesparse_ds_budget_scale", f'layer_group="{group}"') == pytest.approx(scale)
        assert 0.25 <= scale <= 2.0
    assert srv.metric("doublesparse_ds_budget_scale_changes_total") == health["changes"]
