"""Host launcher for the Double Sparsity decode (score -> top-k select -> sparse attention).

It uses launch.py's attention launcher and common.py's checks. The same rules hold: checks read
shapes, dtypes and devices only, and the geometry depends on static sizes and the
``KernelTuning`` only, so a call is capturable in a CUDA graph.
"""

from __future__ import annotations

import warnings

import torch
import triton

from ..cuda import score as cuda_score
from ..cuda import select as cuda_select
from ..reference import MODES
from ..tuning import KernelTuning
from ..workspace import SCORE_PAD, SELECT_MAX_PROGS, TOPP_MAX_PROGS
from .common import INTERPRET, check, check_decode, check_labels, check_q_label, fail, num_sms
from .ds_score import score_mma_kernel
from .ds_score_rows import score_kernel
from .ds_select import select_kernel
from .ds_topp import topp_keep_kernel, topp_mass_kernel
from .launch import split_attention, sparse_splits


STAGES = ("score", "hist", "select", "attend", "rest", "all")


def ds_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
              seq_lens, sm_scale, args, ws=None, out=None, num_splits=None, num_progs=None, return_sel=False,
              stage="all", k_scale=None, v_scale=None, q_label=None):
    """See ops.ds_decode (``args``: an ops.DSDecodeArgs). ``stage`` ("score", "hist", "select",
    "attend", "all") runs a prefix or the last part only, for the stage-by-stage benchmark; "rest"
    runs everything after the score (select and attend), so that callers can order batch parts'
    stages across streams; ``return_sel`` also returns the selection ([B, rows, K] int32, row b's
    first ``args.k[b]`` entries meaningful where it decodes sparsely). With the top-p budget its
    launches (ds_topp.py) run after the select (stage "select" included); the attention then
    reads ``ws.topp_slot`` and ``ws.row_k``. k_scale, v_scale: an fp8 pool's scales. q_label: the
    query the score stage reads (ops.ds_decode; default q), the attention stage reads q."""
    B, Hq, Hkv, D = check_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, ws, out, k_scale, v_scale)
    dev = q.device
    qs = q if q_label is None else check_q_label(q_label, q)
    r = check_labels(label_cache, label_scale, channels, k_cache, dev)
    mode, tuning, top_p = args.mode, args.tuning, args.top_p
    if mode == "layer":
        fail(f"mode must be one of {MODES[:3]} (the layer mode: ds_layer.py), got {mode!r}")
    k = args.k
    check(k, "args.k", 1, (torch.int32,), dev)
    if k.shape[0] != B:
        fail(f"args.k {tuple(k.shape)} must be [{B}]")
    # Only the host bound is checked: the per-request k live on the device (no sync).
    k_max = int(args.k_max)
    if not ws.k_max:
        fail("workspace has no Double Sparsity buffers (k_max=0)")
    if k_max > ws.k_max:
        fail(f"k_max={k_max} exceeds workspace k_max={ws.k_max}")
    if req_to_token.shape[1] > ws.max_ctx:
        fail(f"req_to_token has {req_to_token.shape[1]} positions > workspace max_ctx {ws.max_ctx}")
    G = Hq // Hkv
    per_head = mode == "per_head"
    rows = Hq if per_head else Hkv
    scores, sel_slot = ws.scores, ws.sel_slot
    if tuning.max_score_block > SCORE_PAD:
        fail(f"select/score block must be <= the workspace's score padding {SCORE_PAD}")
    if stage not in STAGES:
        fail(f"stage must be one of {STAGES}, got {stage!r}")
    impl, hist_in_score, geometry = _score_impl(qs, label_cache, channels, mode, tuning)
    num_sink, num_recent = int(args.num_sink), int(args.num_recent)
    if stage not in ("attend", "rest"):
        nsm = num_sms(dev)
        if impl == "cuda":
            per_thread, _, tc, depth, max_hpw = geometry
            step = cuda_score.step_tokens(qs, label_cache, per_thread, tc, depth, max_hpw)
            P = num_progs or max(1, min(triton.cdiv(tuning.score_cuda_programs_per_sm * nsm, B),
                                        triton.cdiv(ws.max_ctx, step)))
            cuda_score.score(qs, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, scores,
                             ws.hist, sm_scale, k, num_sink, num_recent, mode, P, hist_in_score, *geometry)
        elif impl == "mma":
            _score_mma(qs, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, ws,
                       float(sm_scale), args, num_progs)
        else:
            P_score = num_progs or max(1, min(triton.cdiv(tuning.score_programs_per_sm * nsm, B * Hkv),
                                              triton.cdiv(ws.max_ctx, tuning.score_block_n)))
            is_fp8 = label_cache.dtype == torch.float8_e4m3fn
            score_kernel[(B, Hkv, P_score)](
                qs, label_cache, channels, label_scale if is_fp8 else qs, req_to_token, req_idx, seq_lens,
                scores, float(sm_scale), k, num_sink, num_recent,
                qs.stride(0), qs.stride(1), label_cache.stride(0), label_cache.stride(1), channels.stride(0),
                req_to_token.stride(0), scores.stride(0), scores.stride(1),
                G=G, R=r, MODE=MODES.index(mode), LABEL_FP8=is_fp8, NUM_PROGS=P_score,
                BLOCK_N=tuning.score_block_n, BLOCK_R=triton.next_power_of_2(r),
                LOOP_STAGES=tuning.score_loop_stages,
                num_warps=tuning.score_warps, num_stages=tuning.score_stages,
            )
        if stage == "score":
            return None
    if stage != "attend":
        _select(ws, seq_lens, req_to_token, req_idx, args, B, rows, hist_in_score, num_progs, stage)
        if stage == "hist":
            return None
        if top_p > 0:
            topp_keep(ws, seq_lens, args, B, rows, num_progs)
        if stage == "select":
            return ws.sel
    if num_splits is None:
        num_splits = sparse_splits(B, rows, Hkv, k_max, ws, dev, tuning)
    o = split_attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out,
                        ws.topp_slot if top_p > 0 else sel_slot, rows, k, k_max, per_head, num_splits, tuning,
                        tuning.sparse_attn_stages, row_ks=ws.row_k if top_p > 0 else None,
                        k_scale=k_scale, v_scale=v_scale)
    return (o, ws.sel) if return_sel else o


def _mma_geometry(q, label_cache, tuning: KernelTuning) -> dict:
    """ds_score.score_mma_slice's constexprs for these shapes (tile: about 16-32 KB of labels,
    whatever Hkv * r is)."""
    Hkv, r = label_cache.shape[1], label_cache.shape[2]
    G = q.shape[1] // Hkv
    g_p = triton.next_power_of_2(G)
    block_c = max(16, triton.next_power_of_2(Hkv * r))
    return dict(HKV=Hkv, G=G, R=r, LABEL_FP8=label_cache.dtype == torch.float8_e4m3fn,
                LABEL_KIND={torch.float16: 1, torch.float32: 2}.get(label_cache.dtype, 0),
                BLOCK_N=max(16, min(tuning.mma_block_n, 16384 // block_c)), BLOCK_C=block_c,
                HKV_P=max(triton.next_power_of_2(Hkv), triton.cdiv(16, g_p)), G_P=g_p)


def _score_impl(q, label_cache, channels, mode, tuning: KernelTuning):
    """Stage 1's kernel ("cuda", "mma" or "rows") under ``tuning.score_impl``, whether its launch
    makes hist[0] (the select's first phase), and the CUDA score's (per_thread, min_blocks, tc,
    depth, max_hpw) (None for the Triton kernels). "auto" takes the CUDA score where it replaces
    mma (measured faster there) and wherever its tensor-core kernel fits; score.cu with many KV heads
    (LongChat-7B's 32 x 16) was slower than "rows" on an H200."""
    impl = tuning.score_impl
    Hq, Hkv, r = q.shape[1], label_cache.shape[1], label_cache.shape[2]
    few_channels = Hkv * r <= tuning.mma_max_channels
    # score_tc.cu (tensor cores) where tuning.score_cuda_tc and its shapes allow, with
    # score_cuda_tc_tiles 16-token tiles per warp per step and a ring of score_cuda_tc_depth steps;
    # else score.cu with score_cuda_rows_per_thread label rows per thread.
    max_hpw = tuning.score_cuda_tc_max_heads_per_warp
    tc = tuning.score_cuda_tc and cuda_score.tc_fits(q, label_cache, max_hpw)
    if impl == "cuda" or (impl == "auto" and (few_channels or tc)):
        hist = tuning.score_cuda_hist and cuda_score.hist_fits(Hq, Hkv, r, mode)
        geometry = (tuning.score_cuda_tc_tiles if tc else tuning.score_cuda_rows_per_thread,
                    tuning.score_cuda_min_blocks, tc, tuning.score_cuda_tc_depth, max_hpw)
        if _take_cuda("score_impl", impl, lambda: cuda_score.why_not(q, label_cache, channels, mode, hist, *geometry)):
            return "cuda", hist, geometry
    if impl in ("cuda", "auto"):
        impl = "mma" if few_channels else "rows"
    return impl, False, None


def _select(ws, seq_lens, req_to_token, req_idx, args, B, rows, skip_phase1, num_progs, stage):
    """Stage 2: the top-k select's three phases, one launch each (phase 1 skipped when the
    score launch made the histogram; stage "hist" runs phase 1 only, for the stage benchmark), by
    ds_select.py's Triton kernel or select.cu's CUDA kernels (``_use_cuda_select``). Row b's rank
    is ``args.k[b]`` ([B] int32 on the device), capped at ``args.k_max`` (<= the sel rows' length)."""
    k, k_max, tuning = args.k, int(args.k_max), args.tuning
    scores, hist, info, counts, sel, sel_slot = (ws.scores, ws.hist, ws.rowinfo, ws.counts, ws.sel,
                                                 ws.sel_slot)
    nsm = num_sms(scores.device)
    cuda = _use_cuda_select(scores, tuning)

    def progs(per_sm, block, max_progs=None):
        # Programs per score row: per_sm per SM over the grid's rows, at most one per block of
        # the longest row (and max_progs); phases 2 and 3 must agree, phase 3 reading phase 2's.
        P = num_progs or max(1, min(triton.cdiv(per_sm * nsm, B * rows), triton.cdiv(ws.max_ctx, block)))
        return min(P, max_progs) if max_progs else P

    if cuda:
        if not skip_phase1:
            cuda_select.hist_high(scores, hist, seq_lens, k, B, rows,
                                  progs(tuning.hist_programs_per_sm, cuda_select.CHUNK))
        if stage != "hist":
            P = progs(tuning.select_programs_per_sm, cuda_select.CHUNK, SELECT_MAX_PROGS)
            cuda_select.hist_low(scores, hist, info, counts, seq_lens, k, k_max, B, rows, P)
            cuda_select.compact(scores, hist, info, counts, seq_lens, sel, sel_slot, req_to_token, req_idx,
                                k, k_max, B, rows, P)
        return
    kargs = (scores, hist, info, counts, seq_lens, sel, sel_slot, req_to_token, req_idx, k, k_max,
             scores.stride(0), scores.stride(1), hist.stride(0), hist.stride(1), hist.stride(2),
             info.stride(0), info.stride(1), counts.stride(0), counts.stride(1),
             sel.stride(0), sel.stride(1), req_to_token.stride(0))

    def launch(phase, block, per_sm, loop_stages, max_progs=None):
        P = progs(per_sm, block, max_progs)
        select_kernel[(B, rows, P)](*kargs, PHASE=phase, NUM_PROGS=P, BLOCK_N=block,
                                    LOOP_STAGES=loop_stages, MAX_PROGS=SELECT_MAX_PROGS,
                                    num_warps=tuning.select_warps, num_stages=tuning.select_stages)

    if not skip_phase1:
        launch(1, tuning.hist_block_n, tuning.hist_programs_per_sm, tuning.select_loop_stages)
    if stage != "hist":
        for phase, stages in ((2, tuning.select_loop_stages), (3, tuning.compact_loop_stages)):
            launch(phase, tuning.select_block_n, tuning.select_programs_per_sm, stages,
                   SELECT_MAX_PROGS)


def topp_keep(ws, seq_lens, args, B, rows, num_progs):
    """The top-p budget's two launches (ds_topp.py): each row's softmax denominator over its
    scores, then which of its selected tokens it keeps -> ws.topp_slot, ws.row_k. args: the
    call's ops.DSDecodeArgs."""
    tuning, k, k_max = args.tuning, args.k, int(args.k_max)
    num_sink, num_recent = int(args.num_sink), int(args.num_recent)
    scores, part = ws.scores, ws.topp_part
    block = tuning.topp_block_n
    P = num_progs or max(1, min(triton.cdiv(tuning.topp_programs_per_sm * num_sms(scores.device), B * rows),
                                triton.cdiv(ws.max_ctx, block)))
    P = min(P, TOPP_MAX_PROGS)
    topp_mass_kernel[(B, rows, P)](
        scores, seq_lens, k, part, num_sink, num_recent,
        scores.stride(0), scores.stride(1), part.stride(0), part.stride(1),
        NUM_PROGS=P, BLOCK_N=block, num_warps=tuning.topp_warps,
    )
    sel = ws.sel
    k_p = triton.next_power_of_2(k_max)
    topp_keep_kernel[(B, rows)](
        scores, seq_lens, k, part, sel, ws.sel_slot, ws.topp_slot, ws.row_k,
        k_max, float(args.top_p), int(args.top_p_min_k), num_sink, num_recent,
        scores.stride(0), scores.stride(1), part.stride(0), part.stride(1), sel.stride(0), sel.stride(1),
        ws.row_k.stride(0),
        NUM_PROGS=P, P_P=triton.next_power_of_2(P), K_P=k_p,
        # a row's whole selection sits in registers: more warps for more entries (sm_90: 8 warps
        # hold 2048 entries in 84 registers a thread, 16 warps 8192 in 113, no spills; beyond
        # that it spills, still correct)
        num_warps=min(16, max(tuning.topp_keep_warps, k_p // 512)),
    )


_WARNED: set = set()  # (knob, reason) a CUDA path could not run, each warned about once


def _take_cuda(knob: str, impl: str, why_not) -> bool:
    """Whether ``impl`` (the value of tuning knob ``knob``) takes its CUDA C++ kernels: "cuda", or
    "auto" = cuda where they can run (``why_not()`` is None); never under the interpreter. "cuda"
    where they cannot warns once and the caller runs Triton."""
    if impl not in ("cuda", "auto") or INTERPRET:
        return False
    why = why_not()
    if why is None:
        return True
    if impl == "cuda" and (knob, why) not in _WARNED:
        _WARNED.add((knob, why))
        warnings.warn(f"{knob}='cuda' cannot run ({why}); using Triton", stacklevel=4)
    return False


def _use_cuda_select(scores, tuning: KernelTuning) -> bool:
    """Whether this call's select runs select.cu (``tuning.select_impl``: "triton", "cuda" or
    "auto" = cuda where it can run); "cuda" where it cannot warns once and runs Triton."""

    def why_not():
        why = cuda_select.unavailable(scores.device)
        if why is None and not cuda_select.aligned(scores):
            why = "the score rows are not 16-byte aligned"
        return why

    return _take_cuda("select_impl", tuning.select_impl, why_not)


def _score_mma(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, ws, sm_scale, args,
               num_progs=None):
    """Stage 1 with ds_score.score_mma_kernel: grid (B, P), every KV head per program."""
    B, tuning = q.shape[0], args.tuning
    geo = _mma_geometry(q, label_cache, tuning)
    P = num_progs or max(1, min(triton.cdiv(tuning.mma_programs_per_sm * num_sms(q.device), B),
                                triton.cdiv(ws.max_ctx, geo["BLOCK_N"])))
    scores = ws.scores
    score_mma_kernel[(B, P)](
        q, label_cache, channels, label_scale if geo["LABEL_FP8"] else q, req_to_token, req_idx, seq_lens,
        scores, sm_scale, args.k, int(args.num_sink), int(args.num_recent),
        q.stride(0), q.stride(1), label_cache.stride(0), label_cache.stride(1), channels.stride(0),
        req_to_token.stride(0), scores.stride(0), scores.stride(1),
        MODE=MODES.index(args.mode), NUM_PROGS=P, DOT_F32=INTERPRET, num_warps=tuning.mma_warps, **geo,
        num_stages=1,  # the loop is pipelined by hand; Triton's pipeliner would only serialize it
    )
