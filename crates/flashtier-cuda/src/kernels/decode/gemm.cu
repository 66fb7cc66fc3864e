// Part of the decode kernels (kernels/decode/, concatenated after
// common.cuh, gemv.cu and moe.cu in the order ops/mod.rs gives).

// ---------------------------------------------------------------------------
// Products of many rows at once (a prompt chunk): tiles of input rows x
// output columns, the input and the weights (widened to f32,
// FP8 codes times their block scale) staged through shared memory GEMM_BK
// columns at a time. Each output is one multiply-add chain over k
// ascending, so its bits depend on its input row and weight row only: not
// on the tile it sits in nor on which rows share that tile. The grouped
// experts below rely on that (a pair gives the same bits whether its
// expert ran for one row or for a whole prompt chunk). Widths must be a
// multiple of 8 (whole chunks of load_raw).

#define GEMM_BK 32
#define GEMM_THREADS 256
// A thread's outputs: TM rows (2, 4 or 8) x TN columns (4 or 8), so a
// tile of 16 TM rows x 16 TN columns (ops/gemm.rs passes the sizes).
// Dense products: tiles of 64 rows x 64 columns by default.
#ifndef GEMM_TM
#define GEMM_TM 4
#endif
#ifndef GEMM_TN
#define GEMM_TN 4
#endif
// Grouped experts: tiles of 32 pairs x 128 columns by default: a prompt
// chunk gives an expert about top_k * rows / experts pairs (16 for 256
// rows of top-8 of 128), so a shorter tile wastes less.
#ifndef GROUP_TM
#define GROUP_TM 2
#endif
#ifndef GROUP_TN
#define GROUP_TN 8
#endif

// The input rows of a tile: row m of the tile is x row
// (rows ? rows[m] / div : m) for m < count.
struct TileRows {
    const float* x;
    long long stride;
    const int* rows;
    int div;
    int count;
};

// Column of output j of thread tx in a tile TN * 16 wide: groups of 4
// side by side, so the threads of a warp read shared memory contiguously.
template <int TN>
static __device__ __forceinline__ int tile_col(int tx, int j) {
    return (j / 4) * 64 + tx * 4 + (j % 4);
}

// acc[q][i][j] += x[row ty * TM + i] . W_q[n0 + tile_col(tx, j)] over k
// columns, for NB matrices sharing the input (gate and up: 2), a tile of
// BM = 16 * TM rows and BN = 16 * TN columns; tx = thread % 16, ty =
// thread / 16. Rows past `a.count` and weight rows past `nc` read as zeros.
// The caller zeroes acc.
template <int DT, int NB, int TM, int TN>
static __device__ __forceinline__ void gemm_tile(const TileRows& a, const Mat* w, int n0, int nc,
                                                 int k, float (&acc)[NB][TM][TN]) {
    constexpr int BM = 16 * TM, BN = 16 * TN;
    constexpr int A_LOADS = BM / 32;  // float4 of the input per thread per k tile
    constexpr int B_LOADS = BN / 64;  // 8-element chunks per matrix per thread per k tile
    __shared__ __align__(16) float sa[GEMM_BK][BM + 4];
    __shared__ __align__(16) float sb[NB][GEMM_BK][BN + 4];
    const int t = threadIdx.x, tx = t % 16, ty = t / 16;
    // This thread's loads of a k tile: input rows t / 8 + 32 u, columns
    // (t % 8) * 4 .. + 4; weight rows (t + 256 v) % BN, chunk
    // (t + 256 v) / BN (8 elements), of each matrix.
    const int ak = (t % 8) * 4;
    const float* arow[A_LOADS];
#pragma unroll
    for (int u = 0; u < A_LOADS; ++u) {
        const int m = t / 8 + 32 * u;
        const long long r = m < a.count ? (a.rows ? a.rows[m] / a.div : m) : -1;
        arow[u] = r >= 0 ? a.x + r * a.stride : nullptr;
    }
    const u8* brow[NB][B_LOADS];
    const float* bsrow[NB][B_LOADS];
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int v = 0; v < B_LOADS; ++v) {
            const int bn = (t + 256 * v) % BN;
            brow[q][v] = bn < nc ? w[q].w + (long long)(n0 + bn) * w[q].row_bytes : nullptr;
            bsrow[q][v] = (DT == 3 && bn < nc)
                              ? w[q].scales + (long long)((n0 + bn) / w[q].br) * w[q].sc_cols
                              : nullptr;
        }
    const Raw none = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 ra[A_LOADS];
    Raw rb[NB][B_LOADS];
    // The first k tile's loads; each later tile's are issued before the
    // products of the one before, so they are in flight meanwhile.
#pragma unroll
    for (int u = 0; u < A_LOADS; ++u)
        ra[u] = (arow[u] && ak < k) ? *(const float4*)(arow[u] + ak) : zero4;
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int v = 0; v < B_LOADS; ++v) {
            const int c = (t + 256 * v) / BN;
            rb[q][v] = (brow[q][v] && c * 8 < k) ? load_raw<DT, 0>(brow[q][v], c) : none;
        }
    for (int k0 = 0; k0 < k; k0 += GEMM_BK) {
        __syncthreads();
#pragma unroll
        for (int u = 0; u < A_LOADS; ++u) {
            const int m = t / 8 + 32 * u;
            sa[ak + 0][m] = ra[u].x;
            sa[ak + 1][m] = ra[u].y;
            sa[ak + 2][m] = ra[u].z;
            sa[ak + 3][m] = ra[u].w;
        }
#pragma unroll
        for (int q = 0; q < NB; ++q)
#pragma unroll
            for (int v = 0; v < B_LOADS; ++v) {
                const int bn = (t + 256 * v) % BN, c = (t + 256 * v) / BN;
                float e[8];
                widen<DT>(rb[q][v], e);
                if (DT == 3) {
                    const int col = k0 + c * 8;
                    const float s = (bsrow[q][v] && col < k) ? bsrow[q][v][col / w[q].bc] : 0.f;
#pragma unroll
                    for (int j = 0; j < 8; ++j) e[j] *= s;
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) sb[q][c * 8 + j][bn] = e[j];
            }
        __syncthreads();
        const int k1 = k0 + GEMM_BK;
        if (k1 < k) {
#pragma unroll
            for (int u = 0; u < A_LOADS; ++u)
                ra[u] = (arow[u] && k1 + ak < k) ? *(const float4*)(arow[u] + k1 + ak) : zero4;
#pragma unroll
            for (int q = 0; q < NB; ++q)
#pragma unroll
                for (int v = 0; v < B_LOADS; ++v) {
                    const int c = (k1 >> 3) + (t + 256 * v) / BN;
                    rb[q][v] = (brow[q][v] && c * 8 < k) ? load_raw<DT, 0>(brow[q][v], c) : none;
                }
        }
#pragma unroll 4
        for (int kk = 0; kk < GEMM_BK; ++kk) {
            float am[TM];
            if (TM % 4 == 0) {
#pragma unroll
                for (int g = 0; g < TM / 4; ++g) {
                    const float4 av = *(const float4*)&sa[kk][ty * TM + 4 * g];
                    am[(4 * g) % TM] = av.x;
                    am[(4 * g + 1) % TM] = av.y;
                    am[(4 * g + 2) % TM] = av.z;
                    am[(4 * g + 3) % TM] = av.w;
                }
            } else {
                const float2 av = *(const float2*)&sa[kk][ty * 2];
                am[0] = av.x;
                am[1 % TM] = av.y;
            }
#pragma unroll
            for (int q = 0; q < NB; ++q) {
                float bm[TN];
#pragma unroll
                for (int g = 0; g < TN / 4; ++g) {
                    const float4 bv = *(const float4*)&sb[q][kk][g * 64 + tx * 4];
                    bm[4 * g] = bv.x;
                    bm[4 * g + 1] = bv.y;
                    bm[4 * g + 2] = bv.z;
                    bm[4 * g + 3] = bv.w;
                }
#pragma unroll
                for (int i = 0; i < TM; ++i)
#pragma unroll
                    for (int j = 0; j < TN; ++j) acc[q][i][j] = fmaf(am[i], bm[j], acc[q][i][j]);
            }
        }
    }
}

template <int NB, int TM, int TN>
static __device__ __forceinline__ void zero_acc(float (&acc)[NB][TM][TN]) {
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[q][i][j] = 0.f;
}

// out_q[r][i] = W_q[i] . x[r] for r < rows, up to four matrices of one
// dtype and width sharing x (struct Mats, as gemv_*). grid: (column tiles
// of all matrices, in matrix order; ceil(rows / (16 * GEMM_TM))), GEMM_THREADS.
template <int DT>
static __device__ void gemm_multi(const Mats& mm, long long row_bytes, int br, int bc, int k,
                                  const float* x, int rows) {
    pdl_enter();
    int q = 0, tile = blockIdx.x;
    while (q < 3) {
        const int tiles = (mm.start[q + 1] - mm.start[q] + 16 * GEMM_TN - 1) / (16 * GEMM_TN);
        if (tile < tiles) break;
        tile -= tiles;
        ++q;
    }
    const int n_rows = mm.start[q + 1] - mm.start[q];
    const int n0 = tile * 16 * GEMM_TN;
    if (n0 >= n_rows) return;  // the whole block: past the last matrix
    const int nc = min(16 * GEMM_TN, n_rows - n0);
    const int m0 = blockIdx.y * 16 * GEMM_TM;
    const TileRows a = {x + (long long)m0 * k, k, nullptr, 1, min(16 * GEMM_TM, rows - m0)};
    const Mat w[1] = {{mm.w[q], row_bytes, mm.scales[q], mm.sc_cols[q], br, bc}};
    float acc[1][GEMM_TM][GEMM_TN];
    zero_acc(acc);
    gemm_tile<DT, 1, GEMM_TM, GEMM_TN>(a, w, n0, nc, k, acc);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float* out = mm.out[q];
#pragma unroll
    for (int i = 0; i < GEMM_TM; ++i) {
        const int m = ty * GEMM_TM + i;
        if (m >= a.count) continue;
#pragma unroll
        for (int j = 0; j < GEMM_TN; ++j) {
            const int n = tile_col<GEMM_TN>(tx, j);
            if (n < nc) out[(long long)(m0 + m) * mm.out_stride[q] + n0 + n] = acc[0][i][j];
        }
    }
}

#define GEMM(NAME, DT)                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                \
    NAME(Mats mm, long long row_bytes, int br, int bc, int k, const float* x, int rows) {     \
        gemm_multi<DT>(mm, row_bytes, br, bc, k, x, rows);                                    \
    }
GEMM(gemm_bf16, 0)
GEMM(gemm_f16, 1)
GEMM(gemm_f32, 2)
GEMM(gemm_fp8, 3)

// ---------------------------------------------------------------------------
// Routed experts of many rows, grouped by expert: the (row, rank) pairs of
// a step sorted by expert (`perm`, pair indices p = row * top_k + rank),
// and tiles of up to 16 * GROUP_TM consecutive pairs of one expert (`tiles`,
// three ints each: expert id, first position in perm, count). Each tile
// reads its expert's weights once for all its pairs. Tiles hold up to
// 16 * GROUP_TM pairs and 16 * GROUP_TN columns. An expert whose table
// entry is 0 (not resident) gives NaN, as moe_gate_up does.

// act[p][i] = silu(gate_i . x[p / top_k]) * (up_i . x[p / top_k]) for the
// pairs of tile blockIdx.y. grid: (ceil(inter / (16 * GROUP_TN)), tiles).
template <int DT>
static __device__ void moe_group_gate_up(const u64* table, int layer_base, const int* perm,
                                         const int* tiles, int top_k, const float* x, int hidden,
                                         int inter, Expert e, float* act) {
    pdl_enter();
    const int* tl = tiles + 3 * blockIdx.y;
    const int expert = tl[0], first = tl[1], count = tl[2];
    if (count == 0) return;  // past the step's last tile (grouped on the device)
    const int n0 = blockIdx.x * 16 * GROUP_TN, nc = min(16 * GROUP_TN, inter - n0);
    const u64 base = expert >= 0 ? table[layer_base + expert] : 0;  // -1: an id out of range
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[2][GROUP_TM][GROUP_TN];
    zero_acc(acc);
    if (base != 0) {
        const u8* rec = (const u8*)base;
        const long long rb = (long long)hidden * (DT == 2 ? 4 : (DT == 3 ? 1 : 2));
        const Mat w[2] = {
            {rec + e.gate_off, rb, (const float*)(rec + e.gate_soff), e.gu_sc_cols, e.br, e.bc},
            {rec + e.up_off, rb, (const float*)(rec + e.up_soff), e.gu_sc_cols, e.br, e.bc}};
        const TileRows a = {x, hidden, perm + first, top_k, count};
        gemm_tile<DT, 2, GROUP_TM, GROUP_TN>(a, w, n0, nc, hidden, acc);
    }
#pragma unroll
    for (int i = 0; i < GROUP_TM; ++i) {
        const int m = ty * GROUP_TM + i;
        if (m >= count) continue;
        const long long p = perm[first + m];
#pragma unroll
        for (int j = 0; j < GROUP_TN; ++j) {
            const int n = tile_col<GROUP_TN>(tx, j);
            if (n < nc)
                act[p * inter + n0 + n] = base == 0 ? __int_as_float(0x7fc00000)
                                                    : silu(acc[0][i][j]) * acc[1][i][j];
        }
    }
}

// y[p][i] = down_i . act[p] for the pairs of tile blockIdx.y.
// grid: (ceil(hidden / (16 * GROUP_TN)), tiles).
template <int DT>
static __device__ void moe_group_down(const u64* table, int layer_base, const int* perm,
                                      const int* tiles, const float* act, int hidden, int inter,
                                      Expert e, float* y) {
    pdl_enter();
    const int* tl = tiles + 3 * blockIdx.y;
    const int expert = tl[0], first = tl[1], count = tl[2];
    if (count == 0) return;  // past the step's last tile (grouped on the device)
    const int n0 = blockIdx.x * 16 * GROUP_TN, nc = min(16 * GROUP_TN, hidden - n0);
    const u64 base = expert >= 0 ? table[layer_base + expert] : 0;  // -1: an id out of range
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[1][GROUP_TM][GROUP_TN];
    zero_acc(acc);
    if (base != 0) {
        const u8* rec = (const u8*)base;
        const long long rb = (long long)inter * (DT == 2 ? 4 : (DT == 3 ? 1 : 2));
        const Mat w[1] = {
            {rec + e.down_off, rb, (const float*)(rec + e.down_soff), e.dn_sc_cols, e.br, e.bc}};
        const TileRows a = {act, inter, perm + first, 1, count};
        gemm_tile<DT, 1, GROUP_TM, GROUP_TN>(a, w, n0, nc, inter, acc);
    }
#pragma unroll
    for (int i = 0; i < GROUP_TM; ++i) {
        const int m = ty * GROUP_TM + i;
        if (m >= count) continue;
        const long long p = perm[first + m];
#pragma unroll
        for (int j = 0; j < GROUP_TN; ++j) {
            const int n = tile_col<GROUP_TN>(tx, j);
            if (n < nc) y[p * hidden + n0 + n] = base == 0 ? __int_as_float(0x7fc00000) : acc[0][i][j];
        }
    }
}

#define MOE_GROUP(DT, SUFFIX)                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_group_gate_up_##SUFFIX(      \
        const u64* table, int layer_base, const int* perm, const int* tiles, int top_k,         \
        const float* x, int hidden, int inter, Expert e, float* act) {                          \
        moe_group_gate_up<DT>(table, layer_base, perm, tiles, top_k, x, hidden, inter, e, act); \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_group_down_##SUFFIX(         \
        const u64* table, int layer_base, const int* perm, const int* tiles, const float* act,  \
        int hidden, int inter, Expert e, float* y) {                                            \
        moe_group_down<DT>(table, layer_base, perm, tiles, act, hidden, inter, e, y);           \
    }
MOE_GROUP(0, bf16)
MOE_GROUP(1, f16)
MOE_GROUP(2, f32)
MOE_GROUP(3, fp8)

// out[r][i] = sum over j < top_k (routed order) of w[r][j] * y[r * top_k +
// j][i], added as moe_down adds its experts' products. One thread per
// output; grid covers rows * hidden.
extern "C" __global__ void moe_group_sum(const float* y, const float* weights, int top_k,
                                         int hidden, long long n, float* out) {
    pdl_enter();
    const long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (o >= n) return;
    const long long r = o / hidden;
    const int i = (int)(o - r * hidden);
    float total = 0.f;
    for (int j = 0; j < top_k; ++j)
        total = fmaf(y[(r * top_k + j) * hidden + i], weights[r * top_k + j], total);
    out[o] = total;
}
