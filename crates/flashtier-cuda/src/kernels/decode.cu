// Kernels of the GPU decode engine: f32 activations and accumulation over
// weights in their stored form (BF16, F16, F32, or FP8 E4M3 codes with F32
// block scales). Every reduction runs in a fixed order (per-lane strided
// sums, then a butterfly over the warp, then warps in index order), so the
// same inputs give the same bits on every run. Compiled by NVRTC for the
// device's own architecture; no headers.
//
// Dtype codes (`DT`): 0 BF16, 1 F16, 2 F32, 3 FP8 E4M3 (unscaled codes; the
// block scale is applied per 8-element chunk).

#define WARP 32
#define ROUTE_THREADS 256
#define MAX_EXPERTS 1024
#define MAX_TOPK 32
#define MAX_ROWS 8
#define MAX_DIM_PER_LANE 8   // head_dim <= 256
#define ATTN_WARPS 4
#define INFINITY __int_as_float(0x7f800000)

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of one value per thread over a block of 256: warp sums, then the 8
// warp sums in warp order, the same total in every thread. `red` holds 8.
static __device__ __forceinline__ float block_sum256(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & (WARP - 1)) == 0) red[threadIdx.x / WARP] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) t += red[w];
    return t;
}

// Element `i` of a row of dtype DT.
template <int DT>
static __device__ __forceinline__ float elem(const u8* row, int i) {
    if (DT == 0) return bf16_to_f32(((const u16*)row)[i]);
    if (DT == 1) return f16_to_f32(((const u16*)row)[i]);
    if (DT == 2) return ((const float*)row)[i];
    return e4m3_to_f32(row[i]);
}

// Weight loads of one-pass kernels (a decode step reads every weight byte
// once) are evict-first (`ld.global.cs`): the step's gigabytes of weights
// stream through L2 without pushing out what the small kernels need next
// (their code, the activations, the KV cache). STREAM_WEIGHTS=0 turns the
// hint off (FLASHTIER_STREAM_WEIGHTS=0), for measuring it.
#ifndef STREAM_WEIGHTS
#define STREAM_WEIGHTS 1
#endif

template <int ONCE, typename T>
static __device__ __forceinline__ T load_weights(const T* p) {
    if (STREAM_WEIGHTS && ONCE) return __ldcs(p);
    return *p;
}

// Elements 8c..8c+8 of a row (16-byte aligned chunks for BF16/F16, 32 for
// F32, 8 for FP8); ONCE: read once per step (see load_weights).
template <int DT, int ONCE>
static __device__ __forceinline__ void load8(const u8* row, int c, float* w) {
    if (DT == 0 || DT == 1) {
        const uint4 q = load_weights<ONCE>((const uint4*)(row + (long long)c * 16));
        const u32 part[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (DT == 0) {
                w[2 * k] = bf16_to_f32(part[k] & 0xFFFFu);
                w[2 * k + 1] = bf16_to_f32(part[k] >> 16);
            } else {
                w[2 * k] = f16_to_f32(part[k] & 0xFFFFu);
                w[2 * k + 1] = f16_to_f32(part[k] >> 16);
            }
        }
    } else if (DT == 2) {
        const float4 a = load_weights<ONCE>((const float4*)(row + (long long)c * 32));
        const float4 b = load_weights<ONCE>((const float4*)(row + (long long)c * 32 + 16));
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else {
        const uint2 q = load_weights<ONCE>((const uint2*)(row + (long long)c * 8));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[k] = e4m3_to_f32((q.x >> (8 * k)) & 0xFFu);
            w[4 + k] = e4m3_to_f32((q.y >> (8 * k)) & 0xFFu);
        }
    }
}

// How a matrix is stored: `row_bytes` between rows; for FP8, the F32 scale
// grid (`sc_cols` scales per grid row) of `br x bc` blocks.
struct Mat {
    const u8* w;
    long long row_bytes;
    const float* scales;
    int sc_cols;
    int br;
    int bc;
};

// Lane partials of dot(row `m` of `a`, x[r]) for r < rows over chunks
// [c0, c1) of 8 elements (vector path) or elements [c0, c1) (scalar path),
// added into acc; four chunks in flight per lane.
template <int DT, int R>
static __device__ __forceinline__ void lane_dots(const Mat& a, int m, const float* x,
                                                 long long x_stride, int rows, int vec, int c0,
                                                 int c1, float* acc) {
    const int lane = threadIdx.x & (WARP - 1);
    const u8* row = a.w + (long long)m * a.row_bytes;
    const float* srow = DT == 3 ? a.scales + (long long)(m / a.br) * a.sc_cols : a.scales;
    if (!vec) {
        for (int i = c0 + lane; i < c1; i += WARP) {
            float w = elem<DT>(row, i);
            if (DT == 3) w *= srow[i / a.bc];
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r < rows) acc[r] = fmaf(w, x[r * x_stride + i], acc[r]);
        }
        return;
    }
    int c = c0 + lane;
    for (; c + 3 * WARP < c1; c += 4 * WARP) {
        float w[4][8];
#pragma unroll
        for (int u = 0; u < 4; ++u) load8<DT, R == 1>(row, c + u * WARP, w[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int cu = c + u * WARP;
            const float s = DT == 3 ? srow[(cu * 8) / a.bc] : 1.f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r < rows) {
                    const float4* xr = (const float4*)(x + r * x_stride + (long long)cu * 8);
                    const float4 p = xr[0], q = xr[1];
                    float d = w[u][0] * p.x;
                    d = fmaf(w[u][1], p.y, d);
                    d = fmaf(w[u][2], p.z, d);
                    d = fmaf(w[u][3], p.w, d);
                    d = fmaf(w[u][4], q.x, d);
                    d = fmaf(w[u][5], q.y, d);
                    d = fmaf(w[u][6], q.z, d);
                    d = fmaf(w[u][7], q.w, d);
                    acc[r] = DT == 3 ? fmaf(s, d, acc[r]) : acc[r] + d;
                }
            }
        }
    }
    for (; c < c1; c += WARP) {
        float w[8];
        load8<DT, R == 1>(row, c, w);
        const float s = DT == 3 ? srow[(c * 8) / a.bc] : 1.f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                const float4* xr = (const float4*)(x + r * x_stride + (long long)c * 8);
                const float4 p = xr[0], q = xr[1];
                float d = w[0] * p.x;
                d = fmaf(w[1], p.y, d);
                d = fmaf(w[2], p.z, d);
                d = fmaf(w[3], p.w, d);
                d = fmaf(w[4], q.x, d);
                d = fmaf(w[5], q.y, d);
                d = fmaf(w[6], q.z, d);
                d = fmaf(w[7], q.w, d);
                acc[r] = DT == 3 ? fmaf(s, d, acc[r]) : acc[r] + d;
            }
        }
    }
}

// acc[r] = dot(row `m` of `a`, x[r]) for r < rows, one warp; `k` columns.
template <int DT, int R>
static __device__ __forceinline__ void warp_dots(const Mat& a, int m, int k, const float* x,
                                                 long long x_stride, int rows, int vec,
                                                 float* acc) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    lane_dots<DT, R>(a, m, x, x_stride, rows, vec, 0, vec ? k / 8 : k, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
}

// Up to four matrices sharing one input and dtype, one launch: matrix q
// owns output rows [start[q], start[q + 1]) of the launch.
struct Mats {
    const u8* w[4];
    const float* scales[4];
    float* out[4];
    int start[5];
    int sc_cols[4];
    long long out_stride[4];
};

// out_q[r][i] = W_q[i] . x[r] for r < rows (<= 8). `wpr` warps (1, 2, 4 or
// 8) share one output row, each over a contiguous slice of the columns,
// their sums added in warp order; 8 / wpr rows per block of 8 warps.
template <int DT, int R>
static __device__ void gemv_multi(const Mats& mm, long long row_bytes, int br, int bc, int k,
                                  const float* x, long long x_stride, int rows, int vec,
                                  int wpr) {
    __shared__ float part[8][R];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int per_block = 8 / wpr;
    const int g = blockIdx.x * per_block + warp / wpr;
    const int slice = warp % wpr;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    int q = 0;
    while (q < 3 && g >= mm.start[q + 1]) ++q;
    const bool live = g < mm.start[4];
    if (live) {
        const Mat a = {mm.w[q], row_bytes, mm.scales[q], mm.sc_cols[q], br, bc};
        const int units = vec ? k / 8 : k;
        const int per = (units + wpr - 1) / wpr;
        const int c0 = min(units, slice * per), c1 = min(units, c0 + per);
        lane_dots<DT, R>(a, g - mm.start[q], x, x_stride, rows, vec, c0, c1, acc);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) part[warp][r] = acc[r];
    }
    __syncthreads();
    if (live && slice == 0 && lane == 0) {
        float* out = mm.out[q];
        const int i = g - mm.start[q];
        for (int r = 0; r < rows; ++r) {
            float sum = 0.f;
            for (int w = 0; w < wpr; ++w) sum += part[warp + w][r];
            out[r * mm.out_stride[q] + i] = sum;
        }
    }
}

// `gemv_*` takes up to 8 input rows per pass, `gemv1_*` exactly one (fewer
// registers, more warps resident: the decode step's case).
#define GEMV(NAME, DT, R)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                         \
    NAME(Mats mm, long long row_bytes, int br, int bc, int k, const float* x,                 \
         long long x_stride, int rows, int vec, int wpr) {                                    \
        gemv_multi<DT, R>(mm, row_bytes, br, bc, k, x, x_stride, rows, vec, wpr);             \
    }
GEMV(gemv_bf16, 0, MAX_ROWS)
GEMV(gemv_f16, 1, MAX_ROWS)
GEMV(gemv_f32, 2, MAX_ROWS)
GEMV(gemv_fp8, 3, MAX_ROWS)
GEMV(gemv1_bf16, 0, 1)
GEMV(gemv1_f16, 1, 1)
GEMV(gemv1_f32, 2, 1)
GEMV(gemv1_fp8, 3, 1)

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

// out[r][i] = sum over j < top_k (ascending id, as routed) of
// w[r][j] * down_i(j) . act[r * top_k + j]: warp w of the block takes the
// experts j = w, w + 8, ...; thread 0 adds their products in j order.
// grid: (hidden, rows), 256 threads.
template <int DT>
static __device__ void moe_down(const u64* table, int layer_base, const int* ids,
                                const float* weights, int top_k, const float* act, int hidden,
                                int inter, Expert e, int vec, float* out) {
    __shared__ float part[MAX_TOPK];
    const int r = blockIdx.y, i = blockIdx.x;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const long long rb = (long long)inter * (DT == 2 ? 4 : (DT == 3 ? 1 : 2));
    for (int j = warp; j < top_k; j += blockDim.x / WARP) {
        const long long p = (long long)r * top_k + j;
        const u64 base = table[layer_base + ids[p]];
        float acc[1] = {__int_as_float(0x7fc00000)};
        if (base != 0) {
            const u8* rec = (const u8*)base;
            Mat d = {rec + e.down_off, rb, (const float*)(rec + e.down_soff), e.dn_sc_cols,
                     e.br, e.bc};
            warp_dots<DT, 1>(d, i, inter, act + p * inter, inter, 1, vec, acc);
        }
        if (lane == 0) part[j] = acc[0];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int j = 0; j < top_k; ++j) total = fmaf(part[j], weights[(long long)r * top_k + j], total);
        out[(long long)r * hidden + i] = total;
    }
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

// ---------------------------------------------------------------------------
// Routing: one block of 256 threads per row, E <= 1024 experts, top_k <= 32.


// Block-wide max of (value, -index): ties go to the lower index.
static __device__ void block_argmax(float v, int idx, float* sv, int* si, float* out_v,
                                    int* out_i) {
    const int t = threadIdx.x;
    sv[t] = v;
    si[t] = idx;
    __syncthreads();
    for (int s = ROUTE_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            const float a = sv[t], b = sv[t + s];
            const int ia = si[t], ib = si[t + s];
            if (b > a || (b == a && ib < ia) || (a != a && b == b)) {
                sv[t] = b;
                si[t] = ib;
            }
        }
        __syncthreads();
    }
    *out_v = sv[0];
    *out_i = si[0];
    __syncthreads();
}

// The best of this thread's strided slice of s[0..n): (value, index).
static __device__ void thread_best(const float* s, int n, float* v, int* idx) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = threadIdx.x; e < n; e += ROUTE_THREADS) {
        const float x = s[e];
        if (x > bv || (x == bv && e < bi)) {
            bv = x;
            bi = e;
        }
    }
    *v = bv;
    *idx = bi;
}

// Top-k of s (destroyed: chosen entries become -inf) into sel_i.
static __device__ void top_k_into(float* s, int n, int k, int* sel_i, float* sv, int* si) {
    for (int t = 0; t < k; ++t) {
        float v;
        int i;
        thread_best(s, n, &v, &i);
        float bv;
        int bi;
        block_argmax(v, i, sv, si, &bv, &bi);
        if (threadIdx.x == 0) {
            sel_i[t] = bi < n ? bi : 0;
            if (bi < n) s[bi] = -INFINITY;
        }
        __syncthreads();
    }
}

// Write the chosen (id, weight) pairs sorted by id (thread 0).
static __device__ void write_sorted(int* sel_i, float* sel_w, int k, int* ids, float* weights) {
    for (int a = 1; a < k; ++a) {
        const int ki = sel_i[a];
        const float kw = sel_w[a];
        int b = a - 1;
        while (b >= 0 && sel_i[b] > ki) {
            sel_i[b + 1] = sel_i[b];
            sel_w[b + 1] = sel_w[b];
            --b;
        }
        sel_i[b + 1] = ki;
        sel_w[b + 1] = kw;
    }
    for (int a = 0; a < k; ++a) {
        ids[a] = sel_i[a];
        weights[a] = sel_w[a];
    }
}

// Warp-wide best of (value, index): larger value, then lower index; a
// number beats NaN.
static __device__ __forceinline__ void warp_best(float* v, int* i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, *v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, *i, o);
        if (ov > *v || (ov == *v && oi < *i) || (*v != *v && ov == ov)) {
            *v = ov;
            *i = oi;
        }
    }
}

// Softmax over E logits, the top k, renormalised to sum 1 when `norm`. One
// warp per row (grid: rows, 32 threads): lanes own experts e = lane (mod 32);
// the chosen pairs are written sorted by id, lane a placing pair a at its
// rank. Loops stay rolled: a one-warp kernel waits on every instruction
// fetch, so its code is kept short.
extern "C" __global__ void __launch_bounds__(WARP)
route_softmax(const float* logits, int n, int k, int norm, int* ids, float* weights) {
    __shared__ float p[MAX_EXPERTS];
    __shared__ int sel_i[MAX_TOPK];
    __shared__ float sel_w[MAX_TOPK];
    const int row = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)row * n;
    float mx = -INFINITY;
    for (int e = lane; e < n; e += WARP) mx = fmaxf(mx, l[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int e = lane; e < n; e += WARP) {
        const float v = expf(l[e] - mx);
        p[e] = v;
        sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < n; e += WARP) p[e] = p[e] / sum;
    __syncwarp();
    unsigned taken = 0;  // bit j: expert lane + 32 j is chosen (n <= 1024)
    for (int t = 0; t < k; ++t) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int e = lane, j = 0; e < n; e += WARP, ++j) {
            if (!((taken >> j) & 1u) && (p[e] > bv || (p[e] == bv && e < bi))) {
                bv = p[e];
                bi = e;
            }
        }
        warp_best(&bv, &bi);
        if (bi >= 0 && bi < n && (bi % WARP) == lane) {
            taken |= 1u << (bi / WARP);
        }
        if (lane == 0) {
            sel_i[t] = bi < n ? bi : 0;
            sel_w[t] = bi < n ? p[bi] : 0.f;
        }
    }
    __syncwarp();
    if (lane < k) {
        float total = 0.f;
        for (int a = 0; a < k; ++a) total += sel_w[a];
        const int id = sel_i[lane];
        float wt = sel_w[lane];
        if (norm) wt = wt / total;
        int rank = 0;
        for (int a = 0; a < k; ++a)
            rank += sel_i[a] < id || (sel_i[a] == id && a < lane);
        ids[(long long)row * k + rank] = id;
        weights[(long long)row * k + rank] = wt;
    }
}

// DeepSeek-V3: sigmoid scores; the choice ranks score + bias within the
// `topk_group` best of `n_group` groups (a group scores its two best
// choices); weights are the scores (renormalised when `norm`) times `scaling`.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
route_sigmoid_groups(const float* logits, const float* bias, int n, int k, int n_group,
                     int topk_group, float scaling, int norm, int* ids, float* weights) {
    __shared__ float score[MAX_EXPERTS];
    __shared__ float choice[MAX_EXPERTS];
    __shared__ float gscore[ROUTE_THREADS];
    __shared__ int keep[ROUTE_THREADS];
    __shared__ float sv[ROUTE_THREADS];
    __shared__ int si[ROUTE_THREADS];
    __shared__ int sel_i[MAX_TOPK];
    __shared__ float sel_w[MAX_TOPK];
    const int row = blockIdx.x;
    const float* l = logits + (long long)row * n;
    for (int e = threadIdx.x; e < n; e += ROUTE_THREADS) {
        score[e] = 1.f / (1.f + expf(-l[e]));
        choice[e] = score[e] + (bias ? bias[e] : 0.f);
    }
    __syncthreads();
    const int per = n / n_group;
    if (threadIdx.x < n_group) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = threadIdx.x * per; e < (threadIdx.x + 1) * per; ++e) {
            const float c = choice[e];
            if (c > b1) {
                b2 = b1;
                b1 = c;
            } else if (c > b2) {
                b2 = c;
            }
        }
        gscore[threadIdx.x] = b1 + b2;
        keep[threadIdx.x] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int t = 0; t < topk_group; ++t) {
            int best = -1;
            for (int g = 0; g < n_group; ++g)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            if (best >= 0) keep[best] = 1;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += ROUTE_THREADS)
        if (!keep[e / per]) choice[e] = -INFINITY;
    __syncthreads();
    top_k_into(choice, n, k, sel_i, sv, si);
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int a = 0; a < k; ++a) {
            sel_w[a] = score[sel_i[a]];
            sum += sel_w[a];
        }
        sum += 1e-20f;
        for (int a = 0; a < k; ++a) {
            if (norm) sel_w[a] = sel_w[a] / sum;
            sel_w[a] = sel_w[a] * scaling;
        }
        write_sorted(sel_i, sel_w, k, ids + (long long)row * k, weights + (long long)row * k);
    }
}

// ---------------------------------------------------------------------------
// Elementwise and small kernels.

// Values per thread a norm keeps in registers (rows up to 8 x 256 = 2048
// wide; wider rows re-read the tail).
#define NORM_REGS 8

// RMSNorm of each `group`-wide slice: out = w * (x * 1 / sqrt(mean(x^2) + eps)).
// Thread t owns elements t, t + 256, ...; grid: (groups per row, rows), 256
// threads.
extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* x, const float* w, int cols, int group, float eps, float* out) {
    __shared__ float red[8];
    const long long at = (long long)blockIdx.y * cols + (long long)blockIdx.x * group;
    const int t = threadIdx.x;
    float v[NORM_REGS], wv[NORM_REGS];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const int i = t + j * 256;
        v[j] = i < group ? x[at + i] : 0.f;
        wv[j] = i < group ? w[i] : 0.f;
        if (i < group) acc = fmaf(v[j], v[j], acc);
    }
    for (int i = t + NORM_REGS * 256; i < group; i += 256) acc = fmaf(x[at + i], x[at + i], acc);
    const float inv = 1.f / sqrtf(block_sum256(acc, red) / (float)group + eps);
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const int i = t + j * 256;
        if (i < group) out[at + i] = wv[j] * (v[j] * inv);
    }
    for (int i = t + NORM_REGS * 256; i < group; i += 256) out[at + i] = w[i] * (x[at + i] * inv);
}

// x += y, then out = w * (x / sqrt(mean(x^2) + eps)) over whole rows (the
// residual add and the next norm in one pass), with rms_norm's arithmetic.
// grid: rows, 256 threads.
extern "C" __global__ void __launch_bounds__(256)
add_rms_norm(float* x, const float* y, const float* w, int cols, float eps, float* out) {
    __shared__ float red[8];
    const long long at = (long long)blockIdx.x * cols;
    const int t = threadIdx.x;
    float v[NORM_REGS], wv[NORM_REGS];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const int i = t + j * 256;
        v[j] = 0.f;
        wv[j] = i < cols ? w[i] : 0.f;
        if (i < cols) {
            v[j] = x[at + i] + y[at + i];
            x[at + i] = v[j];
            acc = fmaf(v[j], v[j], acc);
        }
    }
    for (int i = t + NORM_REGS * 256; i < cols; i += 256) {
        const float s = x[at + i] + y[at + i];
        x[at + i] = s;
        acc = fmaf(s, s, acc);
    }
    const float inv = 1.f / sqrtf(block_sum256(acc, red) / (float)cols + eps);
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const int i = t + j * 256;
        if (i < cols) out[at + i] = wv[j] * (v[j] * inv);
    }
    for (int i = t + NORM_REGS * 256; i < cols; i += 256) out[at + i] = w[i] * (x[at + i] * inv);
}

extern "C" __global__ void add_inplace(float* x, const float* y, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void add_bias(float* x, const float* b, int cols, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}

extern "C" __global__ void silu_mul(float* g, const float* u, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) g[i] = silu(g[i]) * u[i];
}

// acc[r][c] += sigmoid(gate[r]) * y[r][c].
extern "C" __global__ void add_gated(float* acc, const float* y, const float* gate, int cols,
                                     long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = 1.f / (1.f + expf(-gate[i / cols]));
    acc[i] = fmaf(g, y[i], acc[i]);
}

// dst[r][h * ds + doff + i] = scale * src[r][h * ss + soff + i]. grid: rows.
extern "C" __global__ void copy_heads(const float* src, int src_cols, int ss, int soff, float* dst,
                                      int dst_cols, int ds, int doff, int heads, int len,
                                      float scale) {
    const int r = blockIdx.x;
    for (int t = threadIdx.x; t < heads * len; t += blockDim.x) {
        const int h = t / len, i = t % len;
        dst[(long long)r * dst_cols + h * ds + doff + i] =
            src[(long long)r * src_cols + h * ss + soff + i] * scale;
    }
}

// Write the rotation of v (2 * half values, in shared memory) by position
// `pos` to at: rotate-half pairs (i, half + i), or interleaved pairs
// (2i, 2i + 1) written to (i, half + i); the block's threads share the pairs.
static __device__ __forceinline__ void rotate(const float* v, float* at, int half, int interleaved,
                                              const float* cos_t, const float* sin_t,
                                              long long pos) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float c = cos_t[pos * half + i], s = sin_t[pos * half + i];
        float a, b;
        if (interleaved) {
            a = v[2 * i];
            b = v[2 * i + 1];
        } else {
            a = v[i];
            b = v[half + i];
        }
        at[i] = a * c - b * s;
        at[half + i] = b * c + a * s;
    }
}

// RoPE on `dims` columns at `h * head_stride + offset` of each head, for
// row r at position first + r; cos/sin from tables [positions][dims / 2].
// grid: (heads, rows), threads >= dims / 2.
extern "C" __global__ void rope(float* x, int cols, int head_stride, int offset, int dims,
                                int interleaved, const float* cos_t, const float* sin_t,
                                int first) {
    __shared__ float v[512];
    const int h = blockIdx.x, r = blockIdx.y;
    float* at = x + (long long)r * cols + h * head_stride + offset;
    for (int i = threadIdx.x; i < dims; i += blockDim.x) v[i] = at[i];
    __syncthreads();
    rotate(v, at, dims / 2, interleaved, cos_t, sin_t, first + r);
}

// Qwen3's per-head q/k RMSNorm (when `has_norm`; weights qw, kw `dim` wide)
// and then RoPE of whole heads, in place: block (h, r) takes q's head h for
// h < q_heads, else k's head h - q_heads, of row r at position first + r.
// The arithmetic is rms_norm's and rope's, in their order (dim <= 512, so
// thread t owns elements t and t + 256 as in rms_norm). grid:
// (q_heads + kv_heads, rows), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
qk_norm_rope(float* q, int q_heads, const float* qw, float* k, int kv_heads, const float* kw,
             int dim, int has_norm, float eps, int interleaved, const float* cos_t,
             const float* sin_t, int first) {
    __shared__ float red[8];
    __shared__ float v[512];
    const int h = blockIdx.x, r = blockIdx.y;
    const bool is_q = h < q_heads;
    const int heads = is_q ? q_heads : kv_heads;
    const int head = is_q ? h : h - q_heads;
    float* at = (is_q ? q : k) + ((long long)r * heads + head) * dim;
    float acc = 0.f;
    for (int i = threadIdx.x; i < dim; i += 256) {
        v[i] = at[i];
        acc = fmaf(v[i], v[i], acc);
    }
    if (has_norm) {
        const float* w = is_q ? qw : kw;
        const float inv = 1.f / sqrtf(block_sum256(acc, red) / (float)dim + eps);
        for (int i = threadIdx.x; i < dim; i += 256) v[i] = w[i] * (v[i] * inv);
    }
    __syncthreads();
    rotate(v, at, dim / 2, interleaved, cos_t, sin_t, first + r);
}

// out[r] = table[ids[r]] widened; FP8 rows times their block scales.
template <int DT>
static __device__ void embed_rows(Mat a, const int* ids, int cols, float* out) {
    const int r = blockIdx.y;
    const int id = ids[r];
    const u8* row = a.w + (long long)id * a.row_bytes;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float v = elem<DT>(row, c);
        if (DT == 3) v *= a.scales[(long long)(id / a.br) * a.sc_cols + c / a.bc];
        out[(long long)r * cols + c] = v;
    }
}

#define EMBED(NAME, DT)                                                                      \
    extern "C" __global__ void NAME(const u8* w, long long row_bytes, const float* scales,  \
                                    int sc_cols, int br, int bc, const int* ids, int cols,  \
                                    float* out) {                                            \
        Mat a = {w, row_bytes, scales, sc_cols, br, bc};                                     \
        embed_rows<DT>(a, ids, cols, out);                                                   \
    }
EMBED(embed_bf16, 0)
EMBED(embed_f16, 1)
EMBED(embed_f32, 2)
EMBED(embed_fp8, 3)

// Index of each row's largest value (the lowest on ties). grid: rows.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
argmax_rows(const float* x, int cols, int* out) {
    __shared__ float sv[ROUTE_THREADS];
    __shared__ int si[ROUTE_THREADS];
    const float* row = x + (long long)blockIdx.x * cols;
    float v;
    int i;
    thread_best(row, cols, &v, &i);
    float bv;
    int bi;
    block_argmax(v, i, sv, si, &bv, &bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

// ---------------------------------------------------------------------------
// KV cache (f32, [position][kv_head][dim] per layer) and decode attention.

// K[first + r] = k[r], V[first + r] = v[r] for each row (width = kv_heads * dim).
extern "C" __global__ void kv_append(const float* k, const float* v, float* K, float* V,
                                     int width, int first, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long at = (long long)first * width + i;
    K[at] = k[i];
    V[at] = v[i];
}

// Partial attention of query head h of row r over positions
// [s * chunk, min(len, (s + 1) * chunk)), len = first + r + 1 (causal):
// (m, l, o) of the online softmax. grid: (q_heads, rows, splits),
// ATTN_WARPS warps; part layout [(r * q_heads + h) * splits + s][2 + dim].
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP)
attn_partial(const float* q, int q_cols, const float* K, const float* V, int kv_heads, int dim,
             int group, int first, float scale, int chunk, float* part, float* direct) {
    __shared__ float wm[ATTN_WARPS];
    __shared__ float wl[ATTN_WARPS];
    __shared__ float wo[ATTN_WARPS][MAX_DIM_PER_LANE * WARP];
    const int h = blockIdx.x, r = blockIdx.y, s = blockIdx.z, splits = gridDim.z;
    const int q_heads = gridDim.x;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int len = first + r + 1;
    const int start = s * chunk;
    const int end = min(len, start + chunk);
    const int kvh = h / group;
    const int per_lane = (dim + WARP - 1) / WARP;
    float qv[MAX_DIM_PER_LANE], o[MAX_DIM_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
        const int d = lane + WARP * j;
        qv[j] = (j < per_lane && d < dim) ? q[(long long)r * q_cols + h * dim + d] : 0.f;
        o[j] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const long long row_stride = (long long)kv_heads * dim;
    for (int p = start + warp; p < end; p += ATTN_WARPS) {
        const float* kp = K + p * row_stride + (long long)kvh * dim;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
            const int d = lane + WARP * j;
            if (j < per_lane && d < dim) dot = fmaf(qv[j], kp[d], dot);
        }
        dot = warp_sum(dot) * scale;
        const float mn = fmaxf(m, dot);
        const float corr = expf(m - mn);
        const float pe = expf(dot - mn);
        l = l * corr + pe;
        const float* vp = V + p * row_stride + (long long)kvh * dim;
#pragma unroll
        for (int j = 0; j < MAX_DIM_PER_LANE; ++j) {
            const int d = lane + WARP * j;
            if (j < per_lane && d < dim) o[j] = fmaf(pe, vp[d], o[j] * corr);
        }
        m = mn;
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
