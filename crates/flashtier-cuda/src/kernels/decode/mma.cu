// Part of the decode kernels (kernels/decode/, concatenated after
// gemm.cu in the order ops/mod.rs gives: it uses Mats, Expert and silu).

// ---------------------------------------------------------------------------
// BF16 products of many rows on the tensor cores (sm_80 and later; the host
// uses them only there). The f32 input is split into two BF16 parts,
// hi = bf16(x) and lo = bf16(x - hi), once per product (split_bf16_rows,
// before the tiles, which all read the same parts): hi + lo keeps 16 of
// x's 24 significand bits (|x - hi - lo| <= 2^-17 |x|), and BF16 weights
// are exact, so each
// output is the sum over k of w * hi + w * lo with f32 accumulation:
// `mma.sync.m16n8k16` 16 columns at a time in ascending k, the hi part then
// the lo part into the same accumulator. An output's bits depend on its
// input row and weight row only, never on which rows share its tile (the
// property the f32 tiles of gemm.cu have, and the grouped experts rely on).
// Compared with those f32 chains, each product term carries an extra
// relative error of at most 2^-17; a finite input past BF16's largest
// value (about 3.4e38) reads as infinite.
//
// Shapes: a block of MMA_THREADS (4 warps) computes BM input rows (32 or
// 64) x BN = 64 output columns of NB matrices sharing the input, staged
// through shared memory MMA_BK columns at a time. Widths must be a
// multiple of 8 (whole 16-byte weight chunks).

// Input columns staged at once (FLASHTIER_MMA_BK: 32 or 64; the same bits).
#ifndef MMA_BK
#define MMA_BK 64
#endif
// 16-byte chunks of a k tile's row, and the rows one pass of the block's
// threads loads.
#define MMA_CH (MMA_BK / 8)
#define MMA_RPP (MMA_THREADS / MMA_CH)
#define MMA_BN 64
#define MMA_THREADS 128
// Shared rows of MMA_BK + 8 BF16 values (144 bytes): the eight 16-byte
// rows one ldmatrix phase reads fall in distinct banks.
#define MMA_LD (MMA_BK + 8)

// Nearest-even BF16 bits of f; a NaN stays a NaN.
static __device__ __forceinline__ u32 bf16_bits(float f) {
    const u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x as hi + lo (BF16 bits each). x - hi is exact in f32; a non-finite hi
// (x infinite, NaN, or past BF16's range) gets lo = 0.
static __device__ __forceinline__ void split_bf16(float x, u32& hi, u32& lo) {
    hi = bf16_bits(x);
    const float h = __uint_as_float(hi << 16);
    lo = isfinite(h) ? bf16_bits(x - h) : 0u;
}

// The split of n f32 values (n a multiple of 4): hi parts at xs[0..n), lo
// parts at xs[n..2n). grid: ceil(n / 4 / 256), 256 threads.
extern "C" __global__ void split_bf16_rows(const float* x, long long n, u16* xs) {
    pdl_enter();
    const long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    const float4 v = *(const float4*)(x + i);
    u32 h[4], l[4];
    split_bf16(v.x, h[0], l[0]);
    split_bf16(v.y, h[1], l[1]);
    split_bf16(v.z, h[2], l[2]);
    split_bf16(v.w, h[3], l[3]);
    *(uint2*)(xs + i) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
    *(uint2*)(xs + n + i) = make_uint2(l[0] | (l[1] << 16), l[2] | (l[3] << 16));
}

// The input rows of a tile, split: row m (< count) is hi[r * stride ..]
// and lo[r * stride ..], r = rows ? rows[m] / div : m.
struct SplitRows {
    const u16* hi;
    const u16* lo;
    long long stride;
    const int* rows;
    int div;
    int count;
};

// Four 8x8 BF16 matrices from shared memory, one per 8 lanes' row
// addresses (lane l gives row l % 8 of matrix l / 8).
static __device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const u16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// c += a b for a 16x16 BF16 A fragment, a 16x8 BF16 B fragment and a 16x8
// f32 accumulator.
static __device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Warp layout of a BM x MMA_BN tile: BM / 32 warps down, the rest across;
// each warp takes 32 rows (two m16 tiles) x WN columns (NT n8 tiles).
template <int BM>
struct MmaShape {
    static constexpr int WARPS_M = BM / 32;
    static constexpr int WARPS_N = 4 / WARPS_M;
    static constexpr int WN = MMA_BN / WARPS_N;
    static constexpr int NT = WN / 8;
};

// The tile row of accumulator element i of m16 tile mt, and the tile
// column of element i of n8 tile nt, for the calling lane.
template <int BM>
static __device__ __forceinline__ int mma_row(int mt, int i) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    return (warp / MmaShape<BM>::WARPS_N) * 32 + mt * 16 + lane / 4 + (i >= 2 ? 8 : 0);
}
template <int BM>
static __device__ __forceinline__ int mma_col(int nt, int i) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    return (warp % MmaShape<BM>::WARPS_N) * MmaShape<BM>::WN + nt * 8 + (lane % 4) * 2 + (i & 1);
}

// acc[q][mt][nt] += x[tile rows] . W_q[n0 + tile columns] over k, for NB
// BF16 matrices (rows `row_bytes` apart) sharing the split input. Rows past
// `a.count`, weight rows past `nc` and columns past k read as zeros. The
// caller zeroes acc.
template <int NB, int BM>
static __device__ __forceinline__ void mma_tile(const SplitRows& a, const u8* const (&w)[NB],
                                                long long row_bytes, int n0, int nc, int k,
                                                float (&acc)[NB][2][MmaShape<BM>::NT][4]) {
    using S = MmaShape<BM>;
    constexpr int A_LOADS = BM / MMA_RPP;      // 16-byte chunks of each part per thread per k tile
    constexpr int B_LOADS = MMA_BN / MMA_RPP;  // 16-byte weight chunks per matrix per thread
    __shared__ __align__(16) u16 s_hi[BM][MMA_LD];
    __shared__ __align__(16) u16 s_lo[BM][MMA_LD];
    __shared__ __align__(16) u16 s_w[NB][MMA_BN][MMA_LD];
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    const int wm = warp / S::WARPS_N, wn = warp % S::WARPS_N;
    // This thread's loads of a k tile: input rows t / MMA_CH + MMA_RPP u,
    // chunk t % MMA_CH (8 values) of each part; weight rows t / MMA_CH +
    // MMA_RPP v, the same chunk.
    const int bk = (t % MMA_CH) * 8;
    long long arow[A_LOADS];
#pragma unroll
    for (int u = 0; u < A_LOADS; ++u) {
        const int m = t / MMA_CH + MMA_RPP * u;
        arow[u] = m < a.count ? (a.rows ? a.rows[m] / a.div : m) * a.stride : -1;
    }
    const u8* brow[NB][B_LOADS];
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int v = 0; v < B_LOADS; ++v) {
            const int bn = t / MMA_CH + MMA_RPP * v;
            brow[q][v] = bn < nc ? w[q] + (long long)(n0 + bn) * row_bytes : nullptr;
        }
    const uint4 zero16 = make_uint4(0u, 0u, 0u, 0u);
    uint4 rh[A_LOADS], rl[A_LOADS];
    uint4 rb[NB][B_LOADS];
    // Loads of the k tile at k0 into registers; each later tile's are
    // issued before the products of the one before, so they are in flight
    // meanwhile.
    auto fetch = [&](int k0) {
#pragma unroll
        for (int u = 0; u < A_LOADS; ++u) {
            const bool in = arow[u] >= 0 && k0 + bk < k;
            rh[u] = in ? *(const uint4*)(a.hi + arow[u] + k0 + bk) : zero16;
            rl[u] = in ? *(const uint4*)(a.lo + arow[u] + k0 + bk) : zero16;
        }
#pragma unroll
        for (int q = 0; q < NB; ++q)
#pragma unroll
            for (int v = 0; v < B_LOADS; ++v)
                rb[q][v] = (brow[q][v] && k0 + bk < k)
                               ? *(const uint4*)(brow[q][v] + (long long)(k0 + bk) * 2)
                               : zero16;
    };
    fetch(0);
    for (int k0 = 0; k0 < k; k0 += MMA_BK) {
        __syncthreads();
#pragma unroll
        for (int u = 0; u < A_LOADS; ++u) {
            const int m = t / MMA_CH + MMA_RPP * u;
            *(uint4*)&s_hi[m][bk] = rh[u];
            *(uint4*)&s_lo[m][bk] = rl[u];
        }
#pragma unroll
        for (int q = 0; q < NB; ++q)
#pragma unroll
            for (int v = 0; v < B_LOADS; ++v)
                *(uint4*)&s_w[q][t / MMA_CH + MMA_RPP * v][bk] = rb[q][v];
        __syncthreads();
        if (k0 + MMA_BK < k) fetch(k0 + MMA_BK);
#pragma unroll
        for (int kk = 0; kk < MMA_BK; kk += 16) {
            u32 ah[2][4], al[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int r = wm * 32 + mt * 16 + lane % 16, c = kk + (lane / 16) * 8;
                ldsm_x4(ah[mt], &s_hi[r][c]);
                ldsm_x4(al[mt], &s_lo[r][c]);
            }
#pragma unroll
            for (int q = 0; q < NB; ++q)
#pragma unroll
                for (int np = 0; np < S::NT / 2; ++np) {
                    // Matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15,
                    // k 0-7), (n 8-15, k 8-15): B fragments of n8 tiles 2 np
                    // and 2 np + 1.
                    u32 b[4];
                    const int n = wn * S::WN + np * 16 + (lane / 16) * 8 + lane % 8;
                    ldsm_x4(b, &s_w[q][n][kk + ((lane / 8) % 2) * 8]);
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma_bf16(acc[q][mt][2 * np], ah[mt], b[0], b[1]);
                        mma_bf16(acc[q][mt][2 * np], al[mt], b[0], b[1]);
                        mma_bf16(acc[q][mt][2 * np + 1], ah[mt], b[2], b[3]);
                        mma_bf16(acc[q][mt][2 * np + 1], al[mt], b[2], b[3]);
                    }
                }
        }
    }
}

// Zero a tile's accumulators (any of the tiles' shapes: NB matrices, MT
// m16 tiles, NT n8 tiles).
template <int NB, int MT, int NT>
static __device__ __forceinline__ void mma_zero(float (&acc)[NB][MT][NT][4]) {
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[q][mt][nt][i] = 0.f;
}

// The epilogue's walk: f(mt, nt, i, m, n) for every accumulator element of
// a BM-row tile whose tile row m < rows and column n < cols.
template <int BM, typename F>
static __device__ __forceinline__ void mma_each(int rows, int cols, F f) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < MmaShape<BM>::NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = mma_row<BM>(mt, i), n = mma_col<BM>(nt, i);
                if (m < rows && n < cols) f(mt, nt, i, m, n);
            }
}

// Dense products (as gemm_multi): out_q[r][i] = W_q[i] . x[r] for r <
// rows, up to four BF16 matrices of one width sharing x. grid: (64-column
// tiles of all matrices, in matrix order; ceil(rows / 64)), MMA_THREADS.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
gemm_mma_bf16(Mats mm, long long row_bytes, int k, const u16* xs, long long lo_off, int rows) {
    constexpr int BM = 64;
    pdl_enter();
    int q = 0, tile = blockIdx.x;
    while (q < 3) {
        const int tiles = (mm.start[q + 1] - mm.start[q] + MMA_BN - 1) / MMA_BN;
        if (tile < tiles) break;
        tile -= tiles;
        ++q;
    }
    const int n_rows = mm.start[q + 1] - mm.start[q];
    const int n0 = tile * MMA_BN;
    if (n0 >= n_rows) return;  // the whole block: past the last matrix
    const int nc = min(MMA_BN, n_rows - n0);
    const int m0 = blockIdx.y * BM;
    const long long at = (long long)m0 * k;
    const SplitRows a = {xs + at, xs + lo_off + at, k, nullptr, 1, min(BM, rows - m0)};
    const u8* const w[1] = {mm.w[q]};
    float acc[1][2][MmaShape<BM>::NT][4];
    mma_zero(acc);
    mma_tile<1, BM>(a, w, row_bytes, n0, nc, k, acc);
    float* out = mm.out[q];
    const long long stride = mm.out_stride[q];
    mma_each<BM>(a.count, nc, [&](int mt, int nt, int i, int m, int n) {
        out[(long long)(m0 + m) * stride + n0 + n] = acc[0][mt][nt][i];
    });
}

// Grouped experts (as moe_group_gate_up / moe_group_down, BF16 records):
// tiles of up to MMA_GROUP_ROWS pairs of one expert. An expert whose table
// entry is 0 gives NaN.
#define MMA_GROUP_ROWS 32

// act[p][i] = silu(gate_i . x[p / top_k]) * (up_i . x[p / top_k]) for the
// pairs of tile blockIdx.y. grid: (ceil(inter / 64), tiles), MMA_THREADS.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
moe_group_gate_up_mma_bf16(const u64* table, int layer_base, const int* perm, const int* tiles,
                           int top_k, const u16* xs, long long lo_off, int hidden, int inter,
                           Expert e, float* act) {
    constexpr int BM = MMA_GROUP_ROWS;
    pdl_enter();
    const int* tl = tiles + 3 * blockIdx.y;
    const int expert = tl[0], first = tl[1], count = tl[2];
    if (count == 0) return;  // past the step's last tile (grouped on the device)
    const int n0 = blockIdx.x * MMA_BN, nc = min(MMA_BN, inter - n0);
    const u64 base = expert >= 0 ? table[layer_base + expert] : 0;  // -1: an id out of range
    float acc[2][2][MmaShape<BM>::NT][4];
    mma_zero(acc);
    if (base != 0) {
        const u8* rec = (const u8*)base;
        const u8* const w[2] = {rec + e.gate_off, rec + e.up_off};
        const SplitRows a = {xs, xs + lo_off, hidden, perm + first, top_k, count};
        mma_tile<2, BM>(a, w, (long long)hidden * 2, n0, nc, hidden, acc);
    }
    mma_each<BM>(count, nc, [&](int mt, int nt, int i, int m, int n) {
        const long long p = perm[first + m];
        act[p * inter + n0 + n] = base == 0 ? __int_as_float(0x7fc00000)
                                            : silu(acc[0][mt][nt][i]) * acc[1][mt][nt][i];
    });
}

// y[p][i] = down_i . act[p] for the pairs of tile blockIdx.y.
// grid: (ceil(hidden / 64), tiles), MMA_THREADS.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
moe_group_down_mma_bf16(const u64* table, int layer_base, const int* perm, const int* tiles,
                        const u16* as, long long lo_off, int hidden, int inter, Expert e,
                        float* y) {
    constexpr int BM = MMA_GROUP_ROWS;
    pdl_enter();
    const int* tl = tiles + 3 * blockIdx.y;
    const int expert = tl[0], first = tl[1], count = tl[2];
    if (count == 0) return;  // past the step's last tile (grouped on the device)
    const int n0 = blockIdx.x * MMA_BN, nc = min(MMA_BN, hidden - n0);
    const u64 base = expert >= 0 ? table[layer_base + expert] : 0;  // -1: an id out of range
    float acc[1][2][MmaShape<BM>::NT][4];
    mma_zero(acc);
    if (base != 0) {
        const u8* rec = (const u8*)base;
        const u8* const w[1] = {rec + e.down_off};
        const SplitRows a = {as, as + lo_off, inter, perm + first, 1, count};
        mma_tile<1, BM>(a, w, (long long)inter * 2, n0, nc, inter, acc);
    }
    mma_each<BM>(count, nc, [&](int mt, int nt, int i, int m, int n) {
        const long long p = perm[first + m];
        y[p * hidden + n0 + n] = base == 0 ? __int_as_float(0x7fc00000) : acc[0][mt][nt][i];
    });
}
