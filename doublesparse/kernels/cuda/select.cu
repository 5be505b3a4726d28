// Double Sparsity stage 2 in CUDA C++: the exact top-k of the fp16 score rows, as a radix select
// over 16-bit keys, with the workspace protocol and the output of ds_select.py's three phases (see
// that file): the same buffers, and per row the same selection in the same order (the positions
// above the threshold in increasing order, then the first tied positions in increasing order).
//
// Why a second implementation: the select's phases are bound by instruction issue, not bytes
// (git show 2fcf640:results/attention-h200-notes.md). Triton 3.6 has no shared-memory atomics, so its histogram
// lowers to ballots and popcounts (about 59 instructions per 32 keys at 256 bins), and its
// compaction to block-wide scans; here a histogram costs one shared-memory atomic per key and a
// compaction one popcount per 8 keys plus a warp scan.
//
// Compiled at run time by NVRTC (kernels/cuda/select.py). Every kernel runs on the grid
// (B, rows, P): P programs (thread blocks) per score row, each owning one slice of the row, cut
// in CHUNK-key steps. Integer arguments are 32-bit (the launcher checks they fit). Each request's
// budget k comes from heavy_ks[b] ([B] int32, on the device); the rank a row selects is
// min(k, max_k), max_k being the host's bound (at most sel's row length: it binds only for a
// budget the host promised never to pass, and keeps the writes inside the row).

#define THREADS 256
#define NWARPS (THREADS / 32)
#define VEC 8                    // keys per thread per step: one 16-byte load
#define CHUNK (THREADS * VEC)    // keys per block per step
#define MAX_PROGS 16             // workspace.SELECT_MAX_PROGS
#define FULL 0xffffffffu

// Order-preserving map of fp16 bits to [0, 65535] (ds_common._key16).
__device__ __forceinline__ unsigned key16(unsigned bits) {
    return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}

// Positions a request contributes to selection (ds_common._sparse_len): all of them iff its
// length exceeds its own budget k (heavy_ks[b]), else none.
__device__ __forceinline__ int sparse_len(int seq_len, int k) {
    return seq_len > k ? seq_len : 0;
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
// sum(h[d:]) >= need (-1 if none) and, in *above, sum(h[d+1:]) (ds_common._threshold_digit).
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
    const int* __restrict__ heavy_ks, int stride_sb, int stride_sr, int stride_hb, int stride_hr, int P)
{
    __shared__ int sh[256];
    const int b = blockIdx.x, row = blockIdx.y, p = blockIdx.z;
    int start, end;
    split_range(sparse_len(seq_lens[b], heavy_ks[b]), p, P, &start, &end);
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

// Phase 2: the high byte d0 of the k-th largest key (program 0 stores it, with the rank left
// inside it, in rowinfo); per program, the low-byte histogram of its keys whose high byte is d0
// -> hist[1 + p], and the count of its keys above d0 -> counts[p]. Every program writes both,
// also with an empty slice, because phase 3 sums them over all P programs.
extern "C" __global__ void __launch_bounds__(THREADS) ds_select_hist_low(
    const unsigned short* __restrict__ scores, int* __restrict__ hist, int* __restrict__ rowinfo,
    int* __restrict__ counts, const int* __restrict__ seq_lens, const int* __restrict__ heavy_ks, int max_k,
    int stride_sb, int stride_sr, int stride_hp, int stride_hb, int stride_hr,
    int stride_rib, int stride_rir, int stride_cb, int stride_cr, int P)
{
    __shared__ int sh[256];
    __shared__ int s_digit, s_count;
    const int b = blockIdx.x, row = blockIdx.y, p = blockIdx.z;
    const int k_row = heavy_ks[b];
    const int heavy_k = min(k_row, max_k);  // this row's rank
    int start, end;
    split_range(sparse_len(seq_lens[b], k_row), p, P, &start, &end);
    const unsigned short* srow = scores + (long long)b * stride_sb + (long long)row * stride_sr;
    uint4 ahead = load_ahead(srow, start, end);
    const long long hrow = (long long)b * stride_hb + (long long)row * stride_hr;
    for (int i = threadIdx.x; i < 256; i += THREADS) sh[i] = hist[hrow + i];
    __syncthreads();
    if (threadIdx.x < 32) {
        int above;
        int d = threshold_digit(sh, heavy_k, &above);
        if (threadIdx.x == 0) {
            s_digit = d;
            s_count = 0;
            if (p == 0) {
                int* info = rowinfo + (long long)b * stride_rib + (long long)row * stride_rir;
                info[0] = d;
                info[1] = heavy_k - above;
            }
        }
    }
    __syncthreads();
    const int d0 = s_digit;
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
            above += hi > d0;
            if (hi == d0) atomicAdd(&sh[key[j] & 255], 1);
        }
    }
    above = warp_sum(above);
    if ((threadIdx.x & 31) == 0) atomicAdd(&s_count, above);
    __syncthreads();
    int* h1 = hist + (long long)(1 + p) * stride_hp + hrow;
    for (int i = threadIdx.x; i < 256; i += THREADS) h1[i] = sh[i];
    if (threadIdx.x == 0) counts[(long long)b * stride_cb + (long long)row * stride_cr + p] = s_count;
}

// Phase 3: the exact 16-bit threshold from the programs' low-byte histograms; each program writes
// its slice's positions above it, then as many keys equal to it as the rank allows, with their
// cache slots, at offsets summed from the programs before it. Program 0 clears hist[0].
extern "C" __global__ void __launch_bounds__(THREADS) ds_select_compact(
    const unsigned short* __restrict__ scores, int* __restrict__ hist, const int* __restrict__ rowinfo,
    const int* __restrict__ counts, const int* __restrict__ seq_lens, int* __restrict__ sel,
    int* __restrict__ sel_slot, const int* __restrict__ req_to_token, const void* __restrict__ req_idx,
    const int* __restrict__ heavy_ks, int req_idx_64, int max_k,
    int stride_sb, int stride_sr, int stride_hp, int stride_hb, int stride_hr, int stride_rib,
    int stride_rir, int stride_cb, int stride_cr, int stride_selb, int stride_selr, int stride_rt, int P)
{
    __shared__ int s_total[256], s_before[256];
    __shared__ int s_warp[2][NWARPS];  // per step, alternating: one barrier per step
    __shared__ int s_thr, s_ngt, s_base, s_base_e;
    const int b = blockIdx.x, row = blockIdx.y, p = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int k_row = heavy_ks[b];
    const int heavy_k = min(k_row, max_k);  // this row's rank (as phase 2's)
    int start, end;
    split_range(sparse_len(seq_lens[b], k_row), p, P, &start, &end);
    const unsigned short* srow = scores + (long long)b * stride_sb + (long long)row * stride_sr;
    uint4 ahead = load_ahead(srow, start, end);
    const long long hrow = (long long)b * stride_hb + (long long)row * stride_hr;
    const int* info = rowinfo + (long long)b * stride_rib + (long long)row * stride_rir;
    const int d0 = info[0], need0 = info[1];
    // Keys above d0 in each program before this one (warp 0 sums them below).
    int gt = (warp == 0 && lane < p) ? counts[(long long)b * stride_cb + (long long)row * stride_cr + lane] : 0;
    if (p == 0)  // hist[0] has had its last reader (phase 2): leave it zeroed for the next call
        for (int i = tid; i < 256; i += THREADS) hist[hrow + i] = 0;
    // Per low-byte bin: its count over all programs, and over the programs before this one.
    for (int i = tid; i < 256; i += THREADS) {
        int total = 0, before = 0;
#pragma unroll 4
        for (int q = 0; q < P; ++q) {
            int c = hist[(long long)(1 + q) * stride_hp + hrow + i];
            total += c;
            before += q < p ? c : 0;
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
    const long long r = req_idx_64 ? ((const long long*)req_idx)[b] : (long long)((const int*)req_idx)[b];
    const int* rt_row = req_to_token + r * stride_rt;
    int* out = sel + (long long)b * stride_selb + (long long)row * stride_selr;
    int* out_slot = sel_slot + (long long)b * stride_selb + (long long)row * stride_selr;
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
