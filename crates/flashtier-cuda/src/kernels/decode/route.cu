// Part of the decode kernels (kernels/decode/, concatenated after
// common.cuh and gemv.cu in the order ops/mod.rs gives).

// ---------------------------------------------------------------------------
// Routing: one block of 256 threads per row, E <= 1024 experts, top_k <= 32.
//
// Every choice keeps the set torch's CPU topk keeps (the engine's topk.rs):
// the fast paths rank ties by index, and a row where equal values straddle
// the keep/drop line is redone by one thread replaying torch's selection
// (tk_keep below), which is rare and so costs nothing on the common path.

// torch's queue entry and its order for largest=True: NaN above every
// number, then the larger value; equal values are interchangeable.
struct TkEntry {
    float v;
    int i;
};

static __device__ __forceinline__ bool tk_ahead(TkEntry a, TkEntry b) {
    return (isnan(a.v) && !isnan(b.v)) || a.v > b.v;
}

// libstdc++'s __adjust_heap: the hole walks down along the child that goes
// last in the order, then `value` climbs back up, not above `top`.
static __device__ void tk_sift(TkEntry* q, int hole, int len, TkEntry value) {
    const int top = hole;
    int child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (tk_ahead(q[child], q[child - 1])) --child;
        q[hole] = q[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        q[hole] = q[child - 1];
        hole = child - 1;
    }
    while (hole > top) {
        const int parent = (hole - 1) / 2;
        if (!tk_ahead(q[parent], value)) break;
        q[hole] = q[parent];
        hole = parent;
    }
    q[hole] = value;
}

// Heap selection of the first `middle` of q[0..len).
static __device__ void tk_heap_select(TkEntry* q, int len, int middle) {
    if (middle >= 2) {
        for (int parent = (middle - 2) / 2; parent >= 0; --parent) tk_sift(q, parent, middle, q[parent]);
    }
    for (int i = middle; i < len; ++i) {
        if (tk_ahead(q[i], q[0])) {
            const TkEntry value = q[i];
            q[i] = q[0];
            tk_sift(q, 0, middle, value);
        }
    }
}

static __device__ void tk_insertion_sort(TkEntry* q, int len) {
    for (int i = 1; i < len; ++i) {
        const TkEntry val = q[i];
        if (tk_ahead(val, q[0])) {
            for (int j = i; j > 0; --j) q[j] = q[j - 1];
            q[0] = val;
        } else {
            int j = i;
            while (j > 1 && tk_ahead(val, q[j - 1])) {
                q[j] = q[j - 1];
                --j;
            }
            q[j] = val;
        }
    }
}

// Median of q[1], q[len/2], q[len-1] to q[0], then Hoare's partition of
// q[1..len) around it; returns the cut. len > 3.
static __device__ int tk_partition(TkEntry* q, int len) {
    const int a = 1, b = len / 2, c = len - 1;
    int m;
    if (tk_ahead(q[a], q[b])) {
        m = tk_ahead(q[b], q[c]) ? b : (tk_ahead(q[a], q[c]) ? c : a);
    } else {
        m = tk_ahead(q[a], q[c]) ? a : (tk_ahead(q[b], q[c]) ? c : b);
    }
    const TkEntry t0 = q[0];
    q[0] = q[m];
    q[m] = t0;
    const TkEntry pivot = q[0];
    int first = 1, last = len;
    while (true) {
        while (first < len - 1 && tk_ahead(q[first], pivot)) ++first;
        --last;
        while (last > 1 && tk_ahead(pivot, q[last])) --last;
        if (first >= last) return first;
        const TkEntry t = q[first];
        q[first] = q[last];
        q[last] = t;
        ++first;
    }
}

// q[0..k) becomes the entries torch's topk(k) keeps: partial_sort's heap
// selection when k * 64 <= n, else nth_element at k - 1 (introselect with
// a depth budget of 2 floor(log2 n)). One thread. 0 < k < n. Not inlined:
// it runs on the rare rows that tie, and stays out of the fast paths'
// registers.
static __device__ __noinline__ void tk_keep(TkEntry* q, int n, int k) {
    if (k * 64 <= n) {
        tk_heap_select(q, n, k);
        return;
    }
    const int nth = k - 1;
    int lo = 0, hi = n;
    int depth = 2 * (31 - __clz(n));
    while (hi - lo > 3) {
        if (depth == 0) {
            tk_heap_select(q + lo, hi - lo, nth - lo + 1);
            const TkEntry t = q[lo];
            q[lo] = q[nth];
            q[nth] = t;
            return;
        }
        --depth;
        const int cut = lo + tk_partition(q + lo, hi - lo);
        if (cut <= nth) {
            lo = cut;
        } else {
            hi = cut;
        }
    }
    tk_insertion_sort(q + lo, hi - lo);
}

// Must torch's selection redo a choice? Yes when an entry left out of it
// (value `out`) is not strictly behind the last one kept (`last`): a tie
// across the line, or a NaN the fast path ranked low.
static __device__ __forceinline__ bool tk_redo(float last, float out) {
    return !tk_ahead(TkEntry{last, 0}, TkEntry{out, 0});
}

// q[0..k) sorted as the host's top_k lists its choice: torch's order, equal
// values by index (insertion sort; k <= MAX_TOPK).
static __device__ void tk_rank_order(TkEntry* q, int k) {
    for (int a = 1; a < k; ++a) {
        const TkEntry e = q[a];
        int b = a - 1;
        while (b >= 0 && (tk_ahead(e, q[b]) || (!tk_ahead(q[b], e) && e.i < q[b].i))) {
            q[b + 1] = q[b];
            --b;
        }
        q[b + 1] = e;
    }
}


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

// Value v at index i as one integer whose order is the fast path's: NaN
// above every number (as torch ranks it), the larger value first, then the
// lower index (a strict total order; -0 ranks as +0). One compare per
// pair, no branches: the rank count below is a straight loop.
static __device__ __forceinline__ u64 rank_key(float v, int i) {
    const u32 u = __float_as_uint(v == 0.f ? 0.f : v);
    const u32 k = v != v ? 0xFFFFFFFFu : ((u & 0x80000000u) ? ~u : (u | 0x80000000u));
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
    __shared__ int straddle;
    if (t == 0) straddle = 0;
    __syncthreads();
    // Equal probabilities across the line: torch's selection decides which
    // of them stay (the values by rank, and so the renormalising sum, are
    // the same either way).
    if (k < n) {
        const float last = by_rank[k - 1];
        for (int e = t; e < n; e += ROUTE_THREADS) {
            const bool in = (chosen[e / WARP] >> (e & (WARP - 1))) & 1u;
            if (!in && tk_redo(last, p[e])) straddle = 1;
        }
    }
    __syncthreads();
    if (straddle) {
        TkEntry* q = reinterpret_cast<TkEntry*>(key);
        for (int e = t; e < n; e += ROUTE_THREADS) q[e] = TkEntry{p[e], e};
        for (int w = t; w < (n + WARP - 1) / WARP; w += ROUTE_THREADS) chosen[w] = 0u;
        __syncthreads();
        if (t == 0) {
            tk_keep(q, n, k);
            for (int a = 0; a < k; ++a) chosen[q[a].i / WARP] |= 1u << (q[a].i & (WARP - 1));
        }
        __syncthreads();
    }
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
    __shared__ TkEntry q[MAX_EXPERTS];
    __shared__ u8 picked[MAX_EXPERTS];
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
    // The groups torch's topk keeps (few groups: one thread replays it).
    if (threadIdx.x == 0) {
        if (topk_group >= n_group) {
            for (int g = 0; g < n_group; ++g) keep[g] = 1;
        } else {
            for (int g = 0; g < n_group; ++g) q[g] = TkEntry{gscore[g], g};
            tk_keep(q, n_group, topk_group);
            for (int a = 0; a < topk_group; ++a) keep[q[a].i] = 1;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += ROUTE_THREADS) {
        if (!keep[e / per]) choice[e] = -INFINITY;
        q[e] = TkEntry{choice[e], e};
        picked[e] = 0;
    }
    __syncthreads();
    top_k_into(choice, n, k, sel_i, sv, si);
    // Equal choices across the line (or a NaN, which the fast path ranks
    // last): torch's selection decides, listed in the host's order (rank,
    // then index) for the weights' sum.
    __shared__ int straddle;
    if (threadIdx.x == 0) {
        straddle = 0;
        for (int a = 0; a < k; ++a) picked[sel_i[a]] = 1;
    }
    __syncthreads();
    if (k < n) {
        const float last = q[sel_i[k - 1]].v;
        for (int e = threadIdx.x; e < n; e += ROUTE_THREADS)
            if (!picked[e] && tk_redo(last, q[e].v)) straddle = 1;
    }
    __syncthreads();
    if (straddle && threadIdx.x == 0) {
        tk_keep(q, n, k);
        tk_rank_order(q, k);
        for (int a = 0; a < k; ++a) sel_i[a] = q[a].i;
    }
    __syncthreads();
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
