// Part of the decode kernels (kernels/decode/, concatenated after
// common.cuh and gemv.cu in the order ops/mod.rs gives).

// ---------------------------------------------------------------------------
// KV cache and decode attention. A layer's keys and values are kept in
// chunks of `chunk` positions, each laid out as one block of the KV store
// format: [K|V][kv_head][chunk][dim] f32, a group stride of `gs` floats
// (>= chunk * dim) between (K|V, kv_head) groups, so a chunk is
// 2 * kv_heads * gs floats. Chunk c of a layer lives in slot
// (c - c_base) % slots of an arena: the layer's resident arena (c_base 0,
// slots = the resident chunks) or one tile of the restore ring (c_base =
// the tile's first chunk).

// Element `rem` (head rem / dim, element rem % dim) of the key and value
// at position p into its chunk's slot (p / chunk) % slots of `arena`.
static __device__ __forceinline__ void kv_put(float kv_k, float kv_v, float* arena, int kv_heads,
                                              int dim, int gs, int slots, long long p, int chunk,
                                              int rem) {
    const int h = rem / dim, d = rem - h * dim;
    const long long c = p / chunk;
    const int t = (int)(p - c * chunk);
    float* base = arena + (c % slots) * (2LL * kv_heads * gs);
    base[(long long)h * gs + (long long)t * dim + d] = kv_k;
    base[(long long)(kv_heads + h) * gs + (long long)t * dim + d] = kv_v;
}

// Keys and values of rows at positions first.. (width = kv_heads * dim):
// K[p][h][d] = k[(p - first) * width + h * dim + d], V likewise.
extern "C" __global__ void kv_append(const float* k, const float* v, float* arena, int kv_heads,
                                     int dim, int gs, int slots, int first, int chunk,
                                     long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int width = kv_heads * dim;
    const long long r = i / width;
    kv_put(k[i], v[i], arena, kv_heads, dim, gs, slots, first + r, chunk, (int)(i - r * width));
}

// The online-softmax fold of one (row, head, split) block: query `qrow`
// (dim floats) over the keys K and values V of positions start..end
// (position p at K + (p - start) * dim). Writes the split's partial (m, l,
// o) at `out`, or, when `direct` is set (the only split), the finished
// o / l at `direct`. ATTN_WARPS warps; every thread of the block calls it.
static __device__ __forceinline__ void attn_fold(const float* qrow, const float* K,
                                                 const float* V, int start, int end, int dim,
                                                 float scale, float* out, float* direct) {
    __shared__ float wm[ATTN_WARPS];
    __shared__ float wl[ATTN_WARPS];
    __shared__ float wo[ATTN_WARPS][MAX_DIM_PER_LANE * WARP];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int per_lane = (dim + WARP - 1) / WARP;
    float qv[MAX_DIM_PER_LANE], o[MAX_DIM_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
        const int d = lane + WARP * j;
        qv[j] = (j < per_lane && d < dim) ? qrow[d] : 0.f;
        o[j] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    // The warp's positions p = start + warp, + ATTN_WARPS, ... in order,
    // ATTN_AHEAD at a time: their keys and values are loaded first (all in
    // flight at once), then each position updates (m, l, o) in turn, the
    // same arithmetic in the same order as one position at a time.
    for (int p0 = start + warp; p0 < end; p0 += ATTN_WARPS * ATTN_AHEAD) {
        float kr[ATTN_AHEAD][MAX_DIM_PER_LANE], vr[ATTN_AHEAD][MAX_DIM_PER_LANE];
#pragma unroll
        for (int g = 0; g < ATTN_AHEAD; ++g) {
            const int p = p0 + g * ATTN_WARPS;
            const float* kp = K + (long long)(p - start) * dim;
            const float* vp = V + (long long)(p - start) * dim;
#pragma unroll
            for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
                const int d = lane + WARP * j;
                const bool in = p < end && j < per_lane && d < dim;
                kr[g][j] = in ? kp[d] : 0.f;
                vr[g][j] = in ? vp[d] : 0.f;
            }
        }
#pragma unroll
        for (int g = 0; g < ATTN_AHEAD; ++g) {
            if (p0 + g * ATTN_WARPS >= end) break;
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
                const int d = lane + WARP * j;
                if (j < per_lane && d < dim) dot = fmaf(qv[j], kr[g][j], dot);
            }
            dot = warp_sum(dot) * scale;
            const float mn = fmaxf(m, dot);
            const float corr = expf(m - mn);
            const float pe = expf(dot - mn);
            l = l * corr + pe;
#pragma unroll
            for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
                const int d = lane + WARP * j;
                if (j < per_lane && d < dim) o[j] = fmaf(pe, vr[g][j], o[j] * corr);
            }
            m = mn;
        }
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < MAX_DIM_PER_LANE; ++j) wo[warp][lane + WARP * j] = o[j];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; ++w) M = fmaxf(M, wm[w]);
    if (direct) {
        // One split: the softmax is complete; write o / l as the merge would.
        float L = 0.f;
        for (int w = 0; w < ATTN_WARPS; ++w)
            if (wm[w] != -INFINITY) L += wl[w] * expf(wm[w] - M);
        for (int d = threadIdx.x; d < dim; d += blockDim.x) {
            float acc = 0.f;
            for (int w = 0; w < ATTN_WARPS; ++w)
                if (wm[w] != -INFINITY) acc += wo[w][d] * expf(wm[w] - M);
            direct[d] = acc / L;
        }
        return;
    }
    if (threadIdx.x == 0) {
        float L = 0.f;
        for (int w = 0; w < ATTN_WARPS; ++w)
            if (wm[w] != -INFINITY) L += wl[w] * expf(wm[w] - M);
        out[0] = M;
        out[1] = L;
    }
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < ATTN_WARPS; ++w)
            if (wm[w] != -INFINITY) acc += wo[w][d] * expf(wm[w] - M);
        out[2 + d] = acc;
    }
}

// Partial attention of query head h of row r over the positions of split
// s = s_first + blockIdx.z, [s * chunk, min(len, (s + 1) * chunk)),
// len = first + r + 1 (causal): (m, l, o) of the online softmax. The
// split's chunk is read from slot (s - c_base) % slots of `arena`.
// grid: (q_heads, rows, splits of this launch), ATTN_WARPS warps; part
// layout [(r * q_heads + h) * splits + s][2 + dim], splits the total.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP)
attn_partial(const float* q, int q_cols, const float* arena, int kv_heads, int dim, int group,
             int first, float scale, int chunk, float* part, float* direct, int gs, int s_first,
             int c_base, int slots, int splits) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y, s = s_first + blockIdx.z;
    const int q_heads = gridDim.x;
    const int len = first + r + 1;
    const int start = s * chunk;
    const int end = min(len, start + chunk);
    const int kvh = h / group;
    const float* base = arena + (long long)((s - c_base) % slots) * (2LL * kv_heads * gs);
    const float* K = base + (long long)kvh * gs;
    const float* V = base + (long long)(kv_heads + kvh) * gs;
    float* out = part + ((long long)(r * q_heads + h) * splits + s) * (2 + dim);
    float* dst = direct ? direct + (long long)r * q_cols + h * dim : nullptr;
    attn_fold(q + (long long)r * q_cols + h * dim, K, V, start, end, dim, scale, out, dst);
}

// One row's merge: out[d] = (sum_s o_s[d] e^(m_s - M)) / (sum_s l_s e^(m_s
// - M)) over the `splits` partials at base (2 + dim floats apart).
static __device__ __forceinline__ void attn_merge_row(const float* base, int dim, int splits,
                                                      float* out) {
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, base[s * (2 + dim)]);
    float L = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float ms = base[s * (2 + dim)];
        if (ms != -INFINITY) L += base[s * (2 + dim) + 1] * expf(ms - M);
    }
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float ms = base[s * (2 + dim)];
            if (ms != -INFINITY) acc += base[s * (2 + dim) + 2 + d] * expf(ms - M);
        }
        out[d] = acc / L;
    }
}

// out[r][h * dim + d] merged over the splits (attn_merge_row). grid:
// (q_heads, rows).
extern "C" __global__ void attn_merge(const float* part, int dim, int splits, float* out,
                                      int out_cols) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y, q_heads = gridDim.x;
    attn_merge_row(part + (long long)(r * q_heads + h) * splits * (2 + dim), dim, splits,
                   out + (long long)r * out_cols + h * dim);
}

// ---------------------------------------------------------------------------
// Decode rows of several sequences in one launch each (ops/attn/rows.rs):
// row r is the next position of its own sequence's cache, described by
// table[4r..4r+4) = (arena address, positions held before it, resident
// slots, splits of held + 1 positions). Every chunk is resident (c_base 0).
// The arithmetic of each row is that of kv_append / attn_partial /
// attn_merge for its sequence alone.

// Keys and values of each row at its sequence's position `held`.
extern "C" __global__ void kv_append_rows(const float* k, const float* v,
                                          const long long* table, int kv_heads, int dim, int gs,
                                          int chunk, long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int width = kv_heads * dim;
    const long long r = i / width;
    const long long* e = table + 4 * r;
    kv_put(k[i], v[i], reinterpret_cast<float*>(e[0]), kv_heads, dim, gs, (int)e[2], e[1], chunk,
           (int)(i - r * width));
}

// Split s = blockIdx.z of head h of row r (blocks past the row's splits
// return). part layout [(r * q_heads + h) * max_splits + s][2 + dim]; a
// row of one split writes out directly. grid: (q_heads, rows, max_splits).
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP)
attn_rows_partial(const float* q, int q_cols, const long long* table, int kv_heads, int dim,
                  int group, float scale, int chunk, float* part, float* out, int gs,
                  int max_splits) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y, s = blockIdx.z;
    const long long* e = table + 4 * r;
    const int splits = (int)e[3];
    if (s >= splits) return;
    const float* arena = reinterpret_cast<const float*>(e[0]);
    const int len = (int)e[1] + 1, slots = (int)e[2];
    const int q_heads = gridDim.x;
    const int start = s * chunk;
    const int end = min(len, start + chunk);
    const int kvh = h / group;
    const float* base = arena + (long long)(s % slots) * (2LL * kv_heads * gs);
    const float* K = base + (long long)kvh * gs;
    const float* V = base + (long long)(kv_heads + kvh) * gs;
    float* p = part + ((long long)(r * q_heads + h) * max_splits + s) * (2 + dim);
    float* dst = splits == 1 ? out + (long long)r * q_cols + h * dim : nullptr;
    attn_fold(q + (long long)r * q_cols + h * dim, K, V, start, end, dim, scale, p, dst);
}

// The merge of the rows of more than one split. grid: (q_heads, rows).
extern "C" __global__ void attn_rows_merge(const float* part, const long long* table, int dim,
                                           int max_splits, float* out, int out_cols) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y, q_heads = gridDim.x;
    const int splits = (int)table[4 * r + 3];
    if (splits <= 1) return;
    attn_merge_row(part + (long long)(r * q_heads + h) * max_splits * (2 + dim), dim, splits,
                   out + (long long)r * out_cols + h * dim);
}

// ---------------------------------------------------------------------------
// The HBM read ceiling: every 16-byte word of `p` read once per launch;
// the XOR of all of them decides a store that never happens in practice, so
// no load can be dropped.
extern "C" __global__ void __launch_bounds__(512)
read_words(const uint4* __restrict__ p, long long n, u32* out) {
    u32 x = 0;
    const long long step = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        const uint4 a = p[i], b = p[i + step], c = p[i + 2 * step], d = p[i + 3 * step];
        x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
        x ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += step) {
        const uint4 a = p[i];
        x ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (x == 0x9e3779b9u) out[0] = x;
}
