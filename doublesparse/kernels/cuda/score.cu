// Double Sparsity stage 1 in CUDA C++: label scoring, with the select's first phase (the
// high-byte histogram of the score keys, select.cu's ds_select_hist_high) fused in.
//
// Why a second implementation: the Triton score kernels are bound by instruction issue, not by
// the label bytes (git show 2fcf640:results/attention-h200-notes.md: fp8 labels, half the bytes, score no faster),
// and Triton 3.6 has no shared-memory atomics for a cheap histogram. Here each thread owns one KV
// head for the whole kernel; a label row (R channels of one head of one token) is one or a few
// 16-byte loads, and consecutive threads read consecutive rows, so a block streams whole label
// rows of consecutive slots. Each thread keeps LPT rows of the next step in flight in registers.
// The scaled query values stay in shared memory (each head's block padded by 16 bytes, so the
// heads of a warp hit different banks), and each 4-channel piece is read once for all LPT rows.
// Measured on an H200: the query in registers left room for only 64 bytes in
// flight per thread; cp.async stages were slower still; re-reading the query for every row made
// the shared-memory reads the limit.
//
// Compiled at run time by NVRTC (score.py) with these compile-time values:
//   HKV, G, R    KV heads, query heads per KV head, heavy channels
//   MODE         0 = per query head (HKV * G score rows), 1 = group sum, 2 = group max
//   LABEL        label dtype: 0 = bf16, 1 = fp16, 2 = fp8 e4m3 (with a [1] fp32 scale)
//   QTYPE        q dtype: 0 = bf16, 1 = fp16, 2 = fp32
//   CH64         channels are int64 (else int32)
//   DO_HIST      add the keys' high-byte histogram to hist[0] (else the select's phase 1 runs)
//   LPT          label rows per thread per step (default 2)
//   MINB         blocks per SM the registers must allow (default 2)
// Grid (B, P): P blocks per request, each one slice of its positions. Same output as the Triton
// score kernels (ds_score.py): fp16 scores clamped to +-65504, sink and recent positions at 65504,
// positions written only for requests that decode sparsely.

#define THREADS 256
#ifndef LPT
#define LPT 2                      // label rows per thread per step (loads in flight)
#endif
#ifndef MINB
#define MINB 2
#endif
#define QS (G * R + 4)           // floats per KV head of the query block in shared memory
#define TOK (THREADS / HKV)      // tokens per block per row of a step
#define STEP (TOK * LPT)           // tokens per block per step
#define ACTIVE (TOK * HKV)       // threads with a (token, head) pair; the rest only help set up
#define ROWS (MODE == 0 ? HKV * G : HKV)
#define LBYTES (LABEL == 2 ? R : 2 * R)
#define NVEC (LBYTES / 16)       // 16-byte loads per label row (the launcher checks LBYTES % 16)
#include "score_common.cuh"
// Label channel j of a row held in 32-bit words. fp8 e4m3 is placed into fp16's bits (sign, then
// exponent and mantissa shifted into place): exact, and 2^8 too small, a factor the query's scale
// carries (score.py).
__device__ __forceinline__ float label_at(const unsigned* w, int j) {
#if LABEL == 2
    unsigned x = (w[j >> 2] >> ((j & 3) * 8)) & 0xFFu;
    return f16_to_f32((unsigned short)(((x & 0x80u) << 8) | ((x & 0x7Fu) << 7)));
#elif LABEL == 1
    return f16_to_f32((unsigned short)((w[j >> 1] >> ((j & 1) * 16)) & 0xFFFFu));
#else
    return __uint_as_float((w[j >> 1] >> ((j & 1) * 16)) << 16);
#endif
}

// Four query values from shared memory, re-read at every use: an ordinary load the compiler
// would hoist out of the token loop into G * R registers, the cost this layout avoids.
__device__ __forceinline__ float4 lds4(const float* p) {
    float4 v;
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
    return v;
}

__device__ __forceinline__ void load_row(const label_t* row, bool valid, uint4 v[NVEC]) {
#pragma unroll
    for (int i = 0; i < NVEC; ++i)
        v[i] = valid ? reinterpret_cast<const uint4*>(row)[i] : make_uint4(0, 0, 0, 0);
}

// The G products of each of this thread's LPT label rows (one KV head, LPT tokens) with the
// head's query block: each 4-channel piece of the query is read from shared memory once for all
// LPT rows (shared-memory bandwidth, not the FMAs, bounds this loop, measured on an H200).
__device__ __forceinline__ void products(const uint4 (&rows)[LPT][NVEC], const float* qh, float (&acc)[LPT][G]) {
#pragma unroll
    for (int u = 0; u < LPT; ++u)
#pragma unroll
        for (int g = 0; g < G; ++g) acc[u][g] = 0.0f;
#pragma unroll
    for (int j = 0; j < R; j += 4) {
        float x[LPT][4];
#pragma unroll
        for (int u = 0; u < LPT; ++u) {
            const unsigned* w = reinterpret_cast<const unsigned*>(rows[u]);
#pragma unroll
            for (int c = 0; c < 4; ++c) x[u][c] = label_at(w, j + c);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float4 qv = lds4(qh + g * R + j);
#pragma unroll
            for (int u = 0; u < LPT; ++u)
                acc[u][g] = fmaf(qv.x, x[u][0], fmaf(qv.y, x[u][1], fmaf(qv.z, x[u][2], fmaf(qv.w, x[u][3], acc[u][g]))));
        }
    }
}

// Writes the score row(s) of one (token, head) pair from its G products.
__device__ __forceinline__ void emit_pair(const float (&acc)[G], int pos, int h, int seq_len, int num_sink,
                                          int num_recent, unsigned short* srow, int stride_sr, int* sh) {
    const bool keep = kept(pos, seq_len, num_sink, num_recent);
#if MODE == 0
#pragma unroll
    for (int g = 0; g < G; ++g)
        emit(acc[g], keep, srow + (long long)(h * G + g) * stride_sr + pos, sh + (h * G + g) * 256);
#else
    float s = acc[0];
#pragma unroll
    for (int g = 1; g < G; ++g) s = MODE == 2 ? fmaxf(s, acc[g]) : s + acc[g];
    emit(s, keep, srow + (long long)h * stride_sr + pos, sh + h * 256);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB) ds_score(
    SCORE_PARAMS)
{
    __shared__ __align__(16) float sq[HKV * QS];
    SCORE_BLOCK_START(STEP);

    float scale = (float)sm_scale;
#if LABEL == 2
    scale *= label_scale[0] * 256.0f;
#endif
    for (int i = tid; i < HKV * G * R; i += THREADS) {
        const int h = i / (G * R), g = (i / R) % G, j = i % R;
        const long long ch = channels[h * stride_ch + j];
        sq[h * QS + g * R + j] = q_to_f32(q[(long long)b * stride_qb + (long long)(h * G + g) * stride_qh + ch]) * scale;
    }
    zero_hist(sh);
    __syncthreads();

    const int h = tid % HKV, tk = tid / HKV;
    const bool active = tid < ACTIVE;
    const float* qh = sq + h * QS;

    const int* rt_row = request_row(req_to_token, req_idx, req_idx_64, b, stride_rt);
    const label_t* lab_h = labels + (long long)h * stride_lh;
    unsigned short* srow = scores + (long long)b * stride_sb;

    // Software-pipelined: the labels of the next step and the slots of the one after are in
    // flight while a step is scored. Thread (tk, h) takes tokens t + u * TOK + tk of step t.
    uint4 ahead[LPT][NVEC];
    int slot_after[LPT];
#pragma unroll
    for (int u = 0; u < LPT; ++u) {
        const int pos = start + u * TOK + tk;
        const bool ok = active && pos < end;
        load_row(lab_h + (long long)(ok ? rt_row[pos] : 0) * stride_ls, ok, ahead[u]);
        slot_after[u] = (active && pos + STEP < end) ? rt_row[pos + STEP] : 0;
    }
    for (int t = start; t < end; t += STEP) {
        uint4 cur[LPT][NVEC];
#pragma unroll
        for (int u = 0; u < LPT; ++u) {
            const int pos = t + u * TOK + tk;
#pragma unroll
            for (int i = 0; i < NVEC; ++i) cur[u][i] = ahead[u][i];
            load_row(lab_h + (long long)slot_after[u] * stride_ls, active && pos + STEP < end, ahead[u]);
            slot_after[u] = (active && pos + 2 * STEP < end) ? rt_row[pos + 2 * STEP] : 0;
        }
        float acc[LPT][G];
        products(cur, qh, acc);
#pragma unroll
        for (int u = 0; u < LPT; ++u) {
            const int pos = t + u * TOK + tk;
            if (active && pos < end) emit_pair(acc[u], pos, h, seq_len, num_sink, num_recent, srow, stride_sr, sh);
        }
    }
    score_end(sh, hist, b, stride_hb, stride_hr);
}
