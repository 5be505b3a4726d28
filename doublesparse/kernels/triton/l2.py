"""Triton kernel: read a tensor once so that it waits in L2 (evict_last) for a later kernel.

Used by the Double Sparsity decode (``TUNING["ds_prefetch"]``): while the top-k select runs, a
latency-bound stretch that leaves DRAM idle, a side stream loads the weights of the projection that
follows the attention (o_proj), so that the projection reads them from L2.
"""

import triton
import triton.language as tl


@triton.jit
def l2_prefetch_kernel(src, sink, n, BLOCK: tl.constexpr):
    # src: n elements of 2 bytes, read once. The sum is stored only if it is NaN: that keeps the
    # loads, which would otherwise be dead code, and in practice writes nothing.
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    s = tl.sum(acc, 0)
    tl.store(sink + pid, s, mask=s != s)
