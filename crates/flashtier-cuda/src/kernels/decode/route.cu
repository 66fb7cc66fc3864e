// Part of the decode kernels (kernels/decode/, concatenated after
// common.cuh and gemv.cu in the order ops/mod.rs gives).

// ---------------------------------------------------------------------------
// Routing: one block of 256 threads per row, E <= 1024 experts, top_k <= 32.


// Block-wide max of (value, -index): ties go to the lower index.
static __device__ void block_argmax(float v, int idx, float* sv, int* si, float* out_v,
                                    int* out_i) {
    const int t = threadIdx.x;
    sv[t] = v;
    si[t] = idx;
    __syncthreads();
    for (int s = ROUTE_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            const float a = sv[t], b = sv[t + s];
            const int ia = si[t], ib = si[t + s];
            if (b > a || (b == a && ib < ia) || (a != a && b == b)) {
                sv[t] = b;
                si[t] = ib;
            }
        }
        __syncthreads();
    }
    *out_v = sv[0];
    *out_i = si[0];
    __syncthreads();
}

// The best of this thread's strided slice of s[0..n): (value, index).
static __device__ void thread_best(const float* s, int n, float* v, int* idx) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = threadIdx.x; e < n; e += ROUTE_THREADS) {
        const float x = s[e];
        if (x > bv || (x == bv && e < bi)) {
            bv = x;
            bi = e;
        }
    }
    *v = bv;
    *idx = bi;
}

// The block's best of s[0..n) (the lowest index on ties) into every thread.
static __device__ void block_best(const float* s, int n, float* sv, int* si, float* bv, int* bi) {
    float v;
    int i;
    thread_best(s, n, &v, &i);
    block_argmax(v, i, sv, si, bv, bi);
}

// Top-k of s (destroyed: chosen entries become -inf) into sel_i.
static __device__ void top_k_into(float* s, int n, int k, int* sel_i, float* sv, int* si) {
    for (int t = 0; t < k; ++t) {
        float bv;
        int bi;
        block_best(s, n, sv, si, &bv, &bi);
        if (threadIdx.x == 0) {
            sel_i[t] = bi < n ? bi : 0;
            if (bi < n) s[bi] = -INFINITY;
        }
        __syncthreads();
    }
}

// Write the chosen (id, weight) pairs sorted by id (thread 0).
static __device__ void write_sorted(int* sel_i, float* sel_w, int k, int* ids, float* weights) {
    for (int a = 1; a < k; ++a) {
        const int ki = sel_i[a];
        const float kw = sel_w[a];
        int b = a - 1;
        while (b >= 0 && sel_i[b] > ki) {
            sel_i[b + 1] = sel_i[b];
            sel_w[b + 1] = sel_w[b];
            --b;
        }
        sel_i[b + 1] = ki;
        sel_w[b + 1] = kw;
    }
    for (int a = 0; a < k; ++a) {
        ids[a] = sel_i[a];
        weights[a] = sel_w[a];
    }
}

// Value v at index i as one integer whose order is the choice's: the
// larger value first, then the lower index; every number above NaN, NaNs
// by index (a strict total order; -0 ranks as +0). One compare per pair,
// no branches: the rank count below is a straight loop.
static __device__ __forceinline__ u64 rank_key(float v, int i) {
    const u32 u = __float_as_uint(v == 0.f ? 0.f : v);
    const u32 k = v != v ? 0u : ((u & 0x80000000u) ? ~u : (u | 0x80000000u));
    return ((u64)k << 32) | (u64)(0xFFFFFFFFu - (u32)i);
}

// Softmax over the n logits at l (n <= MAX_EXPERTS), the top k (k <= n,
// k <= MAX_TOPK), renormalised to sum 1 when `norm`; the chosen (id,
// weight) pairs written sorted by id. One block of ROUTE_THREADS threads;
// CG: read the logits from L2 (another block of this grid wrote them).
// Warp 0 takes the max and the sum as one warp does (lanes own experts e
// = lane (mod 32), then a butterfly), so every rows' probabilities are the
// same bits in any launch. Each expert's rank (how many rank above it) is
// counted by its own thread over the experts' keys (rank_key), so the
// choice takes one pass over the probabilities instead of k; the
// renormalising sum adds the chosen in rank order.
template <bool CG>
static __device__ void route_softmax_row(const float* l, int n, int k, int norm, int* ids,
                                         float* weights) {
    __shared__ float p[MAX_EXPERTS];
    __shared__ u64 key[MAX_EXPERTS];
    __shared__ float sum_sh;
    __shared__ u32 chosen[MAX_EXPERTS / WARP];
    __shared__ float by_rank[MAX_TOPK];
    const int t = threadIdx.x, lane = t & (WARP - 1);
    // Every thread loads its logits (one round trip, not one per 32), then
    // warp 0 takes the max and the sum from shared memory.
    for (int e = t; e < n; e += ROUTE_THREADS) p[e] = CG ? __ldcg(l + e) : l[e];
    __syncthreads();
    if (t < WARP) {
        float mx = -INFINITY;
        for (int e = lane; e < n; e += WARP) mx = fmaxf(mx, p[e]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.f;
        for (int e = lane; e < n; e += WARP) {
            const float v = expf(p[e] - mx);
            p[e] = v;
            sum += v;
        }
        sum = warp_sum(sum);
        if (lane == 0) sum_sh = sum;
    }
    __syncthreads();
    const float sum = sum_sh;
    for (int e = t; e < n; e += ROUTE_THREADS) {
        p[e] = p[e] / sum;
        key[e] = rank_key(p[e], e);
    }
    __syncthreads();
    for (int e0 = 0; e0 < n; e0 += ROUTE_THREADS) {
        const int e = e0 + t;
        bool sel = false;
        if (e < n) {
            const float pe = p[e];
            const u64 ke = key[e];
            int rank = 0;
#pragma unroll 8
            for (int j = 0; j < n; ++j) rank += key[j] > ke;
            sel = rank < k;
            if (sel) by_rank[rank] = pe;
        }
        const u32 bits = __ballot_sync(0xffffffffu, sel);
        if (lane == 0) chosen[e0 / WARP + t / WARP] = bits;
    }
    __syncthreads();
    for (int e = t; e < n; e += ROUTE_THREADS) {
        const int w = e / WARP, b = e & (WARP - 1);
        const u32 word = chosen[w];
        if ((word >> b) & 1u) {
            int pos = __popc(word & ((1u << b) - 1u));
            for (int i = 0; i < w; ++i) pos += __popc(chosen[i]);
            float total = 0.f;
            for (int a = 0; a < k; ++a) total += by_rank[a];
            const float wt = p[e];
            ids[pos] = e;
            weights[pos] = norm ? wt / total : wt;
        }
    }
}

// Softmax top-k routing of each row (see route_softmax_row). grid: rows,
// ROUTE_THREADS threads.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
route_softmax(const float* logits, int n, int k, int norm, int* ids, float* weights) {
    pdl_enter();
    const long long row = blockIdx.x;
    route_softmax_row<false>(logits + row * n, n, k, norm, ids + row * k, weights + row * k);
}

// One row's router logits and its softmax top-k routing in one launch: the
// blocks compute logits = W x as gemv1 does (same warps per row, so the
// same bits), and the last block to finish routes them as route_softmax
// does. `counter` is 0 between launches. The first ten arguments are
// gemv1's for W and one row (`rows` is 1). grid and block: gemv1's.
#define ROUTER(NAME, DT)                                                                      \
    extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)                               \
    NAME(Mats mm, long long row_bytes, int br, int bc, int k, const float* x,                 \
         long long x_stride, int rows, int vec, int wpr, int top_k, int norm, int* ids,       \
         float* weights, u32* counter) {                                                      \
        gemv_multi<DT, 1>(mm, row_bytes, br, bc, k, x, x_stride, 1, vec, wpr);               \
        if (!last_block_done(counter)) return;                                                \
        route_softmax_row<true>(mm.out[0], mm.start[1], top_k, norm, ids, weights);           \
    }
ROUTER(router_softmax_bf16, 0)
ROUTER(router_softmax_f16, 1)
ROUTER(router_softmax_f32, 2)
ROUTER(router_softmax_fp8, 3)

// DeepSeek-V3: sigmoid scores; the choice ranks score + bias within the
// `topk_group` best of `n_group` groups (a group scores its two best
// choices); weights are the scores (renormalised when `norm`) times `scaling`.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
route_sigmoid_groups(const float* logits, const float* bias, int n, int k, int n_group,
                     int topk_group, float scaling, int norm, int* ids, float* weights) {
    __shared__ float score[MAX_EXPERTS];
    __shared__ float choice[MAX_EXPERTS];
    __shared__ float gscore[ROUTE_THREADS];
    __shared__ int keep[ROUTE_THREADS];
    __shared__ float sv[ROUTE_THREADS];
    __shared__ int si[ROUTE_THREADS];
    __shared__ int sel_i[MAX_TOPK];
    __shared__ float sel_w[MAX_TOPK];
    const int row = blockIdx.x;
    const float* l = logits + (long long)row * n;
    pdl_enter();
    for (int e = threadIdx.x; e < n; e += ROUTE_THREADS) {
        score[e] = 1.f / (1.f + expf(-l[e]));
        choice[e] = score[e] + (bias ? bias[e] : 0.f);
    }
    __syncthreads();
    const int per = n / n_group;
    if (threadIdx.x < n_group) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = threadIdx.x * per; e < (threadIdx.x + 1) * per; ++e) {
            const float c = choice[e];
            if (c > b1) {
                b2 = b1;
                b1 = c;
            } else if (c > b2) {
                b2 = c;
            }
        }
        gscore[threadIdx.x] = b1 + b2;
        keep[threadIdx.x] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int t = 0; t < topk_group; ++t) {
            int best = -1;
            for (int g = 0; g < n_group; ++g)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            if (best >= 0) keep[best] = 1;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += ROUTE_THREADS)
        if (!keep[e / per]) choice[e] = -INFINITY;
    __syncthreads();
    top_k_into(choice, n, k, sel_i, sv, si);
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int a = 0; a < k; ++a) {
            sel_w[a] = score[sel_i[a]];
            sum += sel_w[a];
        }
        sum += 1e-20f;
        for (int a = 0; a < k; ++a) {
            if (norm) sel_w[a] = sel_w[a] / sum;
            sel_w[a] = sel_w[a] * scaling;
        }
        write_sorted(sel_i, sel_w, k, ids + (long long)row * k, weights + (long long)row * k);
    }
}
