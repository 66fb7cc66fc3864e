// Definitions the decode and util kernels share (prepended to each by
// `flashtier_cuda`): integer types and the exact widenings of BF16, F16 and
// FP8 E4M3 to f32.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

static __device__ __forceinline__ float bf16_to_f32(u32 b) { return __int_as_float(b << 16); }

static __device__ __forceinline__ float f16_to_f32(u32 h) {
    float f;
    const unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
// 0x7F / 0xFF are NaN, 0x7E is 448. Exact in f32 (subnormals: man * 2^-9).
static __device__ __forceinline__ float e4m3_to_f32(u32 b) {
    const u32 sign = (b & 0x80u) << 24;
    const u32 exp = (b >> 3) & 0xFu;
    const u32 man = b & 0x7u;
    if (exp == 0xFu && man == 0x7u) return __int_as_float(0x7fc00000 | sign);
    if (exp == 0u) {
        const float v = (float)man * 0.001953125f;
        return __int_as_float(__float_as_int(v) | sign);
    }
    return __int_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}
