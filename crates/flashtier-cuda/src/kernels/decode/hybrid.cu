// Part of the decode kernels (kernels/decode/, concatenated after the
// parts before it in the order ops/mod.rs gives; uses norm_span from
// elementwise.cu and tk_keep from route.cu).
//
// The operations of hybrid decoders (Qwen4-Exp, ops/hybrid.rs): stream
// mixers, gates, the causal convolution, the gated delta rule, and the
// sparse attention over the blocks its indexer keeps. f32 throughout; every
// sum runs in an order fixed by the shapes, so a result does not depend on
// the expert or row budget.

static __device__ __forceinline__ float hy_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// torch's softplus (beta 1, threshold 20).
static __device__ __forceinline__ float hy_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Block-wide max over 256 threads, the same value in every thread. `red`
// holds 8; the caller syncs before reusing it.
static __device__ __forceinline__ float block_max256(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & (WARP - 1)) == 0) red[threadIdx.x / WARP] = v;
    __syncthreads();
    float m = red[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) m = fmaxf(m, red[w]);
    return m;
}

// A zeroed state (the pool recycles activations without clearing them).
extern "C" __global__ void zero_fill(float* x, long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = 0.f;
}

// RMSNorm of each `group`-wide slice of a row, slice g with the weights
// w[g * group..]. grid: (groups per row, rows), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
rms_norm_wide(const float* x, const float* w, int cols, int group, float eps, float* out) {
    pdl_enter();
    const long long at = (long long)blockIdx.y * cols + (long long)blockIdx.x * group;
    norm_span<false>((float*)x + at, nullptr, w + (long long)blockIdx.x * group, group, eps,
                     out + at);
}

// x = silu(x / div) (sig == 0) or mul * sigmoid(x / div).
extern "C" __global__ void hy_map(float* x, long long n, int sig, float div, float mul) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i] / div;
    x[i] = sig ? mul * hy_sigmoid(v) : silu(v);
}

// x *= sigmoid(gate).
extern "C" __global__ void mul_sigmoid(float* x, const float* gate, long long n) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] *= hy_sigmoid(gate[i]);
}

// out[r][j] = (sum over s ascending of sigmoid(g[r][s h + j]) n[r][s h + j])
// / streams. One thread per output element.
extern "C" __global__ void hc_mix(const float* g, const float* nrm, int h, int streams,
                                  long long n, float* out) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = i / h;
    const int j = (int)(i % h);
    const long long at = r * streams * h + j;
    float acc = 0.f;
    for (int s = 0; s < streams; ++s) {
        const float v = hy_sigmoid(g[at + (long long)s * h]) * nrm[at + (long long)s * h];
        acc = s == 0 ? v : acc + v;
    }
    out[i] = acc / (float)streams;
}

// x[r][s h + j] += y[r][j] gate(w[r][s]), gate hy_map's map (sig, div,
// mul) of the raw weight. One thread per element of x.
extern "C" __global__ void hc_inject(float* x, const float* y, const float* w, int h, int streams,
                                     long long n, int sig, float div, float mul) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long wide = (long long)streams * h;
    const long long r = i / wide;
    const int c = (int)(i % wide);
    const float v = w[r * streams + c / h] / div;
    const float g = sig ? mul * hy_sigmoid(v) : silu(v);
    x[i] += y[r * h + c % h] * g;
}

// The causal depthwise convolution of `rows` rows after `(k - 1) dil` rows
// of history in `state`, SiLU after; then the state keeps the last rows.
// One thread per channel (reads its own column only, so the in-place
// update is safe: row i is written after row i + rows was read).
extern "C" __global__ void causal_conv(float* state, const float* x, const float* w, int rows,
                                       int cols, int k, int dil, float* out) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const int held = (k - 1) * dil;
    const float* wc = w + (long long)c * k;
    for (int r = 0; r < rows; ++r) {
        const int t = held + r;
        float acc = 0.f;
        for (int m = 0; m < k; ++m) {
            const int at = t - (k - 1 - m) * dil;
            const float v = at < held ? state[(long long)at * cols + c]
                                      : x[(long long)(at - held) * cols + c];
            acc += wc[m] * v;
        }
        out[(long long)r * cols + c] = silu(acc);
    }
    for (int i = 0; i < held; ++i) {
        const int at = rows + i;
        state[(long long)i * cols + c] = at < held ? state[(long long)at * cols + c]
                                                   : x[(long long)(at - held) * cols + c];
    }
}

// The gated delta rule over `rows` rows in order (ops/hybrid.rs states
// it), its state in registers: loaded once, updated row after row, stored
// once. grid: (value heads, column tiles of 32), GD_WARPS warps; lane l
// owns column j = tile * 32 + l, warp w the state rows i = w + GD_WARPS m.
// A row's two reductions over i (S^T k and S^T q) sum each thread's rows
// in ascending m, then the warps' partials in ascending w: an order fixed
// by the shapes. Key heads of at most GD_KMAX (host-checked).
#define GD_WARPS 8
#define GD_KMAX 256
#define GD_PER (GD_KMAX / GD_WARPS)
extern "C" __global__ void __launch_bounds__(GD_WARPS * WARP)
gated_delta(float* state, const float* mixed, const float* b, const float* a,
            const float* a_exp, const float* dt_bias, int rows, int k_heads, int v_heads,
            int k_dim, int v_dim, float* out) {
    pdl_enter();
    __shared__ float qs[GD_KMAX], ks[GD_KMAX];
    __shared__ float part[GD_WARPS][WARP];
    __shared__ float red[2 * GD_WARPS];
    const int hv = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & (WARP - 1), warp = tid / WARP;
    const int j = blockIdx.y * WARP + lane;
    const bool col = j < v_dim;
    const int kh = hv / (v_heads / k_heads);
    const long long kd = (long long)k_heads * k_dim;
    const long long mc = 2 * kd + (long long)v_heads * v_dim;
    float* s = state + (long long)hv * k_dim * v_dim;
    const float scale = 1.f / sqrtf((float)k_dim);
    float sv[GD_PER];
#pragma unroll
    for (int m = 0; m < GD_PER; ++m) {
        const int i = warp + GD_WARPS * m;
        sv[m] = col && i < k_dim ? s[(long long)i * v_dim + j] : 0.f;
    }
    // Row r + 1's inputs load while row r computes (k_dim <= GD_KMAX, the
    // block's thread count: thread i loads element i of q and k).
    float qn = 0.f, kn = 0.f, vn = 0.f, bn = 0.f, an = 0.f;
    auto load = [&](int r) {
        const float* row = mixed + r * mc;
        if (tid < k_dim) {
            qn = row[(long long)kh * k_dim + tid];
            kn = row[kd + (long long)kh * k_dim + tid];
        }
        vn = col ? row[2 * kd + (long long)hv * v_dim + j] : 0.f;
        bn = b[(long long)r * v_heads + hv];
        an = a[(long long)r * v_heads + hv];
    };
    if (rows > 0) load(0);
    for (int r = 0; r < rows; ++r) {
        const float qv = qn, kv = kn, v_in = vn, bv = bn, av = an;
        if (r + 1 < rows) load(r + 1);
        float sq = 0.f, sk = 0.f;
        if (tid < k_dim) {
            qs[tid] = qv;
            ks[tid] = kv;
            sq = qv * qv;
            sk = kv * kv;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        if (lane == 0) {
            red[warp] = sq;
            red[GD_WARPS + warp] = sk;
        }
        __syncthreads();
        float tq = 0.f, tk = 0.f;
#pragma unroll
        for (int w = 0; w < GD_WARPS; ++w) {
            tq += red[w];
            tk += red[GD_WARPS + w];
        }
        const float iq = 1.f / sqrtf(tq + 1e-6f);
        const float ik = 1.f / sqrtf(tk + 1e-6f);
        const float beta = hy_sigmoid(bv);
        const float decay = expf(-a_exp[hv] * hy_softplus(av + dt_bias[hv]));
        // S *= decay; this thread's share of S^T k.
        float dp = 0.f;
#pragma unroll
        for (int m = 0; m < GD_PER; ++m) {
            const int i = warp + GD_WARPS * m;
            if (i < k_dim) {
                sv[m] *= decay;
                dp += sv[m] * (ks[i] * ik);
            }
        }
        part[warp][lane] = dp;
        __syncthreads();
        float delta = 0.f;
#pragma unroll
        for (int w = 0; w < GD_WARPS; ++w) delta += part[w][lane];
        const float d = (v_in - delta) * beta;
        // Every warp has read `part` before it is overwritten.
        __syncthreads();
        float op = 0.f;
#pragma unroll
        for (int m = 0; m < GD_PER; ++m) {
            const int i = warp + GD_WARPS * m;
            if (i < k_dim) {
                sv[m] += (ks[i] * ik) * d;
                op += sv[m] * ((qs[i] * iq) * scale);
            }
        }
        part[warp][lane] = op;
        __syncthreads();
        if (warp == 0 && col) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < GD_WARPS; ++w) o += part[w][lane];
            out[(long long)r * v_heads * v_dim + (long long)hv * v_dim + j] = o;
        }
        // The next row overwrites qs, ks, red and part.
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < GD_PER; ++m) {
        const int i = warp + GD_WARPS * m;
        if (col && i < k_dim) s[(long long)i * v_dim + j] = sv[m];
    }
}

// The gated delta rule over `rows` rows in order (ops/hybrid.rs states
// it), for key heads wider than GD_KMAX (gated_delta below takes the rest). grid: (value heads, column groups of 64), 64 threads, each owning
// one column j of its head's state S[k_dim][v_dim]; dynamic shared memory:
// 2 k_dim floats (the row's normed q and k of the head's key head).
extern "C" __global__ void __launch_bounds__(64)
gated_delta_cols(float* state, const float* mixed, const float* b, const float* a,
            const float* a_exp, const float* dt_bias, int rows, int k_heads, int v_heads,
            int k_dim, int v_dim, float* out) {
    pdl_enter();
    extern __shared__ float hy_sh[];
    __shared__ float red[4];
    float* qs = hy_sh;
    float* ks = hy_sh + k_dim;
    const int hv = blockIdx.x;
    const int j = blockIdx.y * 64 + threadIdx.x;
    const int kh = hv / (v_heads / k_heads);
    const long long kd = (long long)k_heads * k_dim;
    const long long mc = 2 * kd + (long long)v_heads * v_dim;
    float* s = state + (long long)hv * k_dim * v_dim;
    const float scale = 1.f / sqrtf((float)k_dim);
    const int lane = threadIdx.x & (WARP - 1), warp = threadIdx.x / WARP;
    for (int r = 0; r < rows; ++r) {
        const float* row = mixed + r * mc;
        float sq = 0.f, sk = 0.f;
        for (int i = threadIdx.x; i < k_dim; i += 64) {
            const float qv = row[(long long)kh * k_dim + i];
            const float kv = row[kd + (long long)kh * k_dim + i];
            qs[i] = qv;
            ks[i] = kv;
            sq += qv * qv;
            sk += kv * kv;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        if (lane == 0) {
            red[warp] = sq;
            red[2 + warp] = sk;
        }
        __syncthreads();
        const float iq = 1.f / sqrtf(red[0] + red[1] + 1e-6f);
        const float ik = 1.f / sqrtf(red[2] + red[3] + 1e-6f);
        for (int i = threadIdx.x; i < k_dim; i += 64) {
            qs[i] = (qs[i] * iq) * scale;
            ks[i] = ks[i] * ik;
        }
        __syncthreads();
        const float beta = hy_sigmoid(b[(long long)r * v_heads + hv]);
        const float decay =
            expf(-a_exp[hv] * hy_softplus(a[(long long)r * v_heads + hv] + dt_bias[hv]));
        if (j < v_dim) {
            float delta = 0.f;
            for (int i = 0; i < k_dim; ++i) {
                const float v = s[(long long)i * v_dim + j] * decay;
                s[(long long)i * v_dim + j] = v;
                delta += v * ks[i];
            }
            const float d = (row[2 * kd + (long long)hv * v_dim + j] - delta) * beta;
            float o = 0.f;
            for (int i = 0; i < k_dim; ++i) {
                const float v = s[(long long)i * v_dim + j] + ks[i] * d;
                s[(long long)i * v_dim + j] = v;
                o += v * qs[i];
            }
            out[(long long)r * v_heads * v_dim + (long long)hv * v_dim + j] = o;
        }
        // The next row overwrites qs, ks and red.
        __syncthreads();
    }
}

// out = w * rms_norm(o) * act(z) per dv-wide head, act sigmoid (sig) or
// SiLU. grid: (heads per row, rows), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
gated_norm(const float* o, const float* z, const float* w, int cols, int dv, float eps, int sig,
           float* out) {
    pdl_enter();
    __shared__ float red[8];
    const long long at = (long long)blockIdx.y * cols + (long long)blockIdx.x * dv;
    float acc = 0.f;
    for (int i = threadIdx.x; i < dv; i += 256) acc += o[at + i] * o[at + i];
    const float inv = 1.f / sqrtf(block_sum256(acc, red) / (float)dv + eps);
    for (int i = threadIdx.x; i < dv; i += 256) {
        const float zv = z[at + i];
        out[at + i] = (w[i] * (o[at + i] * inv)) * (sig ? hy_sigmoid(zv) : silu(zv));
    }
}

// PLE's gated value: per (stream s, row r), g = key . query / sqrt(h) over
// the stream's h columns, g = sign(g) sqrt(max(|g|, 1e-6)), and the stream
// gets sigmoid(g) value[r]. grid: (streams, rows), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
ple_gate(const float* key, const float* query, const float* value, int h, int streams,
         float* gated) {
    pdl_enter();
    __shared__ float red[8];
    const long long at = ((long long)blockIdx.y * streams + blockIdx.x) * h;
    float acc = 0.f;
    for (int i = threadIdx.x; i < h; i += 256) acc += key[at + i] * query[at + i];
    float g = block_sum256(acc, red) / sqrtf((float)h);
    const float sg = g > 0.f ? 1.f : (g < 0.f ? -1.f : 0.f);
    g = sqrtf(fmaxf(fabsf(g), 1e-6f)) * sg;
    const float wt = hy_sigmoid(g);
    const float* v = value + (long long)blockIdx.y * h;
    for (int i = threadIdx.x; i < h; i += 256) gated[at + i] = wt * v[i];
}

// ---------------------------------------------------------------------------
// Sparse attention (QSA): the cache holds every position's keys and values
// (`kvw` wide) and raw index keys (`di` wide), and one key per complete
// block of `ratio` positions.

// Rows first..first + rows of the cache from k, v (rows x kvw) and ik
// (rows x di). One thread per element copied.
extern "C" __global__ void sparse_append(float* keys, float* values, float* index_keys,
                                         const float* k, const float* v, const float* ik,
                                         long long first, int kvw, int di, long long n_kv,
                                         long long n_ik) {
    pdl_enter();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n_kv) {
        keys[first * kvw + i] = k[i];
        values[first * kvw + i] = v[i];
    }
    if (i < n_ik) index_keys[first * di + i] = ik[i];
}

// The key of block first_block + blockIdx.x: the mean of its ratio index
// keys (summed in position order), RMSNormed with k_norm, its first
// rope_dims columns rotated (rotate_half) at the block's first position.
// 256 threads; dynamic shared memory: di floats.
extern "C" __global__ void __launch_bounds__(256)
sparse_block_keys(const float* index_keys, const float* k_norm, const float* cos_t,
                  const float* sin_t, int half, int ratio, int di, int rope_dims, float eps,
                  int first_block, float* block_keys) {
    pdl_enter();
    extern __shared__ float hy_sh[];
    __shared__ float red[8];
    const int blk = first_block + blockIdx.x;
    const float* src = index_keys + (long long)blk * ratio * di;
    float acc = 0.f;
    for (int i = threadIdx.x; i < di; i += 256) {
        float p = 0.f;
        for (int q = 0; q < ratio; ++q) p += src[(long long)q * di + i];
        p /= (float)ratio;
        hy_sh[i] = p;
        acc += p * p;
    }
    const float inv = 1.f / sqrtf(block_sum256(acc, red) / (float)di + eps);
    for (int i = threadIdx.x; i < di; i += 256) hy_sh[i] = k_norm[i] * (hy_sh[i] * inv);
    __syncthreads();
    const int rh = rope_dims / 2;
    const long long pos = (long long)blk * ratio;
    float* out = block_keys + (long long)blk * di;
    for (int i = threadIdx.x; i < di; i += 256) {
        float v = hy_sh[i];
        if (i < rh) {
            const float c = cos_t[pos * half + i], s = sin_t[pos * half + i];
            v = hy_sh[i] * c - hy_sh[i + rh] * s;
        } else if (i < rope_dims) {
            const float c = cos_t[pos * half + i - rh], s = sin_t[pos * half + i - rh];
            v = hy_sh[i] * c + hy_sh[i - rh] * s;
        }
        out[i] = v;
    }
}

// The indexer of row r (position first + r): each of its complete blocks
// scores sum over index heads of relu(iq . key) / sqrt(di); the `keep`
// best stay, as torch's CPU topk keeps them (tk_keep, ties included).
// kept[r][0..count) gets their indices ascending, count[r] how many.
// grid: rows, 256 threads; dynamic shared memory: ih * di floats (the
// row's index queries); `entries` holds max_blocks entries per row.
extern "C" __global__ void __launch_bounds__(256)
sparse_select(const float* iq, const float* block_keys, long long first, int ratio, int di,
              int ih, int keep, int max_blocks, TkEntry* entries, int* kept, int* count) {
    pdl_enter();
    extern __shared__ float hy_sh[];
    const int r = blockIdx.x;
    const long long t = first + r;
    const int n = (int)((t + 1) / ratio);
    const float* q = iq + (long long)r * ih * di;
    for (int i = threadIdx.x; i < ih * di; i += 256) hy_sh[i] = q[i];
    __syncthreads();
    int* out = kept + (long long)r * keep;
    if (n <= keep) {
        for (int b = threadIdx.x; b < n; b += 256) out[b] = b;
        if (threadIdx.x == 0) count[r] = n;
        return;
    }
    TkEntry* e = entries + (long long)r * max_blocks;
    const float root = sqrtf((float)di);
    for (int b = threadIdx.x; b < n; b += 256) {
        const float* key = block_keys + (long long)b * di;
        float s = 0.f;
        for (int h = 0; h < ih; ++h) {
            float d = 0.f;
            for (int i = 0; i < di; ++i) d += hy_sh[h * di + i] * key[i];
            s += fmaxf(d, 0.f);
        }
        e[b] = TkEntry{s / root, b};
    }
    __syncthreads();
    if (threadIdx.x == 0) tk_keep(e, n, keep);
    __syncthreads();
    for (int x = threadIdx.x; x < keep; x += 256) {
        const int id = e[x].i;
        int rank = 0;
        for (int y = 0; y < keep; ++y) rank += e[y].i < id;
        out[rank] = id;
    }
    if (threadIdx.x == 0) count[r] = keep;
}

// Attention of query head blockIdx.x of row blockIdx.y (position first +
// r) over the positions of its kept blocks, ascending, then the positions
// of its incomplete last block: online softmax over chunks of 256
// positions (fixed order), scale 1/sqrt(d). 256 threads, thread j owning
// output column j (d <= 256); dynamic shared memory: d + 256 floats.
extern "C" __global__ void __launch_bounds__(256)
sparse_attend(const float* q, const float* keys, const float* values, const int* kept,
              const int* count, long long first, int ratio, int keep, int q_heads, int kv_heads,
              int d, float* out) {
    pdl_enter();
    extern __shared__ float hy_sh[];
    __shared__ float red[8];
    float* qs = hy_sh;
    float* w = hy_sh + d;
    const int hq = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
    const int kvh = hq / (q_heads / kv_heads);
    const long long kvw = (long long)kv_heads * d;
    const long long t = first + r;
    const int nb = (int)((t + 1) / ratio);
    const int c = count[r];
    const int* kb = kept + (long long)r * keep;
    const long long span = (long long)c * ratio;
    const long long total = span + (t + 1 - (long long)nb * ratio);
    const long long qat = ((long long)r * q_heads + hq) * d;
    for (int i = tid; i < d; i += 256) qs[i] = q[qat + i];
    __syncthreads();
    const float scale = 1.f / sqrtf((float)d);
    float m = -INFINITY, l = 0.f, acc = 0.f;
    for (long long base = 0; base < total; base += 256) {
        const long long i = base + tid;
        float s = -INFINITY;
        if (i < total) {
            const long long p =
                i < span ? (long long)kb[i / ratio] * ratio + i % ratio : (long long)nb * ratio + (i - span);
            const float* k = keys + p * kvw + (long long)kvh * d;
            float dd = 0.f;
            for (int x = 0; x < d; ++x) dd += qs[x] * k[x];
            s = dd * scale;
        }
        const float cm = block_max256(s, red);
        const float mn = fmaxf(m, cm);
        const float e = i < total ? expf(s - mn) : 0.f;
        w[tid] = e;
        __syncthreads();
        const float cs = block_sum256(e, red + 0);
        const float corr = expf(m - mn);
        l = l * corr + cs;
        if (tid < d) {
            float part = 0.f;
            const long long end = total - base < 256 ? total - base : 256;
            for (long long x = 0; x < end; ++x) {
                const long long ii = base + x;
                const long long p = ii < span ? (long long)kb[ii / ratio] * ratio + ii % ratio
                                              : (long long)nb * ratio + (ii - span);
                part += w[x] * values[p * kvw + (long long)kvh * d + tid];
            }
            acc = acc * corr + part;
        }
        m = mn;
        // The next chunk overwrites w and red.
        __syncthreads();
    }
    if (tid < d) out[qat + tid] = acc / l;
}
