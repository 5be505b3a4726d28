"""ops.DSDecodeArgs: what a Double Sparsity decode call selects with. Its host values are checked
when it is made (a clear error naming the field), never its device tensor; ``rows`` is the same
call for a slice of the batch."""

import pytest
import torch

from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels.tuning import DEFAULT_TUNING, KernelTuning


def test_defaults_and_rows():
    k = torch.tensor([5, 9, 2**31 - 1, 7], dtype=torch.int32)
    a = DSDecodeArgs(k, 16)
    assert (a.mode, a.num_sink, a.num_recent, a.top_p, a.top_p_min_k) == ("group_max", 0, 0, 0.0, 0)
    assert a.tuning is DEFAULT_TUNING
    t = KernelTuning(select_impl="triton")
    b = DSDecodeArgs(k, 16, "per_head", 1, 2, 0.9, 4, t).rows(1, 3)
    assert b.k.tolist() == [9, 2**31 - 1] and b.k.data_ptr() == k[1:].data_ptr()   # a view, no copy
    assert (b.k_max, b.mode, b.num_sink, b.num_recent, b.top_p, b.top_p_min_k, b.tuning) == (16, "per_head", 1, 2,
                                                                                            0.9, 4, t)
    with pytest.raises(AttributeError):
        a.k_max = 3  # frozen


@pytest.mark.parametrize("kw,match", [
    (dict(k_max=0), "k_max must be positive"),
    (dict(mode="bogus"), "mode must be one of"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(mode="layer", top_p=0.5), "layer selection mode takes no top-p"),
    (dict(num_sink=10, num_recent=7), "num_sink \\+ num_recent <= k_max"),
    (dict(num_sink=-1), "num_sink \\+ num_recent <= k_max"),
])
def test_bad_host_values_are_refused(kw, match):
    args = dict(k=torch.zeros(2, dtype=torch.int32), k_max=16) | kw
    with pytest.raises(ValueError, match=match):
        DSDecodeArgs(**args)
