"""Tensor parallelism on 2 GPUs (NCCL): with each rank's decode CUDA graphs and the overlap
schedule, greedy outputs equal one GPU's, dense and Double Sparsity."""

import pytest
import torch

from doublesparse.distributed.group import TPGroup
from doublesparse.api import Engine
from doublesparse.testing import ByteTokenizer, tiny_llama
from tp_utils import GREEDY, prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def group():
    g = TPGroup(2, "cuda")
    yield g
    g.stop()


@pytest.mark.parametrize("ds", [False, True], ids=["dense", "ds"])
def test_graphs_greedy_equals_one_gpu(group, ds):
    model = tiny_llama(max_position_embeddings=1024, device="cuda")
    kw = dict(context_length=1024, max_total_tokens=8192, max_running_requests=8, cuda_graph_max_bs=8)
    if ds:
        kw.update(enable_double_sparsity=True, ds_heavy_token_num=16, ds_sparse_decode_threshold=0)
    ref = Engine(model=model, tokenizer=ByteTokenizer(), progress=False, **kw)
    par = Engine(model=model, tokenizer=ByteTokenizer(), progress=False, tp_size=2, tp_group=group, **kw)
    try:
        assert par.parts.runner.graphs and par.overlap
        ps = prompts(5, seed=7, lo=40, hi=200)
        sp = {**GREEDY, "max_new_tokens": 12}
        assert [r["token_ids"] for r in par.generate(ps, sp)] == [r["token_ids"] for r in ref.generate(ps, sp)]
        assert par.stats()["sparse_decode_steps"] == ref.stats()["sparse_decode_steps"]
    finally:
        par.close()
