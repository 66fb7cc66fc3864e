// Part of the decode kernels (kernels/decode/, concatenated after
// attend.cu in the order ops/mod.rs gives: it writes the partials
// attn_merge reads).

// ---------------------------------------------------------------------------
// A prompt chunk's attention as tiles (ops/attn/launch.rs). attn_partial
// gives each (row, head, split) its own block, so a 256-row chunk reads
// every key and value of a split once per row and head from L2, and
// reduces every score across a warp. Here a block takes PA_BM query
// vectors of one kv head (rows x the heads sharing it, row-major) and one
// split, and walks the split's positions PA_BN at a time: the tile's keys
// and values are staged in shared memory once for all of its queries,
// S = Q K^T and O += P V are f32 register tiles, and the softmax is
// online per query. The result is a split partial (m, l, o) in
// attn_partial's layout, merged by attn_merge as before, or with one split
// the finished o / l.
//
// Exactness: every value is f32, as in attn_partial; only the order of the
// sums differs (a score is one FMA chain over ascending d; a query's row
// max and sum are one butterfly over the 16 lanes holding its scores; o is
// one FMA chain over ascending positions). A query's bits depend on its
// own q, its positions' keys and values and the split bounds only, never
// on which other queries share its tile: a key past a query's position is
// masked to -inf, a probability of 0 adds nothing (it is skipped, so a
// non-finite value at a later position never reaches an earlier query),
// and a tile of positions entirely past a query leaves its (m, l, o)
// exactly as it was.
//
// Shapes: PA_THREADS threads; thread t holds queries (t / 16) * 4 .. + 4,
// positions t % 16 + 16 u (u < 4) of the score tile and head elements
// (t % 16) * 4 + 64 w .. + 4 (w < D / 64) of o. Heads of up to D elements
// (D = 64, 128 or 256; shorter heads read zeros past their end), width a
// multiple of 4. Dynamic shared memory (`prompt_attn_smem` in
// ops/attn/launch.rs, set as the kernel's limit when the module loads):
// the tile's queries, staged once, one tile of keys (then of values) and
// the probability tile: 51, 83 and 147 KiB.

#define PA_BM 64
#define PA_BN 64
#define PA_THREADS 256
#define PA_P_LD (PA_BN + 4)

// grid: (ceil(rows * group / PA_BM), kv_heads, splits of this launch);
// the other arguments as attn_partial's, and `rows` the chunk's rows.
template <int D>
static __device__ __forceinline__ void attn_prompt(const float* q, int q_cols, const float* arena,
                                                   int kv_heads, int dim, int group, int first,
                                                   float scale, int chunk, float* part,
                                                   float* direct, int gs, int s_first, int c_base,
                                                   int slots, int splits, int rows) {
    constexpr int DW = D / 64;   // float4s of o per thread per query
    constexpr int LD = D + 4;    // floats per staged row
    constexpr int ROW4 = D / 4;  // float4s per staged row
    extern __shared__ __align__(16) float pa_smem[];
    float* const sq = pa_smem;                // [PA_BM][LD]
    float* const skv = pa_smem + PA_BM * LD;  // [PA_BN][LD]
    float* const sp = skv + PA_BN * LD;       // [PA_BM][PA_P_LD]
    const int t = threadIdx.x, tr = t / 16, tc = t % 16;
    const int kvh = blockIdx.y, s = s_first + blockIdx.z;
    const int q_heads = kv_heads * group;
    const int m0 = blockIdx.x * PA_BM;
    const int vectors = rows * group;
    const int start = s * chunk;
    const int split_end = min(first + rows, start + chunk);
    // The last row with a query in this tile bounds the positions read.
    const int r_last = min(rows - 1, (min(m0 + PA_BM, vectors) - 1) / group);
    const int kend = min(split_end, first + r_last + 1);
    const float* base = arena + (long long)((s - c_base) % slots) * (2LL * kv_heads * gs);
    const float* K = base + (long long)kvh * gs;
    const float* V = base + (long long)(kv_heads + kvh) * gs;

    // This thread's queries: tile rows tr * 4 + i.
    int pos[4];  // the query's position, or -1 past the chunk's rows
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int v = m0 + tr * 4 + i;
        pos[i] = v < vectors ? first + v / group : -1;
    }
    float m[4], l[4], o[4][DW][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.f;
#pragma unroll
        for (int w = 0; w < DW; ++w)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[i][w][c] = 0.f;
    }
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);

    // The tile's queries, once; then 64 positions at a time, keys then
    // values through the same stage: PA_BN rows of `src` from position p0
    // (zeros past kend and past the head).
    auto stage = [&](float* dst, const float* src, int p0) {
#pragma unroll
        for (int idx = t; idx < PA_BN * ROW4; idx += PA_THREADS) {
            const int row = idx / ROW4, c = (idx % ROW4) * 4;
            const int p = p0 + row;
            *(float4*)&dst[row * LD + c] =
                (p < kend && c < dim) ? *(const float4*)(src + (long long)(p - start) * dim + c)
                                      : zero4;
        }
    };
#pragma unroll
    for (int idx = t; idx < PA_BM * ROW4; idx += PA_THREADS) {
        const int row = idx / ROW4, c = (idx % ROW4) * 4;
        const int v = m0 + row;
        float4 qv = zero4;
        if (v < vectors && c < dim) {
            const int r = v / group, h = kvh * group + v % group;
            qv = *(const float4*)(q + (long long)r * q_cols + h * dim + c);
        }
        *(float4*)&sq[row * LD + c] = qv;
    }
    for (int p0 = start; p0 < kend; p0 += PA_BN) {
        __syncthreads();  // the last tile's values and probabilities are read
        stage(skv, K, p0);
        __syncthreads();
        // S = Q K^T, one FMA chain over ascending d per score.
        float sc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int u = 0; u < 4; ++u) sc[i][u] = 0.f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            float4 qa[4], kb[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) qa[i] = *(const float4*)&sq[(tr * 4 + i) * LD + d];
#pragma unroll
            for (int u = 0; u < 4; ++u) kb[u] = *(const float4*)&skv[(tc + 16 * u) * LD + d];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    float a = sc[i][u];
                    a = fmaf(qa[i].x, kb[u].x, a);
                    a = fmaf(qa[i].y, kb[u].y, a);
                    a = fmaf(qa[i].z, kb[u].z, a);
                    a = fmaf(qa[i].w, kb[u].w, a);
                    sc[i][u] = a;
                }
        }
        // The online softmax of each query over this tile's positions.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float mx = -INFINITY;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int p = p0 + tc + 16 * u;
                sc[i][u] = (p < kend && p <= pos[i]) ? sc[i][u] * scale : -INFINITY;
                mx = fmaxf(mx, sc[i][u]);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float mn = fmaxf(m[i], mx);
            float corr = 1.f, rs = 0.f;
            if (mn != -INFINITY) {
                corr = expf(m[i] - mn);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    sc[i][u] = expf(sc[i][u] - mn);
                    rs += sc[i][u];
                }
            } else {
#pragma unroll
                for (int u = 0; u < 4; ++u) sc[i][u] = 0.f;
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) rs += __shfl_xor_sync(0xffffffffu, rs, off);
            l[i] = l[i] * corr + rs;
            m[i] = mn;
#pragma unroll
            for (int w = 0; w < DW; ++w)
#pragma unroll
                for (int c = 0; c < 4; ++c) o[i][w][c] *= corr;
#pragma unroll
            for (int u = 0; u < 4; ++u) sp[(tr * 4 + i) * PA_P_LD + tc + 16 * u] = sc[i][u];
        }
        __syncthreads();  // the keys are read, the probabilities written
        stage(skv, V, p0);
        __syncthreads();
        // O += P V over the tile's positions (those past kend add nothing).
        const int kn = min(PA_BN, kend - p0);
        for (int kk = 0; kk < kn; kk += 4) {
            float4 pa[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) pa[i] = *(const float4*)&sp[(tr * 4 + i) * PA_P_LD + kk];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                float4 vb[DW];
#pragma unroll
                for (int w = 0; w < DW; ++w)
                    vb[w] = *(const float4*)&skv[(kk + u) * LD + tc * 4 + 64 * w];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float pr = u == 0 ? pa[i].x : u == 1 ? pa[i].y : u == 2 ? pa[i].z : pa[i].w;
                    if (pr == 0.f) continue;
#pragma unroll
                    for (int w = 0; w < DW; ++w) {
                        o[i][w][0] = fmaf(pr, vb[w].x, o[i][w][0]);
                        o[i][w][1] = fmaf(pr, vb[w].y, o[i][w][1]);
                        o[i][w][2] = fmaf(pr, vb[w].z, o[i][w][2]);
                        o[i][w][3] = fmaf(pr, vb[w].w, o[i][w][3]);
                    }
                }
            }
        }
    }
    // The split's partial, or with one split the finished o / l.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (pos[i] < 0) continue;
        const int v = m0 + tr * 4 + i;
        const int r = v / group, h = kvh * group + v % group;
        float* dst;
        float div = 1.f;
        if (direct) {
            dst = direct + (long long)r * q_cols + h * dim;
            div = l[i];
        } else {
            float* out = part + ((long long)(r * q_heads + h) * splits + s) * (2 + dim);
            if (tc == 0) {
                out[0] = m[i];
                out[1] = l[i];
            }
            dst = out + 2;
        }
#pragma unroll
        for (int w = 0; w < DW; ++w)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int d = tc * 4 + 64 * w + c;
                if (d < dim) dst[d] = direct ? o[i][w][c] / div : o[i][w][c];
            }
    }
}

#define ATTN_PROMPT(D)                                                                           \
    extern "C" __global__ void __launch_bounds__(PA_THREADS)                                     \
    attn_prompt_##D(const float* q, int q_cols, const float* arena, int kv_heads, int dim,        \
                    int group, int first, float scale, int chunk, float* part, float* direct,     \
                    int gs, int s_first, int c_base, int slots, int splits, int rows) {           \
        pdl_enter();                                                                             \
        attn_prompt<D>(q, q_cols, arena, kv_heads, dim, group, first, scale, chunk, part,        \
                       direct, gs, s_first, c_base, slots, splits, rows);                        \
    }
ATTN_PROMPT(64)
ATTN_PROMPT(128)
ATTN_PROMPT(256)
