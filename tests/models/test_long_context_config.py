"""The shipped ``llama-3.1-8b-1m`` config: Llama-3.1-8B's shapes at a 1,048,576-token context, which
resolves for dummy runs and which the engine's config and pool sizing accept without allocating."""

import torch

from doublesparse.config import EngineConfig
from doublesparse.engine.memory import plan_memory
from doublesparse.engine.scheduler import Scheduler
from doublesparse.models import load_config, model_class, shipped_configs
from doublesparse.models.loader import resolve_model_path

ONE_M = 1 << 20


def test_resolves_with_llama31_shapes():
    assert "llama-3.1-8b-1m" in shipped_configs()
    fmt, path = resolve_model_path("llama-3.1-8b-1m", "dummy")
    assert fmt == "dummy" and path.name == "llama-3.1-8b-1m.json"
    long, base = load_config("llama-3.1-8b-1m", "dummy"), load_config("llama-3.1-8b", "dummy")
    assert long.name == "llama-3.1-8b-1m" and long.max_position_embeddings == ONE_M
    # llama3 scaling: the context grows 8x over Llama-3.1's 128K, and so does the factor that
    # stretches the original 8K window (8 -> 64), keeping the 128K model's max / (factor x original) = 2
    rs, rb = long.rope_scaling, base.rope_scaling
    assert rs["rope_type"] == "llama3" and rs["factor"] == 8 * rb["factor"]
    assert ONE_M / (rs["factor"] * rs["original_max_position_embeddings"]) == \
        base.max_position_embeddings / (rb["factor"] * rb["original_max_position_embeddings"]) == 2
    assert {k: v for k, v in rs.items() if k != "factor"} == \
        {k: v for k, v in rb.items() if k != "factor"}
    assert long.num_params == base.num_params and long.kv_bytes_per_token() == base.kv_bytes_per_token()


def test_engine_accepts_1m_context_without_allocating():
    mc = load_config("llama-3.1-8b-1m", "dummy")
    cfg = EngineConfig(model_path="llama-3.1-8b-1m", load_format="dummy", context_length=ONE_M,
                       max_total_tokens=ONE_M, max_running_requests=2, enable_double_sparsity=True)
    max_ctx = min(mc.max_position_embeddings, cfg.context_length)  # as engine/setup.py caps it
    plan = plan_memory(cfg, mc, torch.bfloat16, torch.device("cpu"), max_ctx, 16)
    assert (plan.max_ctx, plan.max_total_tokens) == (ONE_M, ONE_M)
    # 128 KiB of K/V per token over 32 layers: 128 GiB for the full context, plus 8 KiB of labels
    assert plan.kv_bytes_per_token == 128 * 1024 and plan.label_bytes_per_token == 32 * 8 * 16 * 2
    assert plan.total_bytes == (ONE_M + 1) * plan.bytes_per_token + 3 * ONE_M * 4
    sched = Scheduler(cfg.scheduler_config(), plan.max_total_tokens, max_ctx)
    sched.check(ONE_M - 64, 64)  # a prompt of the whole context less the output is admissible


def test_model_builds_its_1m_rope_table_on_meta():
    mc = load_config("llama-3.1-8b-1m", "dummy")
    model = model_class(mc.architecture)(mc, device="meta", dtype=torch.bfloat16)
    # one float32 cos/sin table over every position: 2 x 1M x 64 x 4 B = 512 MiB on the device
    assert model.rope.cos.shape == (ONE_M, 64) and model.rope.cos.dtype == torch.float32
