// Shared by the CUDA label scores (score.cu: CUDA cores, score_tc.cu: tensor cores): their
// parameters, types by dtype, conversions, a block's slice of positions, and the store of one
// score with its key's high byte into the block's histogram. nvrtc.py inlines it; both sources define THREADS, ROWS and the compile-time values
// they document before the include.
#pragma once

#define FP16_MAX 65504.0f

// The block's histogram of the keys' high bytes in shared memory ([ROWS, 256]; none without
// DO_HIST), declared at the top of each kernel.
#if DO_HIST
#define HIST_SMEM __shared__ int sh[ROWS * 256]
#else
#define HIST_SMEM int* sh = nullptr
#endif

// Both kernels' parameters (score.py passes the same arguments to either).
#define SCORE_PARAMS \
    const q_t* __restrict__ q, const label_t* __restrict__ labels, const ch_t* __restrict__ channels, \
    const float* __restrict__ label_scale, const int* __restrict__ req_to_token, \
    const void* __restrict__ req_idx, int req_idx_64, const int* __restrict__ seq_lens, \
    unsigned short* __restrict__ scores, int* __restrict__ hist, double sm_scale, \
    const int* __restrict__ heavy_ks, int num_sink, int num_recent, \
    int stride_qb, int stride_qh, int stride_ls, int stride_lh, int stride_ch, int stride_rt, \
    int stride_sb, int stride_sr, int stride_hb, int stride_hr, int P

// Both kernels' first lines: the block histogram sh (HIST_SMEM), request b, thread tid, and this
// block's slice [start, end) of b's row in whole steps of STEP_ tokens; a block with no positions
// (a dense request: seq_len <= its budget heavy_ks[b], or past the row's end) returns.
#define SCORE_BLOCK_START(STEP_) \
    HIST_SMEM; \
    const int b = blockIdx.x, tid = threadIdx.x; \
    const int seq_len = seq_lens[b]; \
    int start, end; \
    block_slice(seq_len, heavy_ks[b], P, STEP_, start, end); \
    if (start >= end) return

#if LABEL == 2
typedef unsigned char label_t;
#else
typedef unsigned short label_t;
#endif
#if QTYPE == 2
typedef float q_t;
#else
typedef unsigned short q_t;
#endif
#if CH64
typedef long long ch_t;
#else
typedef int ch_t;
#endif

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float q_to_f32(q_t x) {
#if QTYPE == 0
    return __uint_as_float((unsigned)x << 16);
#elif QTYPE == 1
    return f16_to_f32(x);
#else
    return x;
#endif
}

// Order-preserving map of fp16 bits to [0, 65535] (select.cu's key16).
__device__ __forceinline__ unsigned key16(unsigned bits) {
    return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}

// One fp16 score (its key's high byte into the block histogram).
__device__ __forceinline__ void emit(float v, bool keep, unsigned short* dst, int* bin_row) {
    const unsigned short s16 = f32_to_f16(keep ? FP16_MAX : fminf(fmaxf(v, -FP16_MAX), FP16_MAX));
    *dst = s16;
#if DO_HIST
    atomicAdd(&bin_row[key16(s16) >> 8], 1);
#endif
}

// Whether position pos is a sink or recent position (always selected: score FP16_MAX).
__device__ __forceinline__ bool kept(int pos, int seq_len, int num_sink, int num_recent) {
    return pos < num_sink || pos >= seq_len - num_recent;
}

// The block's histogram (sh: [ROWS, 256]) added to hist[0] of request b.
__device__ __forceinline__ void flush_hist(const int* sh, int* hist, int b, int stride_hb, int stride_hr) {
    __syncthreads();
    int* h0 = hist + (long long)b * stride_hb;
    for (int i = threadIdx.x; i < ROWS * 256; i += THREADS)
        if (sh[i]) atomicAdd(h0 + (long long)(i >> 8) * stride_hr + (i & 255), sh[i]);
}

// The end of both score kernels: with DO_HIST, the block's histogram flushed.
__device__ __forceinline__ void score_end(const int* sh, int* hist, int b, int stride_hb, int stride_hr) {
#if DO_HIST
    flush_hist(sh, hist, b, stride_hb, stride_hr);
#endif
}

// This block's positions [start, end) of request b's row: one of P slices of whole steps, empty
// for a request that decodes densely (its length not above its own budget heavy_k).
__device__ __forceinline__ void block_slice(int seq_len, int heavy_k, int P, int step, int& start, int& end) {
    const int n = seq_len > heavy_k ? seq_len : 0;  // sparse rows only (ds_common._sparse_len)
    const int per = ((n + P - 1) / P + step - 1) / step * step;
    start = blockIdx.y * per;
    end = min(start + per, n);
}

// Request b's row of req_to_token (req_idx is int32 or int64).
__device__ __forceinline__ const int* request_row(const int* req_to_token, const void* req_idx, int req_idx_64,
                                                  int b, int stride_rt) {
    const long long req = req_idx_64 ? ((const long long*)req_idx)[b] : ((const int*)req_idx)[b];
    return req_to_token + req * stride_rt;
}

// Clears the block's histogram (callers sync before its first use).
__device__ __forceinline__ void zero_hist(int* sh) {
#if DO_HIST
    for (int i = threadIdx.x; i < ROWS * 256; i += THREADS) sh[i] = 0;
#endif
}
