"""Host side of the persistent Double Sparsity decode (ds_persistent.py): the work-item table and
the launch.

``ds_launch.ds_decode`` calls ``run`` when ``TUNING["ds_persistent"]`` is on (stage "all"), after
its checks. The table depends on static sizes only (batch, rows, item counts, lags), is built once
per such key (outside graph capture: the engine and benchmarks warm up first) and cached on the
device, so the launch stays capturable.
"""

from __future__ import annotations

import torch
import triton

from ..reference import MODES
from ..workspace import SELECT_MAX_PROGS
from .ds_persistent import ATTN, COMPACT, HIST1, HIST2, ITEM_FIELDS, SCORE, ds_persistent_kernel
from .launch import _INTERPRET, TUNING, _attn_block_n, _fail, _num_sms, select_prefetches

KIND_NAMES = {SCORE: "SCORE", HIST1: "HIST1", HIST2: "HIST2", COMPACT: "COMPACT", ATTN: "ATTN"}

_TABLES: dict = {}  # (device, sizes...) -> int32 [num_items, ITEM_FIELDS] on that device


def work_items(B: int, rows: int, n_score: int, n_hist: int, n_sel: int, n_splits: int,
               select_lag: int, attn_lag: int) -> list[tuple[int, int, int, int]]:
    """The work items (kind, b, row, p) in queue order. Wave w queues entry w's score slices,
    then entry (w - select_lag)'s select (its three phases, row by row; no first phase when
    ``n_hist`` is 0, the score items making its histogram), then entry (w - attn_lag)'s
    attention splits; so every item comes after the items it waits for
    (``0 <= select_lag <= attn_lag``)."""
    if not 0 <= select_lag <= attn_lag:
        _fail(f"need 0 <= persistent_select_lag <= persistent_attn_lag, got {select_lag}, {attn_lag}")
    items = []
    for w in range(B + attn_lag):
        if w < B:
            items += [(SCORE, w, 0, p) for p in range(n_score)]
        b = w - select_lag
        if 0 <= b < B:
            for kind, n in ((HIST1, n_hist), (HIST2, n_sel), (COMPACT, n_sel)):
                items += [(kind, b, r, p) for r in range(rows) for p in range(n)]
        b = w - attn_lag
        if 0 <= b < B:
            items += [(ATTN, b, r, s) for r in range(rows) for s in range(n_splits)]
    return items


def _table(device, *sizes) -> torch.Tensor:
    key = (device, *sizes)
    if key not in _TABLES:
        items = work_items(*sizes)
        _TABLES[key] = torch.tensor(items, dtype=torch.int32).reshape(len(items), int(ITEM_FIELDS)).to(device)
    return _TABLES[key]


def run(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens,
        sm_scale, k, threshold, num_sink, num_recent, mode, ws, out, score_geo, num_splits):
    """The DS decode in one persistent launch. Arguments as ``ds_launch.ds_decode`` after its checks;
    ``score_geo``: ds_score.score_mma_slice's constexprs (``ds_launch._mma_geometry``);
    ``num_splits``: attention splits per row. Returns ``out`` [B, Hq, D]."""
    B, Hq, D = q.shape
    dev = q.device
    per_head = mode == "per_head"
    rows = Hq if per_head else k_cache.shape[1]
    G = Hq // k_cache.shape[1]
    n_score = max(1, triton.cdiv(ws.max_ctx, TUNING["persistent_score_tokens"]))
    # The score items make the select's high-byte histogram themselves (group modes only): then
    # the table has no HIST1 items.
    score_hist = bool(TUNING["persistent_score_hist"]) and not per_head
    n_hist = TUNING["persistent_hist_items"]
    n_sel = TUNING["persistent_select_items"]
    if not (1 <= n_hist and 1 <= n_sel <= SELECT_MAX_PROGS):
        _fail(f"need persistent_hist_items >= 1 and 1 <= persistent_select_items <= {SELECT_MAX_PROGS}")
    if not 1 <= num_splits <= ws.max_splits:
        _fail(f"num_splits={num_splits} must be in [1, {ws.max_splits}]")
    spin_limit = int(TUNING["persistent_spin_limit"])
    if spin_limit < 0:
        _fail(f"persistent_spin_limit must be >= 0 (0 = wait forever), got {spin_limit}")
    items = _table(dev, B, rows, n_score, 0 if score_hist else n_hist, n_sel, num_splits,
                   TUNING["persistent_select_lag"], TUNING["persistent_attn_lag"])
    progs = max(1, min(items.shape[0], TUNING["persistent_programs_per_sm"] * _num_sms(dev)))
    if out is None:
        out = torch.empty_like(q)
    sync, hist, info, counts = ws.persistent_sync, ws.hist, ws.rowinfo, ws.counts
    sel_slot, po, pl, cnt = ws.sel_slot, ws.part_o, ws.part_lse, ws.split_count
    geo = dict(score_geo)
    score_block_n = geo.pop("BLOCK_N")
    ds_persistent_kernel[(progs,)](
        items, items.shape[0], sync,
        q, label_cache, channels, label_scale if geo["LABEL_FP8"] else q, k_cache, v_cache,
        req_to_token, req_idx, seq_lens,
        ws.scores, hist, info, counts, ws.sel, sel_slot, po, pl, cnt, out,
        sm_scale, k, threshold, num_sink, num_recent, B,
        sync.stride(0),
        q.stride(0), q.stride(1), label_cache.stride(0), label_cache.stride(1), channels.stride(0),
        req_to_token.stride(0),
        ws.scores.stride(0), ws.scores.stride(1), hist.stride(0), hist.stride(1), hist.stride(2),
        info.stride(0), info.stride(1), counts.stride(0), counts.stride(1),
        sel_slot.stride(0), sel_slot.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), cnt.stride(0),
        out.stride(0), out.stride(1),
        MODE=MODES.index(mode), SCORE_ITEMS=n_score, SCORE_BLOCK_N=score_block_n, SCORE_HIST=score_hist,
        HIST_ITEMS=n_hist, HIST_BLOCK_N=TUNING["hist_block_n"], SEL_ITEMS=n_sel,
        SEL_BLOCK_N=TUNING["select_block_n"], ATOMIC_HIST=TUNING["select_atomic_hist"],
        SEL_LOOP_STAGES=TUNING["select_loop_stages"], COMPACT_LOOP_STAGES=TUNING["compact_loop_stages"],
        MAX_PROGS=SELECT_MAX_PROGS, PREFETCH2=select_prefetches(2), PREFETCH3=select_prefetches(3),
        D=D, NUM_SPLITS=num_splits, BLOCK_H=max(16, triton.next_power_of_2(1 if per_head else G)),
        ATTN_BLOCK_N=_attn_block_n(B * rows, dev), BLOCK_D=triton.next_power_of_2(D),
        BLOCK_S=triton.next_power_of_2(num_splits), ROWS_MAX=Hq,
        SYNC_BLOCK=triton.next_power_of_2(3 * Hq + 3), DOT_F32=_INTERPRET, SPIN_LIMIT=spin_limit,
        num_warps=TUNING["persistent_warps"], num_stages=TUNING["sparse_attn_stages"], **geo,
        **({"maxnreg": TUNING["persistent_maxnreg"]} if TUNING["persistent_maxnreg"] else {}),
    )
    if spin_limit and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _check_stall(ws, Hq, spin_limit)
    return out


def _check_stall(ws, Hq: int, spin_limit: int) -> None:
    """Raise RuntimeError naming the first wait that gave up (``persistent_spin_limit``; also one
    left by a CUDA-graph replay, which cannot be checked), after clearing its record (the six
    columns after the first row's ticket and exit count in ``persistent_sync [B, 3 Hq + 9]``) and
    the scratch that a late item may have left dirty (``hist[0]``, ``split_count``)."""
    stall = ws.persistent_sync[0, 3 * Hq + 3:3 * Hq + 9]
    ticket, seen, kind, b, row, p = stall.tolist()  # the one host sync, in this debugging mode only
    if not ticket:
        return
    stall.zero_()
    ws.hist[0].zero_()
    ws.split_count.zero_()
    waits_on = {HIST1: "score slices", HIST2: "phase-1 slices (or score slices)",
                COMPACT: "phase-2 slices", ATTN: "phase-3 slices"}[kind]
    raise RuntimeError(
        f"persistent DS decode: item {ticket - 1} ({KIND_NAMES[kind]}, entry {b}, row {row}, slice {p}) "
        f"gave up after {spin_limit} polls, with {seen} of its entry's or row's {waits_on} arrived: "
        f"the items it waits for never arrived (the table, the counts or the synchronisation is wrong)")
