// Kernels of the GPU decode engine: f32 activations and accumulation over
// weights in their stored form (BF16, F16, F32, or FP8 E4M3 codes with F32
// block scales). Every reduction runs in a fixed order (per-lane strided
// sums, then a butterfly over the warp, then warps in index order), so the
// same inputs give the same bits on every run. Compiled by NVRTC for the
// device's own architecture, after common.cuh; the other parts of
// kernels/decode/ follow this one.
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
// Positions a warp of the decode attention loads ahead (FLASHTIER_ATTN_AHEAD).
#ifndef ATTN_AHEAD
#define ATTN_AHEAD 4
#endif
#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (sm_90): inside a graph whose edge into a
// kernel is programmatic (launch/graph.rs), the kernel's blocks may start
// while the kernel before it still runs. pdl_wait() returns once that
// kernel has finished and its writes are visible; before it a kernel only
// reads what no kernel of the step writes (weights, the expert table) and
// writes nothing. pdl_launch() lets the next kernel's blocks start (their
// prologue overlaps this kernel); every kernel calls it right after its
// wait, so at most two kernels are in flight. Outside such a graph (launches
// one by one, older devices) both do nothing, so the results are the same.
static __device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Both, at the top of a kernel with no prologue.
static __device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch();
}

// Ask L2 for the 128-byte line holding `p` (a hint; `p` must lie in an
// allocation).
static __device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The calling warp asks L2 for bytes [0, len) at `p`, a line per lane in turn.
static __device__ __forceinline__ void warp_prefetch(const u8* p, long long len) {
    for (long long o = (long long)(threadIdx.x & 31) * 128; o < len; o += 32 * 128)
        prefetch_l2(p + o);
}

// Up to four byte ranges to ask L2 for (ops/hint.rs builds them).
struct Spans {
    const u8* p[4];
    long long len[4];
};

// After every thread of the block wrote its part of the grid's result:
// whether this block is the last of the grid to get here (then every other
// block's writes are visible to it; read them with __ldcg). The last block
// sets the counter back to 0 for the next launch. All threads call it.
static __device__ bool last_block_done(u32* counter) {
    __shared__ u32 ticket;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(counter, 1u);
    __syncthreads();
    const bool last = ticket == gridDim.x * gridDim.y * gridDim.z - 1;
    if (last) {
        __threadfence();
        if (threadIdx.x == 0) *counter = 0u;
    }
    return last;
}

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

// Chunks of 8 weights a lane keeps in flight in a one-row product
// (FLASHTIER_GEMV_LOADS sets it); several rows per pass keep 4.
#ifndef GEMV_LOADS
#define GEMV_LOADS 4
#endif

// Chunk c of a row as loaded: 8 elements (16-byte aligned chunks for
// BF16/F16, 32 for F32 (in a and b), 8 for FP8 (a.x, a.y)), widened only
// when used (widen), so several loads are in flight at once.
struct Raw {
    uint4 a, b;
};

// ONCE: read once per step (see load_weights).
template <int DT, int ONCE>
static __device__ __forceinline__ Raw load_raw(const u8* row, int c) {
    Raw r = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    if (DT == 0 || DT == 1) {
        r.a = load_weights<ONCE>((const uint4*)(row + (long long)c * 16));
    } else if (DT == 2) {
        r.a = load_weights<ONCE>((const uint4*)(row + (long long)c * 32));
        r.b = load_weights<ONCE>((const uint4*)(row + (long long)c * 32 + 16));
    } else {
        const uint2 q = load_weights<ONCE>((const uint2*)(row + (long long)c * 8));
        r.a.x = q.x;
        r.a.y = q.y;
    }
    return r;
}

// The 8 elements of a loaded chunk, widened exactly.
template <int DT>
static __device__ __forceinline__ void widen(const Raw& r, float* w) {
    if (DT == 0 || DT == 1) {
        const u32 part[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
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
        const u32 v[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = __uint_as_float(v[k]);
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[k] = e4m3_to_f32((r.a.x >> (8 * k)) & 0xFFu);
            w[4 + k] = e4m3_to_f32((r.a.y >> (8 * k)) & 0xFFu);
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

// w[0..8) . x[0..8) (x 16-byte aligned), multiply-adds in element order.
static __device__ __forceinline__ float dot8(const float* w, const float* x) {
    const float4 p = ((const float4*)x)[0], q = ((const float4*)x)[1];
    float d = w[0] * p.x;
    d = fmaf(w[1], p.y, d);
    d = fmaf(w[2], p.z, d);
    d = fmaf(w[3], p.w, d);
    d = fmaf(w[4], q.x, d);
    d = fmaf(w[5], q.y, d);
    d = fmaf(w[6], q.z, d);
    return fmaf(w[7], q.w, d);
}

// Lane partials of dot(row `m` of `a`, x[r]) for r < rows over chunks
// [c0, c1) of 8 elements (vector path) or elements [c0, c1) (scalar path),
// added into acc; several chunks in flight per lane (LOADS).
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
    // Chunks c, c + 32, ... in order, LOADS loads in flight per round: the
    // sums are added in chunk order whatever LOADS is.
    constexpr int LOADS = R == 1 ? (DT == 2 && GEMV_LOADS > 4 ? 4 : GEMV_LOADS) : 4;
    for (int c = c0 + lane; c < c1; c += LOADS * WARP) {
        Raw raw[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u)
            if (c + u * WARP < c1) raw[u] = load_raw<DT, R == 1>(row, c + u * WARP);
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int cu = c + u * WARP;
            if (cu < c1) {
                float w[8];
                widen<DT>(raw[u], w);
                const float s = DT == 3 ? srow[(cu * 8) / a.bc] : 1.f;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r < rows) {
                        const float d = dot8(w, x + r * x_stride + (long long)cu * 8);
                        acc[r] = DT == 3 ? fmaf(s, d, acc[r]) : acc[r] + d;
                    }
                }
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
    const int units = vec ? k / 8 : k;
    const int per = (units + wpr - 1) / wpr;
    const int c0 = min(units, slice * per), c1 = min(units, c0 + per);
    if (live) {
        // The weights are no kernel's output: ask for this warp's slice of
        // its row before waiting on the kernel before (see pdl_wait).
        const long long eb = DT == 2 ? 4 : (DT == 3 ? 1 : 2);
        const long long ub = vec ? 8 * eb : eb;
        warp_prefetch(mm.w[q] + (long long)(g - mm.start[q]) * row_bytes + c0 * ub,
                      (c1 - c0) * ub);
    }
    pdl_enter();
    if (live) {
        const Mat a = {mm.w[q], row_bytes, mm.scales[q], mm.sc_cols[q], br, bc};
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
