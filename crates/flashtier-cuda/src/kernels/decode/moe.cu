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

// Which block of a routed-expert launch this is: (the block of output
// rows, the pair or row). With `pairs_fast` the grid is (pairs or rows,
// output blocks), so the blocks of one output block of every pair run
// side by side: rows that share an expert read its same weight rows at
// about the same time, and L2 serves all but the first (a served batch's
// rows often share experts). The arithmetic does not depend on it.
static __device__ __forceinline__ void moe_block(int pairs_fast, int* out_block, int* unit) {
    *out_block = pairs_fast ? blockIdx.y : blockIdx.x;
    *unit = pairs_fast ? blockIdx.x : blockIdx.y;
}

// act[p][i] = silu(gate_i . x[r]) * (up_i . x[r]) for pair p = r * top_k + j,
// expert ids[p]. A block of 8 warps takes 4 output rows; warp w computes
// the gate (w even) or up (w odd) dot of row b * 4 + w / 2 of output block
// b. grid: (ceil(inter / 4), pairs), or (pairs, ceil(inter / 4)) with
// `pairs_fast` (moe_block); 256 threads.
template <int DT>
static __device__ void moe_gate_up(const u64* table, int layer_base, const int* ids, int top_k,
                                   const float* x, int hidden, int inter, Expert e, int vec,
                                   float* act, int pairs_fast) {
    __shared__ float gu[4][2];
    int b, p;
    moe_block(pairs_fast, &b, &p);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int i = b * 4 + warp / 2, which = warp & 1;
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
    const int t = threadIdx.x, it = b * 4 + t;
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
// order. grid: (ceil(hidden / DOWN_ROWS), rows), or (rows, ceil(hidden /
// DOWN_ROWS)) with `pairs_fast` (moe_block); 256 threads.
template <int DT>
static __device__ void moe_down(const u64* table, int layer_base, const int* ids,
                                const float* weights, int top_k, const float* act, int hidden,
                                int inter, Expert e, int vec, float* out, int pairs_fast) {
    __shared__ float part[DOWN_ROWS][MAX_TOPK];
    int b, r;
    moe_block(pairs_fast, &b, &r);
    const int i0 = b * DOWN_ROWS;
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

#define MOE(DT, SUFFIX)                                                                         \
    extern "C" __global__ void moe_gate_up_##SUFFIX(                                           \
        const u64* table, int layer_base, const int* ids, int top_k, const float* x,            \
        int hidden, int inter, Expert e, int vec, float* act, int pairs_fast) {                 \
        moe_gate_up<DT>(table, layer_base, ids, top_k, x, hidden, inter, e, vec, act,           \
                        pairs_fast);                                                            \
    }                                                                                           \
    extern "C" __global__ void moe_down_##SUFFIX(                                              \
        const u64* table, int layer_base, const int* ids, const float* weights, int top_k,      \
        const float* act, int hidden, int inter, Expert e, int vec, float* out,                 \
        int pairs_fast) {                                                                       \
        moe_down<DT>(table, layer_base, ids, weights, top_k, act, hidden, inter, e, vec, out,   \
                     pairs_fast);                                                               \
    }
MOE(0, bf16)
MOE(1, f16)
MOE(2, f32)
MOE(3, fp8)

// ---------------------------------------------------------------------------
// A prompt step's pairs grouped by expert on the device (ops/group.rs), the
// groups ops/gemm.rs `group_pairs` makes on the host, without copying the
// routed ids to the host: pairs first .. first + n of `ids` (row * top_k +
// rank), sorted by expert with pair order kept inside an expert, cut into
// tiles of at most `tile_rows` pairs. An id outside 0 .. experts goes to
// one more group after the last expert, whose tiles name expert -1 (the
// grouped kernels read it as not resident: NaN, never another expert's
// bytes). Three launches: the counts, then the offsets and tile starts,
// then the places; each group is one warp's ordered ballot scan, so the
// result is the same every run.

static __device__ __forceinline__ int group_of(const int* ids, int p, int experts) {
    const int e = ids[p];
    return (e >= 0 && e < experts) ? e : experts;
}

// counts[g] = the pairs of group g (g <= experts). grid: ceil((experts +
// 1) / 8), 256 threads: a warp per group.
extern "C" __global__ void group_count(const int* ids, int first, int n, int experts, int* counts) {
    pdl_enter();
    const int g = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (g > experts) return;
    int c = 0;
    for (int i = lane; i - lane < n; i += 32) {
        const bool mine = i < n && group_of(ids, first + i, experts) == g;
        c += __popc(__ballot_sync(0xffffffffu, mine));
    }
    if (lane == 0) counts[g] = c;
}

// offsets[g] = the first place of group g, tile_first[g] its first tile;
// every tile entry from the last group's end to max_tiles is (0, 0, 0), a
// tile the grouped kernels skip. One thread (at most a few hundred groups).
extern "C" __global__ void group_offsets(const int* counts, int experts, int tile_rows,
                                         int max_tiles, int* offsets, int* tile_first,
                                         int* tiles) {
    pdl_enter();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int at = 0, tile = 0;
    for (int g = 0; g <= experts; ++g) {
        offsets[g] = at;
        tile_first[g] = tile;
        at += counts[g];
        tile += (counts[g] + tile_rows - 1) / tile_rows;
    }
    for (int t = tile; t < max_tiles; ++t) {
        tiles[3 * t] = 0;
        tiles[3 * t + 1] = 0;
        tiles[3 * t + 2] = 0;
    }
}

// perm and the tiles of each group. grid: ceil((experts + 1) / 8), 256
// threads: a warp per group.
extern "C" __global__ void group_place(const int* ids, int first, int n, int experts,
                                       int tile_rows, const int* counts, const int* offsets,
                                       const int* tile_first, int* perm, int* tiles) {
    pdl_enter();
    const int g = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (g > experts) return;
    int at = offsets[g];
    for (int i = lane; i - lane < n; i += 32) {
        const bool mine = i < n && group_of(ids, first + i, experts) == g;
        const unsigned b = __ballot_sync(0xffffffffu, mine);
        if (mine) perm[at + __popc(b & ((1u << lane) - 1u))] = first + i;
        at += __popc(b);
    }
    const int c = counts[g], t0 = tile_first[g];
    for (int t = lane; t * tile_rows < c; t += 32) {
        tiles[3 * (t0 + t)] = g < experts ? g : -1;
        tiles[3 * (t0 + t) + 1] = offsets[g] + t * tile_rows;
        tiles[3 * (t0 + t) + 2] = min(tile_rows, c - t * tile_rows);
    }
}
