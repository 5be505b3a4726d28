// Double Sparsity stage 3 in CUDA C++: split-K decode attention over each row's selected tokens
// (their cache slots, from the select), or over positions 0..seq_len-1 for the requests that
// decode densely in the same batch; the partials go to the workspace for the merge kernel
// (triton/decode_attn.py's merge_kernel), as the Triton kernel's do.
//
// Why a second implementation: the Triton kernel's gathered K/V tiles arrive behind a chain of
// dependent loads (slot, then rows) with one tile in flight per program; at 3 x 64K it reads its
// 50 MB at about 0.6 of the copy bandwidth (results/attention-h200-notes.md). Here each lane
// copies 16 bytes (8 channels) of a K row and of a V row for NT tokens per step into shared
// memory by cp.async, NS - 1 steps ahead of the step it computes, with the slots loaded one step
// ahead of their copies; a lane reads back only what it copied, so no barrier is needed.
// (Loads straight into registers, one step at a time, were slower than the Triton kernel:
// results/h200-s17.)
//
// Layout: a K/V row (D channels) is LPR = D / 8 lanes; a warp covers TPI = 32 / LPR rows per
// load. Each (warp, row-in-instruction) keeps its own online softmax over its tokens; the block
// combines those states in shared memory at the end and writes one partial per query head.
// Scores are in log2 units (q scaled by sm_scale * log2 e), as the merge expects.
//
// Compiled at run time by NVRTC (attn.py) with:
//   D            head dim (8..256, a power of 2)
//   G            query heads per KV head
//   PER_HEAD     1 = a program is one query head (per-head selection), 0 = a KV head's group
//   KTYPE        0 = bf16, 1 = fp16 (q and the caches)
//   NT, NS       tokens per lane per step, steps in the shared-memory ring (NS - 1 in flight)
//   NWA, MINB    warps per block, blocks per SM the registers must allow
// Grid (B, rows, S): rows = Hq (PER_HEAD) or Hkv; S splits of each row's token list.

#define THREADS (NWA * 32)
#define LPR (D / 8)                 // lanes per K/V row
#define TPI (32 / LPR)              // rows per warp per load instruction
#define STEP (NWA * TPI * NT)       // tokens per block per step
#define GP (PER_HEAD ? 1 : G)       // query heads per program
#define STATES (NWA * TPI)          // online-softmax states per block
#define NEG (-1e30f)                // running max before any token (finite: no inf - inf)
#define RING (NS * NT * 2 * THREADS)  // 16-byte pieces in the ring: [step][token][K, V][thread]
#define COMBINE_BYTES (STATES * GP * (D + 2) * 4)
#define SMEM_BYTES (RING * 16 > COMBINE_BYTES ? RING * 16 : COMBINE_BYTES)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, zero-filled where !ok (src then only has to be a valid address).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ float lo_f(unsigned w) {
#if KTYPE == 0
    return __uint_as_float(w << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w & 0xFFFFu)));
    return f;
#endif
}

__device__ __forceinline__ float hi_f(unsigned w) {
#if KTYPE == 0
    return __uint_as_float(w & 0xFFFF0000u);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w >> 16)));
    return f;
#endif
}

__device__ __forceinline__ void unpack8(uint4 v, float (&x)[8]) {
    x[0] = lo_f(v.x); x[1] = hi_f(v.x); x[2] = lo_f(v.y); x[3] = hi_f(v.y);
    x[4] = lo_f(v.z); x[5] = hi_f(v.z); x[6] = lo_f(v.w); x[7] = hi_f(v.w);
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB) ds_attn(
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ req_to_token,
    const void* __restrict__ req_idx, int req_idx_64, const int* __restrict__ seq_lens,
    const int* __restrict__ sel, float* __restrict__ part_o, float* __restrict__ part_lse,
    double qk_scale_d, int heavy_k, int threshold, int has_sel,  // Python floats arrive as doubles
    int stride_qb, int stride_qh, int stride_ks, int stride_kh, int stride_vs, int stride_vh,
    int stride_rt, int stride_selb, int stride_selr,
    int stride_pob, int stride_poh, int stride_pos, int stride_plb, int stride_plh, int S)
{
    __shared__ __align__(16) unsigned char smem[SMEM_BYTES];
    uint4* ring = reinterpret_cast<uint4*>(smem);

    const int b = blockIdx.x, row = blockIdx.y, split = blockIdx.z, tid = threadIdx.x;
    const int seq_len = seq_lens[b];
    const bool sparse = has_sel && seq_len > heavy_k && seq_len >= threshold;
    const int n = sparse ? heavy_k : seq_len;
    // Static split count, dynamic split length (the grid never depends on seq_lens).
    const int per = ((n + S - 1) / S + 15) / 16 * 16;
    const int start = split * per, end = min(start + per, n);
    const int kvh = PER_HEAD ? row / G : row, head0 = PER_HEAD ? row : row * G;
    const int warp = tid >> 5, lane = tid & 31, sub = lane / LPR, cl = lane % LPR;

    const float qk_scale = (float)qk_scale_d;
    float qf[GP][8];
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        const uint4 w = *reinterpret_cast<const uint4*>(q + (long long)b * stride_qb + (long long)(head0 + g) * stride_qh + 8 * cl);
        unpack8(w, qf[g]);
#pragma unroll
        for (int c = 0; c < 8; ++c) qf[g][c] *= qk_scale;
    }
    const long long req = req_idx_64 ? ((const long long*)req_idx)[b] : ((const int*)req_idx)[b];
    const int* src = sparse ? sel + (long long)b * stride_selb + (long long)row * stride_selr
                            : req_to_token + req * stride_rt;
    const unsigned short* kb = k_cache + (long long)kvh * stride_kh + 8 * cl;
    const unsigned short* vb = v_cache + (long long)kvh * stride_vh + 8 * cl;

    float m[GP], l[GP], acc[GP][8];
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        m[g] = NEG;
        l[g] = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[g][c] = 0.0f;
    }
    // Token u of step i: start + i * STEP + (u * NWA + warp) * TPI + sub. Slots one step ahead of
    // their copies, copies NS - 1 steps ahead of their use.
    const int nsteps = start < end ? (end - start + STEP - 1) / STEP : 0;
    int slot[NT];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
        const int pos = start + (u * NWA + warp) * TPI + sub;
        slot[u] = pos < end ? src[pos] : 0;
    }
    auto issue = [&](int i) {  // copies of step i (slots in slot[]), then the slots of step i + 1
        uint4* st = ring + (i % NS) * NT * 2 * THREADS;
#pragma unroll
        for (int u = 0; u < NT; ++u) {
            const int pos = start + i * STEP + (u * NWA + warp) * TPI + sub;
            const bool ok = pos < end;
            copy16(st + (2 * u) * THREADS + tid, kb + (long long)slot[u] * stride_ks, ok);
            copy16(st + (2 * u + 1) * THREADS + tid, vb + (long long)slot[u] * stride_vs, ok);
            slot[u] = pos + STEP < end ? src[pos + STEP] : 0;
        }
    };
#pragma unroll
    for (int i = 0; i < NS - 1; ++i) {
        if (i < nsteps) issue(i);
        asm volatile("cp.async.commit_group;");
    }
    for (int i = 0; i < nsteps; ++i) {
        if (i + NS - 1 < nsteps) issue(i + NS - 1);
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group %0;" :: "n"(NS - 1));
        const uint4* st = ring + (i % NS) * NT * 2 * THREADS;
        const int t = start + i * STEP;
        float s[NT][GP];
#pragma unroll
        for (int u = 0; u < NT; ++u) {
            float x[8];
            unpack8(st[(2 * u) * THREADS + tid], x);
#pragma unroll
            for (int g = 0; g < GP; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int c = 0; c < 8; ++c) d = fmaf(qf[g][c], x[c], d);
#pragma unroll
                for (int off = LPR / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
                const int pos = t + (u * NWA + warp) * TPI + sub;
                s[u][g] = pos < end ? d : __int_as_float(0xff800000);  // -inf: weight 0
            }
        }
#pragma unroll
        for (int g = 0; g < GP; ++g) {
            float mx = s[0][g];
#pragma unroll
            for (int u = 1; u < NT; ++u) mx = fmaxf(mx, s[u][g]);
            const float m_new = fmaxf(m[g], mx), alpha = exp2f(m[g] - m_new);
            l[g] *= alpha;
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[g][c] *= alpha;
            m[g] = m_new;
        }
#pragma unroll
        for (int u = 0; u < NT; ++u) {
            float x[8];
            unpack8(st[(2 * u + 1) * THREADS + tid], x);
#pragma unroll
            for (int g = 0; g < GP; ++g) {
                const float p = exp2f(s[u][g] - m[g]);
                l[g] += p;
#pragma unroll
                for (int c = 0; c < 8; ++c) acc[g][c] = fmaf(p, x[c], acc[g][c]);
            }
        }
    }
    asm volatile("cp.async.wait_all;");
    __syncthreads();  // the ring's memory is the combine's below

    // Combine the block's STATES softmax states per query head.
    float (*sm_acc)[GP][D] = reinterpret_cast<float (*)[GP][D]>(smem);
    float (*sm_m)[GP] = reinterpret_cast<float (*)[GP]>(smem + STATES * GP * D * 4);
    float (*sm_l)[GP] = reinterpret_cast<float (*)[GP]>(smem + STATES * GP * (D + 1) * 4);
    const int id = warp * TPI + sub;
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        if (cl == 0) {
            sm_m[id][g] = m[g];
            sm_l[id][g] = l[g];
        }
        *reinterpret_cast<float4*>(&sm_acc[id][g][8 * cl]) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        *reinterpret_cast<float4*>(&sm_acc[id][g][8 * cl + 4]) = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
    __syncthreads();
    for (int i = tid; i < GP * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float M = NEG;
#pragma unroll
        for (int j = 0; j < STATES; ++j) M = fmaxf(M, sm_m[j][g]);
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int j = 0; j < STATES; ++j) {
            const float w = exp2f(sm_m[j][g] - M);
            L = fmaf(sm_l[j][g], w, L);
            O = fmaf(sm_acc[j][g][d], w, O);
        }
        const long long h = head0 + g;
        part_o[(long long)b * stride_pob + h * stride_poh + (long long)split * stride_pos + d] = L > 0.0f ? O / L : 0.0f;
        if (d == 0)
            part_lse[(long long)b * stride_plb + h * stride_plh + split] =
                L > 0.0f ? M + log2f(L) : __int_as_float(0xff800000);
    }
}
