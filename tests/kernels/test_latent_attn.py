"""The MLA latent decode kernel (kernels/triton/latent_attn.py; V pool = K pool, values = the
first DN channels) through ops.dense_decode / ops.ds_decode against the PyTorch path, on the test
device (CPU: under the interpreter; CUDA: compiled, bf16)."""

import pytest
import torch
from conftest import DEVICE
from kernel_utils import budgets, make_case, make_ws, rel_err

from doublesparse.kernels import ops
from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels.latent import latent_split
from doublesparse.kernels.tuning import KernelTuning


@pytest.mark.parametrize("ds,heads", [(False, None), (True, None), (True, 37)])
def test_latent_pool_decode_matches_torch(ds, heads):
    """heads 37 with 16 per program: three head blocks per (request, split), the last partly filled."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    hq, d = (16, 576) if DEVICE == "cuda" else (5, 48)   # 5 heads: a partly filled head block
    hq = heads or hq
    tuning = KernelTuning(latent_max_heads=16)
    dn, _ = latent_split(d)
    c = make_case([37, 90, 13], hq, 1, d, r=8, dtype=dtype, device=DEVICE, seed=3)
    kv = c.k_cache  # one pool for K and V, as MemoryPlan.latent makes it
    ws = make_ws(c, k_max=16 if ds else 0)
    if ds:
        ks = budgets(c, 16)
        args = (c.q, kv, kv, c.label_cache, c.label_scale, c.channels, c.req_to_token, c.req_idx, c.seq_lens,
                c.sm_scale, DSDecodeArgs(ks, 16, tuning=tuning))
        got = ops.ds_decode(*args, ws=ws, impl="triton")
        want = ops.ds_decode(*args, impl="torch")
    else:
        args = (c.q, kv, kv, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale)
        got = ops.dense_decode(*args, ws=ws, impl="triton", tuning=tuning)
        want = ops.dense_decode(*args, impl="torch")
    assert rel_err(got[..., :dn], want[..., :dn]) < (2e-2 if dtype == torch.bfloat16 else 1e-4)


def test_latent_pool_top_p_reads_only_the_kept_slots():
    """The top-p budget on a latent pool: the attention reads only each request's kept slots (the
    rest of the selection buffer holds a previous step's entries, poisoned here)."""
    hq, d = 5, 48
    dn, _ = latent_split(d)
    c = make_case([37, 90, 13], hq, 1, d, r=8, dtype=torch.float32, device=DEVICE, seed=3)
    kv = c.k_cache
    ws = make_ws(c, k_max=16)
    args = (c.q, kv, kv, c.label_cache, c.label_scale, c.channels, c.req_to_token, c.req_idx, c.seq_lens,
            c.sm_scale, DSDecodeArgs(budgets(c, 16), 16, top_p=0.5, top_p_min_k=2))
    ws.topp_slot.fill_(1)
    got = ops.ds_decode(*args, ws=ws, impl="triton")
    want = ops.ds_decode(*args, impl="torch")
    # float32 (stale slots cost ~2e-2 here); on the GPU its dots run as tf32
    assert rel_err(got[..., :dn], want[..., :dn]) < (3e-3 if DEVICE == "cuda" else 1e-4)
