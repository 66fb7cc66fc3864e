// Part of the decode kernels (kernels/decode/, concatenated after
// common.cuh and gemv.cu in the order ops/mod.rs gives).

// ---------------------------------------------------------------------------
// Routed experts. An expert record lives at `table[layer_base + id]` (a
// device address; 0 means "not resident", which writes NaN rather than read
// anything); its matrices sit at fixed byte offsets inside the record.

struct Expert {
    long long gate_off, up_off, down_off;        // matrix offsets in the record
    long long gate_soff, up_soff, down_soff;     // FP8 scale offsets
    int gu_sc_cols, dn_sc_cols, br, bc;          // FP8 scale grids
};

static __device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// act[p][i] = silu(gate_i . x[r]) * (up_i . x[r]) for pair p = r * top_k + j,
// expert ids[p]. A block of 8 warps takes 4 output rows; warp w computes
// the gate (w even) or up (w odd) dot of row blockIdx.x * 4 + w / 2.
// grid: (ceil(inter / 4), pairs), 256 threads.
template <int DT>
static __device__ void moe_gate_up(const u64* table, int layer_base, const int* ids, int top_k,
                                   const float* x, int hidden, int inter, Expert e, int vec,
                                   float* act) {
    __shared__ float gu[4][2];
    const int p = blockIdx.y;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int i = blockIdx.x * 4 + warp / 2, which = warp & 1;
    const int r = p / top_k;
    pdl_enter();
    const u64 base = table[layer_base + ids[p]];
    if (i < inter && base != 0) {
        const u8* rec = (const u8*)base;
        const long long rb = (long long)hidden * (DT == 2 ? 4 : (DT == 3 ? 1 : 2));
        const long long off = which ? e.up_off : e.gate_off;
        const long long soff = which ? e.up_soff : e.gate_soff;
        Mat m = {rec + off, rb, (const float*)(rec + soff), e.gu_sc_cols, e.br, e.bc};
        float acc[1];
        warp_dots<DT, 1>(m, i, hidden, x + (long long)r * hidden, hidden, 1, vec, acc);
        if (lane == 0) gu[warp / 2][which] = acc[0];
    }
    __syncthreads();
    const int t = threadIdx.x, it = blockIdx.x * 4 + t;
    if (t < 4 && it < inter)
        act[(long long)p * inter + it] = base == 0 ? __int_as_float(0x7fc00000)
                                                   : silu(gu[t][0]) * gu[t][1];
}

// Output rows of the down product one block takes (FLASHTIER_DOWN_ROWS:
// several keep the grid to about one wave on a large GPU, where short
// blocks in several waves spent most of their time starting).
#ifndef DOWN_ROWS
#define DOWN_ROWS 4
#endif

// The down product's rows of one expert a warp computes: with
// DOWN_TOGETHER (FLASHTIER_DOWN_TOGETHER=1) the rows' loads of a round are
// in flight at once (a row of Qwen3-30B-A3B's experts is one round of
// loads per lane, so the rows' round trips overlap instead of following
// each other), at about 100 registers a thread (two blocks an SM); 0 (the
// default) takes the rows one after another at 56 (four blocks an SM).
#ifndef DOWN_TOGETHER
#define DOWN_TOGETHER 0
#endif
// The down product's weights staged in shared memory (FLASHTIER_DOWN_STAGE=1):
// before its wait, each block copies its rows of every routed expert's down
// matrix into dynamic shared memory with cp.async, so the copies run while
// the gate/up product still computes, and after the wait only the
// activations come from L2. The host gives a launch the tile's bytes of
// dynamic shared memory when it fits (top_k x DOWN_ROWS rows, a multiple of
// 16 bytes each, at most 48 KiB), else none, and a launch without it runs
// the plain path. The sums are warp_dots' (per lane in chunk order, then
// the butterfly), so either path gives the same bits. Measured about 5%
// slower than the plain path's L2 prefetch on the H200 (docs/benchmarks.md),
// so off by default.
#ifndef DOWN_STAGE
#define DOWN_STAGE 0
#endif

// Four blocks an SM either way, so 512 blocks are one wave on an H100/H200.
#if DOWN_TOGETHER || DOWN_STAGE
#define DOWN_BOUNDS __launch_bounds__(256, 4)
#else
#define DOWN_BOUNDS
#endif

static __device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// Copy 16 bytes to shared memory asynchronously, through L2 only. (With
// an L2 evict-first policy operand, NVRTC 13 built the copy's memory
// descriptor from the policy register, desc[UR7], and the H200 stopped
// there with an illegal instruction; without it the copy uses the
// kernel's own descriptor.)
static __device__ __forceinline__ void stage16(void* dst, const void* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

static __device__ __forceinline__ void stage_wait_all() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
}

// acc[q] = dot(row m0 + q of `a`, x) for q < nrows (<= NR), one warp, each
// row's sum in warp_dots' order (per lane in chunk order, then the warp's
// butterfly), whatever rounds the loads take.
template <int DT, int NR>
static __device__ __forceinline__ void warp_rows_dots(const Mat& a, int m0, int nrows, int k,
                                                      const float* x, int vec, float* acc) {
#pragma unroll
    for (int q = 0; q < NR; ++q) acc[q] = 0.f;
    if (!vec) {
        for (int q = 0; q < nrows; ++q)
            lane_dots<DT, 1>(a, m0 + q, x, k, 1, vec, 0, vec ? k / 8 : k, acc + q);
    } else {
        constexpr int LOADS = DT == 2 ? 1 : 2;
        const int lane = threadIdx.x & (WARP - 1), c1 = k / 8;
        for (int c = lane; c < c1; c += LOADS * WARP) {
            Raw raw[NR][LOADS];
#pragma unroll
            for (int q = 0; q < NR; ++q) {
                const u8* row = a.w + (long long)(m0 + q) * a.row_bytes;
#pragma unroll
                for (int u = 0; u < LOADS; ++u)
                    if (q < nrows && c + u * WARP < c1) raw[q][u] = load_raw<DT, 1>(row, c + u * WARP);
            }
#pragma unroll
            for (int q = 0; q < NR; ++q) {
                const float* srow =
                    DT == 3 ? a.scales + (long long)((m0 + q) / a.br) * a.sc_cols : a.scales;
#pragma unroll
                for (int u = 0; u < LOADS; ++u) {
                    const int cu = c + u * WARP;
                    if (q < nrows && cu < c1) {
                        float w[8];
                        widen<DT>(raw[q][u], w);
                        const float d = dot8(w, x + (long long)cu * 8);
                        acc[q] = DT == 3 ? fmaf(srow[(cu * 8) / a.bc], d, acc[q]) : acc[q] + d;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int q = 0; q < NR; ++q) acc[q] = warp_sum(acc[q]);
}

// out[r][i] = sum over j < top_k (ascending id, as routed) of
// w[r][j] * down_i(j) . act[r * top_k + j] for the DOWN_ROWS rows i of
// block x: warp w takes the experts j = w, w + 8, ..., each over the
// block's rows (warp_rows_dots); thread t < DOWN_ROWS adds row t's products in j
// order. grid: (ceil(hidden / DOWN_ROWS), rows), 256 threads.
template <int DT>
static __device__ void moe_down(const u64* table, int layer_base, const int* ids,
                                const float* weights, int top_k, const float* act, int hidden,
                                int inter, Expert e, int vec, float* out, const Spans& next) {
    __shared__ float part[DOWN_ROWS][MAX_TOPK];
    const int r = blockIdx.y, i0 = blockIdx.x * DOWN_ROWS;
    const int rows = min(DOWN_ROWS, hidden - i0);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const long long rb = (long long)inter * (DT == 2 ? 4 : (DT == 3 ? 1 : 2));
    // The block's rows of each routed expert's down matrix (contiguous),
    // asked of L2 before the wait: the ids were written by the routing,
    // which finished before the gate/up kernel before this one passed its
    // own wait (read from L2, not L1); the table is written only between
    // steps.
    extern __shared__ __align__(16) u8 down_tile[];
    const long long tile = (long long)top_k * DOWN_ROWS * rb;
    const bool staged = DOWN_STAGE && vec && rb % 16 == 0 && tile <= dynamic_smem_bytes();
    if (staged) {
        // Row q of expert j at down_tile[(j * DOWN_ROWS + q) * rb].
        const int per_row = (int)(rb / 16);
        for (int u = threadIdx.x; u < top_k * rows * per_row; u += blockDim.x) {
            const int jq = u / per_row, c = u % per_row;
            const int j = jq / rows, q = jq % rows;
            const u64 base = table[layer_base + __ldcg(ids + (long long)r * top_k + j)];
            if (base != 0)
                stage16(down_tile + ((long long)j * DOWN_ROWS + q) * rb + (long long)c * 16,
                        (const u8*)base + e.down_off + (long long)(i0 + q) * rb +
                            (long long)c * 16);
        }
    } else {
        const int lines = (int)((rb * rows + 127) / 128);
        for (int u = threadIdx.x; u < top_k * lines; u += blockDim.x) {
            const int j = u / lines;
            const u64 base = table[layer_base + __ldcg(ids + (long long)r * top_k + j)];
            if (base != 0)
                prefetch_l2((const u8*)base + e.down_off + (long long)i0 * rb +
                            (long long)(u % lines) * 128);
        }
    }
    // Weights a later kernel reads (the next layer's q/k/v, when the host
    // passes them): the down product leaves read bandwidth unused.
    grid_prefetch(next);
    pdl_enter();
    if (staged) {
        stage_wait_all();
        __syncthreads();
        const int c1 = inter / 8;
        for (int j = warp; j < top_k; j += blockDim.x / WARP) {
            const long long p = (long long)r * top_k + j;
            const u64 base = table[layer_base + ids[p]];
            const float* xa = act + p * inter;
            const float* sc = (const float*)((const u8*)base + e.down_soff);
            for (int q = 0; q < rows; ++q) {
                float acc = 0.f;
                if (base != 0) {
                    const u8* row = down_tile + ((long long)j * DOWN_ROWS + q) * rb;
                    const float* srow =
                        DT == 3 ? sc + (long long)((i0 + q) / e.br) * e.dn_sc_cols : sc;
                    for (int c = lane; c < c1; c += WARP) {
                        // Plain loads (ONCE = 0): the row is in shared memory.
                        float w[8];
                        widen<DT>(load_raw<DT, 0>(row, c), w);
                        const float d = dot8(w, xa + (long long)c * 8);
                        acc = DT == 3 ? fmaf(srow[(c * 8) / e.bc], d, acc) : acc + d;
                    }
                    acc = warp_sum(acc);
                } else {
                    acc = __int_as_float(0x7fc00000);
                }
                if (lane == 0) part[q][j] = acc;
            }
        }
    }
    for (int j = warp; j < top_k && !staged; j += blockDim.x / WARP) {
        const long long p = (long long)r * top_k + j;
        const u64 base = table[layer_base + ids[p]];
        const u8* rec = (const u8*)base;
        const Mat d = {rec + e.down_off, rb, (const float*)(rec + e.down_soff), e.dn_sc_cols,
                       e.br, e.bc};
#if DOWN_TOGETHER
        float acc[DOWN_ROWS];
        if (base != 0) {
            warp_rows_dots<DT, DOWN_ROWS>(d, i0, rows, inter, act + p * inter, vec, acc);
        } else {
#pragma unroll
            for (int q = 0; q < DOWN_ROWS; ++q) acc[q] = __int_as_float(0x7fc00000);
        }
        if (lane == 0) {
#pragma unroll
            for (int q = 0; q < DOWN_ROWS; ++q)
                if (q < rows) part[q][j] = acc[q];
        }
#else
        for (int q = 0; q < rows; ++q) {
            float acc[1] = {__int_as_float(0x7fc00000)};
            if (base != 0) warp_dots<DT, 1>(d, i0 + q, inter, act + p * inter, inter, 1, vec, acc);
            if (lane == 0) part[q][j] = acc[0];
        }
#endif
    }
    __syncthreads();
    const int t = threadIdx.x;
    if (t < rows) {
        float total = 0.f;
        for (int j = 0; j < top_k; ++j) total = fmaf(part[t][j], weights[(long long)r * top_k + j], total);
        out[(long long)r * hidden + i0 + t] = total;
    }
}

#define MOE(DT, SUFFIX)                                                                         \
    extern "C" __global__ void moe_gate_up_##SUFFIX(const u64* table, int layer_base,          \
                                                    const int* ids, int top_k, const float* x,  \
                                                    int hidden, int inter, Expert e, int vec,   \
                                                    float* act) {                               \
        moe_gate_up<DT>(table, layer_base, ids, top_k, x, hidden, inter, e, vec, act);          \
    }                                                                                           \
    extern "C" __global__ void DOWN_BOUNDS moe_down_##SUFFIX(                 \
        const u64* table, int layer_base, const int* ids, const float* weights, int top_k,      \
        const float* act, int hidden, int inter, Expert e, int vec, float* out, Spans next) {   \
        moe_down<DT>(table, layer_base, ids, weights, top_k, act, hidden, inter, e, vec, out,   \
                     next);                                                                     \
    }
MOE(0, bf16)
MOE(1, f16)
MOE(2, f32)
MOE(3, fp8)
