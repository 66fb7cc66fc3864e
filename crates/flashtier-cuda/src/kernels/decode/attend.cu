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
    const int rem = (int)(i - r * width);
    const int h = rem / dim, d = rem - h * dim;
    const long long p = first + r;
    const long long c = p / chunk;
    const int t = (int)(p - c * chunk);
    float* base = arena + (c % slots) * (2LL * kv_heads * gs);
    base[(long long)h * gs + (long long)t * dim + d] = k[i];
    base[(long long)(kv_heads + h) * gs + (long long)t * dim + d] = v[i];
}

// A one-row decode step's q/k RMSNorm (when has_norm), RoPE and KV append,
// done inside the attention's launch (`on`; otherwise the kernels
// qk_norm_rope and kv_append ran before it): k_new / v_new hold the row's
// raw keys and values (kv_heads * dim), q the raw queries; qw / kw the norm
// weights. Heads up to FUSE_DIM wide (one value per thread of the block).
struct Fuse {
    const float* k_new;
    const float* v_new;
    const float* cos_t;
    const float* sin_t;
    const float* qw;
    const float* kw;
    float eps;
    int has_norm;
    int interleaved;
    int on;
};

#define FUSE_DIM (ATTN_WARPS * WARP)

// One head's per-head RMSNorm (weight w, when f.has_norm) and RoPE by
// position `pos`, from the `dim` values at src into dst (shared), with
// qk_norm_rope's arithmetic: thread t holds element t, the warps' sums are
// added in warp order (qk_norm_rope's other four warps add zeros, which
// leaves a sum of squares unchanged). All threads call it.
static __device__ void fused_head(const float* src, const float* w, const Fuse& f, int dim,
                                  long long pos, float* v, float* dst, float* red) {
    const int t = threadIdx.x;
    float acc = 0.f;
    if (t < dim) {
        v[t] = src[t];
        acc = fmaf(v[t], v[t], acc);
    }
    if (f.has_norm) {
        acc = warp_sum(acc);
        if ((t & (WARP - 1)) == 0) red[t / WARP] = acc;
        __syncthreads();
        float sum = 0.f;
#pragma unroll
        for (int w8 = 0; w8 < ATTN_WARPS; ++w8) sum += red[w8];
        const float inv = 1.f / sqrtf(sum / (float)dim + f.eps);
        if (t < dim) v[t] = w[t] * (v[t] * inv);
    }
    __syncthreads();
    rotate(v, dst, dim / 2, f.interleaved, f.cos_t, f.sin_t, pos);
    __syncthreads();
}

// Partial attention of query head h of row r over the positions of split
// s = s_first + blockIdx.z, [s * chunk, min(len, (s + 1) * chunk)),
// len = first + r + 1 (causal): (m, l, o) of the online softmax. The
// split's chunk is read from slot (s - c_base) % slots of `arena`.
// grid: (q_heads, rows, splits of this launch), ATTN_WARPS warps; part
// layout [(r * q_heads + h) * splits + s][2 + dim], splits the total.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP)
attn_partial(const float* q, int q_cols, float* arena, int kv_heads, int dim, int group,
             int first, float scale, int chunk, float* part, float* direct, int gs, int s_first,
             int c_base, int slots, int splits, Fuse f) {
    __shared__ float wm[ATTN_WARPS];
    __shared__ float wl[ATTN_WARPS];
    __shared__ float wo[ATTN_WARPS][MAX_DIM_PER_LANE * WARP];
    __shared__ float fq[FUSE_DIM], fk[FUSE_DIM], fv[FUSE_DIM], ftmp[FUSE_DIM], fred[ATTN_WARPS];
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y, s = s_first + blockIdx.z;
    const int q_heads = gridDim.x;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int len = first + r + 1;
    const int start = s * chunk;
    const int end = min(len, start + chunk);
    const int kvh = h / group;
    const int per_lane = (dim + WARP - 1) / WARP;
    float* base = arena + (long long)((s - c_base) % slots) * (2LL * kv_heads * gs);
    const float* K = base + (long long)kvh * gs;
    const float* V = base + (long long)(kv_heads + kvh) * gs;
    // Fused (one row, r = 0): the new position `first` is the last of the
    // last split; that split's blocks take its key and value from shared
    // memory (the block of each kv head's first query head also writes them
    // to the arena, which no block of this launch reads at that position).
    const bool fused = f.on != 0;
    const bool newest = fused && s == splits - 1;
    if (fused) {
        fused_head(q + (long long)h * dim, f.qw, f, dim, first, ftmp, fq, fred);
        if (newest) {
            fused_head(f.k_new + (long long)kvh * dim, f.kw, f, dim, first, ftmp, fk, fred);
            if (threadIdx.x < dim) fv[threadIdx.x] = f.v_new[(long long)kvh * dim + threadIdx.x];
            __syncthreads();
            if (h % group == 0 && threadIdx.x < dim) {
                const int t = first - start;
                base[(long long)kvh * gs + (long long)t * dim + threadIdx.x] = fk[threadIdx.x];
                base[(long long)(kv_heads + kvh) * gs + (long long)t * dim + threadIdx.x] =
                    fv[threadIdx.x];
            }
        }
    }
    float qv[MAX_DIM_PER_LANE], o[MAX_DIM_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
        const int d = lane + WARP * j;
        const bool in = j < per_lane && d < dim;
        qv[j] = !in ? 0.f : (fused ? fq[d] : q[(long long)r * q_cols + h * dim + d]);
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
            const bool now = newest && p == first;
            const float* kp = now ? fk : K + (long long)(p - start) * dim;
            const float* vp = now ? fv : V + (long long)(p - start) * dim;
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
    float* out = part + ((long long)(r * q_heads + h) * splits + s) * (2 + dim);
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
            direct[(long long)r * q_cols + h * dim + d] = acc / L;
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

// out[r][h * dim + d] = (sum_s o_s[d] e^(m_s - M)) / (sum_s l_s e^(m_s - M)).
// grid: (q_heads, rows).
extern "C" __global__ void attn_merge(const float* part, int dim, int splits, float* out,
                                      int out_cols) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y, q_heads = gridDim.x;
    const float* base = part + (long long)(r * q_heads + h) * splits * (2 + dim);
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
        out[(long long)r * out_cols + h * dim + d] = acc / L;
    }
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
