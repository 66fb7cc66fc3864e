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

// Warp-wide best of (value, index): larger value, then lower index; a
// number beats NaN.
static __device__ __forceinline__ void warp_best(float* v, int* i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, *v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, *i, o);
        if (ov > *v || (ov == *v && oi < *i) || (*v != *v && ov == ov)) {
            *v = ov;
            *i = oi;
        }
    }
}

// Softmax over E logits, the top k, renormalised to sum 1 when `norm`. One
// warp per row (grid: rows, 32 threads): lanes own experts e = lane (mod 32);
// the chosen pairs are written sorted by id, lane a placing pair a at its
// rank. Loops stay rolled: a one-warp kernel waits on every instruction
// fetch, so its code is kept short.
extern "C" __global__ void __launch_bounds__(WARP)
route_softmax(const float* logits, int n, int k, int norm, int* ids, float* weights) {
    __shared__ float p[MAX_EXPERTS];
    __shared__ int sel_i[MAX_TOPK];
    __shared__ float sel_w[MAX_TOPK];
    const int row = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)row * n;
    float mx = -INFINITY;
    for (int e = lane; e < n; e += WARP) mx = fmaxf(mx, l[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int e = lane; e < n; e += WARP) {
        const float v = expf(l[e] - mx);
        p[e] = v;
        sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < n; e += WARP) p[e] = p[e] / sum;
    __syncwarp();
    unsigned taken = 0;  // bit j: expert lane + 32 j is chosen (n <= 1024)
    for (int t = 0; t < k; ++t) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int e = lane, j = 0; e < n; e += WARP, ++j) {
            if (!((taken >> j) & 1u) && (p[e] > bv || (p[e] == bv && e < bi))) {
                bv = p[e];
                bi = e;
            }
        }
        warp_best(&bv, &bi);
        if (bi >= 0 && bi < n && (bi % WARP) == lane) {
            taken |= 1u << (bi / WARP);
        }
        if (lane == 0) {
            sel_i[t] = bi < n ? bi : 0;
            sel_w[t] = bi < n ? p[bi] : 0.f;
        }
    }
    __syncwarp();
    if (lane < k) {
        float total = 0.f;
        for (int a = 0; a < k; ++a) total += sel_w[a];
        const int id = sel_i[lane];
        float wt = sel_w[lane];
        if (norm) wt = wt / total;
        int rank = 0;
        for (int a = 0; a < k; ++a)
            rank += sel_i[a] < id || (sel_i[a] == id && a < lane);
        ids[(long long)row * k + rank] = id;
        weights[(long long)row * k + rank] = wt;
    }
}

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
