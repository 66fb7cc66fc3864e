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

// out[r][i] = sum over j < top_k (ascending id, as routed) of
// w[r][j] * down_i(j) . act[r * top_k + j] for the DOWN_ROWS rows i of
// block x: warp w takes the experts j = w, w + 8, ..., each over the
// block's rows in turn; thread t < DOWN_ROWS adds row t's products in j
// order. grid: (ceil(hidden / DOWN_ROWS), rows), 256 threads.
template <int DT>
static __device__ void moe_down(const u64* table, int layer_base, const int* ids,
                                const float* weights, int top_k, const float* act, int hidden,
                                int inter, Expert e, int vec, float* out) {
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
    const int lines = (int)((rb * rows + 127) / 128);
    for (int u = threadIdx.x; u < top_k * lines; u += blockDim.x) {
        const int j = u / lines;
        const u64 base = table[layer_base + __ldcg(ids + (long long)r * top_k + j)];
        if (base != 0)
            prefetch_l2((const u8*)base + e.down_off + (long long)i0 * rb +
                        (long long)(u % lines) * 128);
    }
    pdl_enter();
    for (int j = warp; j < top_k; j += blockDim.x / WARP) {
        const long long p = (long long)r * top_k + j;
        const u64 base = table[layer_base + ids[p]];
        const u8* rec = (const u8*)base;
        const Mat d = {rec + e.down_off, rb, (const float*)(rec + e.down_soff), e.dn_sc_cols,
                       e.br, e.bc};
        for (int q = 0; q < rows; ++q) {
            float acc[1] = {__int_as_float(0x7fc00000)};
            if (base != 0) warp_dots<DT, 1>(d, i0 + q, inter, act + p * inter, inter, 1, vec, acc);
            if (lane == 0) part[q][j] = acc[0];
        }
    }
    __syncthreads();
    const int t = threadIdx.x;
    if (t < rows) {
        float total = 0.f;
        for (int j = 0; j < top_k; ++j) total = fmaf(part[t][j], weights[(long long)r * top_k + j], total);
        out[(long long)r * hidden + i0 + t] = total;
    }
}

// ---------------------------------------------------------------------------
// A decode step of a few rows (2..MAX_ROWS, a served batch): each routed
// expert's matrices are read once for every row routed to it, not once per
// (row, expert) pair. The blocks of pair p work only when p is the first
// pair naming its expert; they then compute that expert for every pair
// naming it. Each pair's values are those of the per-pair kernels above
// (warp_dots_rows: the same order of every multiply-add per row), and the
// down products are summed per row in routed order by moe_once_sum, as
// moe_down sums them.

// Is pair p the first of the `pairs` pairs to name its expert? Every
// thread learns it, and then `mask` holds the rows routed to that expert
// and (*slot)[r] the position of that expert in row r's choice (shared
// memory). Call after the wait (the ids are the routing kernel's output).
static __device__ bool moe_group_of(const int* ids, int pairs, int top_k, int p, u32* mask,
                                    const int** slot) {
    __shared__ u32 m;
    __shared__ int sl[MAX_ROWS];
    if (threadIdx.x == 0) m = 0u;
    __syncthreads();
    const int id = ids[p];
    int earlier = 0;
    for (int q = threadIdx.x; q < pairs; q += blockDim.x) {
        if (ids[q] != id) continue;
        if (q < p) {
            earlier = 1;
        } else {
            const int r = q / top_k;
            atomicOr(&m, 1u << r);
            sl[r] = q - r * top_k;
        }
    }
    const int skip = __syncthreads_or(earlier);
    *mask = m;
    *slot = sl;
    return !skip;
}

// Row s of a group (the s-th set bit of `mask`; 0 past the last).
static __device__ __forceinline__ int group_row(u32 mask, int s) {
    const u32 r = __fns(mask, 0, s + 1);
    return r == 0xFFFFFFFFu ? 0 : (int)r;
}

// act[q][i] = silu(gate_i . x[r]) * (up_i . x[r]) for every pair q = r *
// top_k + slot[r] naming pair p's expert (see moe_gate_up for the block's
// shape). grid: (ceil(inter / 4), pairs), 256 threads.
template <int DT>
static __device__ void moe_once_gate_up(const u64* table, int layer_base, const int* ids,
                                        int top_k, int pairs, const float* x, int hidden,
                                        int inter, Expert e, int vec, float* act) {
    __shared__ float gu[4][2][MAX_ROWS];
    const int p = blockIdx.y;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int i = blockIdx.x * 4 + warp / 2, which = warp & 1;
    pdl_enter();
    u32 mask;
    const int* slot;
    if (!moe_group_of(ids, pairs, top_k, p, &mask, &slot)) return;
    const int n = __popc(mask);
    const float* xr[MAX_ROWS];
#pragma unroll
    for (int s = 0; s < MAX_ROWS; ++s) xr[s] = x + (long long)group_row(mask, s) * hidden;
    const u64 base = table[layer_base + ids[p]];
    if (i < inter && base != 0) {
        const u8* rec = (const u8*)base;
        const long long rb = (long long)hidden * (DT == 2 ? 4 : (DT == 3 ? 1 : 2));
        const long long off = which ? e.up_off : e.gate_off;
        const long long soff = which ? e.up_soff : e.gate_soff;
        Mat m = {rec + off, rb, (const float*)(rec + soff), e.gu_sc_cols, e.br, e.bc};
        float acc[MAX_ROWS];
        warp_dots_rows<DT, MAX_ROWS>(m, i, hidden, xr, n, vec, acc);
        if (lane == 0) {
#pragma unroll
            for (int s = 0; s < MAX_ROWS; ++s)
                if (s < n) gu[warp / 2][which][s] = acc[s];
        }
    }
    __syncthreads();
    const int t = threadIdx.x, s = t / 4, it = blockIdx.x * 4 + (t & 3);
    if (s < n && it < inter) {
        const int r = group_row(mask, s);
        const long long q = (long long)r * top_k + slot[r];
        act[q * inter + it] = base == 0 ? __int_as_float(0x7fc00000)
                                        : silu(gu[t & 3][0][s]) * gu[t & 3][1][s];
    }
}

// part[q][i] = down_i . act[q] for the DOWN_ROWS rows i of block x and
// every pair q naming pair p's expert (NaN when it is not resident): warp
// w takes output rows i0 + w, i0 + w + 8, ..., each over all those pairs
// at once. grid: (ceil(hidden / DOWN_ROWS), pairs), 256 threads.
template <int DT>
static __device__ void moe_once_down(const u64* table, int layer_base, const int* ids,
                                     int top_k, int pairs, const float* act, int hidden,
                                     int inter, Expert e, int vec, float* part) {
    const int p = blockIdx.y, i0 = blockIdx.x * DOWN_ROWS;
    const int rows = min(DOWN_ROWS, hidden - i0);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const long long rb = (long long)inter * (DT == 2 ? 4 : (DT == 3 ? 1 : 2));
    {
        // The block's rows of the expert's down matrix, asked of L2 before
        // the wait (as moe_down does).
        const int lines = (int)((rb * rows + 127) / 128);
        const u64 b = table[layer_base + __ldcg(ids + p)];
        if (b != 0)
            for (int u = threadIdx.x; u < lines; u += blockDim.x)
                prefetch_l2((const u8*)b + e.down_off + (long long)i0 * rb + (long long)u * 128);
    }
    pdl_enter();
    u32 mask;
    const int* slot;
    if (!moe_group_of(ids, pairs, top_k, p, &mask, &slot)) return;
    const int n = __popc(mask);
    const float* xr[MAX_ROWS];
    long long pair_of[MAX_ROWS];
#pragma unroll
    for (int s = 0; s < MAX_ROWS; ++s) {
        const int r = group_row(mask, s);
        pair_of[s] = (long long)r * top_k + slot[r];
        xr[s] = act + pair_of[s] * inter;
    }
    const u64 base = table[layer_base + ids[p]];
    for (int w = warp; w < rows; w += blockDim.x / WARP) {
        float acc[MAX_ROWS];
#pragma unroll
        for (int s = 0; s < MAX_ROWS; ++s) acc[s] = __int_as_float(0x7fc00000);
        if (base != 0) {
            const u8* rec = (const u8*)base;
            const Mat d = {rec + e.down_off, rb, (const float*)(rec + e.down_soff), e.dn_sc_cols,
                           e.br, e.bc};
            warp_dots_rows<DT, MAX_ROWS>(d, i0 + w, inter, xr, n, vec, acc);
        }
        if (lane == 0) {
#pragma unroll
            for (int s = 0; s < MAX_ROWS; ++s)
                if (s < n) part[pair_of[s] * hidden + i0 + w] = acc[s];
        }
    }
}

// out[r][i] = sum over j < top_k (in order) of part[r * top_k + j][i] *
// w[r][j], the sum moe_down makes. grid: (ceil(hidden / 256), rows), 256
// threads.
extern "C" __global__ void __launch_bounds__(256)
moe_once_sum(const float* part, const float* weights, int top_k, int hidden, float* out) {
    pdl_enter();
    const int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) return;
    float total = 0.f;
    for (int j = 0; j < top_k; ++j)
        total = fmaf(part[((long long)r * top_k + j) * hidden + i], weights[(long long)r * top_k + j],
                     total);
    out[(long long)r * hidden + i] = total;
}

#define MOE(DT, SUFFIX)                                                                         \
    extern "C" __global__ void moe_gate_up_##SUFFIX(const u64* table, int layer_base,          \
                                                    const int* ids, int top_k, const float* x,  \
                                                    int hidden, int inter, Expert e, int vec,   \
                                                    float* act) {                               \
        moe_gate_up<DT>(table, layer_base, ids, top_k, x, hidden, inter, e, vec, act);          \
    }                                                                                           \
    extern "C" __global__ void moe_down_##SUFFIX(                                              \
        const u64* table, int layer_base, const int* ids, const float* weights, int top_k,      \
        const float* act, int hidden, int inter, Expert e, int vec, float* out) {               \
        moe_down<DT>(table, layer_base, ids, weights, top_k, act, hidden, inter, e, vec, out);  \
    }
MOE(0, bf16)
MOE(1, f16)
MOE(2, f32)
MOE(3, fp8)

#define MOE_ONCE(DT, SUFFIX)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) moe_once_gate_up_##SUFFIX(               \
        const u64* table, int layer_base, const int* ids, int top_k, int pairs,                \
        const float* x, int hidden, int inter, Expert e, int vec, float* act) {                \
        moe_once_gate_up<DT>(table, layer_base, ids, top_k, pairs, x, hidden, inter, e, vec,   \
                             act);                                                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) moe_once_down_##SUFFIX(                  \
        const u64* table, int layer_base, const int* ids, int top_k, int pairs,                \
        const float* act, int hidden, int inter, Expert e, int vec, float* part) {             \
        moe_once_down<DT>(table, layer_base, ids, top_k, pairs, act, hidden, inter, e, vec,    \
                          part);                                                                \
    }
MOE_ONCE(0, bf16)
MOE_ONCE(1, f16)
MOE_ONCE(2, f32)
MOE_ONCE(3, fp8)
