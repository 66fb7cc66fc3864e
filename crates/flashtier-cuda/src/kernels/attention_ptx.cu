// Tiled decode attention (flash-decoding) for flashtier.
//
// Compiled by NVRTC at run time with -DHEAD_DIM=<d> for the device's own
// architecture (sm_90 on Hopper). No headers: bf16 is carried as raw u16 and
// every Hopper/Ampere instruction is written as inline PTX.
//
// Contract (matches the CPU reference in flashtier::kv):
//   state per (seq, q head): m (running max, natural-log units), l (running
//   sum), o[HEAD_DIM] (unnormalised f32 accumulator).
//   attn_split  : one CTA per (split, kv head x q-head group, seq). It folds
//                 the split's share of the tile's tokens for up to 16 query
//                 heads of one kv head (GQA: the KV bytes are read once for
//                 the whole group) and writes a partial (m, l, o).
//   attn_merge  : log-sum-exp merge of the partials into the running state.
//   attn_finalize: out = bf16(o / l).
//
// Inside attn_split each warp streams 16-token sub-tiles through shared
// memory with cp.async (16-byte vectors, STAGES deep), computes S = Q K^T and
// O += P V with mma.m16n8k16 (bf16 in, f32 accumulate; the query heads are
// the M rows), keeps its own online-softmax state, and the CTA's warps merge
// in shared memory at the end.

// This part: the tile geometry and tuning switches, and the inline-PTX
// wrappers (cp.async, ldmatrix, mma, conversions); attention.cu follows with
// the loaders and attn_split, then attention_merge.cu.

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif

#define WARPS 4
#define SUB 16
// cp.async pipeline depth per warp, chosen on the host from the device's
// shared memory (bytes in flight per SM are what bound a decode kernel).
#ifndef STAGES
#define STAGES (HEAD_DIM <= 128 ? 3 : 2)
#endif
#define PITCH (HEAD_DIM * 2 + 16)
// KREG: K goes straight from global memory into mma B fragments (16-byte
// loads, the dims permuted identically in Q and K), so shared memory holds V
// alone and the V pipeline can be twice as deep. Needs HEAD_DIM % 32 == 0.
#ifndef KREG
#define KREG 0
#endif
#if KREG && (HEAD_DIM % 32 != 0)
#error "KREG needs HEAD_DIM % 32 == 0"
#endif
#define STAGE_BYTES ((KREG ? 1 : 2) * SUB * PITCH)
#define CHUNKS_PER_ROW (HEAD_DIM / 8)
#define CHUNKS_PER_LANE (SUB * CHUNKS_PER_ROW / 32)
#define KSTEPS (HEAD_DIM / 16)
#define NTILES (HEAD_DIM / 8)
#define MAX_SPLITS 256
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

typedef unsigned int u32;
typedef unsigned short u16;

#define NEG_INF (__int_as_float(0xff800000))

static __device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// L2_PF: L2 prefetch size hint of the KV copies (0 none, 1 128 B, 2 256 B).
// EVICT_FIRST: the KV copies carry an L2 evict-first policy (read once).
#ifndef L2_PF
#define L2_PF 1
#endif
#ifndef EVICT_FIRST
#define EVICT_FIRST 1
#endif
#if L2_PF == 1
#define CP_PF ".L2::128B"
#elif L2_PF == 2
#define CP_PF ".L2::256B"
#else
#define CP_PF ""
#endif

static __device__ __forceinline__ unsigned long long kv_policy() {
    unsigned long long p = 0;
#if EVICT_FIRST
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
    return p;
}

static __device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes,
                                                  unsigned long long pol = 0) {
#if EVICT_FIRST
    asm volatile("cp.async.cg.shared.global.L2::cache_hint" CP_PF " [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(pol)
                 : "memory");
#else
    (void)pol;
    asm volatile("cp.async.cg.shared.global" CP_PF " [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
#endif
}

static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

#if !KREG
static __device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
#endif

static __device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

static __device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> packed bf16x2 (round to nearest even); `lo` lands in bits 0..15.
static __device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

static __device__ __forceinline__ u16 f32_to_bf16(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

static __device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
