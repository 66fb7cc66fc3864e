// Part of the decode kernels (kernels/decode/, concatenated after mma.cu in
// the order ops/mod.rs gives: it uses SplitRows, ldsm_x4, mma_bf16,
// mma_zero, Expert and silu).
//
// ---------------------------------------------------------------------------
// Grouped experts on the tensor cores in wide tiles (FLASHTIER_MMA_GROUP_ROWS
// = 128): the products of moe_group_*_mma_bf16 with the same operands and
// the same order of operations per output (ascending k, 16 columns at a
// time, the hi part then the lo part into one f32 accumulator), so the same
// bits; only the tile is larger and its loads are asynchronous.
//
// Why: with tiles of 32 pairs x 64 columns, a 2048-token prompt step reads
// each expert's weights from L2 once per 32 of its pairs and each pair's
// input once per 64 columns: about 10 GB of L2 traffic a layer, which is
// what bounds those kernels. A tile of 128 pairs x 128 columns (gate and up:
// 64 columns of each) reads about half as much.
//
// Shape: MG_THREADS (8 warps) in 4 rows of 32 pairs x 2 columns of warps; a
// warp computes 32 pairs x MG_BN / 2 columns (split across the NB matrices).
// A warp whose 32 pairs are all past the tile's count skips its products
// (a tile of an expert's last few pairs costs one warp, not eight). The
// input and weight columns go through MG_STAGES shared-memory stages of
// MG_BK columns, filled by cp.async (16-byte chunks; a chunk past a row's
// end, past k or past the matrix is zero-filled, never read).
//
// Bounds: dynamic shared memory MG_SMEM_BYTES (90 KiB) per block, two
// blocks an SM.

#define MG_THREADS 256
#define MG_BM 128
#define MG_BN 128
#define MG_BK 32
#define MG_STAGES 3
// Shared rows of MG_BK + 8 BF16 values (80 bytes): the eight rows one
// ldmatrix phase reads fall in distinct banks.
#define MG_LD (MG_BK + 8)
// One stage: the input's hi rows, its lo rows, then the weight rows (MG_BN
// of them across the NB matrices), MG_LD values each.
#define MG_STAGE (3 * MG_BM * MG_LD)
#define MG_SMEM_BYTES (MG_STAGES * MG_STAGE * 2)

template <int NB>
struct MgShape {
    static constexpr int BNM = MG_BN / NB;  // columns of each matrix a block computes
    static constexpr int WNC = BNM / 2;     // of which one warp computes
    static constexpr int NT = WNC / 8;      // n8 tiles per matrix per warp
};

// 16 bytes from global to shared memory without passing through registers;
// `in` false fills the 16 bytes with zeros and reads nothing.
static __device__ __forceinline__ void mg_copy16(u16* dst, const void* src, bool in) {
#if __CUDA_ARCH__ >= 800
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                 "r"(in ? 16 : 0));
#else
    *(uint4*)dst = in ? *(const uint4*)src : make_uint4(0u, 0u, 0u, 0u);
#endif
}

static __device__ __forceinline__ void mg_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N committed groups of this thread are in flight.
template <int N>
static __device__ __forceinline__ void mg_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// acc[q][mt][nt] += x[tile rows] . W_q[n0 + tile columns] over k, as
// mma_tile in mma.cu does, for NB BF16 matrices (rows `row_bytes` apart)
// sharing the split input. Pairs past `a.count`, weight rows past `nc` and
// columns past k read as zeros. The caller zeroes acc; every thread of the
// block calls it (it synchronizes the block).
template <int NB>
static __device__ __forceinline__ void mg_tile(const SplitRows& a, const u8* const (&w)[NB],
                                               long long row_bytes, int n0, int nc, int k,
                                               float (&acc)[NB][2][MgShape<NB>::NT][4]) {
    using S = MgShape<NB>;
    extern __shared__ __align__(16) u16 mg_smem[];
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    const int wm = warp / 2, wn = warp % 2;
    const bool active = wm * 32 < a.count;
    // This thread's chunk of each stage: columns ch .. ch + 8 of rows
    // t / 4 and t / 4 + 64 (pairs for the input, matrix rows for the
    // weights: row r is column r % BNM of matrix r / BNM).
    const int ch = (t % 4) * 8;
    const u16* ahi[2];
    const u8* wrow[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int r = t / 4 + 64 * u;
        ahi[u] = r < a.count ? a.hi + (a.rows ? a.rows[r] / a.div : r) * a.stride + ch : nullptr;
        const int q = r / S::BNM, j = r % S::BNM;
        const u8* wq = q == 0 ? w[0] : w[NB - 1];
        wrow[u] = j < nc ? wq + (long long)(n0 + j) * row_bytes + ch * 2 : nullptr;
    }
    const long long lo = a.lo - a.hi;  // the lo parts' offset from the hi parts
    auto fill = [&](int slot, int k0) {
        u16* s_hi = mg_smem + slot * MG_STAGE + (t / 4) * MG_LD + ch;
        const bool kin = k0 + ch < k;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            u16* s = s_hi + 64 * u * MG_LD;
            const bool ain = kin && ahi[u] != nullptr;
            const u16* src = ain ? ahi[u] + k0 : a.hi;
            mg_copy16(s, src, ain);
            mg_copy16(s + MG_BM * MG_LD, src + (ain ? lo : 0), ain);
            const bool win = kin && wrow[u] != nullptr;
            mg_copy16(s + 2 * MG_BM * MG_LD, win ? wrow[u] + k0 * 2 : w[0], win);
        }
    };
    const int kt_count = (k + MG_BK - 1) / MG_BK;
#pragma unroll
    for (int s = 0; s < MG_STAGES - 1; ++s) {
        if (s < kt_count) fill(s, s * MG_BK);
        mg_commit();
    }
    for (int kt = 0; kt < kt_count; ++kt) {
        // Stage kt has landed (one younger group may still be in flight),
        // and every warp is done with the slot the next fill overwrites
        // (stage kt - 1's).
        mg_wait<MG_STAGES - 2>();
        __syncthreads();
        const int next = kt + MG_STAGES - 1;
        if (next < kt_count) fill(next % MG_STAGES, next * MG_BK);
        mg_commit();
        if (!active) continue;
        const u16* s_hi = mg_smem + (kt % MG_STAGES) * MG_STAGE;
        const u16* s_lo = s_hi + MG_BM * MG_LD;
        const u16* s_w = s_lo + MG_BM * MG_LD;
#pragma unroll
        for (int kk = 0; kk < MG_BK; kk += 16) {
            u32 ah[2][4], al[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int r = wm * 32 + mt * 16 + lane % 16, c = kk + (lane / 16) * 8;
                ldsm_x4(ah[mt], &s_hi[r * MG_LD + c]);
                ldsm_x4(al[mt], &s_lo[r * MG_LD + c]);
            }
#pragma unroll
            for (int q = 0; q < NB; ++q)
#pragma unroll
                for (int np = 0; np < S::NT / 2; ++np) {
                    // B fragments of n8 tiles 2 np and 2 np + 1, as in
                    // mma_tile.
                    u32 b[4];
                    const int n = q * S::BNM + wn * S::WNC + np * 16 + (lane / 16) * 8 + lane % 8;
                    ldsm_x4(b, &s_w[n * MG_LD + kk + ((lane / 8) % 2) * 8]);
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
    mg_wait<0>();
}

// The epilogue's walk for a wide tile: f(mt, nt, i, m, n) for every
// accumulator element whose pair m < rows and matrix column n < cols.
template <int NB, typename F>
static __device__ __forceinline__ void mg_each(int rows, int cols, F f) {
    using S = MgShape<NB>;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / 2, wn = warp % 2;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = wm * 32 + mt * 16 + lane / 4 + (i >= 2 ? 8 : 0);
                const int n = wn * S::WNC + nt * 8 + (lane % 4) * 2 + (i & 1);
                if (m < rows && n < cols) f(mt, nt, i, m, n);
            }
}

// act[p][i] = silu(gate_i . x[p / top_k]) * (up_i . x[p / top_k]) for the
// pairs of tile blockIdx.y (at most MG_BM). grid: (ceil(inter / 64),
// tiles), MG_THREADS, MG_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(MG_THREADS, 2)
moe_group_gate_up_wide_bf16(const u64* table, int layer_base, const int* perm, const int* tiles,
                            int top_k, const u16* xs, long long lo_off, int hidden, int inter,
                            Expert e, float* act) {
    using S = MgShape<2>;
    pdl_enter();
    const int* tl = tiles + 3 * blockIdx.y;
    const int expert = tl[0], first = tl[1], count = tl[2];
    if (count == 0) return;  // past the step's last tile (grouped on the device)
    const int n0 = blockIdx.x * S::BNM, nc = min(S::BNM, inter - n0);
    const u64 base = expert >= 0 ? table[layer_base + expert] : 0;  // -1: an id out of range
    float acc[2][2][S::NT][4];
    mma_zero(acc);
    if (base != 0) {
        const u8* rec = (const u8*)base;
        const u8* const w[2] = {rec + e.gate_off, rec + e.up_off};
        const SplitRows a = {xs, xs + lo_off, hidden, perm + first, top_k, count};
        mg_tile<2>(a, w, (long long)hidden * 2, n0, nc, hidden, acc);
    }
    mg_each<2>(count, nc, [&](int mt, int nt, int i, int m, int n) {
        const long long p = perm[first + m];
        act[p * inter + n0 + n] = base == 0 ? __int_as_float(0x7fc00000)
                                            : silu(acc[0][mt][nt][i]) * acc[1][mt][nt][i];
    });
}

// y[p][i] = down_i . act[p] for the pairs of tile blockIdx.y (at most
// MG_BM). grid: (ceil(hidden / 128), tiles), MG_THREADS, MG_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(MG_THREADS, 2)
moe_group_down_wide_bf16(const u64* table, int layer_base, const int* perm, const int* tiles,
                         const u16* as, long long lo_off, int hidden, int inter, Expert e,
                         float* y) {
    using S = MgShape<1>;
    pdl_enter();
    const int* tl = tiles + 3 * blockIdx.y;
    const int expert = tl[0], first = tl[1], count = tl[2];
    if (count == 0) return;  // past the step's last tile (grouped on the device)
    const int n0 = blockIdx.x * S::BNM, nc = min(S::BNM, hidden - n0);
    const u64 base = expert >= 0 ? table[layer_base + expert] : 0;  // -1: an id out of range
    float acc[1][2][S::NT][4];
    mma_zero(acc);
    if (base != 0) {
        const u8* rec = (const u8*)base;
        const u8* const w[1] = {rec + e.down_off};
        const SplitRows a = {as, as + lo_off, inter, perm + first, 1, count};
        mg_tile<1>(a, w, (long long)inter * 2, n0, nc, inter, acc);
    }
    mg_each<1>(count, nc, [&](int mt, int nt, int i, int m, int n) {
        const long long p = perm[first + m];
        y[p * hidden + n0 + n] = base == 0 ? __int_as_float(0x7fc00000) : acc[0][mt][nt][i];
    });
}
