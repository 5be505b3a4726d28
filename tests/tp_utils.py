"""Shared by the tensor-parallel tests (tests/distributed/): one engine at tp_size 1 and one on a
started group, compared on logits step by step and on greedy outputs."""

from __future__ import annotations

import torch

from doublesparse.api import Engine
from doublesparse.testing import ByteTokenizer

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# small chunks: prompts prefill in several chunks, the later ones over a cached prefix
ENGINE = dict(device="cpu", context_length=512, max_total_tokens=2048, max_running_requests=4,
              chunked_prefill_size=24)
# k = 8 of prompts of 20+ tokens: every decode step selects
DS = dict(enable_double_sparsity=True, ds_heavy_token_num=8, ds_sparse_decode_threshold=0,
          ds_num_sink=1, ds_num_recent=2)


def prompts(n: int, seed: int, lo: int = 20, hi: int = 50) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 250, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(model, group=None, tp: int = 1, **kw) -> Engine:
    extra = dict(tp_size=tp, tp_group=group) if tp > 1 else {}
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, **ENGINE, **extra, **kw)


def step_logits(e: Engine, ids: list[int], steps: int) -> torch.Tensor:
    """Logits ``[1 + steps, V]`` of a prompt's prefill and ``steps`` greedy decode steps, through
    the engine's runner (rank 0's runner drives the other ranks)."""
    p = e.parts
    row = p.memory.rows.alloc()
    out = [p.runner.prefill([row], [0], [ids], [True])]
    for i in range(steps):
        tok = int(out[-1][0].argmax())
        out.append(p.runner.decode([row], [tok], [len(ids) + i]))
    p.memory.release(row, len(ids) + steps)
    return torch.cat(out)


def check_same(model, group, tp: int, steps: int = 5, overlap: bool = False, extend: bool = True,
               **kw) -> None:
    """TP logits within float32 rounding of TP 1's, and the same greedy tokens for a batch of
    prompts, then (``extend``) for prompts that extend them (prefix-cache hits), with the same
    number of sparse decode steps. ``overlap``: both engines on the overlap schedule."""
    ref, par = engine(model, **kw), engine(model, group, tp, **kw)
    ref.overlap = par.overlap = overlap
    try:
        assert par.parts.model.config.num_q_heads * tp == model.config.num_q_heads
        ids = prompts(1, seed=1, lo=30, hi=31)[0]
        a, b = step_logits(ref, ids, steps), step_logits(par, ids, steps)
        assert (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-5, (a - b).abs().max()
        sp = {**GREEDY, "max_new_tokens": steps}
        first = prompts(3, seed=2)
        again = [p + q for p, q in zip(first, prompts(3, seed=3, lo=5, hi=30))]
        for ps in (first, again) if extend else (first,):
            assert [r["token_ids"] for r in par.generate(ps, sp)] == [r["token_ids"] for r in ref.generate(ps, sp)]
        st = par.stats()
        assert st["prefix_cache_hit_tokens"] > 0 or not extend
        assert st["sparse_decode_steps"] == ref.stats()["sparse_decode_steps"]
        if kw.get("enable_double_sparsity"):
            assert st["sparse_decode_steps"] > 0
    finally:
        par.close()
