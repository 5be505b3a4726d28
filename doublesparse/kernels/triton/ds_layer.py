"""The "layer" selection mode on the Triton path: one top-k per request shared by every head of a
layer, over the sum of all query heads' label scores.

No kernel of its own: the layer is a group mode of one virtual KV head. Its G virtual query heads
are the model's query heads regrouped, virtual head g holding query head g of every KV group side
by side ([Hkv * D] values), its labels are a token's labels of all KV heads ([Hkv * r] channels,
a view of the label pool) and its channels point into the right KV head's part. ``group_sum`` over
the virtual group then sums ``q_h[ch] . label`` over every query head h: the layer's score. The
attention reads the one selection row for every KV head through a stride-0 view.

DS-Offload uses the shared selection to fetch a token's K (and V) of all KV heads of a layer as
one row of ``Hkv * D`` values (2 KB for 8 heads of 128 in bf16), which page-locked host memory
serves at PCIe speed where per-head rows (256 B) do not.
"""

from __future__ import annotations

from dataclasses import replace

from .common import check_decode, check_labels, check_q_label, fail
from .ds_launch import ds_decode as _ds
from .launch import sparse_splits, split_attention


def layer_views(q, label_cache, channels, offsets):
    """(q [B, G, Hkv * D], labels [S, 1, Hkv * r], channels [1, Hkv * r]) of the virtual KV head.
    q: [B, Hq, D]; label_cache: [S, Hkv, r] contiguous in its last two dims; channels: [Hkv, r];
    offsets: [Hkv, 1] int32, h * D (the layer workspace's ``channel_offsets``)."""
    B, Hq, D = q.shape
    S, Hkv, r = label_cache.shape
    G = Hq // Hkv
    qv = q.view(B, Hkv, G, D).transpose(1, 2).reshape(B, G, Hkv * D)
    lab = label_cache.view(S, 1, Hkv * r)
    return qv, lab, (channels + offsets).view(1, Hkv * r)


def layer_select(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, sm_scale, args, ws):
    """Each sparse request's layer selection: ``[B, 1, K]`` int32 KV slots (a view of
    ``ws.layer.sel_slot``; row b's first ``args.k[b]`` entries meaningful where it decodes
    sparsely). Arguments as ops.ds_decode's (``args.mode`` is not read: this is the layer mode);
    ``ws`` built with ``layer_select=True``."""
    if getattr(ws, "layer", None) is None:
        fail("the layer selection mode needs a workspace built with layer_select=True")
    B, Hq, D = q.shape
    S, Hkv, _ = label_cache.shape
    if Hq % Hkv:
        fail(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    qv, lab, ch = layer_views(q, label_cache, channels, ws.layer.channel_offsets)
    # the select stage reads no K/V; its checks want a K pool as long as the label pool (a
    # stride-0 view of the virtual q's first row: no memory)
    kv = qv.as_strided((S, 1, Hkv * D), (0, Hkv * D, 1))
    _ds(qv, kv, kv, lab, label_scale, ch, req_to_token, req_idx, seq_lens, sm_scale,
        replace(args, mode="group_sum"), ws.layer, stage="select")
    return ws.layer.sel_slot[:B, :1, :int(args.k_max)]


def ds_decode_layer(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
                    seq_lens, sm_scale, args, ws=None, out=None, k_scale=None, v_scale=None, q_label=None):
    """ops.ds_decode in the layer mode (no top-p budget): the shared selection (scored with
    ``q_label``, default q), then the exact attention of every KV head over it (dense requests
    over their whole cache)."""
    B, Hq, Hkv, D = check_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, ws, out, k_scale, v_scale)
    check_labels(label_cache, label_scale, channels, k_cache, q.device)
    qs = q if q_label is None else check_q_label(q_label, q)
    K, tuning = int(args.k_max), args.tuning
    if K > ws.k_max:
        fail(f"k_max={K} exceeds workspace k_max={ws.k_max}")
    sel = layer_select(qs, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, sm_scale, args, ws)
    S = sparse_splits(B, Hkv, Hkv, K, ws, q.device, tuning)
    return split_attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out,
                           sel.expand(B, Hkv, K), Hkv, args.k, K, False, S, tuning,
                           tuning.sparse_attn_stages, k_scale=k_scale, v_scale=v_scale)
