// Tiled decode attention, part 2 (after attention_ptx.cu): the split
// kernel's arguments, its sub-tile, key and query loaders, and attn_split.

struct SplitArgs {
    int num_q_heads;
    int group;        // q heads per kv head
    int block_size;   // tokens per KV block
    int tile_capacity;
    long long blk_stride;  // elements
    long long tok_stride;
    long long kvh_stride;
    int sub_total;     // SUB-token sub-tiles of the longest sequence; split s
                       // covers sub-tiles [s * sub_total / splits, (s + 1) * sub_total / splits)
    float scale_log2;  // softmax scale * log2(e)
};

// Issue the cp.async copies of one 16-token sub-tile (K and V) into a stage.
// Fast path (`one_block`): a 16-aligned sub-tile never straddles a block when
// the block size is a multiple of 16, so one table lookup, `blk`, prefetched
// by the caller an iteration ahead, serves the whole sub-tile.
static __device__ __forceinline__ void load_subtile(
    const u16* __restrict__ k_pool, const u16* __restrict__ v_pool,
    const int* __restrict__ blocks, const SplitArgs& a, int kvh, int tok0, int t_end,
    unsigned char* k_stage, unsigned char* v_stage, int lane, bool one_block, int blk) {
    const long long head_off = (long long)kvh * a.kvh_stride;
#if (32 % CHUNKS_PER_ROW) == 0
    if (one_block) {
        // Each lane keeps one 16-byte column and walks rows with a constant
        // stride: one address computation per sub-tile, not per chunk.
        const int rps = 32 / CHUNKS_PER_ROW;  // rows per warp-wide chunk step
        const int r0 = lane / CHUNKS_PER_ROW;
        const int part = lane % CHUNKS_PER_ROW;
        const long long off0 = (long long)blk * a.blk_stride + head_off +
                               (long long)(tok0 % a.block_size + r0) * a.tok_stride + part * 8;
        const u16* kp = k_pool + off0;
        const u16* vp = v_pool + off0;
        const long long step = (long long)rps * a.tok_stride;
        const u32 sk = smem_addr(k_stage + r0 * PITCH + part * 16);
        const u32 sv = smem_addr(v_stage + r0 * PITCH + part * 16);
        const unsigned long long pol = kv_policy();
#pragma unroll
        for (int i = 0; i < CHUNKS_PER_LANE; ++i) {
            const bool valid = tok0 + r0 + i * rps < t_end;
            const int bytes = valid ? 16 : 0;
            if (!KREG) cp_async16(sk + i * rps * PITCH, valid ? (const void*)(kp + i * step) : (const void*)k_pool, bytes, pol);
            cp_async16(sv + i * rps * PITCH, valid ? (const void*)(vp + i * step) : (const void*)v_pool, bytes, pol);
        }
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < CHUNKS_PER_LANE; ++i) {
        const int c = lane + 32 * i;
        const int row = c / CHUNKS_PER_ROW;
        const int part = c % CHUNKS_PER_ROW;
        const int tok = tok0 + row;
        const bool valid = tok < t_end;
        long long off = 0;
        if (valid) {
            if (one_block) {
                off = (long long)blk * a.blk_stride + head_off +
                      (long long)(tok0 % a.block_size + row) * a.tok_stride;
            } else {
                const int b = blocks[tok / a.block_size];
                off = (long long)b * a.blk_stride + (long long)(tok % a.block_size) * a.tok_stride + head_off;
            }
            off += part * 8;
        }
        const int bytes = valid ? 16 : 0;
        if (!KREG) cp_async16(smem_addr(k_stage + row * PITCH + part * 16), k_pool + off, bytes);
        cp_async16(smem_addr(v_stage + row * PITCH + part * 16), v_pool + off, bytes);
    }
}

#if KREG
#define KCH (HEAD_DIM / 32)
static __device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// K of one sub-tile as B fragments: lane (g, t) holds, for token 8j + g,
// dims 32c + 8t .. 32c + 8t + 7 of every 32-dim chunk c.
static __device__ __forceinline__ void load_k_regs(uint4 (&kr)[2][KCH], const u16* __restrict__ k_pool,
                                                   const int* __restrict__ blocks, const SplitArgs& a, int kvh,
                                                   int tok0, int t_end, bool one_block, int blk, int g, int t) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int tok = tok0 + 8 * j + g;
        if (tok < t_end) {
            long long off;
            if (one_block) {
                off = (long long)blk * a.blk_stride + (long long)(tok0 % a.block_size + 8 * j + g) * a.tok_stride;
            } else {
                off = (long long)blocks[tok / a.block_size] * a.blk_stride +
                      (long long)(tok % a.block_size) * a.tok_stride;
            }
            const u16* p = k_pool + off + (long long)kvh * a.kvh_stride + 8 * t;
#pragma unroll
            for (int c = 0; c < KCH; ++c) kr[j][c] = ld_nc_v4(p + 32 * c);
        } else {
#pragma unroll
            for (int c = 0; c < KCH; ++c) kr[j][c] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}
#endif

// Q as mma A fragments (rows = query heads; rows past `rows` are zero).
static __device__ __forceinline__ void load_q(u32 (&qf)[KSTEPS][4], const u16* __restrict__ q, const SplitArgs& a,
                                              int seq, int head0, int rows, int g, int t) {
    const u16* qs = q + ((long long)seq * a.num_q_heads + head0) * HEAD_DIM;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#if KREG
        const int c0 = (ks >> 1) * 32 + 8 * t + 4 * (ks & 1);
        const int c2 = c0 + 2;
#else
        const int c0 = ks * 16 + 2 * t;
        const int c2 = c0 + 8;
#endif
        qf[ks][0] = g < rows ? *(const u32*)(qs + g * HEAD_DIM + c0) : 0u;
        qf[ks][1] = g + 8 < rows ? *(const u32*)(qs + (g + 8) * HEAD_DIM + c0) : 0u;
        qf[ks][2] = g < rows ? *(const u32*)(qs + g * HEAD_DIM + c2) : 0u;
        qf[ks][3] = g + 8 < rows ? *(const u32*)(qs + (g + 8) * HEAD_DIM + c2) : 0u;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
attn_split(const u16* __restrict__ q, const u16* __restrict__ k_pool, const u16* __restrict__ v_pool,
           const int* __restrict__ tile_blocks, const int* __restrict__ tile_tokens,
           float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_o,
           const SplitArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    // Programmatic dependent launch: this grid may be resident before the
    // previous kernel on the stream (the last step's merge) has finished;
    // nothing is read or written before that kernel completes. A no-op when
    // launched normally.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // Let the merge kernel (launched with programmatic dependent launch) get
    // resident now; it waits for this grid's completion before reading.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int split = blockIdx.x;
    const int qgroups = (a.group + 15) / 16;
    const int kvh = blockIdx.y / qgroups;
    const int qg = blockIdx.y % qgroups;
    const int seq = blockIdx.z;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int rows = min(16, a.group - qg * 16);
    const int head0 = kvh * a.group + qg * 16;

    // Balanced splits: every split gets floor or ceil of sub_total / splits
    // sub-tiles, so every CTA of a full wave streams the same bytes.
    const int splits = gridDim.x;
    const int sub_lo = (int)((long long)split * a.sub_total / splits);
    const int sub_hi = (int)((long long)(split + 1) * a.sub_total / splits);
    const int t_begin = sub_lo * SUB;
    const int* blocks = tile_blocks + (long long)seq * a.tile_capacity;
    const bool one_block = (a.block_size % SUB) == 0;
#define SUB_TOK0(i) (t_begin + (warp + (i) * WARPS) * SUB)
    u32 qf[KSTEPS][4];
    const int n_tok = tile_tokens[seq];
    const int t_end = min(n_tok, sub_hi * SUB);
    load_q(qf, q, a, seq, head0, rows, g, t);

    float o[NTILES][4];
#pragma unroll
    for (int i = 0; i < NTILES; ++i) {
        o[i][0] = 0.f; o[i][1] = 0.f; o[i][2] = 0.f; o[i][3] = 0.f;
    }
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    unsigned char* wbase = smem + warp * (STAGES * STAGE_BYTES);
    const int n_sub = t_end > t_begin ? (t_end - t_begin + SUB - 1) / SUB : 0;
    const int my_n = n_sub > warp ? (n_sub - warp + WARPS - 1) / WARPS : 0;

    // Block id of this warp's sub-tile `i` (fast path), 0 past the end.
#define BLOCK_OF(i) ((one_block && (i) < my_n) ? blocks[SUB_TOK0(i) / a.block_size] : 0)
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < my_n) {
            unsigned char* ks_ = wbase + st * STAGE_BYTES;
            load_subtile(k_pool, v_pool, blocks, a, kvh, SUB_TOK0(st), t_end, ks_, ks_ + (KREG ? 0 : SUB * PITCH),
                         lane, one_block, BLOCK_OF(st));
        }
        cp_async_commit();
    }
    int blk_next = BLOCK_OF(STAGES - 1);

#if KREG
    uint4 kc[2][KCH];
    uint4 kn[2][KCH];
    if (my_n > 0) load_k_regs(kc, k_pool, blocks, a, kvh, SUB_TOK0(0), t_end, one_block, BLOCK_OF(0), g, t);
    int kblk_next = BLOCK_OF(1);
#endif

    // ldmatrix row addresses (per lane) within a stage.
    const int lm = lane >> 3, lr = lane & 7;
#if !KREG
    const int k_row = lr + 8 * (lm >> 1), k_col = 8 * (lm & 1);  // K: non-transposed
#endif
    const int v_row = lr + 8 * (lm & 1), v_col = 8 * (lm >> 1);  // V: transposed

    for (int it = 0; it < my_n; ++it) {
        // Refill the stage consumed last iteration before waiting, so STAGES
        // sub-tiles are in flight while this warp waits and STAGES - 1 while
        // it computes.
        {
            const int nxt = it + STAGES - 1;
            if (nxt < my_n) {
                unsigned char* ks_ = wbase + (nxt % STAGES) * STAGE_BYTES;
                load_subtile(k_pool, v_pool, blocks, a, kvh, SUB_TOK0(nxt), t_end, ks_, ks_ + (KREG ? 0 : SUB * PITCH),
                             lane, one_block, blk_next);
            }
            cp_async_commit();
            // The table lookup for the next refill, an iteration early.
            blk_next = BLOCK_OF(it + STAGES);
        }
#if KREG
        // K of the next sub-tile into registers, while this one is computed.
        if (it + 1 < my_n) {
            load_k_regs(kn, k_pool, blocks, a, kvh, SUB_TOK0(it + 1), t_end, one_block, kblk_next, g, t);
        }
        kblk_next = BLOCK_OF(it + 2);
#endif
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const int stage = it % STAGES;
        unsigned char* kst = wbase + stage * STAGE_BYTES;
        unsigned char* vst = kst + (KREG ? 0 : SUB * PITCH);
        const int tok0 = t_begin + (warp + it * WARPS) * SUB;

        // S = Q K^T for 16 tokens: s[j] is the n-tile of tokens 8j..8j+7.
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#if KREG
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const uint4 k0 = kc[0][ks >> 1];
            const uint4 k1 = kc[1][ks >> 1];
            if (ks & 1) {
                mma16816(s[0], qf[ks], k0.z, k0.w);
                mma16816(s[1], qf[ks], k1.z, k1.w);
            } else {
                mma16816(s[0], qf[ks], k0.x, k0.y);
                mma16816(s[1], qf[ks], k1.x, k1.y);
            }
        }
#else
        const u32 k_addr = smem_addr(kst + k_row * PITCH + k_col * 2);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            u32 b0, b1, b2, b3;
            ldsm_x4(k_addr + ks * 32, b0, b1, b2, b3);
            mma16816(s[0], qf[ks], b0, b1);
            mma16816(s[1], qf[ks], b2, b3);
        }
#endif

        // Online softmax (log2 domain), rows g (s[.][0..1]) and g+8 (s[.][2..3]).
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool ok = tok0 + 8 * j + 2 * t + e < t_end;
                s[j][e] = ok ? s[j][e] * a.scale_log2 : NEG_INF;
                s[j][2 + e] = ok ? s[j][2 + e] * a.scale_log2 : NEG_INF;
                mx0 = fmaxf(mx0, s[j][e]);
                mx1 = fmaxf(mx1, s[j][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == NEG_INF ? 0.f : mn0;
        const float mu1 = mn1 == NEG_INF ? 0.f : mn1;
        const float al0 = fast_exp2(m0 - mu0), al1 = fast_exp2(m1 - mu1);
        m0 = mn0;
        m1 = mn1;
        float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[j][e] = fast_exp2(s[j][e] - mu0);
                s[j][2 + e] = fast_exp2(s[j][2 + e] - mu1);
                ps0 += s[j][e];
                ps1 += s[j][2 + e];
            }
        }
        l0 = l0 * al0 + ps0;
        l1 = l1 * al1 + ps1;
        // Rescale only when some row's max moved (rare once the max settles).
        if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
            for (int i = 0; i < NTILES; ++i) {
                o[i][0] *= al0; o[i][1] *= al0; o[i][2] *= al1; o[i][3] *= al1;
            }
        }

        // O += P V: P (16 heads x 16 tokens) straight from the S fragments.
        u32 pa[4];
        pa[0] = pack_bf16x2(s[0][0], s[0][1]);
        pa[1] = pack_bf16x2(s[0][2], s[0][3]);
        pa[2] = pack_bf16x2(s[1][0], s[1][1]);
        pa[3] = pack_bf16x2(s[1][2], s[1][3]);
        const u32 v_addr = smem_addr(vst + v_row * PITCH + v_col * 2);
#pragma unroll
        for (int dn = 0; dn < KSTEPS; ++dn) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(v_addr + dn * 32, b0, b1, b2, b3);
            mma16816(o[2 * dn], pa, b0, b1);
            mma16816(o[2 * dn + 1], pa, b2, b3);
        }
        __syncwarp();
#if KREG
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int c = 0; c < KCH; ++c) kc[j][c] = kn[j][c];
        }
#endif
    }
#undef BLOCK_OF
#undef SUB_TOK0
    cp_async_wait<0>();

    // Row sums over the quad.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

    // Merge the warps in shared memory (the staging area is free now).
    __syncthreads();
    float* sm_m = (float*)smem;               // [WARPS][16]
    float* sm_l = sm_m + WARPS * 16;          // [WARPS][16]
    float* sm_o = sm_l + WARPS * 16;          // [WARPS][16][HEAD_DIM]
    if (t == 0) {
        sm_m[warp * 16 + g] = m0;
        sm_m[warp * 16 + g + 8] = m1;
        sm_l[warp * 16 + g] = l0;
        sm_l[warp * 16 + g + 8] = l1;
    }
#pragma unroll
    for (int i = 0; i < NTILES; ++i) {
        float* r0 = sm_o + (warp * 16 + g) * HEAD_DIM + i * 8 + 2 * t;
        float* r1 = sm_o + (warp * 16 + g + 8) * HEAD_DIM + i * 8 + 2 * t;
        r0[0] = o[i][0]; r0[1] = o[i][1];
        r1[0] = o[i][2]; r1[1] = o[i][3];
    }
    __syncthreads();

    const int max_splits = gridDim.x;
    for (int idx = threadIdx.x; idx < rows * HEAD_DIM; idx += WARPS * 32) {
        const int r = idx / HEAD_DIM;
        const int d = idx % HEAD_DIM;
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w * 16 + r]);
        float ll = 0.f, oo = 0.f;
        if (mm != NEG_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = fast_exp2(sm_m[w * 16 + r] - mm);
                ll += sm_l[w * 16 + r] * f;
                oo += sm_o[(w * 16 + r) * HEAD_DIM + d] * f;
            }
        }
        const long long pi = ((long long)seq * a.num_q_heads + head0 + r) * max_splits + split;
        part_o[pi * HEAD_DIM + d] = oo;
        if (d == 0) {
            part_m[pi] = mm == NEG_INF ? NEG_INF : mm * LN2_F;
            part_l[pi] = ll;
        }
    }
}
