// Part of the decode kernels (kernels/decode/, concatenated after
// prompt_attn.cu in the order ops/mod.rs gives: it writes the partials
// attn_merge reads, as attn_prompt<D> does).

// ---------------------------------------------------------------------------
// A prompt chunk's attention on the tensor cores (ops/attn/prompt.rs):
// what attn_prompt<D> computes, with S = Q K^T and O += P V as TF32
// products of split operands.
//
// Numerics: every f32 operand x is split once, hi = tf32(x) (round to
// nearest, `cvt.rna`) and lo = tf32(x - hi) (lo = 0 where hi is not
// finite, so an inf stays an inf and never becomes inf - inf), and a
// product a b is hi_a hi_b + hi_a lo_b + lo_a hi_b, each term an
// `mma.m16n8k8` TF32 product accumulated in f32: what is dropped (lo_a
// lo_b and the rounding of lo) is a few parts in 2^22 of |a b|, about an
// f32 chain's rounding. A score keeps two accumulators, hi hi and the two
// small terms, added once at the end. The online softmax is the f32
// kernel's (scale, mask, max, expf, corrections) on those scores; then
// P, split the same way, times V.
//
// Shapes: PT_THREADS threads, 8 warps; a warp takes one m16 tile: 16
// consecutive rows of one query head, whose positions form one block of
// 16 aligned to a multiple of 16 (the tiles count rows from the aligned
// position at or below the chunk's first, rows before it or past the
// chunk are padding that is computed and never written). A block takes 8
// such tiles (rows x the heads sharing one kv head, rows outer) and one
// split, and walks the split's positions PT_BN at a time. The queries
// are split into shared memory once (hi and lo, row-major, read as A
// fragments with ldmatrix); each tile's keys are split into shared memory
// row-major (B fragments of S by ldmatrix) and its values transposed,
// each pair of positions as (hi, hi, lo, lo) so that one 128-bit load is
// a B fragment of P V. The probabilities are the score accumulators
// themselves: the accumulator holds columns 2t and 2t + 1 of a row where
// an A fragment wants t and t + 4, so P V's k index runs over the
// positions in the order 0, 2, 4, 6, 1, 3, 5, 7 and the value fragment
// reads positions 2t and 2t + 1 to match. Keys and values of the next
// tile are loaded into registers while this one is computed.
//
// What a query's bits depend on: its own q, the keys and values of its
// visible positions and the split bounds, never on which other queries
// share its tile, nor on which rows its chunk holds. Each tile updates the
// softmax once (the tiles start at the split start, a multiple of
// PT_BN); the tile of positions before the query's block of 16 is summed
// by the tensor cores (every row of the warp sees all of it); the block
// itself, where each row sees a different prefix, is summed by f32 FMAs
// in ascending position that skip a probability of 0, so a NaN or inf
// value at a later position never meets the 0 that masks it; tiles past
// the block are not visited. All three are fixed by the query's position
// alone (a row's block is its position rounded down to 16), and an
// accumulator row of mma.sync depends only on its own A row.
//
// Heads of up to D elements (D = 64 or 128; shorter heads read zeros past
// their end), width a multiple of 4. Dynamic shared memory
// (`prompt_attn_tc_smem` in ops/attn/prompt.rs, set as the kernel's limit
// when the module loads): 105 KiB for D = 64 (two blocks an SM), 205 KiB
// for D = 128 (one). Needs compute capability 8.0 (TF32 mma.sync).

#define PT_BM 128                // queries per block: 8 warps x 16
#define PT_BN 32                 // positions per tile
#define PT_THREADS 256
// Set by the host (Tuning::prompt_attn_pipe): 1 pipelines the score
// products' fragment loads (heads of 128).
#ifndef PT_PIPE
#define PT_PIPE 0
#endif
#define PT_VLD (2 * PT_BN + 16)  // floats per staged value row (column of V)

// hi = tf32(x), lo = tf32(x - hi); lo = 0 where hi is inf or NaN.
static __device__ __forceinline__ void pt_split(float x, float& hi, float& lo) {
#if __CUDA_ARCH__ >= 800
    u32 h, l;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(x));
    hi = __uint_as_float(h);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(x - hi));
    lo = isfinite(hi) ? __uint_as_float(l) : 0.f;
#else
    hi = x;
    lo = 0.f;
#endif
}

static __device__ __forceinline__ float pt_at(const float4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// c += a b for a 16x8 TF32 A fragment, an 8x8 TF32 B fragment and a 16x8
// f32 accumulator.
static __device__ __forceinline__ void pt_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four 8x4 f32 matrices (8x8 b16 to ldmatrix) from shared memory at the
// shared-window address `a`, lane l giving row l % 8 of matrix l / 8;
// lane l receives word l % 4 of row l / 4 of each.
static __device__ __forceinline__ void pt_ldsm4(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// One k step of S = Q K^T for NS n8 tiles: hi hi into sb, then hi lo and
// lo hi into ss (a: the queries' hi and lo A fragments; k: each tile's
// key B fragments, hi in words 0-1, lo in 2-3).
template <int NS>
static __device__ __forceinline__ void pt_scores(float (&sb)[NS][4], float (&ss)[NS][4],
                                                 const u32 (&ah)[4], const u32 (&al)[4],
                                                 const u32 (&kb)[NS][4]) {
#pragma unroll
    for (int nt = 0; nt < NS; ++nt) pt_mma(sb[nt], ah, kb[nt][0], kb[nt][1]);
#pragma unroll
    for (int nt = 0; nt < NS; ++nt) pt_mma(ss[nt], ah, kb[nt][2], kb[nt][3]);
#pragma unroll
    for (int nt = 0; nt < NS; ++nt) pt_mma(ss[nt], al, kb[nt][0], kb[nt][1]);
}

// grid: (ceil(ceil((rows + first % 16) / 16) * group / 8), kv_heads,
// splits of this launch); the other arguments as attn_prompt's.
template <int D>
static __device__ __forceinline__ void attn_prompt_tc(const float* q, int q_cols,
                                                      const float* arena, int kv_heads, int dim,
                                                      int group, int first, float scale, int chunk,
                                                      float* part, float* direct, int gs,
                                                      int s_first, int c_base, int slots,
                                                      int splits, int rows) {
    constexpr int LD = D + 4;                            // floats per query or key row
    constexpr int ROW4 = D / 4;                          // float4s per head
    constexpr int NO = D / 8;                            // n8 tiles of a warp's o
    constexpr int NS = PT_BN / 8;                        // n8 tiles of a warp's scores
    constexpr int KF = PT_BN * ROW4 / PT_THREADS;        // key float4s a thread stages
    constexpr int VF = (PT_BN / 2) * ROW4 / PT_THREADS;  // pairs of value float4s
    static_assert(KF * PT_THREADS == PT_BN * ROW4, "keys stage evenly");
    static_assert(VF * PT_THREADS == (PT_BN / 2) * ROW4, "values stage evenly");
    static_assert(NO % 4 == 0, "o's tiles go four at a time");
    extern __shared__ __align__(16) float pt_smem[];
    float* const sqh = pt_smem;             // [PT_BM][LD] queries, hi
    float* const sql = sqh + PT_BM * LD;    // [PT_BM][LD] queries, lo
    float* const skh = sql + PT_BM * LD;    // [PT_BN][LD] keys, hi
    float* const skl = skh + PT_BN * LD;    // [PT_BN][LD] keys, lo
    float* const svt = skl + PT_BN * LD;    // [D][PT_VLD] values by column
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int g = lane >> 2, tq = lane & 3;  // the mma fragments' row and column
    const int kvh = blockIdx.y, s = s_first + blockIdx.z;
    const int q_heads = kv_heads * group;
    const int lead = first & 15;  // padding rows before the chunk's first
    const int mtiles = ((rows + lead + 15) >> 4) * group;
    const int mt = blockIdx.x * 8 + warp;
    const bool live = mt < mtiles;
    const int j16 = mt / group, head = kvh * group + mt % group;
    const int pos0 = first - lead + 16 * j16;  // the position of the warp's row 0
    const int start = s * chunk;
    const int split_end = min(first + rows, start + chunk);
    // The block's last row with a query bounds the positions read.
    const int mt_last = min(blockIdx.x * 8 + 7, mtiles - 1);
    const int r_last = min(rows - 1, (mt_last / group) * 16 + 15 - lead);
    const int kend = min(split_end, first + r_last + 1);
    const float* base = arena + (long long)((s - c_base) % slots) * (2LL * kv_heads * gs);
    const float* K = base + (long long)kvh * gs;
    const float* V = base + (long long)(kv_heads + kvh) * gs;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);

    // This thread's rows g and g + 8 of the warp's tile: written or not.
    bool valid[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * j16 + g + 8 * hf - lead;
        valid[hf] = live && r >= 0 && r < rows;
    }

    // The block's queries, split once.
#pragma unroll 4
    for (int idx = t; idx < PT_BM * ROW4; idx += PT_THREADS) {
        const int row = idx / ROW4, c = (idx % ROW4) * 4;
        const int m2 = blockIdx.x * 8 + row / 16;
        const int r = (m2 / group) * 16 + row % 16 - lead;
        float4 x = zero4;
        if (m2 < mtiles && r >= 0 && r < rows && c < dim) {
            const int h = kvh * group + m2 % group;
            x = *(const float4*)(q + (long long)r * q_cols + h * dim + c);
        }
        float4 hi, lo;
        pt_split(x.x, hi.x, lo.x);
        pt_split(x.y, hi.y, lo.y);
        pt_split(x.z, hi.z, lo.z);
        pt_split(x.w, hi.w, lo.w);
        *(float4*)&sqh[row * LD + c] = hi;
        *(float4*)&sql[row * LD + c] = lo;
    }

    // A tile's keys and values, loaded into registers one tile ahead
    // (zeros past kend and past the head), then split into shared memory.
    float4 kpre[KF], vpre[VF][2];
    auto load_tile = [&](int p0) {
#pragma unroll
        for (int e = 0; e < KF; ++e) {
            const int idx = t + e * PT_THREADS;
            const int p = p0 + idx / ROW4, c = (idx % ROW4) * 4;
            kpre[e] = (p < kend && c < dim) ? *(const float4*)(K + (long long)(p - start) * dim + c)
                                            : zero4;
        }
#pragma unroll
        for (int e = 0; e < VF; ++e) {
            const int idx = t + e * PT_THREADS;
            const int p = p0 + 2 * (idx % (PT_BN / 2)), c = (idx / (PT_BN / 2)) * 4;
            const float* src = V + (long long)(p - start) * dim + c;
            vpre[e][0] = (p < kend && c < dim) ? *(const float4*)src : zero4;
            vpre[e][1] = (p + 1 < kend && c < dim) ? *(const float4*)(src + dim) : zero4;
        }
    };
    auto store_tile = [&]() {
#pragma unroll
        for (int e = 0; e < KF; ++e) {
            const int idx = t + e * PT_THREADS;
            const int row = idx / ROW4, c = (idx % ROW4) * 4;
            float4 hi, lo;
            pt_split(kpre[e].x, hi.x, lo.x);
            pt_split(kpre[e].y, hi.y, lo.y);
            pt_split(kpre[e].z, hi.z, lo.z);
            pt_split(kpre[e].w, hi.w, lo.w);
            *(float4*)&skh[row * LD + c] = hi;
            *(float4*)&skl[row * LD + c] = lo;
        }
        // Position pair pr of column c + i at svt[(c + i) * PT_VLD + 4 pr]:
        // the 8 lanes of a store phase take pairs 0..7 of one column, 16
        // distinct bytes of every bank quadruple (PT_VLD = 16 mod 32).
#pragma unroll
        for (int e = 0; e < VF; ++e) {
            const int idx = t + e * PT_THREADS;
            const int pr = idx % (PT_BN / 2), c = (idx / (PT_BN / 2)) * 4;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float4 w;
                pt_split(pt_at(vpre[e][0], i), w.x, w.z);
                pt_split(pt_at(vpre[e][1], i), w.y, w.w);
                *(float4*)&svt[(c + i) * PT_VLD + 4 * pr] = w;
            }
        }
    };

    // ldmatrix row addresses: the queries' lanes give rows g' and g' + 8
    // at columns +0 and +4 (A fragment a0..a3); the keys' lanes give
    // position rows at columns +0 and +4, hi then lo (B fragments).
    const u32 q_lane = (u32)__cvta_generic_to_shared(
        sqh + (16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 4);
    const u32 q_lo = PT_BM * LD * 4;  // bytes from hi to lo
    const u32 k_lane = (u32)__cvta_generic_to_shared(
        ((lane >> 4) ? skl : skh) + (lane & 7) * LD + ((lane >> 3) & 1) * 4);

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[n][c] = 0.f;

    if (start < kend) load_tile(start);
    for (int p0 = start; p0 < kend; p0 += PT_BN) {
        __syncthreads();  // the last tile's keys and values are read
        store_tile();
        if (p0 + PT_BN < kend) load_tile(p0 + PT_BN);
        __syncthreads();
        // Tiles past the warp's block of 16 are none of its rows' business.
        if (!live || p0 >= pos0 + 16) continue;
        const bool diag = p0 + PT_BN > pos0;  // the tile holding the block

        // S = Q K^T: hi hi into sb, hi lo + lo hi into ss, ascending d.
        float sb[NS][4], ss[NS][4];
#pragma unroll
        for (int nt = 0; nt < NS; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) sb[nt][c] = ss[nt][c] = 0.f;
        if constexpr (PT_PIPE && D == 128) {
            // The next k step's fragments load while this step's products run
            // (two register buffers; the loop unrolled, so each is fixed). The
            // same pt_scores as below, so the same bits. Heads of 128 only: their kernel has up
            // to 255 registers (252 with this), the 64-wide one 128.
            const int ksn = min(D / 8, (dim + 7) / 8);
            u32 fa[2][2][4], fk[2][NS][4];
            auto frag = [&](int ks, int b) {
                pt_ldsm4(fa[b][0], q_lane + ks * 32);
                pt_ldsm4(fa[b][1], q_lane + q_lo + ks * 32);
#pragma unroll
                for (int nt = 0; nt < NS; ++nt) pt_ldsm4(fk[b][nt], k_lane + (nt * 8 * LD + ks * 8) * 4);
            };
            frag(0, 0);
#pragma unroll
            for (int ks = 0; ks < D / 8; ++ks) {
                if (ks >= ksn) break;
                const int b = ks & 1;
                if (ks + 1 < ksn) frag(ks + 1, b ^ 1);
                pt_scores<NS>(sb, ss, fa[b][0], fa[b][1], fk[b]);
            }
        } else {
#pragma unroll 4
            for (int ks = 0; ks < D / 8; ++ks) {
                if (ks * 8 >= dim) break;  // zeros past the head
                u32 ah[4], al[4], kb[NS][4];
                pt_ldsm4(ah, q_lane + ks * 32);
                pt_ldsm4(al, q_lane + q_lo + ks * 32);
#pragma unroll
                for (int nt = 0; nt < NS; ++nt) pt_ldsm4(kb[nt], k_lane + (nt * 8 * LD + ks * 8) * 4);
                pt_scores<NS>(sb, ss, ah, al, kb);
            }
        }

        // The online softmax of rows g (hf 0) and g + 8 (hf 1): the quad
        // of lanes 4g..4g+3 holds a row, 2 positions per n8 tile each.
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pos = pos0 + g + 8 * hf;
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int p = p0 + nt * 8 + 2 * tq + e;
                    const float x = (sb[nt][2 * hf + e] + ss[nt][2 * hf + e]) * scale;
                    sb[nt][2 * hf + e] = (diag && p > pos) ? -INFINITY : x;
                    mx = fmaxf(mx, sb[nt][2 * hf + e]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[hf], mx);
            float corr = 1.f, rs = 0.f;
            if (mn != -INFINITY) {
                corr = expf(m[hf] - mn);
#pragma unroll
                for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        sb[nt][2 * hf + e] = expf(sb[nt][2 * hf + e] - mn);
                        rs += sb[nt][2 * hf + e];
                    }
            } else {
#pragma unroll
                for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) sb[nt][2 * hf + e] = 0.f;
            }
            rs += __shfl_xor_sync(0xffffffffu, rs, 1);
            rs += __shfl_xor_sync(0xffffffffu, rs, 2);
            l[hf] = l[hf] * corr + rs;
            m[hf] = mn;
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                o[n][2 * hf] *= corr;
                o[n][2 * hf + 1] *= corr;
            }
        }

        // O += P V on the tensor cores over the positions every row of the
        // warp sees: the whole tile, or in the block's tile those before
        // the block. P's k order is 0, 2, 4, 6, 1, 3, 5, 7 (see the top).
        const int ksee = diag ? (pos0 - p0) / 8 : NS;
#pragma unroll
        for (int kk = 0; kk < NS; ++kk) {
            if (kk >= ksee) break;
            float f[4][2];
            pt_split(sb[kk][0], f[0][0], f[0][1]);
            pt_split(sb[kk][2], f[1][0], f[1][1]);
            pt_split(sb[kk][1], f[2][0], f[2][1]);
            pt_split(sb[kk][3], f[3][0], f[3][1]);
            const u32 ph[4] = {__float_as_uint(f[0][0]), __float_as_uint(f[1][0]),
                               __float_as_uint(f[2][0]), __float_as_uint(f[3][0])};
            const u32 pl[4] = {__float_as_uint(f[0][1]), __float_as_uint(f[1][1]),
                               __float_as_uint(f[2][1]), __float_as_uint(f[3][1])};
            const float* vrow = svt + g * PT_VLD + (4 * kk + tq) * 4;
#pragma unroll
            for (int n0 = 0; n0 < NO; n0 += 4) {
                float4 vb[4];
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    vb[u] = *(const float4*)(vrow + (n0 + u) * 8 * PT_VLD);
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    pt_mma(o[n0 + u], ph, __float_as_uint(vb[u].x), __float_as_uint(vb[u].y));
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    pt_mma(o[n0 + u], ph, __float_as_uint(vb[u].z), __float_as_uint(vb[u].w));
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    pt_mma(o[n0 + u], pl, __float_as_uint(vb[u].x), __float_as_uint(vb[u].y));
            }
        }

        // The block of 16 in f32, ascending position, a probability of 0
        // skipped: row g + 8 hf sees positions pos0 .. pos0 + g + 8 hf.
        // Values come from global memory (the tile's, just staged: L1 or
        // L2), exact f32; only positions a written row sees are read.
        if (diag) {
            // This lane's probabilities in the block, cand[half][e][hf]:
            // positions 8 half + 2 tq + e of rows g + 8 hf.
            const bool upper = pos0 - p0 >= 16;  // the block is the tile's second half
            float cand[2][2][2];
#pragma unroll
            for (int h8 = 0; h8 < 2; ++h8)
#pragma unroll
                for (int e = 0; e < 2; ++e)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
                        cand[h8][e][hf] = valid[hf]
                                              ? (upper ? sb[h8 + 2][2 * hf + e] : sb[h8][2 * hf + e])
                                              : 0.f;
            const float* vq = V + (long long)(pos0 - start) * dim + 2 * tq;
#pragma unroll 2
            for (int j = 0; j < 16; ++j) {
                // Position j of the block is held by lane 4g + (j % 8) / 2.
                const int src = (lane & ~3) | ((j & 7) >> 1);
                const bool h8 = j >= 8, odd = j & 1;
                float pr[2];
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float x = h8 ? (odd ? cand[1][1][hf] : cand[1][0][hf])
                                       : (odd ? cand[0][1][hf] : cand[0][0][hf]);
                    pr[hf] = __shfl_sync(0xffffffffu, x, src);
                }
                if (pr[0] != 0.f || pr[1] != 0.f) {
                    const float* vj = vq + (long long)j * dim;
#pragma unroll
                    for (int n = 0; n < NO; ++n) {
                        if (8 * n + 2 * tq >= dim) break;
                        const float2 v = *(const float2*)(vj + 8 * n);
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf)
                            if (pr[hf] != 0.f) {
                                o[n][2 * hf] = fmaf(pr[hf], v.x, o[n][2 * hf]);
                                o[n][2 * hf + 1] = fmaf(pr[hf], v.y, o[n][2 * hf + 1]);
                            }
                    }
                }
            }
        }
    }

    // The split's partial, or with one split the finished o / l.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (!valid[hf]) continue;
        const int r = 16 * j16 + g + 8 * hf - lead;
        float* dst;
        float div = 1.f;
        if (direct) {
            dst = direct + (long long)r * q_cols + head * dim;
            div = l[hf];
        } else {
            float* out = part + ((long long)(r * q_heads + head) * splits + s) * (2 + dim);
            if (tq == 0) {
                out[0] = m[hf];
                out[1] = l[hf];
            }
            dst = out + 2;
        }
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            const int d = 8 * n + 2 * tq;
            if (d >= dim) break;
            const float x = o[n][2 * hf], y = o[n][2 * hf + 1];
            *(float2*)(dst + d) = direct ? make_float2(x / div, y / div) : make_float2(x, y);
        }
    }
}

#define ATTN_PROMPT_TC(D, MIN_BLOCKS)                                                            \
    extern "C" __global__ void __launch_bounds__(PT_THREADS, MIN_BLOCKS)                         \
    attn_prompt_tc_##D(const float* q, int q_cols, const float* arena, int kv_heads, int dim,     \
                       int group, int first, float scale, int chunk, float* part, float* direct,  \
                       int gs, int s_first, int c_base, int slots, int splits, int rows) {        \
        pdl_enter();                                                                             \
        attn_prompt_tc<D>(q, q_cols, arena, kv_heads, dim, group, first, scale, chunk, part,     \
                          direct, gs, s_first, c_base, slots, splits, rows);                     \
    }
// Two blocks of heads of 64 (105 KiB each) fit a Hopper SM's 228 KiB,
// so they get 128 registers a thread; an Ampere SM holds one block
// either way. Heads of 128 take 205 KiB: one block an SM, up to 255
// registers at no cost in occupancy.
#if __CUDA_ARCH__ >= 900
#define PT_BLOCKS_64 2
#else
#define PT_BLOCKS_64 1
#endif
ATTN_PROMPT_TC(64, PT_BLOCKS_64)
ATTN_PROMPT_TC(128, 1)
