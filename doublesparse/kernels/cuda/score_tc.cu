// Double Sparsity stage 1 on tensor cores: label scoring (the output of score.cu, with the select's
// first phase fused in the same way), for labels of 16-channel pieces: bf16 (bf16 mma), fp16 or
// fp8 e4m3 (fp16 mma; e4m3 converts to fp16 exactly).
//
// Why: score.cu's products are fp32 FMAs, G * R per label row, and its issue slots, not the label
// bytes, set its time (measured on an H200). Here mma.sync m16n8k16 scores 16 tokens of a warp's
// HPW adjacent KV heads (a "unit": HPW = 8 / G where G is 1, 2 or 4, so that the unit's query
// heads fill the mma's 8 columns; else 1) against their query heads. The unit's label row (HPW * R
// channels, contiguous in the pool) is KC pieces of 16 channels. Lane (m, c) = (lane / 4,
// lane % 4) loads channels [4 KC c, 4 KC (c + 1)) of the rows of tokens m and m + 8 of a tile,
// 8 KC bytes of bf16 (with KC = 2, as for Llama-3's 8 x 16 labels, a warp's load is 8 rows x 64
// contiguous bytes).
// The channels' order is permuted (the sum over channels does not depend on it): in piece kc,
// k-slots 2c, 2c+1 of the A fragment are channels 4 KC c + 4 kc + (0, 1), k-slots 2c+8, 2c+9
// the next two; the query's B fragment (column n = query head n of the unit, zero where the
// channel is another head's) follows the same order. The scaled query is split into hi + lo
// parts of the mma's type (two mmas) so that the products keep about fp32's precision (2^-16 or
// better), as the fp32 scores of score.cu and the Triton kernels do.
//
// Compiled at run time by NVRTC (score.py) with score.cu's HKV, G, R, MODE, LABEL, QTYPE, CH64,
// DO_HIST and MINB, and
//   LT           16-token tiles per warp per step (default 4)
//   DEPTH        steps of label rows held in registers (default 2): DEPTH - 1 steps' loads are in
//                flight while one step is scored
//   HPW          KV heads per unit: 1, or up to 8 / G where G is 1, 2 or 4 (default 1)
// The launcher checks: HKV / HPW divides 8, HPW * G <= 8, R % 16 == 0, heads contiguous in the
// label pool where HPW > 1. Grid (B, P) as score.cu.

#define THREADS 256
#define NW (THREADS / 32)
#ifndef LT
#define LT 4
#endif
#ifndef MINB
#define MINB 2
#endif
#ifndef HPW
#define HPW 1
#endif
#ifndef DEPTH
#define DEPTH 2
#endif
#define UNITS (HKV / HPW)          // units (HPW adjacent KV heads) per token
#define WPU (NW / UNITS)           // warps per unit
#define STEP (WPU * 16 * LT)       // tokens per block per step
#define SPL ((LT * 16 + 31) / 32)  // slots per lane per step (load_slots)
#define KC (HPW * R / 16)          // 16-channel pieces of a unit's label row
#define RW (LABEL == 2 ? KC : 2 * KC)  // 32-bit label words per lane and row (4 channels per piece)
#define ROWS (MODE == 0 ? HKV * G : HKV)
#include "score_common.cuh"
#if LABEL == 0
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

// Two fp32 values as the mma's 16-bit pair (lo in the low half: the lower k-slot).
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
#if LABEL == 0
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// Element e (0 = low half) of a packed pair, as fp32.
__device__ __forceinline__ float half_at(unsigned w, int e) {
#if LABEL == 0
    return __uint_as_float(e ? w & 0xFFFF0000u : w << 16);
#else
    return f16_to_f32((unsigned short)(e ? w >> 16 : w & 0xFFFFu));
#endif
}

// The A-fragment words (channels 0, 1 and 2, 3 of this lane's piece kc) of one label row.
__device__ __forceinline__ uint2 piece(const unsigned (&raw)[RW], int kc) {
#if LABEL == 2
    unsigned w0, w1;  // four e4m3 channels -> two fp16 pairs, exactly
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e4m3x2 %0, lo; cvt.rn.f16x2.e4m3x2 %1, hi; }"
        : "=r"(w0), "=r"(w1) : "r"(raw[kc]));
    return make_uint2(w0, w1);
#else
    return make_uint2(raw[2 * kc], raw[2 * kc + 1]);
#endif
}

__device__ __forceinline__ void mma(float (&d)[4], uint2 row_m, uint2 row_m8, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(row_m.x), "r"(row_m8.x), "r"(row_m.y), "r"(row_m8.y), "r"(b0), "r"(b1));
}

// The G-head combination of one token's products in the group modes: lane c holds columns 2c and
// 2c+1 (v0, v1); after this every lane holds its head's. All lanes call it.
__device__ __forceinline__ float group(float v0, float v1, int c) {
#if HPW > 1
    // Reached with G = 4 only (G = 1 and 2 store per lane): HPW = 2, lanes 0, 1 hold the unit's
    // first head, lanes 2, 3 its second.
    const float s = MODE == 2 ? fmaxf(v0, v1) : v0 + v1;
    const float o = __shfl_xor_sync(0xffffffffu, s, 1);
    return MODE == 2 ? fmaxf(s, o) : s + o;
#else
    const float id = MODE == 2 ? __int_as_float(0xff800000) : 0.0f;  // -inf for the max
    v0 = 2 * c < G ? v0 : id;
    v1 = 2 * c + 1 < G ? v1 : id;
    float s = MODE == 2 ? fmaxf(v0, v1) : v0 + v1;
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, s, x);
        s = MODE == 2 ? fmaxf(s, o) : s + o;
    }
    return s;
#endif
}

// The scores of one tile: d[0], d[1] are token pos0 (= tile start + m) for the unit's query
// heads 2c, 2c+1, d[2], d[3] token pos0 + 8; stored (with their keys' histogram) per the mode.
__device__ __forceinline__ void emit_tile(const float (&d)[4], int pos0, int end, int seq_len, int num_sink,
                                          int num_recent, int c, int h0, unsigned short* srow, int stride_sr,
                                          int* sh) {
#if MODE == 0 || G == 1
    // Every column its own score row (with G = 1 the KV heads' rows in every mode).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int pos = pos0 + 8 * r;
        if (pos < end) {
            const bool keep = kept(pos, seq_len, num_sink, num_recent);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int qh = h0 * G + 2 * c + e;  // query head
                if (2 * c + e < HPW * G)
                    emit(d[2 * r + e], keep, srow + (long long)qh * stride_sr + pos, sh + qh * 256);
            }
        }
    }
#elif G == 2 && HPW > 1
    // Lane c's two columns are head h0 + c's group: it stores both tokens.
    if (c < HPW) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int pos = pos0 + 8 * r;
            const float v = MODE == 2 ? fmaxf(d[2 * r], d[2 * r + 1]) : d[2 * r] + d[2 * r + 1];
            if (pos < end)
                emit(v, kept(pos, seq_len, num_sink, num_recent), srow + (long long)(h0 + c) * stride_sr + pos,
                     sh + (h0 + c) * 256);
        }
    }
#else
    const float s0 = group(d[0], d[1], c), s1 = group(d[2], d[3], c);
    // Of each head's lanes, the first stores token m, the second token m + 8 (with HPW 1,
    // lanes 0 and 1 of the quad).
    const int hd = HPW == 2 ? h0 + (c >> 1) : h0, odd = HPW == 2 ? c & 1 : c;
    const int pos = pos0 + 8 * odd;
    if (odd < 2 && pos < end)
        emit(odd ? s1 : s0, kept(pos, seq_len, num_sink, num_recent), srow + (long long)hd * stride_sr + pos,
             sh + hd * 256);
#endif
}

// The slots of a warp's LT * 16 positions of the step at t (tile u: t + (u * WPU + j) * 16 + i,
// i < 16), position p = 16 u + i of them on lane p % 32, entry p / 32 (0 past the row's end).
__device__ __forceinline__ void load_slots(const int* rt_row, int t, int end, int j, int lane, int (&s)[SPL]) {
#pragma unroll
    for (int e = 0; e < SPL; ++e) {
        const int p = 32 * e + lane, u = p >> 4, pos = t + (u * WPU + j) * 16 + (p & 15);
        s[e] = u < LT && pos < end ? rt_row[pos] : 0;
    }
}

// The slot of row m + 8 r of tile u, from the lanes that load_slots gave it to. All lanes call it.
__device__ __forceinline__ int slot_of(const int (&s)[SPL], int u, int r, int m) {
    return __shfl_sync(0xffffffffu, s[(16 * u + 8 * r) / 32], (16 * u + 8 * r + m) & 31);
}

// This lane's 4 * KC channels of one unit label row (RW words), in the widest loads they allow.
__device__ __forceinline__ void load_row(const label_t* row, bool valid, unsigned (&v)[RW]) {
#if RW % 4 == 0
#pragma unroll
    for (int i = 0; i < RW / 4; ++i) {
        const uint4 w = valid ? reinterpret_cast<const uint4*>(row)[i] : make_uint4(0, 0, 0, 0);
        v[4 * i] = w.x; v[4 * i + 1] = w.y; v[4 * i + 2] = w.z; v[4 * i + 3] = w.w;
    }
#elif RW % 2 == 0
#pragma unroll
    for (int i = 0; i < RW / 2; ++i) {
        const uint2 w = valid ? reinterpret_cast<const uint2*>(row)[i] : make_uint2(0, 0);
        v[2 * i] = w.x; v[2 * i + 1] = w.y;
    }
#else
    // an odd word count (fp8 labels of an odd number of 16-channel pieces, e.g. r = 48): one word
    // at a time, every one of them (a single load here left the others undefined)
#pragma unroll
    for (int i = 0; i < RW; ++i) v[i] = valid ? reinterpret_cast<const unsigned*>(row)[i] : 0u;
#endif
}

// This lane's rows (m and m + 8 of each tile u) of the step at t, into one ring entry; slots from
// load_slots (rows past the row's end read as zeros). All lanes call it.
__device__ __forceinline__ void load_step(const label_t* lab, int stride_ls, const int (&slots)[SPL], int t, int end,
                                          int j, int m, unsigned (&entry)[LT][2][RW]) {
#pragma unroll
    for (int u = 0; u < LT; ++u)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int pos = t + (u * WPU + j) * 16 + m + 8 * r;
            load_row(lab + (long long)slot_of(slots, u, r, m) * stride_ls, pos < end, entry[u][r]);
        }
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB) ds_score_tc(
    SCORE_PARAMS)
{
    SCORE_BLOCK_START(STEP);
    const int warp = tid >> 5, lane = tid & 31, m = lane >> 2, c = lane & 3;
    const int h0 = (warp % UNITS) * HPW, j = warp / UNITS;  // the unit's first KV head

    const int* rt_row = request_row(req_to_token, req_idx, req_idx_64, b, stride_rt);
    const label_t* lab = labels + (long long)h0 * stride_lh + 4 * KC * c;
    unsigned short* srow = scores + (long long)b * stride_sb;

    // B fragments: column m = query head m % G of the unit's head m / G (zero past the unit's
    // HPW * G heads, and where the channel is another head's), this lane's channels of each piece.
    unsigned bhi[KC][2], blo[KC][2];
    float scale = (float)sm_scale;
#if LABEL == 2
    scale *= label_scale[0];
#endif
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        float x[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int cu = 4 * KC * c + 4 * kc + i, hc = cu / R;  // channel of the unit's row, its head
            const long long ch = channels[(h0 + hc) * stride_ch + cu % R];
            const bool mine = m < HPW * G && m / G == hc;
            x[i] = mine ? q_to_f32(q[(long long)b * stride_qb + (long long)(h0 * G + m) * stride_qh + ch]) * scale : 0.0f;
        }
        bhi[kc][0] = pack2(x[0], x[1]);
        bhi[kc][1] = pack2(x[2], x[3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) lo[i] = x[i] - half_at(bhi[kc][i >> 1], i & 1);
        blo[kc][0] = pack2(lo[0], lo[1]);
        blo[kc][1] = pack2(lo[2], lo[3]);
    }
    zero_hist(sh);
#if DO_HIST
    __syncthreads();
#endif

    // (Requesting the first rows before the B fragments, so that the slot -> row and the
    // channel -> q load chains overlap, was no faster at 3 x 64K and 2 us slower at 16 x 32K:
    // on an H200.)
    // Software-pipelined through a ring of DEPTH steps' label rows: while one step is scored,
    // the loads of the next DEPTH - 1 steps are in flight (registers are the only buffer, so no
    // copy between them: the loop is unrolled DEPTH times). Tile u of step t starts at
    // t + (u * WPU + j) * 16; this lane reads its rows m and m + 8 (r = 0, 1). The slots of a
    // ring entry's next step are read one ring turn ahead of its label rows, spread over the
    // warp's lanes (load_slots / slot_of) to keep registers for the rows.
    unsigned ring[DEPTH][LT][2][RW];
    int slot_next[DEPTH][SPL];
    {
        int now[DEPTH][SPL];  // all slot loads first: one round trip before the rows, not DEPTH
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) load_slots(rt_row, start + d * STEP, end, j, lane, now[d]);
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) load_slots(rt_row, start + (d + DEPTH) * STEP, end, j, lane, slot_next[d]);
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) load_step(lab, stride_ls, now[d], start + d * STEP, end, j, m, ring[d]);
    }

    for (int t0 = start; t0 < end; t0 += DEPTH * STEP) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int t = t0 + d * STEP;
            if (t >= end) break;  // block-uniform
#pragma unroll
            for (int u = 0; u < LT; ++u) {
                const int pos0 = t + (u * WPU + j) * 16 + m;
                const unsigned (&cur)[2][RW] = ring[d][u];
                float dd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int kc = 0; kc < KC; ++kc) {
                    const uint2 am = piece(cur[0], kc), am8 = piece(cur[1], kc);
                    mma(dd, am, am8, bhi[kc][0], bhi[kc][1]);
                    mma(dd, am, am8, blo[kc][0], blo[kc][1]);
                }
                emit_tile(dd, pos0, end, seq_len, num_sink, num_recent, c, h0, srow, stride_sr, sh);
            }
            // This entry's rows are consumed: refill it with step t + DEPTH * STEP.
            load_step(lab, stride_ls, slot_next[d], t + DEPTH * STEP, end, j, m, ring[d]);
            load_slots(rt_row, t + 2 * DEPTH * STEP, end, j, lane, slot_next[d]);
        }
    }
    score_end(sh, hist, b, stride_hb, stride_hr);
}
