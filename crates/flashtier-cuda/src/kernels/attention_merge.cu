// Merge and finalize kernels of the tiled decode attention. NVRTC compiles
// this file appended to attention.cu (nvrtc::ATTENTION_SRC), whose
// definitions (u16, NEG_INF, MAX_SPLITS, HEAD_DIM, f32_to_bf16) it uses.

// Fold `num_splits` partials into the running state of every (seq, q head);
// one CTA of 256 threads per (head, seq). `fresh` != 0: the state was reset by
// begin_step and holds nothing yet. `out` != null: also write bf16(o / l)
// (the step's last tile, finalize fused).
extern "C" __global__ void __launch_bounds__(256)
attn_merge(float* __restrict__ st_m, float* __restrict__ st_l, float* __restrict__ st_o,
           const float* __restrict__ part_m, const float* __restrict__ part_l,
           const float* __restrict__ part_o, int num_splits, int fresh, u16* __restrict__ out) {
    __shared__ float w[MAX_SPLITS];
    __shared__ float red[16];
    __shared__ float4 acc_sh[256];
    __shared__ float mm_sh, l_sh, wold_sh;
    // Programmatic dependent launch: resident early, read only after the
    // split grid has completed (a no-op when launched normally); the next
    // step's split grid may in turn get resident now (it waits for this
    // grid's completion before touching memory).
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int tid = threadIdx.x;
    const long long i = (long long)blockIdx.y * gridDim.x + blockIdx.x;  // seq * nq + head
    const float* pm = part_m + i * num_splits;
    const float* pl = part_l + i * num_splits;
    const float m_old = fresh ? NEG_INF : st_m[i];

    // Max over the splits and the old state (warp shuffles, then 8 warps).
    const int lane = tid & 31, wid = tid >> 5;
    const float ms = tid < num_splits ? pm[tid] : NEG_INF;
    float v = ms;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) red[wid] = v;
    __syncthreads();
    if (tid == 0) {
        float mm = m_old;
        for (int k = 0; k < 8; ++k) mm = fmaxf(mm, red[k]);
        mm_sh = mm;
    }
    __syncthreads();
    const float mm = mm_sh;
    const float ws = (mm == NEG_INF || ms == NEG_INF) ? 0.f : __expf(ms - mm);
    if (tid < num_splits) w[tid] = ws;
    float ls = tid < num_splits ? pl[tid] * ws : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);
    if (lane == 0) red[8 + wid] = ls;
    __syncthreads();
    if (tid == 0) {
        float lsum = 0.f;
        for (int k = 0; k < 8; ++k) lsum += red[8 + k];
        const float wold = (mm == NEG_INF || m_old == NEG_INF) ? 0.f : __expf(m_old - mm);
        const float l = lsum + (fresh ? 0.f : st_l[i] * wold);
        wold_sh = wold;
        l_sh = l;
        st_l[i] = l;
        st_m[i] = mm;
    }
    __syncthreads();

    // o: thread (column of 4 dims, split group) sums its splits, then the
    // groups are added in shared memory.
    const int cols = HEAD_DIM / 4;
    const int groups = 256 / cols;
    const int c = tid % cols;
    const int sg = tid / cols;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (sg < groups) {
        const float4* po = (const float4*)(part_o + i * num_splits * HEAD_DIM) + c;
#pragma unroll 4
        for (int s = sg; s < num_splits; s += groups) {
            const float4 v = po[(long long)s * cols];
            const float f = w[s];
            acc.x += v.x * f; acc.y += v.y * f; acc.z += v.z * f; acc.w += v.w * f;
        }
    }
    acc_sh[tid] = acc;
    __syncthreads();
    if (tid < cols) {
        float4 t = acc_sh[tid];
        for (int g = 1; g < groups; ++g) {
            const float4 u = acc_sh[g * cols + tid];
            t.x += u.x; t.y += u.y; t.z += u.z; t.w += u.w;
        }
        float4* so = (float4*)(st_o + i * HEAD_DIM) + tid;
        if (!fresh) {
            const float wold = wold_sh;
            const float4 u = *so;
            t.x += u.x * wold; t.y += u.y * wold; t.z += u.z * wold; t.w += u.w * wold;
        }
        *so = t;
        if (out != 0) {
            const float l = l_sh;
            const float inv = l > 0.f ? 1.f / l : 0.f;
            u16* dst = out + i * HEAD_DIM + tid * 4;
            dst[0] = f32_to_bf16(t.x * inv);
            dst[1] = f32_to_bf16(t.y * inv);
            dst[2] = f32_to_bf16(t.z * inv);
            dst[3] = f32_to_bf16(t.w * inv);
        }
    }
}


// out = bf16(o / l); a head that saw no token (l == 0) or `empty` writes 0.
extern "C" __global__ void __launch_bounds__(128)
attn_finalize(const float* __restrict__ st_l, const float* __restrict__ st_o, u16* __restrict__ out,
              int empty) {
    const long long i = (long long)blockIdx.y * gridDim.x + blockIdx.x;
    const float l = empty ? 0.f : st_l[i];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        const float v = l > 0.f ? st_o[i * HEAD_DIM + d] * inv : 0.f;
        out[i * HEAD_DIM + d] = f32_to_bf16(v);
    }
}
