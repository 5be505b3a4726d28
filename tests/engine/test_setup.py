"""build_parts' two seams: where the parts live (one process or a tensor-parallel rank) and where
K/V live (the device pools or DS-Offload's host store) are each one choice with one interface."""

import inspect

import torch

from doublesparse.config import EngineConfig
from doublesparse.distributed.rank import RankContext
from doublesparse.engine.memory import KVMemory, plan_memory
from doublesparse.engine.offload_setup import OffloadTier
from doublesparse.engine.setup import InGPUTier, OneProcess
from doublesparse.testing import tiny_config


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_one_process_has_the_rank_context_methods_build_parts_calls():
    for name in ("load_model", "shard_model", "agree", "memory", "runner"):
        assert _params(getattr(OneProcess, name)) == _params(getattr(RankContext, name)), name
    assert OneProcess.rank == 0


def test_the_two_kv_tiers_have_one_interface():
    for name in ("plan", "build"):
        assert _params(getattr(InGPUTier, name)) == _params(getattr(OffloadTier, name)), name


def test_in_gpu_tier_plans_and_builds_what_plan_memory_and_kv_memory_do():
    cfg = EngineConfig(max_total_tokens=256, max_running_requests=4, device="cpu")
    mc = tiny_config()
    cpu = torch.device("cpu")
    tier = InGPUTier(cfg, OneProcess())
    plan = tier.plan(mc, torch.float32, cpu, 128, 0)
    assert plan == plan_memory(cfg, mc, torch.float32, cpu, 128, 0)
    memory, backend, ds = tier.build(plan, cpu, None, mc, None, None)
    assert isinstance(memory, KVMemory) and memory.plan == plan
    assert backend.memory is memory and ds is None
    assert OneProcess().agree(plan, cpu) is plan
