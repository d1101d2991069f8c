// Fragments and dequantization: the activation dtypes' traits, the codes of layout v1 as exact floats
// (the bias trick), zero points and scales applied in the activation dtype, and the group of a K column.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: the encoder is fetched from the driver at run time)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace w4p {

// ------------------------------------------------------------------------------------------------
// Type traits: fp16 / bf16 with the bias trick used to turn codes into exact floats.
template <typename T, int SB> struct Tr;
template <> struct Tr<half, 4> {
  using T2 = half2;
  static constexpr float MAGIC = 1024.f;  // 0x6400 | q == 1024 + q
};
template <> struct Tr<half, 8> {
  using T2 = half2;
  static constexpr float MAGIC = 1024.f;
};
template <> struct Tr<__nv_bfloat16, 4> {
  using T2 = __nv_bfloat162;
  static constexpr float MAGIC = 128.f;  // 0x4300 | q == 128 + q
};
template <> struct Tr<__nv_bfloat16, 8> {
  using T2 = __nv_bfloat162;
  static constexpr float MAGIC = 0.f;  // bytes converted through fp32 (exact for 0..255)
};

__device__ __forceinline__ float to_f(half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ half from_f<half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ half2 bcast2(half v) { return __half2half2(v); }
__device__ __forceinline__ __nv_bfloat162 bcast2(__nv_bfloat16 v) { return __bfloat162bfloat162(v); }

template <typename T2> __device__ __forceinline__ T2 as_t2(uint32_t u) { return *reinterpret_cast<T2 *>(&u); }
template <typename T2> __device__ __forceinline__ uint32_t as_u32(T2 v) { return *reinterpret_cast<uint32_t *>(&v); }

// (a & mask) | bits in one LOP3: written out because the compiler otherwise splits it into two LOP3s (one
// immediate each), which made the dequantization a third of a small-M kernel's instructions (SASS, H200)
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

// The four register pairs (a0..a3 of the m16n8k16 A fragment) of k16 slice j, as raw "magic + q" values.
// 4-bit: word j, pair i = nibbles (i, i+4). 8-bit: words 2j and 2j+1, bytes in fragment order.
template <typename T, int SB> struct Codes;
// (fp16 4-bit codes take the lop3 path in dq_int<half, 4> below.)
template <> struct Codes<__nv_bfloat16, 4> {
  static __device__ __forceinline__ void get(const uint32_t *w, int j, uint32_t (&h)[4]) {
    uint32_t x = w[j];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = and_or(x >> (4 * i), 0x000f000fu, 0x43004300u);
  }
};
template <> struct Codes<half, 8> {
  static __device__ __forceinline__ void get(const uint32_t *w, int j, uint32_t (&h)[4]) {
    uint32_t x0 = w[2 * j], x1 = w[2 * j + 1];
    h[0] = __byte_perm(x0, 0x64u, 0x4140);
    h[1] = __byte_perm(x0, 0x64u, 0x4342);
    h[2] = __byte_perm(x1, 0x64u, 0x4140);
    h[3] = __byte_perm(x1, 0x64u, 0x4342);
  }
};
template <> struct Codes<__nv_bfloat16, 8> {
  static __device__ __forceinline__ void get(const uint32_t *w, int j, uint32_t (&h)[4]) {
    uint32_t x[2] = {w[2 * j], w[2 * j + 1]};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t src = x[i >> 1];
      int b = (i & 1) * 2;
      float f0 = __uint_as_float(__byte_perm(src, 0x4B00u, 0x5440 + b)) - 8388608.f;
      float f1 = __uint_as_float(__byte_perm(src, 0x4B00u, 0x5440 + b + 1)) - 8388608.f;
      __nv_bfloat162 v = __floats2bfloat162_rn(f0, f1);
      h[i] = as_u32(v);
    }
  }
};

// Zero-point constants of one group for the two rows a lane holds (lo = row gid, hi = row gid + 8).
template <typename T, int SB> struct ZC {
  typename Tr<T, SB>::T2 lo, hi;
};
template <typename T, int SB> __device__ __forceinline__ ZC<T, SB> zc_make(float z_lo, float z_hi) {
  ZC<T, SB> c;  // h - (magic + z) = q - z
  c.lo = bcast2(from_f<T>(Tr<T, SB>::MAGIC + z_lo));
  c.hi = bcast2(from_f<T>(Tr<T, SB>::MAGIC + z_hi));
  return c;
}
template <> __device__ __forceinline__ ZC<half, 4> zc_make<half, 4>(float z_lo, float z_hi) {
  ZC<half, 4> c;  // lo nibbles: h - (1024 + z); hi nibbles (16q + 1024): h / 16 - (64 + z)
  c.lo = __float2half2_rn(1024.f + z_lo);
  c.hi = __float2half2_rn(-(64.f + z_hi));
  return c;
}

// The same constants from zeros stored in the activation type: for fp16 two half-precision operations
// (1024 + z and -(64 + z) are exact for the codes of 4-bit layers) instead of a round trip through fp32.
template <typename T> __device__ __forceinline__ ZC<T, 4> zc_load(T z_lo, T z_hi) {
  return zc_make<T, 4>(to_f(z_lo), to_f(z_hi));
}
template <> __device__ __forceinline__ ZC<half, 4> zc_load<half>(half z_lo, half z_hi) {
  ZC<half, 4> c;
  c.lo = __hadd2(bcast2(z_lo), __float2half2_rn(1024.f));
  c.hi = __hfma2(bcast2(z_hi), __float2half2_rn(-1.f), __float2half2_rn(-64.f));
  return c;
}

// (q - z) as exact pairs for the four A registers of k16 slice j.
template <typename T, int SB>
__device__ __forceinline__ void dq_int(const uint32_t *w, int j, const ZC<T, SB> &c, uint32_t (&a)[4]) {
  using T2 = typename Tr<T, SB>::T2;
  uint32_t h[4];
  Codes<T, SB>::get(w, j, h);
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = as_u32(__hsub2(as_t2<T2>(h[i]), (i & 1) ? c.hi : c.lo));
}
template <>
__device__ __forceinline__ void dq_int<half, 4>(const uint32_t *w, int j, const ZC<half, 4> &c, uint32_t (&a)[4]) {
  uint32_t x = w[j];
  const uint32_t l0 = and_or(x, 0x000f000fu, 0x64006400u), h0 = and_or(x, 0x00f000f0u, 0x64006400u);
  x >>= 8;
  const uint32_t l1 = and_or(x, 0x000f000fu, 0x64006400u), h1 = and_or(x, 0x00f000f0u, 0x64006400u);
  const half2 s16 = __float2half2_rn(0.0625f);
  a[0] = as_u32(__hsub2(as_t2<half2>(l0), c.lo));
  a[1] = as_u32(__hfma2(as_t2<half2>(h0), s16, c.hi));
  a[2] = as_u32(__hsub2(as_t2<half2>(l1), c.lo));
  a[3] = as_u32(__hfma2(as_t2<half2>(h1), s16, c.hi));
}

// s * q + m pairs (zero mode "float"): one rounding (FMA) per weight.
template <typename T, int SB>
__device__ __forceinline__ void dq_float(const uint32_t *w, int j, typename Tr<T, SB>::T2 s_lo,
                                         typename Tr<T, SB>::T2 s_hi, typename Tr<T, SB>::T2 m_lo,
                                         typename Tr<T, SB>::T2 m_hi, uint32_t (&a)[4]) {
  using T2 = typename Tr<T, SB>::T2;
  const ZC<T, SB> c0 = zc_make<T, SB>(0.f, 0.f);
  uint32_t q[4];
  dq_int<T, SB>(w, j, c0, q);
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = as_u32(__hfma2(as_t2<T2>(q[i]), (i & 1) ? s_hi : s_lo, (i & 1) ? m_hi : m_lo));
}

// The wgmma kernels' operand pairs of k16 slice j in the activation dtype, one rounding per weight: (q - z) * s
// (zero modes none and int: zc from zc_make / zc_load) or s * q + m (ZMODE 2, float minima m).
template <typename T, int ZMODE>
__device__ __forceinline__ void dq_scaled(const uint32_t *w, int j, const ZC<T, 4> &zc, typename Tr<T, 4>::T2 s_lo,
                                          typename Tr<T, 4>::T2 s_hi, typename Tr<T, 4>::T2 m_lo,
                                          typename Tr<T, 4>::T2 m_hi, uint32_t (&a)[4]) {
  using T2 = typename Tr<T, 4>::T2;
  if (ZMODE == 2) {
    dq_float<T, 4>(w, j, s_lo, s_hi, m_lo, m_hi, a);
  } else {
    uint32_t qz[4];
    dq_int<T, 4>(w, j, zc, qz);
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = as_u32(__hmul2(as_t2<T2>(qz[i]), (i & 1) ? s_hi : s_lo));
  }
}

// ------------------------------------------------------------------------------------------------
// group of column k: one multiply-high by gmul = ceil(2^32 / gs) (0 per channel), exact while k * gs < 2^32
// (gmul_of checks it for the layer; for powers of two it is exact for every k). No branch, so the compiler
// can schedule the tiles of an unrolled loop together.
__device__ __forceinline__ int group_of(int k, unsigned gmul) { return (int)__umulhi((unsigned)k, gmul); }

}  // namespace w4p
