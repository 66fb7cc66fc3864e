// Part of the decode kernels (kernels/decode/, concatenated after
// common.cuh and gemv.cu in the order ops/mod.rs gives).

// ---------------------------------------------------------------------------
// Elementwise and small kernels.

// Values per thread a norm keeps in registers (rows up to 8 x 256 = 2048
// wide; wider rows re-read the tail).
#define NORM_REGS 8

// The body of rms_norm and add_rms_norm over the n values at x: with ADD,
// x += y first (written back); then out = w * (x / sqrt(mean(x^2) + eps)).
// Thread t owns elements t, t + 256, ...; 256 threads.
template <bool ADD>
static __device__ __forceinline__ void norm_span(float* x, const float* y, const float* w, int n,
                                                 float eps, float* out) {
    __shared__ float red[8];
    const int t = threadIdx.x;
    float v[NORM_REGS], wv[NORM_REGS];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const int i = t + j * 256;
        v[j] = 0.f;
        wv[j] = i < n ? w[i] : 0.f;
        if (i < n) {
            v[j] = ADD ? x[i] + y[i] : x[i];
            if (ADD) x[i] = v[j];
            acc = fmaf(v[j], v[j], acc);
        }
    }
    for (int i = t + NORM_REGS * 256; i < n; i += 256) {
        const float s = ADD ? x[i] + y[i] : x[i];
        if (ADD) x[i] = s;
        acc = fmaf(s, s, acc);
    }
    const float inv = 1.f / sqrtf(block_sum256(acc, red) / (float)n + eps);
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const int i = t + j * 256;
        if (i < n) out[i] = wv[j] * (v[j] * inv);
    }
    for (int i = t + NORM_REGS * 256; i < n; i += 256) out[i] = w[i] * (x[i] * inv);
}

// RMSNorm of each `group`-wide slice. grid: (groups per row, rows), 256
// threads. (x is only read: norm_span<false> never writes it.)
extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* x, const float* w, int cols, int group, float eps, float* out) {
    pdl_enter();
    const long long at = (long long)blockIdx.y * cols + (long long)blockIdx.x * group;
    norm_span<false>((float*)x + at, nullptr, w, group, eps, out + at);
}

// x += y, then the RMSNorm of whole rows into out (the residual add and the
// next norm in one pass), with rms_norm's arithmetic. grid: rows, 256 threads.
extern "C" __global__ void __launch_bounds__(256)
add_rms_norm(float* x, const float* y, const float* w, int cols, float eps, float* out) {
    pdl_enter();
    const long long at = (long long)blockIdx.x * cols;
    norm_span<true>(x + at, y + at, w, cols, eps, out + at);
}

extern "C" __global__ void add_inplace(float* x, const float* y, long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void add_bias(float* x, const float* b, int cols, long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}

extern "C" __global__ void silu_mul(float* g, const float* u, long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) g[i] = silu(g[i]) * u[i];
}

// acc[r][c] += sigmoid(gate[r]) * y[r][c].
extern "C" __global__ void add_gated(float* acc, const float* y, const float* gate, int cols,
                                     long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = 1.f / (1.f + expf(-gate[i / cols]));
    acc[i] = fmaf(g, y[i], acc[i]);
}

// dst[r][h * ds + doff + i] = scale * src[r][h * ss + soff + i]. grid: rows.
extern "C" __global__ void copy_heads(const float* src, int src_cols, int ss, int soff, float* dst,
                                      int dst_cols, int ds, int doff, int heads, int len,
                                      float scale) {
    pdl_enter();
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
        // Each product rounded before the sum, as the CPU computes it (no
        // fused multiply-add): every kernel that rotates gives the same bits.
        at[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        at[half + i] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

// RoPE on `dims` columns at `h * head_stride + offset` of each head, for
// row r at position first + r; cos/sin from tables [positions][dims / 2].
// grid: (heads, rows), threads >= dims / 2.
extern "C" __global__ void rope(float* x, int cols, int head_stride, int offset, int dims,
                                int interleaved, const float* cos_t, const float* sin_t,
                                int first) {
    __shared__ float v[512];
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y;
    float* at = x + (long long)r * cols + h * head_stride + offset;
    for (int i = threadIdx.x; i < dims; i += blockDim.x) v[i] = at[i];
    __syncthreads();
    rotate(v, at, dims / 2, interleaved, cos_t, sin_t, first + r);
}

// Qwen3's per-head q/k RMSNorm (when `has_norm`; weights qw, kw `dim` wide)
// and then RoPE of whole heads, in place: block (h, r) takes q's head h for
// h < q_heads, else k's head h - q_heads, of row r at position first + r,
// or, with a decode-rows table (ops/attn/rows.rs), at the position its
// sequence holds: rows[4r + 1]. The arithmetic is rms_norm's and rope's, in
// their order (dim <= 512, so thread t owns elements t and t + 256 as in
// rms_norm). grid: (q_heads + kv_heads, rows), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
qk_norm_rope(float* q, int q_heads, const float* qw, float* k, int kv_heads, const float* kw,
             int dim, int has_norm, float eps, int interleaved, const float* cos_t,
             const float* sin_t, int first, const long long* rows) {
    __shared__ float red[8];
    __shared__ float v[512];
    pdl_enter();
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
    rotate(v, at, dim / 2, interleaved, cos_t, sin_t, rows ? (int)rows[4 * r + 1] : first + r);
}

// out[r] = table[ids[r]] widened; FP8 rows times their block scales.
template <int DT>
// Row r's id is ids[r], or id0 when ids is null (one row: the id travels
// in the launch's arguments, so a replayed graph needs no upload).
static __device__ void embed_rows(Mat a, const int* ids, int id0, int cols, float* out) {
    pdl_enter();
    const int r = blockIdx.y;
    const int id = ids ? ids[r] : id0;
    const u8* row = a.w + (long long)id * a.row_bytes;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float v = elem<DT>(row, c);
        if (DT == 3) v *= a.scales[(long long)(id / a.br) * a.sc_cols + c / a.bc];
        out[(long long)r * cols + c] = v;
    }
}

#define EMBED(NAME, DT)                                                                      \
    extern "C" __global__ void NAME(const u8* w, long long row_bytes, const float* scales,  \
                                    int sc_cols, int br, int bc, const int* ids, int id0,   \
                                    int cols, float* out) {                                  \
        Mat a = {w, row_bytes, scales, sc_cols, br, bc};                                     \
        embed_rows<DT>(a, ids, id0, cols, out);                                              \
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
    pdl_enter();
    const float* row = x + (long long)blockIdx.x * cols;
    float bv;
    int bi;
    block_best(row, cols, sv, si, &bv, &bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

// Index of the largest of x[0..n) over the grid, as the host's argmax
// (flashtier_engine's `kernels::argmax`) picks it: the lowest index of the
// largest number; 0 when x[0] is NaN or no value is a number. Block b
// scans x[b * per_block..][..per_block] into part_v/part_i[b]; the last
// block to finish reduces the partials (ties to the lower index) into
// out[0]. `counter` is 0 between launches. grid: ceil(n / per_block),
// ROUTE_THREADS threads.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
argmax_grid(const float* x, int n, int per_block, float* part_v, int* part_i, u32* counter,
            int* out) {
    __shared__ float sv[ROUTE_THREADS];
    __shared__ int si[ROUTE_THREADS];
    pdl_enter();
    const int lo = blockIdx.x * per_block, hi = min(n, lo + per_block);
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = lo + threadIdx.x; e < hi; e += ROUTE_THREADS) {
        const float v = x[e];
        if (v > bv || (v == bv && e < bi)) {
            bv = v;
            bi = e;
        }
    }
    float v;
    int i;
    block_argmax(bv, bi, sv, si, &v, &i);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = i;
    }
    if (!last_block_done(counter)) return;
    bv = -INFINITY;
    bi = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += ROUTE_THREADS) {
        const float pv = __ldcg(part_v + b);
        const int pi = __ldcg(part_i + b);
        if (pv > bv || (pv == bv && pi < bi)) {
            bv = pv;
            bi = pi;
        }
    }
    block_argmax(bv, bi, sv, si, &v, &i);
    if (threadIdx.x == 0) {
        const float x0 = x[0];
        out[0] = (x0 != x0 || i >= n) ? 0 : i;
    }
}

// Up to four byte ranges asked of L2 for a later kernel of the step (the
// attention's output product, while the attention's own small kernels
// leave HBM idle): issued before the wait (they are weights, no kernel's
// output), so they overlap the kernel before; computes nothing. Thread t
// of the grid asks for lines t, t + threads, ... of each range.
extern "C" __global__ void __launch_bounds__(256) prefetch_spans(Spans s) {
    const long long step = (long long)gridDim.x * blockDim.x * 128;
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 128;
#pragma unroll
    for (int q = 0; q < 4; ++q)
        for (long long o = first; o < s.len[q]; o += step) prefetch_l2(s.p[q] + o);
    pdl_enter();
}
