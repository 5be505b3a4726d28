"""The second door to the kernels: pieces of the Triton decode path that composed backends put
together themselves, beside :mod:`.ops`'s whole calls. DS-Offload selects on the device and
attends over its hot set (rows that are not the pool's), the recall probe stashes a sampled
layer's query, output and selection, the chunked prefill merges two partial attentions, and the
attention benchmark times the stages one by one. CUDA tensors (or ``TRITON_INTERPRET=1``); each
function imports its launcher when called, so a machine without Triton never loads one.
"""

from __future__ import annotations


def split_attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out, sel, rows, k,
                    k_max, per_head, num_splits, tuning, stages=None, row_ks=None, k_scale=None, v_scale=None):
    """Split-K attention with its merge, over each row's cache or its selected slots (``sel``
    [B, rows, K] int32 indices into ``k_cache``/``v_cache`` [S, Hkv, D]; ``k`` [B] int32 each
    row's count; ``seq_lens`` [B] int32). The pools may live in page-locked host memory (the
    launcher below :func:`.ops.dense_decode` does not check their device). Returns [B, Hq, D]."""
    from .triton.launch import split_attention as _split
    return _split(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out, sel, rows, k, k_max,
                  per_head, num_splits, tuning, stages, row_ks, k_scale=k_scale, v_scale=v_scale)


def dense_splits(B: int, Hkv: int, ws, device, tuning) -> int:
    """Split-K partitions of a dense row (B requests x Hkv heads) on ``device``."""
    from .triton.launch import dense_splits as _dense
    return _dense(B, Hkv, ws, device, tuning)


def sparse_splits(B: int, rows: int, Hkv: int, k_max: int, ws, device, tuning) -> int:
    """Split-K partitions of a row of the attention over at most ``k_max`` selected tokens."""
    from .triton.launch import sparse_splits as _sparse
    return _sparse(B, rows, Hkv, k_max, ws, device, tuning)


def layer_select(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, sm_scale, args, ws):
    """The layer mode's selection (one per request for every head): ``[B, 1, K]`` int32 KV slots
    (``ws.layer.sel_slot``). Arguments as :func:`.ops.ds_decode`'s."""
    from .triton.ds_layer import layer_select as _select
    return _select(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, sm_scale, args, ws)


def group_select(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, sm_scale, args, ws):
    """A group mode's selection (one per KV head) without the attention: ``[B, Hkv, K]`` int32
    KV slots (``ws.sel_slot``). Arguments as :func:`.ops.ds_decode`'s; no K/V is read."""
    from .triton.ds_launch import ds_decode as _ds
    B, Hkv, D = q.shape[0], label_cache.shape[1], q.shape[2]
    # the launcher's checks want K/V pools as long as the label pool: a stride-0 view of q
    shaped = q.as_strided((label_cache.shape[0], Hkv, D), (0, 0, 1))
    _ds(q, shaped, shaped, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, sm_scale, args,
        ws, stage="select")
    return ws.sel_slot[:B, :Hkv, :args.k_max]


def ds_decode_stage(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens,
                    sm_scale, args, ws, out=None, stage: str = "all"):
    """:func:`.ops.ds_decode`'s group-mode Triton path up to ``stage`` ("score", "hist",
    "select" or "all"), for timing the stages apart."""
    from .triton.ds_launch import ds_decode as _ds
    return _ds(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, sm_scale,
               args, ws, out, stage=stage)


def recall_stash(ctl, q, out, sel, row_k, dq, do, dsel, drowk, layer: int, R: int) -> None:
    """Copy the armed batch rows' q, output and selection of layer ``layer`` into the recall
    probe's buffers, on the device (kernels/triton/recall_stash.py says the shapes)."""
    from .triton.recall_stash import recall_stash as _stash
    _stash(ctl, q, out, sel, row_k, dq, do, dsel, drowk, layer, R)


def lse_merge(o1, o2, lse1, lse2):
    """Attention over the union of two disjoint key sets from its partials: o1, o2 [H, N, D],
    lse1, lse2 [H, N] float32 -> [H, N, D] in o1's dtype."""
    from .triton.fused_launch import lse_merge as _merge
    return _merge(o1, o2, lse1, lse2)
