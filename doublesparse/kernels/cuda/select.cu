// Double Sparsity stage 2 in CUDA C++: the exact top-k of the fp16 score rows, as a radix select
// over 16-bit keys, with the workspace protocol and the output of ds_topk.py's three phases (see
// that file): the same buffers, and per row the same selection in the same order (the positions
// above the threshold in increasing order, then the first tied positions in increasing order).
//
// Why a second implementation: the select's phases are bound by instruction issue, not bytes
// (results/attention-h200-notes.md). Triton 3.6 has no shared-memory atomics, so its histogram
// lowers to ballots and popcounts (about 59 instructions per 32 keys at 256 bins), and its
// compaction to block-wide scans; here a histogram costs one shared-memory atomic per key and a
// compaction one popcount per 8 keys plus a warp scan.
//
// Compiled at run time by NVRTC (kernels/cuda/select.py). Every kernel runs on the grid
// (B, rows, P): P programs (thread blocks) per score row, each owning one slice of the row, cut
// in CHUNK-key steps. Integer arguments are 32-bit (the launcher checks they fit).

#define THREADS 256
#define NWARPS (THREADS / 32)
#define VEC 8                    // keys per thread per step: one 16-byte load
#define CHUNK (THREADS * VEC)    // keys per block per step
#define MAX_PROGS 16             // workspace.SELECT_MAX_PROGS
#define FULL 0xffffffffu

// Order-preserving map of fp16 bits to [0, 65535] (ds_select._key16).
__device__ __forceinline__ unsigned key16(unsigned bits) {
    return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}

// Positions a request contributes to selection (ds_select._sparse_len).
__device__ __forceinline__ int sparse_len(int seq_len, int k, int threshold) {
    return (seq_len > k && seq_len >= threshold) ? seq_len : 0;
}

// Program p's slice [start, end) of n positions, in whole chunks (the same in every phase that
// shares P, so that phase 3 can sum the histograms of the programs before it).
__device__ __forceinline__ void split_range(int n, int p, int P, int* start, int* end) {
    int per = ((n + P - 1) / P + CHUNK - 1) / CHUNK * CHUNK;
    *start = p * per;
    *end = min(*start + per, n);
}

// The 16 bytes (8 fp16 scores) at pos; rows are padded, so whole chunks are always readable.
// Loops load the next chunk's scores one step ahead (the first before their prologue), so that
// each load's latency overlaps the work on the chunk before it.
__device__ __forceinline__ uint4 load_raw(const unsigned short* srow, int pos) {
    return *reinterpret_cast<const uint4*>(srow + pos);
}

__device__ __forceinline__ void to_keys(uint4 v, unsigned key[VEC]) {
    unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < VEC; ++j) key[j] = key16((w[j >> 1] >> ((j & 1) * 16)) & 0xFFFFu);
}

// Program-uniform: the scores of the chunk at t for this thread, or zeros past the slice.
__device__ __forceinline__ uint4 load_ahead(const unsigned short* srow, int t, int end) {
    return t < end ? load_raw(srow, t + threadIdx.x * VEC) : make_uint4(0, 0, 0, 0);
}

// This thread's keys of the chunk at t, whose scores were loaded a step ahead into `ahead`; starts
// the load of the next chunk's.
__device__ __forceinline__ void next_keys(const unsigned short* srow, uint4& ahead, int t, int end,
                                          unsigned key[VEC]) {
    to_keys(ahead, key);
    ahead = load_ahead(srow, t + CHUNK, end);
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// Called by one whole warp. h: 256 counts (shared memory). Returns the largest digit d with
// sum(h[d:]) >= need (-1 if none) and, in *above, sum(h[d+1:]) (ds_select._threshold_digit).
__device__ __forceinline__ int threshold_digit(const int* h, int need, int* above) {
    int lane = threadIdx.x & 31;
    int c[8], s = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { c[j] = h[lane * 8 + j]; s += c[j]; }
    int suf = s;  // bins lane*8 .. 255
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_down_sync(FULL, suf, o);
        if (lane + o < 32) suf += v;
    }
    int best = -1, best_above = 0, ge = suf;
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // ge = sum(h[lane*8 + j:]), falling with j
        if (ge >= need) { best = lane * 8 + j; best_above = ge - c[j]; }
        ge -= c[j];
    }
    unsigned m = __ballot_sync(FULL, best >= 0);
    int total = __shfl_sync(FULL, suf, 0);
    if (!m) { *above = total; return -1; }
    int src = 31 - __clz(m);
    *above = __shfl_sync(FULL, best_above, src);
    return __shfl_sync(FULL, best, src);
}

// Phase 1: histogram of the keys' high byte, added to hist[0] of the row (kept zero between
// calls: phase 3 clears it).
extern "C" __global__ void __launch_bounds__(THREADS) ds_select_hist_high(
    const unsigned short* __restrict__ scores, int* __restrict__ hist, const int* __restrict__ seq_lens,
    int heavy_k, int threshold, int stride_sb, int stride_sr, int stride_hb, int stride_hr, int P)
{
    __shared__ int sh[256];
    const int b = blockIdx.x, row = blockIdx.y, p = blockIdx.z;
    int start, end;
    split_range(sparse_len(seq_lens[b], heavy_k, threshold), p, P, &start, &end);
    if (start >= end) return;
    const unsigned short* srow = scores + (long long)b * stride_sb + (long long)row * stride_sr;
    uint4 ahead = load_ahead(srow, start, end);
    for (int i = threadIdx.x; i < 256; i += THREADS) sh[i] = 0;
    __syncthreads();
    for (int t = start; t < end; t += CHUNK) {
        const int pos = t + threadIdx.x * VEC;
        unsigned key[VEC];
        next_keys(srow, ahead, t, end, key);
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            if (pos + j < end) atomicAdd(&sh[key[j] >> 8], 1);
    }
    __syncthreads();
    int* h0 = hist + (long long)b * stride_hb + (long long)row * stride_hr;
    for (int i = threadIdx.x; i < 256; i += THREADS)
        if (sh[i]) atomicAdd(h0 + i, sh[i]);
}

// Phase 2 body, one program's slice [start, end) of its row: the row's high digit d0 and the
// rank left inside it (every program finds them from h0 = the row's hist[0]; returned in *d0,
// *need0, and stored in info where given), the low-byte histogram of the slice's keys whose high
// byte is d0 -> h1, and the count of its keys above d0 -> *cnt. Writes both also for an empty
// slice, because phase 3 sums them over all the row's programs.
__device__ __forceinline__ void low_pass(const unsigned short* srow, int start, int end, const int* h0,
                                         int* h1, int* cnt, int* info, int heavy_k, int* d0, int* need0)
{
    __shared__ int sh[256];
    __shared__ int s_digit, s_need, s_count;
    uint4 ahead = load_ahead(srow, start, end);
    for (int i = threadIdx.x; i < 256; i += THREADS) sh[i] = h0[i];
    __syncthreads();
    if (threadIdx.x < 32) {
        int above;
        int d = threshold_digit(sh, heavy_k, &above);
        if (threadIdx.x == 0) {
            s_digit = d;
            s_need = heavy_k - above;
            s_count = 0;
        }
    }
    __syncthreads();
    *d0 = s_digit;
    *need0 = s_need;
    for (int i = threadIdx.x; i < 256; i += THREADS) sh[i] = 0;
    __syncthreads();
    int above = 0;
    for (int t = start; t < end; t += CHUNK) {
        const int pos = t + threadIdx.x * VEC;
        unsigned key[VEC];
        next_keys(srow, ahead, t, end, key);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (pos + j >= end) continue;
            const int hi = (int)(key[j] >> 8);
            above += hi > *d0;
            if (hi == *d0) atomicAdd(&sh[key[j] & 255], 1);
        }
    }
    above = warp_sum(above);
    if ((threadIdx.x & 31) == 0) atomicAdd(&s_count, above);
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += THREADS) h1[i] = sh[i];
    if (threadIdx.x == 0) {
        *cnt = s_count;
        if (info) {
            info[0] = *d0;
            info[1] = *need0;
        }
    }
}

// Phase 3 body, program p of P on its row: the exact 16-bit threshold from the programs'
// low-byte histograms (hist1: program q's at hist1 + q * stride_hp); writes the slice's positions
// above it, then as many keys equal to it as the rank allows, with their cache slots, at offsets
// summed from the programs before it. Program 0 clears h0. The histograms and counts are read
// through L2 (__ldcg): in the fused launch other programs wrote them during this kernel.
__device__ __forceinline__ void compact_pass(const unsigned short* srow, int start, int end, int* h0,
                                             const int* hist1, long long stride_hp, const int* cnt_row,
                                             int p, int P, int d0, int need0, int heavy_k,
                                             const int* rt_row, int* out, int* out_slot)
{
    __shared__ int s_total[256], s_before[256];
    __shared__ int s_warp[2][NWARPS];  // per step, alternating: one barrier per step
    __shared__ int s_thr, s_ngt, s_base, s_base_e;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint4 ahead = load_ahead(srow, start, end);
    // Keys above d0 in each program before this one (warp 0 sums them below).
    int gt = (warp == 0 && lane < p) ? __ldcg(cnt_row + lane) : 0;
    if (p == 0)  // h0 has had its last reader (phase 2): leave it zeroed for the next call
        for (int i = tid; i < 256; i += THREADS) h0[i] = 0;
    // Per low-byte bin: its count over all programs, and over the programs before this one (all
    // the loads issued at once: their latency is paid once).
    for (int i = tid; i < 256; i += THREADS) {
        int c[MAX_PROGS];
#pragma unroll
        for (int q = 0; q < MAX_PROGS; ++q) c[q] = q < P ? __ldcg(hist1 + q * stride_hp + i) : 0;
        int total = 0, before = 0;
#pragma unroll
        for (int q = 0; q < MAX_PROGS; ++q) {
            total += c[q];
            before += q < p ? c[q] : 0;
        }
        s_total[i] = total;
        s_before[i] = before;
    }
    __syncthreads();
    if (warp == 0) {
        int above1;
        const int d1 = threshold_digit(s_total, need0, &above1);
        // Offsets: the programs before this one hold, above the threshold, their keys above d0
        // (counts) and their keys of bucket d0 above d1; equal to it, their bucket-d0 keys at d1.
#pragma unroll
        for (int j = 0; j < 8; ++j) gt += (lane * 8 + j > d1) ? s_before[lane * 8 + j] : 0;
        gt = warp_sum(gt);
        if (lane == 0) {
            s_thr = d0 * 256 + d1;
            s_ngt = heavy_k - need0 + above1;
            s_base = gt;
            s_base_e = d1 >= 0 ? s_before[d1] : 0;
        }
    }
    __syncthreads();
    const unsigned thr = (unsigned)s_thr;
    const int n_gt = s_ngt, ties = heavy_k - n_gt;
    int base = s_base, base_e = s_base_e;
    int step = 0;
    for (int t = start; t < end; t += CHUNK, step ^= 1) {
        const int pos = t + tid * VEC;
        unsigned key[VEC];
        next_keys(srow, ahead, t, end, key);
        unsigned gtm = 0, eqm = 0;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const bool ok = pos + j < end;
            gtm |= (unsigned)(ok && key[j] > thr) << j;
            eqm |= (unsigned)(ok && key[j] == thr) << j;
        }
        // The candidates' cache slots, loaded now so that their latency overlaps the ranking.
        int slot[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) slot[j] = ((gtm | eqm) >> j) & 1 ? rt_row[pos + j] : 0;
        // Ranks in position order: "equal" counts ride in the high half (a chunk holds < 2^16).
        const int mine = __popc(gtm) | (__popc(eqm) << 16);
        int inc = mine;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(FULL, inc, o);
            if (lane >= o) inc += v;
        }
        if (lane == 31) s_warp[step][warp] = inc;
        __syncthreads();
        int before = 0, chunk = 0;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const int v = s_warp[step][w];
            before += w < warp ? v : 0;
            chunk += v;
        }
        const int excl = before + inc - mine;
        int ig = base + (excl & 0xFFFF), ie = base_e + (excl >> 16);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            // The bounds never bind when the histograms are consistent; they keep a corrupted
            // workspace from writing outside its row.
            int dst = -1;
            if ((gtm >> j) & 1) { if (ig < n_gt) dst = ig; ++ig; }
            if ((eqm >> j) & 1) { if (ie >= 0 && ie < ties) dst = n_gt + ie; ++ie; }
            if (dst >= 0) {
                out[dst] = pos + j;
                out_slot[dst] = slot[j];
            }
        }
        base += chunk & 0xFFFF;
        base_e += chunk >> 16;
    }
}

__device__ __forceinline__ const int* request_tokens(const int* req_to_token, const void* req_idx, int req_idx_64,
                                                     int b, int stride_rt)
{
    const long long r = req_idx_64 ? ((const long long*)req_idx)[b] : (long long)((const int*)req_idx)[b];
    return req_to_token + r * stride_rt;
}

// Phase 2 alone (grid (B, rows, P)): rowinfo, hist[1 + p] and counts[p] of each row.
extern "C" __global__ void __launch_bounds__(THREADS) ds_select_hist_low(
    const unsigned short* __restrict__ scores, int* __restrict__ hist, int* __restrict__ rowinfo,
    int* __restrict__ counts, const int* __restrict__ seq_lens, int heavy_k, int threshold,
    int stride_sb, int stride_sr, int stride_hp, int stride_hb, int stride_hr,
    int stride_rib, int stride_rir, int stride_cb, int stride_cr, int P)
{
    const int b = blockIdx.x, row = blockIdx.y, p = blockIdx.z;
    int start, end, d0, need0;
    split_range(sparse_len(seq_lens[b], heavy_k, threshold), p, P, &start, &end);
    const long long hrow = (long long)b * stride_hb + (long long)row * stride_hr;
    low_pass(scores + (long long)b * stride_sb + (long long)row * stride_sr, start, end, hist + hrow,
             hist + (long long)(1 + p) * stride_hp + hrow, counts + (long long)b * stride_cb + (long long)row * stride_cr + p,
             p == 0 ? rowinfo + (long long)b * stride_rib + (long long)row * stride_rir : nullptr, heavy_k, &d0, &need0);
}

// Phase 3 alone (grid (B, rows, P), P as phase 2's): sel / sel_slot of each row, hist[0] cleared.
extern "C" __global__ void __launch_bounds__(THREADS) ds_select_compact(
    const unsigned short* __restrict__ scores, int* __restrict__ hist, const int* __restrict__ rowinfo,
    const int* __restrict__ counts, const int* __restrict__ seq_lens, int* __restrict__ sel,
    int* __restrict__ sel_slot, const int* __restrict__ req_to_token, const void* __restrict__ req_idx,
    int req_idx_64, int heavy_k, int threshold,
    int stride_sb, int stride_sr, int stride_hp, int stride_hb, int stride_hr, int stride_rib,
    int stride_rir, int stride_cb, int stride_cr, int stride_selb, int stride_selr, int stride_rt, int P)
{
    const int b = blockIdx.x, row = blockIdx.y, p = blockIdx.z;
    int start, end;
    split_range(sparse_len(seq_lens[b], heavy_k, threshold), p, P, &start, &end);
    const long long hrow = (long long)b * stride_hb + (long long)row * stride_hr;
    const int* info = rowinfo + (long long)b * stride_rib + (long long)row * stride_rir;
    const long long so = (long long)b * stride_selb + (long long)row * stride_selr;
    compact_pass(scores + (long long)b * stride_sb + (long long)row * stride_sr, start, end, hist + hrow,
                 hist + stride_hp + hrow, stride_hp, counts + (long long)b * stride_cb + (long long)row * stride_cr,
                 p, P, info[0], info[1], heavy_k, request_tokens(req_to_token, req_idx, req_idx_64, b, stride_rt),
                 sel + so, sel_slot + so);
}

__device__ __forceinline__ int load_acquire(const int* ptr) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

// Phases 2 and 3 in one launch (grid (B * rows * P)): the row's programs meet at a barrier in
// between. Programs take their (request, row, slice) from a ticket in the order they start, so a
// row's programs hold consecutive tickets: every row whose programs have all started passes its
// barrier, and only the row being started waits on programs not yet running (at most P - 1), so
// the launch cannot deadlock while the GPU holds P blocks. sync: [B, rows, 2] int32, zero between
// calls: per row a barrier count (to P on arrival, to 2P on leaving; the last leaver clears it);
// sync[0, 0, 1] the ticket (the last ticket taken clears it).
extern "C" __global__ void __launch_bounds__(THREADS) ds_select_fused(
    const unsigned short* __restrict__ scores, int* __restrict__ hist, int* __restrict__ rowinfo,
    int* __restrict__ counts, const int* __restrict__ seq_lens, int* __restrict__ sel,
    int* __restrict__ sel_slot, const int* __restrict__ req_to_token, const void* __restrict__ req_idx,
    int* __restrict__ sync, int req_idx_64, int heavy_k, int threshold,
    int stride_sb, int stride_sr, int stride_hp, int stride_hb, int stride_hr, int stride_rib,
    int stride_rir, int stride_cb, int stride_cr, int stride_selb, int stride_selr, int stride_rt,
    int stride_yb, int stride_yr, int rows, int P)
{
    __shared__ int s_ticket;
    if (threadIdx.x == 0) {
        const int t = atomicAdd(sync + 1, 1);
        if (t == (int)gridDim.x - 1) atomicExch(sync + 1, 0);  // every other ticket is taken
        s_ticket = t;
    }
    __syncthreads();
    const int p = s_ticket % P, b = s_ticket / P / rows, row = s_ticket / P % rows;
    const int n = sparse_len(seq_lens[b], heavy_k, threshold);
    if (n == 0) return;  // so do all of the row's programs: none waits at its barrier
    int start, end, d0, need0;
    split_range(n, p, P, &start, &end);
    const long long hrow = (long long)b * stride_hb + (long long)row * stride_hr;
    const unsigned short* srow = scores + (long long)b * stride_sb + (long long)row * stride_sr;
    const int* cnt_row = counts + (long long)b * stride_cb + (long long)row * stride_cr;
    low_pass(srow, start, end, hist + hrow, hist + (long long)(1 + p) * stride_hp + hrow, (int*)cnt_row + p,
             p == 0 ? rowinfo + (long long)b * stride_rib + (long long)row * stride_rir : nullptr, heavy_k, &d0, &need0);
    int* bar = sync + (long long)b * stride_yb + (long long)row * stride_yr;
    __threadfence();  // this thread's histogram and count stores, before the arrival below
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(bar, 1);
        // Bounded: a corrupted count traps (an error) instead of hanging the GPU.
        for (unsigned spin = 0; load_acquire(bar) < P; ++spin) {
            if (spin > (1u << 24)) __trap();
            __nanosleep(64);
        }
    }
    __syncthreads();
    const long long so = (long long)b * stride_selb + (long long)row * stride_selr;
    compact_pass(srow, start, end, hist + hrow, hist + stride_hp + hrow, stride_hp, cnt_row, p, P, d0, need0,
                 heavy_k, request_tokens(req_to_token, req_idx, req_idx_64, b, stride_rt), sel + so, sel_slot + so);
    if (threadIdx.x == 0 && atomicAdd(bar, 1) == 2 * P - 1) atomicExch(bar, 0);
}
