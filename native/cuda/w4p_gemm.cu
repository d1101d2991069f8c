// w4pack CUDA W4A16 / W8A16 GEMM on layout w4pack-tiles v1 (docs/LAYOUT.md, docs/CUDA.md).
//
// The weight matrix is the A operand of mma.sync.m16n8k16 (rows = output features), tokens are the
// instruction's N. A 16x64 tile is 512 bytes (4-bit) or 1 KiB (8-bit); lane l's 16 bytes are its A
// fragments for the tile's four k16 slices, so one 16-byte load feeds four MMAs after a few LOP3s.
//
// Kernels:
//   gemv:   M = 1, 4-bit, sm_80+ (auto takes it on sm_90 where its blocks fill their rounds). Blocks own whole
//           16-row stripes and sum them in warp order; weights through plain 16-byte loads one step ahead in
//           registers, activations staged once per block in fragment order.
//   bulk:   M <= 16, sm_90 (auto takes it at M = 1-4). Stream-K over two blocks per SM; the weights and the
//           activation rows arrive through the bulk copy engine (the fastest weight stream measured here),
//           group parameters through cp.async, 8 consumer warps per block.
//   ring:   M <= 8 (default there before sm_90; M = 5-7 on large layers on sm_90). Stream-K over warps: each warp streams one contiguous range of K tiles
//           of four stripes through its own cp.async shared-memory ring (weights, group parameters and
//           activation columns, 3 units of 2 KiB in flight), grid sized to the resident warps; quads
//           shared by several warps are reduced deterministically by the last one to finish.
//   stream: small M (<= 32 tokens per block). Each warp streams whole 16-row stripes along its share of
//           K straight from global memory into registers (8 tiles in flight per lane), activations and
//           group parameters staged in shared memory per K-chunk; split-K over the grid with a
//           deterministic fp32 reduction done by the last block of each output tile.
//   tiled:  large M. 128x128 output tile, 8 warps, 4-stage cp.async pipeline for weights, activations
//           and group parameters; ldmatrix for activations; the same split-K epilogue when the grid
//           would not fill the GPU.
// Dequantization stays in the activation dtype: (magic|q) - (magic + z) is exact, one multiply by the
// scale rounds once (float minima: one FMA). fp32 accumulation.
#include <cuda.h>  // CUtensorMap (the type only: the encoder is fetched from the driver at run time)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <string.h>
#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <type_traits>

// the ABI functions keep default visibility; everything else in the library is hidden
#pragma GCC visibility push(default)
#include "../w4pack.h"
#pragma GCC visibility pop

#define W4P_CUDA_ABI 1

namespace {

thread_local char g_err[512] = "";

int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  return code;
}

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

template <typename T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma<half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t &r0, uint32_t &r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ------------------------------------------------------------------------------------------------
// group of column k: one multiply-high by gmul = ceil(2^32 / gs) (0 per channel), exact while k * gs < 2^32
// (gmul_of checks it for the layer; for powers of two it is exact for every k). No branch, so the compiler
// can schedule the tiles of an unrolled loop together.
__device__ __forceinline__ int group_of(int k, unsigned gmul) { return (int)__umulhi((unsigned)k, gmul); }

struct Params {
  const void *x;      // [M][ldx]
  void *y;            // [M][ldy]
  const uint32_t *qw; // layout v1
  const void *scales, *zeros, *mins, *bias;
  const int32_t *perm;
  float *part;        // [S][M][Np] fp32 partial sums (split-K)
  unsigned *counters; // one per output tile
  int64_t ldx, ldy, M;
  int N, K, Np, Kp, KT;  // KT = Kp / 64
  int gs, zm;            // group size (-1: per channel), zero mode
  unsigned gmul;         // group_of's multiplier: ceil(2^32 / gs), 0 per channel
  int S, TB;             // splits, token blocks
  int KC;                // stream kernel: tiles per staged chunk
  int xvec;              // stream: x rows 16-byte loadable; tiled: x readable with cp.async (else gathered)
  int kx;                // tiled: valid K extent of the (possibly gathered) activations
  unsigned sink;         // probe modes: a value the checksum never equals
  int64_t W;             // ring kernel: workers (warps) sharing the weight stream
  int probe;             // bulk, wgmma_ws kernels: 1 = copies only, no arithmetic (the copy pipeline's rate)
  int kg;                // bulk kernel: tiles per stream-K granule (1, or the unit size: whole units per block)
  int cl;                // wgmma_ws, wgmma_ss with splits: launched as clusters of the S splits (cluster_reduce)
  int sk;                // wgmma_ws stream-K: its output tiles (over a grid of resident blocks); 0 otherwise
  int pdl;               // bulk, wgmma_ws, wgmma_ss: launched with programmatic dependent launch (pdl_start)
};

// y for the rows row..row+3 of token tok (rows from N on dropped): the split sums v plus the bias
template <typename T>
__device__ __forceinline__ void store_quad(const Params &p, int64_t tok, int row, const float (&v)[4], bool pairs) {
  using T2 = typename Tr<T, 4>::T2;
  const T *bias = (const T *)p.bias;
  T *dst = (T *)p.y + tok * p.ldy + row;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 2 * h;
    const float v0 = v[2 * h] + ((bias && r < p.N) ? to_f(bias[r]) : 0.f);
    const float v1 = v[2 * h + 1] + ((bias && r + 1 < p.N) ? to_f(bias[r + 1]) : 0.f);
    if (pairs && r + 1 < p.N) {
      T2 o;
      o.x = from_f<T>(v0);
      o.y = from_f<T>(v1);
      *reinterpret_cast<T2 *>(dst + 2 * h) = o;
    } else {
      if (r < p.N) dst[2 * h] = from_f<T>(v0);
      if (r + 1 < p.N) dst[2 * h + 1] = from_f<T>(v1);
    }
  }
}
__device__ __forceinline__ bool y_pairs(const Params &p) {
  return (p.ldy & 1) == 0 && (reinterpret_cast<uintptr_t>(p.y) & 3) == 0;
}

// A block barrier, or (nt > 0) named barrier 1 over threads 0..nt-1 where the others have left (wgmma_ws's
// 256-row blocks and 256-token tile, whose producer warpgroup leaves before the epilogue)
__device__ __forceinline__ void block_or_named_sync(int nt) {
  if (nt == 0)
    __syncthreads();
  else
    asm volatile("bar.sync 1, %0;\n" ::"r"(nt) : "memory");
}
// Named barrier `id` over n threads that also returns whether any of them passed true: a flag handed to the
// others without shared memory (racecheck reported a shared flag's store and loads as a hazard in a few runs
// although a barrier ordered them)
__device__ __forceinline__ bool named_any(int id, int n, bool v) {
  unsigned r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r) : "r"((unsigned)v), "r"(id), "r"(n) : "memory");
  return r != 0;
}
// block_or_named_sync's barrier with named_any's flag
__device__ __forceinline__ bool block_or_named_any(int nt, bool v) {
  return nt == 0 ? __syncthreads_or(v) != 0 : named_any(1, nt, v);
}

// Split-K epilogue through the workspace: every block stores its fp32 partial tile; the last block to arrive
// sums the S partials in split order (bit-identical whoever arrives last) and writes y.
// The sum runs on quads of rows (16-byte loads; Np and row0 are multiples of 16, the workspace 256-byte
// aligned) with U quads per thread in flight and the split loop unrolled, so the last block waits for a few
// L2 round trips rather than one per output element (a 256 x 128 tile summed one element per thread and
// iteration is 114 dependent round trips for 288 threads). U = 4 gave the wgmma_ws kernels a 4-byte spill
// (their 2 blocks per SM cap them at 112 registers): 2 there, 4 where registers allow. NT: block_or_named_sync's.
template <typename T, int RB, int TBK, int SR_U = 2, int NT = 0>
__device__ __forceinline__ void split_reduce(const Params &p, int rb, int tb, int row0, int tok0) {
  __threadfence();
  block_or_named_sync(NT);
  const int tile = tb + p.TB * rb;
  bool last = false;
  if (threadIdx.x == 0) last = atomicAdd(&p.counters[tile], 1u) == (unsigned)(p.S - 1);
  if (!block_or_named_any(NT, last)) return;
  __threadfence();
  const bool pairs = y_pairs(p);
  const size_t plane = (size_t)p.M * p.Np;
  const int nq = min(RB, p.Np - row0) / 4;                        // row quads of the tile inside Np
  const int ntok = (int)(p.M - tok0 < TBK ? p.M - tok0 : TBK);
  const int total = nq * ntok, step = NT ? NT : (int)blockDim.x;
  for (int base = (int)threadIdx.x; base < total; base += SR_U * step) {
    const float *src[SR_U];
    float4 a[SR_U];
#pragma unroll
    for (int u = 0; u < SR_U; ++u) {
      const int idx = min(base + u * step, total - 1);  // past the end: a repeated load, never stored
      const int t = idx / nq, q = idx - t * nq;
      src[u] = p.part + (size_t)(tok0 + t) * p.Np + row0 + 4 * q;
      a[u] = __ldcg(reinterpret_cast<const float4 *>(src[u]));
    }
#pragma unroll 4
    for (int s = 1; s < p.S; ++s) {
#pragma unroll
      for (int u = 0; u < SR_U; ++u) {
        const float4 b = __ldcg(reinterpret_cast<const float4 *>(src[u] + s * plane));
        a[u].x += b.x;
        a[u].y += b.y;
        a[u].z += b.z;
        a[u].w += b.w;
      }
    }
#pragma unroll
    for (int u = 0; u < SR_U; ++u) {
      const int idx = base + u * step;
      if (idx >= total) break;
      const int t = idx / nq;
      const float v[4] = {a[u].x, a[u].y, a[u].z, a[u].w};
      store_quad<T>(p, tok0 + t, row0 + 4 * (idx - t * nq), v, pairs);
    }
  }
  if (threadIdx.x == 0) p.counters[tile] = 0u;  // ready for the next call / graph replay
}

// Split-K epilogue inside a thread block cluster (sm_90; the S <= 8 blocks of one output tile launched as one
// cluster, dims 1 x 1 x S): each block has put its fp32 partial tile at shared address `tile`, as [TBK tokens]
// [RB + 8] floats (8 floats of padding per token put a warp's 8 tokens in different banks). After a cluster
// barrier, block z sums its 1/S share of the tile over the S blocks' shared memory, in split order
// (bit-identical every call), and writes y; a second barrier keeps every block's tile until the others have
// read it. The partials never leave the SMs: no workspace, no counters. Measured on an H200 (docs/CUDA.md):
// the workspace epilogue's partial stores and last-block sums cost wgmma_ss 27 of 37 us on 4096x4096 at M = 128
// with 8 splits.
constexpr int CLUSTER_MAX = 8;  // the portable cluster size
__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr, uint32_t rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
  uint32_t ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(ra) : "memory");
#endif
  return v;
}
template <typename T, int RB, int TBK, int NT = 0>  // NT: as split_reduce's (the others arrive on the barriers)
__device__ __forceinline__ void cluster_reduce(const Params &p, uint32_t tile, int row0, int64_t tok0) {
  constexpr int PITCH = RB + 8, QR = RB / 4, Q = TBK * QR;
  cluster_barrier();
  const int S = p.S, z = (int)blockIdx.z;
  const bool pairs = y_pairs(p);
  const int q1 = (z + 1) * Q / S;
  for (int idx = z * Q / S + (int)threadIdx.x; idx < q1; idx += NT ? NT : (int)blockDim.x) {
    const int t = idx / QR, q = idx - t * QR;
    const int64_t tok = tok0 + t;
    const int row = row0 + 4 * q;
    if (tok >= p.M || row >= p.N) continue;
    const uint32_t la = tile + (uint32_t)(t * PITCH + 4 * q) * 4u;
    float4 v[CLUSTER_MAX];
#pragma unroll
    for (int s = 0; s < CLUSTER_MAX; ++s)
      if (s < S) v[s] = ld_cluster_f4(la, (uint32_t)s);
    float a[4] = {v[0].x, v[0].y, v[0].z, v[0].w};
#pragma unroll
    for (int s = 1; s < CLUSTER_MAX; ++s)
      if (s < S) {
        a[0] += v[s].x;
        a[1] += v[s].y;
        a[2] += v[s].z;
        a[3] += v[s].w;
      }
    store_quad<T>(p, tok, row, a, pairs);
  }
  cluster_barrier();
}

// ------------------------------------------------------------------------------------------------
// Stream kernel: 4 warps, each owning MI consecutive 16-row stripes and streaming them along the block's
// K range. Weights: bursts of U tiles per warp, double-buffered in registers (the next U are in flight
// while these are computed). Activations and group parameters: K-chunks of KC tiles, double-buffered in
// shared memory with cp.async (chunk c+1 lands while chunk c is computed). Zero modes none/int: the MMA
// takes exact (q - z) values and the fp32 accumulator gets the group's scale once per group; float
// minima: the weights are dequantized (s * q + m) in the activation dtype.
constexpr int SW = 4;  // warps per stream block

template <int MI, int SB> struct StreamCfg {
  static constexpr int V = SB / 4;                                 // uint4 per lane per tile
  static constexpr int U = (8 / (MI * V)) > 0 ? 8 / (MI * V) : 1;  // tiles in flight per warp (16 measured slower)
  static constexpr int RB = SW * MI * 16;                          // rows per block
};

__host__ __device__ __forceinline__ int stream_ngmax(int KC, int gs) { return gs > 0 ? (KC * 64) / gs + 2 : 1; }
__host__ __device__ __forceinline__ size_t stream_buf_bytes(int NI, int MI, int KC, int gs) {
  const size_t x = (size_t)NI * 8 * (KC * 64 + 8) * 2;
  const size_t prm = (size_t)stream_ngmax(KC, gs) * (SW * MI * 16) * 2;
  return (x + 2 * prm + 15) / 16 * 16;
}

template <typename T, int SB, int MI, int NI, int MODE, bool FM>
__global__ void __launch_bounds__(SW * 32, 3) stream_kernel(const Params p) {
  using C = StreamCfg<MI, SB>;
  constexpr bool FULL = MODE == 0;  // 1, 2: probes (load only; load + dequantize)
  using T2 = typename Tr<T, SB>::T2;
  constexpr int V = C::V, U = C::U, RB = C::RB, TOK = NI * 8;
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tid4 = lane & 3;

  int bid = blockIdx.x;
  const int tb = bid % p.TB;
  bid /= p.TB;
  const int split = bid % p.S;
  const int rb = bid / p.S;
  const int t0 = (int)((int64_t)p.KT * split / p.S), t1 = (int)((int64_t)p.KT * (split + 1) / p.S);
  const int row0 = rb * RB;
  const int64_t tok0 = (int64_t)tb * TOK;
  const int XP = p.KC * 64 + 8;  // activation row pitch (elements): +16 B keeps ldmatrix conflict-free
  const int ngmax = stream_ngmax(p.KC, p.gs);
  const size_t buf_bytes = stream_buf_bytes(NI, MI, p.KC, p.gs);

  const int stripe0 = rb * (SW * MI) + warp * MI;
  const int nstripes = p.Np >> 4;
  const uint4 *wbase[MI];
  bool wvalid[MI];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    wvalid[mi] = (stripe0 + mi) < nstripes;
    wbase[mi] = reinterpret_cast<const uint4 *>(p.qw) + ((size_t)(wvalid[mi] ? stripe0 + mi : 0) * p.KT) * (32 * V) + lane * V;
  }

  // ---- weights: bursts of U tiles per warp, double-buffered in registers ----
  uint4 wr[U][MI][V];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int t = t0 + u;
        wr[u][mi][v] = (t < t1 && wvalid[mi]) ? ld_stream(wbase[mi] + (size_t)t * (32 * V) + v) : make_uint4(0, 0, 0, 0);
      }

  const T *x = (const T *)p.x;
  // ---- chunk staging into buffer b: activations [TOK][XP], scales and zeros/mins [ngmax][RB] ----
  auto stage = [&](int b, int cb, int ce) {
    T *sx = reinterpret_cast<T *>(smem + b * buf_bytes);
    T *sS = sx + TOK * XP;
    T *sZ = sS + ngmax * RB;
    const int kbeg = cb * 64, vpr = (ce - cb) * 8;  // 16-byte vectors per token row
    const bool fast = !p.perm && p.xvec;
    const int rows = (int)min((int64_t)TOK, p.M - tok0);  // rows >= M stay zero from the start
    for (int r = 0; r < rows; ++r) {
      const T *xr = x + (tok0 + r) * p.ldx;
      for (int c = threadIdx.x; c < vpr; c += SW * 32) {
        const int kk = kbeg + c * 8;
        T *dst = sx + r * XP + c * 8;
        if (fast && kk + 8 <= p.K) {
          cp_async16(dst, xr + kk, true);
        } else {
          uint32_t hw[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int kidx = kk + e;
            hw[e] = 0;
            if (kidx < p.K) {
              T val = xr[p.perm ? __ldg(p.perm + kidx) : kidx];
              hw[e] = *reinterpret_cast<const unsigned short *>(&val);
            }
          }
          *reinterpret_cast<uint4 *>(dst) =
              make_uint4(hw[0] | (hw[1] << 16), hw[2] | (hw[3] << 16), hw[4] | (hw[5] << 16), hw[6] | (hw[7] << 16));
        }
      }
    }
    const int g_lo = group_of(kbeg, p.gmul);
    const int ng = group_of(ce * 64 - 1, p.gmul) - g_lo + 1;
    const int vec = RB / 8;  // 16-byte vectors per group row block
    const int nsrc = p.zm == 0 ? 1 : 2;
    const T *zsrc = (const T *)(p.zm == 1 ? p.zeros : p.mins);
    if (p.zm == 0)  // symmetric: the implicit zero point 2^(bits-1)
      for (int idx = threadIdx.x; idx < ng * RB; idx += SW * 32) sZ[idx] = from_f<T>((float)(1 << (SB == 4 ? 3 : 7)));
    for (int idx = threadIdx.x; idx < nsrc * ng * vec; idx += SW * 32) {
      const int which = idx / (ng * vec), rem = idx - which * ng * vec;
      const int gi = rem / vec, c = rem - gi * vec;
      const int row = row0 + c * 8;
      const bool ok = row < p.Np;
      const T *srcb = which == 0 ? (const T *)p.scales : zsrc;
      const T *src = ok ? srcb + (size_t)(g_lo + gi) * p.Np + row : srcb;
      cp_async16((which == 0 ? sS : sZ) + gi * RB + c * 8, src, ok);
    }
    cp_async_commit();
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.f;
  unsigned sink = 0;

  const int nI = t1 - t0;
  {
    const int rows = (int)max((int64_t)0, min((int64_t)TOK, p.M - tok0));
    const int vrow = XP / 8;
    for (int b = 0; b < 2; ++b) {
      uint4 *z4 = reinterpret_cast<uint4 *>(smem + b * buf_bytes) + rows * vrow;
      for (int idx = threadIdx.x; idx < (TOK - rows) * vrow; idx += SW * 32) z4[idx] = make_uint4(0, 0, 0, 0);
    }
  }
  if (nI > 0) stage(0, t0, min(t0 + p.KC, t1));
  const T *sx = reinterpret_cast<const T *>(smem);
  const T *sS = sx;
  const T *sZ = sx;
  int cb = t0, g_lo = 0;
  for (int base = t0; base < t1; base += U) {
    if ((base - t0) % p.KC == 0) {  // next chunk: wait for its staging, start staging the one after
      const int ch = (base - t0) / p.KC;
      cb = base;
      const int ce = min(cb + p.KC, t1);
      cp_async_wait<0>();
      __syncthreads();
      if (ce < t1) stage((ch + 1) & 1, ce, min(ce + p.KC, t1));
      sx = reinterpret_cast<const T *>(smem + (ch & 1) * buf_bytes);
      sS = sx + TOK * XP;
      sZ = sS + ngmax * RB;
      g_lo = group_of(cb * 64, p.gmul);
    }
    // burst: take the U tiles that arrived, request the next U (in flight while these are computed)
    uint4 cur[U][MI][V];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int v = 0; v < V; ++v) cur[u][mi][v] = wr[u][mi][v];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const int tn = base + U + u;
          if (tn < t1 && wvalid[mi]) wr[u][mi][v] = ld_stream(wbase[mi] + (size_t)tn * (32 * V) + v);
        }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u;
      if (t >= t1) break;
      {
        uint4 w[MI][V];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int v = 0; v < V; ++v) w[mi][v] = cur[u][mi][v];
        if (MODE == 1) {
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int v = 0; v < V; ++v) sink ^= w[mi][v].x ^ w[mi][v].y ^ w[mi][v].z ^ w[mi][v].w;
          continue;
        }
        const int tl = t - cb;
        // B fragments of the whole tile: b[j][ni][2]
        uint32_t b[4][NI][2];
        if (FULL) {
          if (NI == 1) {
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              const int q = lane >> 3;
              const T *ptr = sx + (lane & 7) * XP + tl * 64 + (jj * 2 + (q >> 1)) * 16 + (q & 1) * 8;
              ldsm_x4(smem_u32(ptr), b[2 * jj][0][0], b[2 * jj][0][1], b[2 * jj + 1][0][0], b[2 * jj + 1][0][1]);
            }
          }
        }
        // two 32-wide halves per tile: group sizes are multiples of 32, so each half has one group; when
        // both halves share it (group size >= 64), its parameters are read and applied once per tile
        float tmp[MI][NI][4];
        float s_lo[MI], s_hi[MI];
        ZC<T, SB> zc[MI];
        T2 s2lo[MI], s2hi[MI], m2lo[MI], m2hi[MI];
        const int gi0 = group_of(t * 64, p.gmul) - g_lo;
        const int gi1 = group_of(t * 64 + 32, p.gmul) - g_lo;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int gi = hh == 0 ? gi0 : gi1;
          if (hh == 1 && gi1 != gi0 && !FM && FULL) {  // close the first group
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
              for (int ni = 0; ni < NI; ++ni) {
                acc[mi][ni][0] = fmaf(s_lo[mi], tmp[mi][ni][0], acc[mi][ni][0]);
                acc[mi][ni][1] = fmaf(s_lo[mi], tmp[mi][ni][1], acc[mi][ni][1]);
                acc[mi][ni][2] = fmaf(s_hi[mi], tmp[mi][ni][2], acc[mi][ni][2]);
                acc[mi][ni][3] = fmaf(s_hi[mi], tmp[mi][ni][3], acc[mi][ni][3]);
              }
          }
          // a new group: read its parameters (same group in the second half: keep them and the partial sums)
#pragma unroll
          for (int mi = 0; mi < MI && (hh == 0 || gi1 != gi0); ++mi) {
            const int rl = gi * RB + (warp * MI + mi) * 16 + gid;
            if (!FM) {
              s_lo[mi] = to_f(sS[rl]);
              s_hi[mi] = to_f(sS[rl + 8]);
              zc[mi] = zc_make<T, SB>(to_f(sZ[rl]), to_f(sZ[rl + 8]));
#pragma unroll
              for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) tmp[mi][ni][c] = 0.f;
            } else {
              s2lo[mi] = bcast2(sS[rl]);
              s2hi[mi] = bcast2(sS[rl + 8]);
              m2lo[mi] = bcast2(sZ[rl]);
              m2hi[mi] = bcast2(sZ[rl + 8]);
            }
          }
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = hh * 2 + jj;
            if (FULL && NI > 1) {  // B fragments of slice j only (keeps registers low)
#pragma unroll
              for (int ni = 0; ni + 1 < NI; ni += 2) {
                const int q = lane >> 3;
                const T *ptr = sx + ((ni + (q >> 1)) * 8 + (lane & 7)) * XP + tl * 64 + j * 16 + (q & 1) * 8;
                ldsm_x4(smem_u32(ptr), b[j][ni][0], b[j][ni][1], b[j][ni + 1][0], b[j][ni + 1][1]);
              }
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              const uint32_t *wd = reinterpret_cast<const uint32_t *>(&w[mi][0]);
              uint32_t a[4];
              if (!FM) {
                dq_int<T, SB>(wd, j, zc[mi], a);
                if (FULL) {
#pragma unroll
                  for (int ni = 0; ni < NI; ++ni) mma<T>(tmp[mi][ni], a, b[j][ni][0], b[j][ni][1]);
                } else {
                  sink += a[0] ^ a[1] ^ a[2] ^ a[3];
                }
              } else {
                dq_float<T, SB>(wd, j, s2lo[mi], s2hi[mi], m2lo[mi], m2hi[mi], a);
                if (FULL) {
#pragma unroll
                  for (int ni = 0; ni < NI; ++ni) mma<T>(acc[mi][ni], a, b[j][ni][0], b[j][ni][1]);
                } else {
                  sink += a[0] ^ a[1] ^ a[2] ^ a[3];
                }
              }
            }
          }
        }
        if (!FM && FULL) {  // apply the (last) group's scale
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
              acc[mi][ni][0] = fmaf(s_lo[mi], tmp[mi][ni][0], acc[mi][ni][0]);
              acc[mi][ni][1] = fmaf(s_lo[mi], tmp[mi][ni][1], acc[mi][ni][1]);
              acc[mi][ni][2] = fmaf(s_hi[mi], tmp[mi][ni][2], acc[mi][ni][2]);
              acc[mi][ni][3] = fmaf(s_hi[mi], tmp[mi][ni][3], acc[mi][ni][3]);
            }
        }
      }
    }
  }
  cp_async_wait<0>();

  if (!FULL) {
    if (sink == p.sink) ((T *)p.y)[0] = from_f<T>((float)sink);  // keeps the loads; never true in practice
    return;
  }

  // ---- epilogue ----
  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  if (p.S == 1) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int row = row0 + (warp * MI + mi) * 16 + gid + (c >> 1) * 8;
          const int64_t tok = tok0 + ni * 8 + tid4 * 2 + (c & 1);
          if (row < p.N && tok < p.M) {
            float v = acc[mi][ni][c];
            if (bias) v += to_f(bias[row]);
            y[tok * p.ldy + row] = from_f<T>(v);
          }
        }
    return;
  }
  float *part = p.part + (size_t)split * p.M * p.Np;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = row0 + (warp * MI + mi) * 16 + gid + (c >> 1) * 8;
        const int64_t tok = tok0 + ni * 8 + tid4 * 2 + (c & 1);
        if (row < p.Np && tok < p.M) __stcg(part + tok * p.Np + row, acc[mi][ni][c]);
      }
  split_reduce<T, RB, TOK>(p, rb, tb, row0, (int)tok0);
}

// ------------------------------------------------------------------------------------------------
// Ring kernel (M <= 8, the decode regime): every warp is an independent worker with its own contiguous
// range of work units; a unit is one 64-wide K tile of four consecutive 16-row stripes (2 KiB of 4-bit
// weights), units in quad-major order, so a worker's range runs along K and may cross into the next quad
// (stream-K). The grid is sized to the resident warps, so each worker pays its prologue once. Per warp
// a shared-memory ring of RD slots, refilled with cp.async one slot per computed slot (a unit's weights,
// its group parameters and its activation columns, shared by the four stripes), keeps RD - 1 units in
// flight with no block barriers: only the warp's own lanes write and read its ring. A quad shared by
// several workers is reduced deterministically: each stores its fp32 piece, the last to arrive
// (per-quad counter) sums the pieces in worker order and writes y.
constexpr int RW = 2;          // warps per ring block (warps are independent; small blocks pack SMs finely)
constexpr int RING_MINB = 10;  // launch bound: registers for 10 blocks (20 warps) per SM
constexpr int RD = 4;          // ring slots per warp
constexpr int RQ = 4;          // stripes per unit
constexpr int RING_XP = 144;   // bytes per staged activation row (128 + 16: conflict-free ldmatrix)

// slot: RQ weight tiles | RQ x 128 B group parameters | M activation rows of 64 values
__host__ __device__ __forceinline__ int ring_slot_bytes(int sb, int m) { return RQ * (512 * (sb / 4) + 128) + m * RING_XP; }
__host__ __device__ __forceinline__ int ring_warp_bytes(int sb, int m) { return 16 + RD * ring_slot_bytes(sb, m); }

// the worker whose range holds unit idx (ranges: [w * total / W, (w + 1) * total / W))
__device__ __forceinline__ int64_t ring_owner(int64_t idx, int64_t total, int64_t W) {
  return ((idx + 1) * W + total - 1) / total - 1;
}

template <typename T, int SB, bool FM>
__global__ void __launch_bounds__(RW * 32, RING_MINB) ring_kernel(const Params p) {
  using T2 = typename Tr<T, SB>::T2;
  constexpr int V = SB / 4, WB = 512 * V, PB = RQ * WB, XB = RQ * (WB + 128);
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tid4 = lane & 3;
  const int64_t gw = (int64_t)blockIdx.x * RW + warp;
  if (gw >= p.W) return;
  const int M = (int)p.M;
  const int SS = ring_slot_bytes(SB, M);
  unsigned char *wreg = smem + (size_t)warp * ring_warp_bytes(SB, M);
  if (lane == 0) *reinterpret_cast<uint4 *>(wreg) = make_uint4(0, 0, 0, 0);  // zero row for tokens >= M
  const uint32_t zero_addr = smem_u32(wreg);
  unsigned char *ring = wreg + 16;
  const uint32_t ring_addr = smem_u32(ring);
  const int nstripes = p.Np >> 4;
  const int nquads = (nstripes + RQ - 1) / RQ;
  const int64_t total = (int64_t)nquads * p.KT;
  const int64_t a = gw * total / p.W, b = (gw + 1) * total / p.W;
  const int n = (int)(b - a);
  const int first_quad = (int)(a / p.KT);

  const uint4 *qw4 = reinterpret_cast<const uint4 *>(p.qw);
  const T *x = (const T *)p.x;
  const T *zsrc = (const T *)(p.zm == 1 ? p.zeros : p.mins);
  const T *ssrc = (const T *)p.scales;
  const int64_t sstride = (int64_t)p.KT * 32 * V;  // uint4 between stripes
  // per-lane roles in the copies: group parameters (one 16-byte vector per lane: stripe pm, half ph,
  // scales / zeros pw, 8-row part pp) and up to two activation vectors (row, 8-column chunk)
  const int pm = lane >> 3, ph = (lane >> 2) & 1, pw = (lane >> 1) & 1, pp = lane & 1;
  const bool p_on = pw == 0 || p.zm != 0;
  const T *p_src = pw ? zsrc : ssrc;
  const int nx = M * 8;
  const bool x0 = lane < nx, x1 = lane + 32 < nx;
  const int64_t xo0 = (int64_t)(lane >> 3) * p.ldx + (lane & 7) * 8, xo1 = (int64_t)((lane + 32) >> 3) * p.ldx + (lane & 7) * 8;
  const uint32_t xd0 = XB + (lane >> 3) * RING_XP + (lane & 7) * 16, xd1 = XB + ((lane + 32) >> 3) * RING_XP + (lane & 7) * 16;

  // the unit to issue next: quad is_q, tile is_t, weight pointer of its first stripe
  int is_q = first_quad, is_t = (int)(a - (int64_t)first_quad * p.KT);
  const uint4 *is_w = qw4 + (int64_t)first_quad * RQ * sstride + ((int64_t)is_t * 32 + lane) * V;
  auto issue = [&](int i) {
    if (i < n) {
      unsigned char *slot = ring + (i % RD) * SS;
      const int s0 = is_q * RQ;
#pragma unroll
      for (int mi = 0; mi < RQ; ++mi) {
        const bool ok = s0 + mi < nstripes;
#pragma unroll
        for (int v = 0; v < V; ++v)
          cp_async16(slot + mi * WB + (lane * V + v) * 16, ok ? is_w + mi * sstride + v : qw4, ok);
      }
      if (p_on) {
        const bool ok = s0 + pm < nstripes;
        const int g = group_of(is_t * 64 + 32 * ph, p.gmul);
        const T *src = ok ? p_src + (size_t)g * p.Np + (s0 + pm) * 16 + pp * 8 : p_src;
        cp_async16(slot + PB + lane * 16, src, ok);
      }
      const int k = is_t * 64;
      if (x0) {
        const bool ok = k + (lane & 7) * 8 < p.kx;
        cp_async16(slot + xd0, ok ? x + xo0 + k : x, ok);
      }
      if (x1) {
        const bool ok = k + (lane & 7) * 8 < p.kx;
        cp_async16(slot + xd1, ok ? x + xo1 + k : x, ok);
      }
      is_w += 32 * V;
      if (++is_t == p.KT) {
        is_t = 0;
        ++is_q;
        is_w = qw4 + (int64_t)is_q * RQ * sstride + lane * V;
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int i = 0; i < RD - 1; ++i) issue(i);

  // ldmatrix row addresses (relative to a slot; rows >= M read the zero row): matrix q = lane >> 3 is
  // slice 2 * jj + (q >> 1), k half q & 1, token lane & 7
  const bool xok = (lane & 7) < M;
  const uint32_t xoff = XB + (lane & 7) * RING_XP + ((lane >> 3) >> 1) * 32 + ((lane >> 3) & 1) * 16;
  const ZC<T, SB> zc_sym = zc_make<T, SB>((float)(1 << (SB == 4 ? 3 : 7)), (float)(1 << (SB == 4 ? 3 : 7)));

  float acc[RQ][4];
#pragma unroll
  for (int mi = 0; mi < RQ; ++mi)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[mi][c] = 0.f;

  int q = first_quad, t = (int)(a - (int64_t)first_quad * p.KT), tb = t;
  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  for (int i = 0; i < n; ++i) {
    __syncwarp();  // every lane is done with the slot about to be refilled
    issue(i + RD - 1);
    cp_async_wait<RD - 1>();
    __syncwarp();  // the bytes copied by other lanes are visible
    const unsigned char *slot = ring + (i % RD) * SS;
    const uint32_t saddr = ring_addr + (i % RD) * SS;
    uint32_t bf[4][2];
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const uint32_t ad = xok ? saddr + xoff + jj * 64 : zero_addr;
      ldsm_x4(ad, bf[2 * jj][0], bf[2 * jj][1], bf[2 * jj + 1][0], bf[2 * jj + 1][1]);
    }
    const int gi0 = group_of(t * 64, p.gmul), gi1 = group_of(t * 64 + 32, p.gmul);
#pragma unroll
    for (int mi = 0; mi < RQ; ++mi) {
      uint32_t wd[4 * V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const uint4 w4 = *reinterpret_cast<const uint4 *>(slot + mi * WB + (lane * V + v) * 16);
        wd[4 * v] = w4.x;
        wd[4 * v + 1] = w4.y;
        wd[4 * v + 2] = w4.z;
        wd[4 * v + 3] = w4.w;
      }
      const T *prm = reinterpret_cast<const T *>(slot + PB + mi * 128);  // [half][scales 16 | zeros 16]
      if (!FM) {
        float tmp[4] = {0.f, 0.f, 0.f, 0.f};
        float s_lo = 0.f, s_hi = 0.f;
        ZC<T, SB> zc = zc_sym;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          if (hh == 0 || gi1 != gi0) {
            if (hh == 1) {
              acc[mi][0] = fmaf(s_lo, tmp[0], acc[mi][0]);
              acc[mi][1] = fmaf(s_lo, tmp[1], acc[mi][1]);
              acc[mi][2] = fmaf(s_hi, tmp[2], acc[mi][2]);
              acc[mi][3] = fmaf(s_hi, tmp[3], acc[mi][3]);
              tmp[0] = tmp[1] = tmp[2] = tmp[3] = 0.f;
            }
            const T *pr = prm + hh * 32;
            s_lo = to_f(pr[gid]);
            s_hi = to_f(pr[gid + 8]);
            if (p.zm != 0) zc = zc_make<T, SB>(to_f(pr[16 + gid]), to_f(pr[16 + gid + 8]));
          }
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = hh * 2 + jj;
            uint32_t av[4];
            dq_int<T, SB>(wd, j, zc, av);
            mma<T>(tmp, av, bf[j][0], bf[j][1]);
          }
        }
        acc[mi][0] = fmaf(s_lo, tmp[0], acc[mi][0]);
        acc[mi][1] = fmaf(s_lo, tmp[1], acc[mi][1]);
        acc[mi][2] = fmaf(s_hi, tmp[2], acc[mi][2]);
        acc[mi][3] = fmaf(s_hi, tmp[3], acc[mi][3]);
      } else {
        T2 s2lo, s2hi, m2lo, m2hi;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          if (hh == 0 || gi1 != gi0) {
            const T *pr = prm + hh * 32;
            s2lo = bcast2(pr[gid]);
            s2hi = bcast2(pr[gid + 8]);
            m2lo = bcast2(pr[16 + gid]);
            m2hi = bcast2(pr[16 + gid + 8]);
          }
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = hh * 2 + jj;
            uint32_t av[4];
            dq_float<T, SB>(wd, j, s2lo, s2hi, m2lo, m2hi, av);
            mma<T>(acc[mi], av, bf[j][0], bf[j][1]);
          }
        }
      }
    }
    ++t;
    if (t == p.KT || i == n - 1) {  // end of this worker's segment of quad q
      const bool full = tb == 0 && t == p.KT;
      const int row0 = q * RQ * 16;
      if (full) {
#pragma unroll
        for (int mi = 0; mi < RQ; ++mi)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int row = row0 + mi * 16 + gid + (c >> 1) * 8;
            const int tok = tid4 * 2 + (c & 1);
            if (row < p.N && tok < M) {
              float v = acc[mi][c];
              if (bias) v += to_f(bias[row]);
              y[(int64_t)tok * p.ldy + row] = from_f<T>(v);
            }
          }
      } else {
        const int sl = q == first_quad ? 0 : 1;
        float *piece = p.part + (size_t)(gw * 2 + sl) * M * (RQ * 16);
#pragma unroll
        for (int mi = 0; mi < RQ; ++mi)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = mi * 16 + gid + (c >> 1) * 8;
            const int tok = tid4 * 2 + (c & 1);
            if (tok < M) __stcg(piece + tok * (RQ * 16) + r, acc[mi][c]);
          }
        __threadfence();
        __syncwarp();
        const int64_t w_lo = ring_owner((int64_t)q * p.KT, total, p.W);
        const int64_t w_hi = ring_owner((int64_t)(q + 1) * p.KT - 1, total, p.W);
        unsigned prev = 0;
        if (lane == 0) prev = atomicAdd(&p.counters[q], 1u);
        prev = __shfl_sync(0xffffffffu, prev, 0);
        if (prev == (unsigned)(w_hi - w_lo)) {  // last piece of this quad: sum in worker order
          __threadfence();
          // worker w's piece of quad q is its slot 0 (its range starts in q) except for w_lo when its range
          // starts in an earlier quad
          const int sl_lo = w_lo * total / p.W < (int64_t)q * p.KT ? 1 : 0;
          const int np = (int)(w_hi - w_lo) + 1, nv = M * RQ * 16;
          const float *base = p.part + (size_t)(w_lo * 2) * nv;  // piece (w, slot) at base + ((w - w_lo) * 2 + slot) * nv
          float v[16];  // this lane's outputs e = lane + 32 * u of the quad's M x 64
#pragma unroll
          for (int u = 0; u < 16; ++u) v[u] = (lane + 32 * u < nv) ? __ldcg(base + sl_lo * nv + lane + 32 * u) : 0.f;
#pragma unroll 4
          for (int j = 1; j < np; ++j) {
            const float *pw2 = base + (size_t)(j * 2) * nv;
#pragma unroll
            for (int u = 0; u < 16; ++u)
              if (lane + 32 * u < nv) v[u] += __ldcg(pw2 + lane + 32 * u);
          }
#pragma unroll
          for (int u = 0; u < 16; ++u) {
            const int e = lane + 32 * u, tok = e / (RQ * 16), r = e % (RQ * 16);
            const int row = row0 + r;
            if (e < M * RQ * 16 && row < p.N) {
              float o = v[u];
              if (bias) o += to_f(bias[row]);
              y[(int64_t)tok * p.ldy + row] = from_f<T>(o);
            }
          }
          if (lane == 0) p.counters[q] = 0u;  // ready for the next call / graph replay
        }
      }
#pragma unroll
      for (int mi = 0; mi < RQ; ++mi)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mi][c] = 0.f;
      ++q;
      t = 0;
      tb = 0;
    }
  }
  cp_async_wait<0>();
}

// ------------------------------------------------------------------------------------------------
// Bulk kernel (sm_90+, M <= 16). A stage holds one chunk: QS stripes (four, or one on small layers) x up to CT
// tiles (QS contiguous runs of up to CT * 512 bytes of weights) and one run per activation row, copied by the
// bulk copy engine (completing on the stage's mbarrier), plus the chunk's group parameters, copied with cp.async by the lanes
// of the producer warps (which arrive on the same mbarrier when their copies land). NS stages per block,
// BBPS blocks of BNP producer + 8 consumer warps per SM. Stream-K over blocks: each block owns one contiguous
// range of tiles numbered along K within each quad of stripes, cut into chunks at CT-aligned unit boundaries.
// Quads shared by several blocks are reduced as in the ring kernel (pieces summed in block order by the last
// to arrive); within a block, the BNC / QS warps that share a stripe sum in warp order. ("Quad" below means a
// unit's group of QS stripes.) Numerics are the stream kernel's.
// CT, tiles per unit: 8 (512 columns of K), 12 or 16 for 4-bit layers (longer runs per copy, less work per
// chunk; measured faster on large layers and at M = 1: docs/CUDA.md); 32 for units of one stripe
constexpr int BQ = 4;           // stripes per unit (QS), or one on small layers
constexpr int BCT1 = 32;        // tiles per unit of one stripe
constexpr int BNC = 8;          // consumer warps
constexpr int BNP = 2;          // producer warps (one measured too slow from M = 4: docs/CUDA.md)
constexpr int BMAXS = 8;        // most stages
constexpr int BBPS = 2;         // blocks per SM (two producers and 16 consumer warps per SM: measured)
// smem pitch of an activation row (+16: conflict-free ldmatrix)
__host__ __device__ constexpr int bulk_xp(int ct) { return ct * 128 + 16; }
// groups a unit's parameters span: exactly CT * 64 / gs where units start on group boundaries, else two more
__host__ __device__ __forceinline__ int bulk_pgroups(int gs, int ct) {
  return gs > 0 ? (ct * 64) / gs + ((ct * 64) % gs == 0 ? 0 : 2) : 1;
}
// stage: weights | group parameters (per group: QS * 16 scales, QS * 16 zeros / minima) | activation rows
__host__ __device__ __forceinline__ int bulk_stage_bytes(int sb, int m, int gs, int ct, int qs = BQ) {
  return qs * ct * 512 * (sb / 4) + bulk_pgroups(gs, ct) * qs * 64 + m * bulk_xp(ct);
}
// fixed part: NS full + NS empty barriers, a zero row, two reduction buffers (NI n8 blocks each), a flag
// (warps that hand their sums to a stripe's first warp: BNC - QS)
__host__ __device__ constexpr int bulk_red_warps(int qs) { return qs >= BNC ? 0 : BNC - qs; }
// (the last 16 bytes held the split sums' "last block" flag, now a barrier reduction; kept, so plans stay as measured)
__host__ __device__ constexpr int bulk_fix(int ni, int qs = BQ) {
  return 2 * BMAXS * 8 + 16 + 2 * bulk_red_warps(qs) * 32 * ni * 4 * 4 + 16;
}
__host__ __device__ __forceinline__ int bulk_smem_bytes(int sb, int m, int gs, int ns, int ct, int qs = BQ) {
  return bulk_fix(m > 8 ? 2 : 1, qs) + ns * bulk_stage_bytes(sb, m, gs, ct, qs);
}

// Programmatic dependent launch (sm_90; p.pdl != 0, launch_ex): a kernel launched with it may start while the kernel
// before it on the stream still runs, so each thread reads or writes global memory only after pdl_start's
// griddepcontrol.wait, which returns once that kernel has completed and its writes are visible (at once where the
// launch had no such dependency). What comes before it (the barriers' set-up, the block's share of the work, L2
// prefetches) overlaps the previous kernel's tail. p.pdl == 1 also lets the next such launch begin now: its blocks
// start wherever an SM has room (on a full GPU, as this kernel's blocks leave) and wait there in turn. Measured on
// an H200 in graphs of back-to-back calls: 0.5-1.5 us less per call on the 7B Llama shapes, 0-1 us on the 70B
// ones (docs/CUDA.md).
__device__ __forceinline__ void pdl_start(const Params &p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (p.pdl != 2) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
// The copies-only probes' consumers: each of nsteps stages (NS barriers full0 / empty0, 8 bytes apart) freed as
// soon as it lands
__device__ __forceinline__ void probe_drain(uint32_t full0, uint32_t empty0, int NS, int nsteps) {
  for (int i = 0; i < nsteps; ++i) {
    mbar_wait(full0 + 8 * (i % NS), (i / NS) & 1);
    mbar_arrive(empty0 + 8 * (i % NS));
  }
}
// (pol: an L2 policy from createpolicy, e.g. evict-first for the weights, evict-last for the activations)
// L2 prefetches: hints only (L2 is where the GPU's writes land, so a line prefetched before another kernel writes
// it is never read stale), hence allowed before pdl_start
__device__ __forceinline__ void prefetch_l2(const void *src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy_hinted(uint32_t dst, const void *src, unsigned bytes, uint32_t bar,
                                                 uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// One 16x64 tile times NI n8 blocks of tokens, accumulated into acc (scales applied in fp32 per 32-wide
// half, as in the stream kernel; float minima dequantized with one HFMA2).
template <typename T, int SB, bool FM, int NI, int ZO = 64>
__device__ __forceinline__ void bulk_tile(float (&acc)[NI][4], const uint32_t (&wd)[SB], const uint32_t (&bf)[NI][4][2],
                                          const T *pr0, const T *pr1, bool split_groups, int gid, int zm,
                                          const ZC<T, SB> &zc_sym) {
  using T2 = typename Tr<T, SB>::T2;
  if (!FM) {
    float tmp[NI][4];
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) tmp[ni][c] = 0.f;
    float s_lo = to_f(pr0[gid]), s_hi = to_f(pr0[gid + 8]);
    ZC<T, SB> zc = zm != 0 ? zc_make<T, SB>(to_f(pr0[ZO + gid]), to_f(pr0[ZO + gid + 8])) : zc_sym;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (hh == 1 && split_groups) {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          acc[ni][0] = fmaf(s_lo, tmp[ni][0], acc[ni][0]);
          acc[ni][1] = fmaf(s_lo, tmp[ni][1], acc[ni][1]);
          acc[ni][2] = fmaf(s_hi, tmp[ni][2], acc[ni][2]);
          acc[ni][3] = fmaf(s_hi, tmp[ni][3], acc[ni][3]);
          tmp[ni][0] = tmp[ni][1] = tmp[ni][2] = tmp[ni][3] = 0.f;
        }
        s_lo = to_f(pr1[gid]);
        s_hi = to_f(pr1[gid + 8]);
        if (zm != 0) zc = zc_make<T, SB>(to_f(pr1[ZO + gid]), to_f(pr1[ZO + gid + 8]));
      }
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = hh * 2 + jj;
        uint32_t av[4];
        dq_int<T, SB>(wd, j, zc, av);
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma<T>(tmp[ni], av, bf[ni][j][0], bf[ni][j][1]);
      }
    }
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      acc[ni][0] = fmaf(s_lo, tmp[ni][0], acc[ni][0]);
      acc[ni][1] = fmaf(s_lo, tmp[ni][1], acc[ni][1]);
      acc[ni][2] = fmaf(s_hi, tmp[ni][2], acc[ni][2]);
      acc[ni][3] = fmaf(s_hi, tmp[ni][3], acc[ni][3]);
    }
  } else {
    T2 s2lo = bcast2(pr0[gid]), s2hi = bcast2(pr0[gid + 8]);
    T2 m2lo = bcast2(pr0[ZO + gid]), m2hi = bcast2(pr0[ZO + gid + 8]);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (hh == 1 && split_groups) {
        s2lo = bcast2(pr1[gid]);
        s2hi = bcast2(pr1[gid + 8]);
        m2lo = bcast2(pr1[ZO + gid]);
        m2hi = bcast2(pr1[ZO + gid + 8]);
      }
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = hh * 2 + jj;
        uint32_t av[4];
        dq_float<T, SB>(wd, j, s2lo, s2hi, m2lo, m2hi, av);
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma<T>(acc[ni], av, bf[ni][j][0], bf[ni][j][1]);
      }
    }
  }
}

// A consumer warp's tiles of one unit (th, th + BNC / QS, ... of stripe mi). FULL: all CT tiles are present, so no
// per-tile guard splits the unrolled loop (the compiler then schedules across tiles). G64: every group spans
// whole 64-wide tiles (group size a multiple of 64, or per channel), one set of parameters per tile.
template <typename T, int SB, bool FM, int NI, bool G64, bool FULL, int CT, int QS>
__device__ __forceinline__ void bulk_warp_unit(float (&acc)[NI][4], const unsigned char *wb, const T *pb,
                                               const uint32_t (&xb)[NI], uint32_t zero_addr, int nt, int t0, int th,
                                               int g_lo, int gid, const Params &p, const ZC<T, SB> &zc_sym) {
  constexpr int V = SB / 4, WB = 512 * V, TSTEP = BNC / QS, TPW = CT * QS / BNC;
#pragma unroll
  for (int j = 0; j < TPW; ++j) {
    if (!FULL && th + j * TSTEP >= nt) break;
    uint32_t wd[SB];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const uint4 w4 = *reinterpret_cast<const uint4 *>(wb + j * TSTEP * WB + v * 16);
      wd[4 * v] = w4.x;
      wd[4 * v + 1] = w4.y;
      wd[4 * v + 2] = w4.z;
      wd[4 * v + 3] = w4.w;
    }
    uint32_t bf[NI][4][2];
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const uint32_t ad = xb[ni] ? xb[ni] + j * TSTEP * 128 + jj * 64 : zero_addr;
        ldsm_x4(ad, bf[ni][2 * jj][0], bf[ni][2 * jj][1], bf[ni][2 * jj + 1][0], bf[ni][2 * jj + 1][1]);
      }
    const int k0 = (t0 + th + j * TSTEP) * 64;
    const int gi0 = group_of(k0, p.gmul) - g_lo;
    const T *pr0 = pb + gi0 * (QS * 32);
    if (G64) {
      bulk_tile<T, SB, FM, NI, QS * 16>(acc, wd, bf, pr0, pr0, false, gid, p.zm, zc_sym);
    } else {
      const int gi1 = group_of(k0 + 32, p.gmul) - g_lo;
      bulk_tile<T, SB, FM, NI, QS * 16>(acc, wd, bf, pr0, pb + gi1 * (QS * 32), gi1 != gi0, gid, p.zm, zc_sym);
    }
  }
}

// the first tile of granule u (NG granules of kg tiles per quad of KT tiles; the last one may be shorter)
__device__ __forceinline__ int64_t bulk_tile_of(int64_t u, int NG, int kg, int KT) {
  const int64_t q = u / NG;
  return q * KT + min((int)(u - q * NG) * kg, KT);
}
// tiles in the chunk starting at tile t0 of a quad of KT tiles, with `left` tiles left in the block's range
template <int CT>
__device__ __forceinline__ int bulk_chunk(int t0, int KT, int64_t left) {
  const int n = min(KT - t0, CT - t0 % CT);
  return left < n ? (int)left : n;
}

template <typename T, int SB, bool FM, int NI, bool G64, int CT, int QS = BQ>
__global__ void __launch_bounds__((BNC + BNP) * 32, BBPS) bulk_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(CT * QS % BNC == 0 && BNC % QS == 0, "a unit's tiles split evenly over the consumer warps");
  constexpr int V = SB / 4, WB = 512 * V;
  constexpr int BXP = bulk_xp(CT), BFIX = bulk_fix(NI, QS), TSTEP = BNC / QS;
  extern __shared__ __align__(16) unsigned char smem[];
  const int NS = p.KC;  // stages
  const int M = (int)p.M;
  const int PG = bulk_pgroups(p.gs, CT);
  const int SSB = bulk_stage_bytes(SB, M, p.gs, CT, QS);
  const int WOFF = 0, POFF = QS * CT * WB, XOFF = POFF + PG * QS * 64;
  const uint32_t sbase = smem_u32(smem);
  const uint32_t full0 = sbase, empty0 = sbase + BMAXS * 8, zero_addr = sbase + 2 * BMAXS * 8;
  float *red = reinterpret_cast<float *>(smem + 2 * BMAXS * 8 + 16);  // [2][BNC - QS warps][32 lanes][NI*4]
  unsigned char *stages = smem + BFIX;
  const uint32_t stages_addr = sbase + BFIX;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full0 + 8 * s, 1 + 32 * BNP);  // the weight bytes' arrival + one cp.async arrival per producer lane
      mbar_init(empty0 + 8 * s, BNC);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (threadIdx.x < 4) reinterpret_cast<uint32_t *>(smem + 2 * BMAXS * 8)[threadIdx.x] = 0u;
  __syncthreads();

  const int nstripes = p.Np >> 4;
  const int nquads = (nstripes + QS - 1) / QS;
  // stream-K over granules of p.kg tiles (1, CT: whole units, or KT: whole quads), NG per quad: block blk owns
  // granules [blk * total / W, (blk + 1) * total / W), the tiles [a, b) of the quads laid end to end (K tiles
  // within a quad). It takes them in chunks that never cross a CT-aligned unit (a chunk's group parameters then fit
  // the stage) nor a quad.
  const int NG = (p.KT + p.kg - 1) / p.kg;
  const int64_t total = (int64_t)nquads * NG;
  const int64_t blk = blockIdx.x;
  const int64_t a = bulk_tile_of(blk * total / p.W, NG, p.kg, p.KT);
  const int64_t b = bulk_tile_of((blk + 1) * total / p.W, NG, p.kg, p.KT);
  const int first_quad = (int)(a / p.KT);

  if (warp >= BNC) {
    const int pw = warp - BNC;  // producer warp: 0 also issues the weight copies
    // producer: lane 0 arms the stage's barrier with the weight and activation bytes and issues their copies
    // (bulk copy engine: four contiguous weight runs, L2 evict-first, and one run per activation row, L2
    // evict-last); every lane copies its share of the group parameters with cp.async (128-byte pieces, which
    // the bulk engine handles slowly: measured) and arrives on the same barrier once they have landed
    uint64_t pol = 0;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    uint64_t pol_x = 0;  // activations: read by every block, kept in L2
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol_x));
    const unsigned char *qwb = reinterpret_cast<const unsigned char *>(p.qw);
    const T *xs = (const T *)p.x;
    const T *zsrc = (const T *)(p.zm == 1 ? p.zeros : p.mins);
    const T *ssrc = (const T *)p.scales;
    const int np = p.zm != 0 ? 2 : 1;
    // the weight run of stripe cc of quad q from tile t0, and the step past a chunk of nt tiles (the chunk walk
    // of the prefetch and of the copies)
    auto wrun = [&](int q, int cc, int t0) { return qwb + ((int64_t)(q * QS + cc) * p.KT + t0) * WB; };
    auto advance = [&](int &q, int &t0, int64_t &left, int nt) {
      left -= nt;
      t0 += nt;
      if (t0 == p.KT) {
        t0 = 0;
        ++q;
      }
    };
    int q = first_quad, t0 = (int)(a - (int64_t)first_quad * p.KT);
    int64_t left = b - a;
    if (p.pdl && pw == 0 && lane == 0) {  // the first stages' weights into L2 while the last kernel ends
      int pq = q, pt = t0;
      int64_t pleft = left;
      for (int i = 0; i < NS && pleft > 0; ++i) {
        const int nt = bulk_chunk<CT>(pt, p.KT, pleft);
        const int nvs = min(QS, nstripes - pq * QS);
        for (int cc = 0; cc < nvs; ++cc) prefetch_l2(wrun(pq, cc, pt), (unsigned)(nt * WB));
        advance(pq, pt, pleft, nt);
      }
    }
    pdl_start(p);
    for (int i = 0; left > 0; ++i) {
      const int s = i % NS;
      if (i >= NS) mbar_wait(empty0 + 8 * s, ((i / NS) - 1) & 1);
      const int nt = bulk_chunk<CT>(t0, p.KT, left);
      const int nvs = min(QS, nstripes - q * QS);
      const int g_lo = group_of(t0 * 64, p.gmul), g_hi = group_of((t0 + nt) * 64 - 1, p.gmul);
      const int ng = g_hi - g_lo + 1;  // scales hold ceil(Kp / gs) groups: the padded tail has its own
      const uint32_t st = stages_addr + s * SSB, full = full0 + 8 * s;
      if (pw == 0 && lane == 0) {
        const unsigned wbytes = (unsigned)(nt * WB);
        mbar_expect_tx(full, nvs * wbytes + M * nt * 128);
        // each activation row's 64 * nt columns are one contiguous run: one bulk copy per token (as 16-byte
        // cp.async pieces they made the producer the bottleneck from M = 4: 62 against 52 us on 8192x28672)
        for (int r = 0; r < M; ++r)
          bulk_copy_hinted(st + XOFF + r * BXP, xs + (int64_t)r * p.ldx + t0 * 64, nt * 128, full, pol_x);
        for (int cc = 0; cc < nvs; ++cc)
          bulk_copy_hinted(st + WOFF + cc * CT * WB, wrun(q, cc, t0), wbytes, full, pol);
      }
      const int pch = nvs * 2, npc = ng * np * pch;
      for (int e = pw * 32 + lane; e < npc; e += 32 * BNP) {
        const int pr = e / pch, ch = e - pr * pch, g = pr / np, which = pr - g * np;
        const uint32_t dst = st + POFF + g * (QS * 64) + which * (QS * 32) + ch * 16;
        const T *src = (which ? zsrc : ssrc) + (size_t)(g_lo + g) * p.Np + q * (QS * 16) + ch * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
      advance(q, t0, left, nt);
    }
    return;
  }

  // consumers: warp w computes stripe w % QS of the unit, tiles w / QS + j * (BNC / QS)
  pdl_start(p);
  const int gid = lane >> 2, tid4 = lane & 3;
  const int mi = warp % QS, th = warp / QS;
  const ZC<T, SB> zc_sym = zc_make<T, SB>((float)(1 << (SB == 4 ? 3 : 7)), (float)(1 << (SB == 4 ? 3 : 7)));
  // ldmatrix: matrix qm = lane >> 3 is slice 2 * jj + (qm >> 1), k half qm & 1, token (lane & 7) + 8 * ni
  const uint32_t xl = ((lane >> 3) >> 1) * 32 + ((lane >> 3) & 1) * 16;
  float acc[NI][4];
#pragma unroll
  for (int ni = 0; ni < NI; ++ni)
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) acc[ni][cc] = 0.f;
  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  int q = first_quad, t0 = (int)(a - (int64_t)first_quad * p.KT), tb = t0, seg = 0;  // tb: the segment's first tile
  int64_t left = b - a;
  for (int i = 0; left > 0; ++i) {
    const int s = i % NS;
    mbar_wait(full0 + 8 * s, (i / NS) & 1);
    const unsigned char *st = stages + s * SSB;
    const uint32_t sa = stages_addr + s * SSB;
    const int nt = bulk_chunk<CT>(t0, p.KT, left);
    if (!p.probe) {
      // per unit: this lane's weight, parameter and ldmatrix row addresses; per tile only immediates change
      const int g_lo = group_of(t0 * 64, p.gmul);
      uint32_t xb[NI];
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int tok = (lane & 7) + 8 * ni;
        xb[ni] = tok < M ? sa + XOFF + tok * BXP + th * 128 + xl : 0u;  // 0: the zero row
      }
      const unsigned char *wb = st + WOFF + (mi * CT + th) * WB + lane * V * 16;
      const T *pb = reinterpret_cast<const T *>(st + POFF) + mi * 16;
      if (nt == CT)
        bulk_warp_unit<T, SB, FM, NI, G64, true, CT, QS>(acc, wb, pb, xb, zero_addr, nt, t0, th, g_lo, gid, p, zc_sym);
      else
        bulk_warp_unit<T, SB, FM, NI, G64, false, CT, QS>(acc, wb, pb, xb, zero_addr, nt, t0, th, g_lo, gid, p, zc_sym);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);
    left -= nt;
    t0 += nt;
    if (t0 == p.KT || left == 0) {  // end of this block's segment of quad q: sum the warps sharing each stripe
      float *rb = red + (seg & 1) * (bulk_red_warps(QS) * 32 * NI * 4);
      if (TSTEP > 1 && th > 0) {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
          for (int cc = 0; cc < 4; ++cc)
            rb[(((th - 1) * QS + mi) * 32 + lane) * NI * 4 + ni * 4 + cc] = acc[ni][cc];
      }
      if (TSTEP > 1) named_sync(1, BNC * 32);
      if (th == 0) {
        if (TSTEP > 1) {  // in warp order: deterministic
#pragma unroll
          for (int h = 1; h < TSTEP; ++h)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
              for (int cc = 0; cc < 4; ++cc)
                acc[ni][cc] += rb[(((h - 1) * QS + mi) * 32 + lane) * NI * 4 + ni * 4 + cc];
        }
        const bool full = tb == 0 && t0 == p.KT;
        const int row0 = q * QS * 16;
        if (full) {
#pragma unroll
          for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
              const int row = row0 + mi * 16 + gid + (cc >> 1) * 8;
              const int tok = ni * 8 + tid4 * 2 + (cc & 1);
              if (row < p.N && tok < M) {
                float v = acc[ni][cc];
                if (bias) v += to_f(bias[row]);
                y[(int64_t)tok * p.ldy + row] = from_f<T>(v);
              }
            }
        } else {
          const int sl = q == first_quad ? 0 : 1;
          const int nv = M * QS * 16;
          float *piece = p.part + (size_t)(blk * 2 + sl) * nv;
#pragma unroll
          for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
              const int r = mi * 16 + gid + (cc >> 1) * 8;
              const int tok = ni * 8 + tid4 * 2 + (cc & 1);
              if (tok < M) __stcg(piece + tok * (QS * 16) + r, acc[ni][cc]);
            }
          __threadfence();
          named_sync(2, QS * 32);
          const int64_t w_lo = ring_owner((int64_t)q * NG, total, p.W);
          const int64_t w_hi = ring_owner((int64_t)(q + 1) * NG - 1, total, p.W);
          // the last piece of this quad: sum the pieces in block order
          if (named_any(2, QS * 32, threadIdx.x == 0 && atomicAdd(&p.counters[q], 1u) == (unsigned)(w_hi - w_lo))) {
            __threadfence();
            const int sl_lo = w_lo * total / p.W < (int64_t)q * NG ? 1 : 0;
            const int npc = (int)(w_hi - w_lo) + 1;
            const float *base = p.part + (size_t)(w_lo * 2) * nv;
            for (int e = threadIdx.x; e < nv; e += QS * 32) {
              float v = __ldcg(base + sl_lo * nv + e);
              for (int jp = 1; jp < npc; ++jp) v += __ldcg(base + (size_t)(jp * 2) * nv + e);
              const int tok = e / (QS * 16), row = row0 + e % (QS * 16);
              if (row < p.N) {
                if (bias) v += to_f(bias[row]);
                y[(int64_t)tok * p.ldy + row] = from_f<T>(v);
              }
            }
            if (threadIdx.x == 0) p.counters[q] = 0u;  // ready for the next call / graph replay
          }
        }
      }
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) acc[ni][cc] = 0.f;
      ++seg;
      t0 = 0;
      tb = 0;
      ++q;
    }
  }
#endif
}


// ------------------------------------------------------------------------------------------------
// gemv kernel (M = 1, 4-bit, group sizes that are multiples of 32 or per channel; sm_80 and newer). Blocks of
// GV_W warps own whole 16-row stripes (block b: stripes b, b + grid, ...), so each stripe is summed inside its
// block in warp order: no workspace, no counters, deterministic. A stripe is walked in steps of GV_W * GV_U
// tiles, warp w taking GV_U consecutive tiles of each step, and every warp loads the next step's weights and
// group parameters into registers (plain 16-byte loads) before it computes this one. Measured on an H200
// (docs/CUDA.md): the order in which the GPU as a whole requests the weights sets the read rate at this size:
// whole stripes per block read a 117 MB layer in 29.9 us against 37.4 for the bulk kernel's copy engine and 39.7
// for one contiguous range per warp (the stream-K order of the ring and bulk kernels). And the arithmetic per
// tile must stay small: with the activations as 8 L1 loads per tile the kernel issued 137 instructions a tile
// and ran at 57 us; here a lane's B fragments of a tile are two 16-byte shared-memory loads of the activations,
// staged once per block in fragment order (gathered by act-order's permutation, zeros past K). Whole stripes
// leave a partial last round of blocks where the stripes are few for the grid: "auto" takes the kernel only
// where they fill the rounds (gemv_auto).
constexpr int GV_W = 8;  // warps per block
constexpr int GV_U = 4;  // tiles per warp and step
constexpr int GV_RED = 2 * GV_W * 16 * 4;  // the stripe sums' two buffers [2][GV_W][16] floats
__host__ __device__ constexpr int gv_minb(int zm, bool g64) { return zm == 0 && g64 ? 3 : 2; }  // blocks per SM
__host__ __device__ constexpr int gv_smem(int kt) { return GV_RED + kt * 128; }

// one tile's group parameters as raw 16-bit values: scale, zero point or minimum (rows gid, gid + 8), for the
// tile's two 32-wide halves where a group may end inside it (!G64)
template <int ZM, bool G64> struct GvPar {
  static constexpr int NH = G64 ? 1 : 2, NV = (ZM == 0 ? 2 : 4) * NH;
  uint32_t v[NV];
};
__device__ __forceinline__ uint32_t ld_u16(const void *p) {
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}
template <typename T> __device__ __forceinline__ T t_of(uint32_t raw) {
  const unsigned short b = (unsigned short)raw;
  return *reinterpret_cast<const T *>(&b);
}

template <typename T, int ZM, bool G64>
__device__ __forceinline__ void gv_load(const Params &p, int s, int kb, bool ok, uint4 &w, GvPar<ZM, G64> &par,
                                        int lane, int gid) {
  w = ok ? ld_stream(reinterpret_cast<const uint4 *>(p.qw) + ((int64_t)s * p.KT + kb) * 32 + lane)
         : make_uint4(0u, 0u, 0u, 0u);
  const T *zp = (const T *)(ZM == 1 ? p.zeros : p.mins);
#pragma unroll
  for (int h = 0; h < GvPar<ZM, G64>::NH; ++h) {
    const int64_t off = (int64_t)group_of(64 * kb + 32 * h, p.gmul) * p.Np + 16 * s + gid;
    par.v[h * 2] = ok ? ld_u16((const T *)p.scales + off) : 0u;
    par.v[h * 2 + 1] = ok ? ld_u16((const T *)p.scales + off + 8) : 0u;
    if (ZM != 0) {
      par.v[2 * GvPar<ZM, G64>::NH + h * 2] = ok ? ld_u16(zp + off) : 0u;
      par.v[2 * GvPar<ZM, G64>::NH + h * 2 + 1] = ok ? ld_u16(zp + off + 8) : 0u;
    }
  }
}

// one tile: acc0 / acc2 (rows gid / gid + 8) += its products with the activations (b: this lane's 8 B pairs)
template <typename T, int ZM, bool G64>
__device__ __forceinline__ void gv_tile(float &acc0, float &acc2, const uint4 &w, const GvPar<ZM, G64> &par,
                                        const uint4 &b01, const uint4 &b23, const ZC<T, 4> &zc_sym) {
  using T2 = typename Tr<T, 4>::T2;
  constexpr int NH = GvPar<ZM, G64>::NH;
  const uint32_t wd[4] = {w.x, w.y, w.z, w.w};
  const uint32_t b[4][2] = {{b01.x, b01.y}, {b01.z, b01.w}, {b23.x, b23.y}, {b23.z, b23.w}};
  float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // the tile's two 32-wide halves
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int ph = G64 ? 0 : h;
    uint32_t a[4];
    if (ZM == 2) {
      const T2 slo = bcast2(t_of<T>(par.v[2 * ph])), shi = bcast2(t_of<T>(par.v[2 * ph + 1]));
      const T2 mlo = bcast2(t_of<T>(par.v[2 * NH + 2 * ph])), mhi = bcast2(t_of<T>(par.v[2 * NH + 2 * ph + 1]));
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        dq_float<T, 4>(wd, 2 * h + jj, slo, shi, mlo, mhi, a);
        mma<T>(d[h], a, b[2 * h + jj][0], b[2 * h + jj][1]);
      }
    } else {
      const ZC<T, 4> zc = ZM == 1 ? zc_load<T>(t_of<T>(par.v[2 * NH + 2 * ph]), t_of<T>(par.v[2 * NH + 2 * ph + 1]))
                                  : zc_sym;
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        dq_int<T, 4>(wd, 2 * h + jj, zc, a);
        mma<T>(d[h], a, b[2 * h + jj][0], b[2 * h + jj][1]);
      }
    }
  }
  if constexpr (ZM == 2) {  // (scaled per weight)
    acc0 += d[0][0] + d[1][0];
    acc2 += d[0][2] + d[1][2];
  } else if constexpr (G64) {
    acc0 = fmaf(to_f(t_of<T>(par.v[0])), d[0][0] + d[1][0], acc0);
    acc2 = fmaf(to_f(t_of<T>(par.v[1])), d[0][2] + d[1][2], acc2);
  } else {
    acc0 = fmaf(to_f(t_of<T>(par.v[0])), d[0][0], fmaf(to_f(t_of<T>(par.v[2])), d[1][0], acc0));
    acc2 = fmaf(to_f(t_of<T>(par.v[1])), d[0][2], fmaf(to_f(t_of<T>(par.v[3])), d[1][2], acc2));
  }
}

template <typename T, int ZM, bool G64>
__global__ void __launch_bounds__(GV_W * 32, gv_minb(ZM, G64)) gemv_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  float *red = reinterpret_cast<float *>(smem);                // [2][GV_W][16]
  uint32_t *xs = reinterpret_cast<uint32_t *>(smem + GV_RED);  // [KT][4 tid][4 slices][2]: B pairs in fragment order
  const int lane = threadIdx.x & 31, gid = lane >> 2, tid = lane & 3, wi = threadIdx.x >> 5;
  const int G = (int)gridDim.x, NS = p.Np / 16, KT = p.KT;
  const int spp = (KT + GV_W * GV_U - 1) / (GV_W * GV_U);  // steps per stripe
  const int nsteps = (int)blockIdx.x < NS ? (NS - (int)blockIdx.x + G - 1) / G * spp : 0;
#if __CUDA_ARCH__ >= 900
  // the first step's weights into L2 while the kernel before this one ends (pdl_start)
  if (lane == 0 && nsteps > 0 && wi * GV_U < KT)
    prefetch_l2(p.qw + ((int64_t)blockIdx.x * KT + wi * GV_U) * 128, 512u * (unsigned)min(GV_U, KT - wi * GV_U));
#endif
  pdl_start(p);
  // the activations in fragment order: pair (k, k + 1) of tile kb goes to slot ((kb * 4 + tid) * 4 + j) * 2 + hi
  {
    const T *x = (const T *)p.x;
    for (int c = (int)threadIdx.x; c < KT * 32; c += GV_W * 32) {
      const int k = 2 * c, kb = k >> 6, r = k & 63, j = r >> 4, hi = (r >> 3) & 1, t = (r & 7) >> 1;
      typename Tr<T, 4>::T2 pr;
      pr.x = k < p.K ? x[p.perm ? p.perm[k] : k] : from_f<T>(0.f);
      pr.y = k + 1 < p.K ? x[p.perm ? p.perm[k + 1] : k + 1] : from_f<T>(0.f);
      xs[((kb * 4 + t) * 4 + j) * 2 + hi] = as_u32(pr);
    }
  }
  __syncthreads();
  const ZC<T, 4> zc_sym = zc_make<T, 4>(8.f, 8.f);
  uint4 w_cur[GV_U], w_nxt[GV_U];
  GvPar<ZM, G64> p_cur[GV_U], p_nxt[GV_U];
  int s = (int)blockIdx.x, st = 0;  // the computed step's stripe and step within it
  int s_n = s, st_n = 0, i_n = 0;   // the loaded step's
  auto load = [&](uint4 (&w)[GV_U], GvPar<ZM, G64> (&par)[GV_U]) {
    const int t0 = st_n * GV_W * GV_U + wi * GV_U;
#pragma unroll
    for (int u = 0; u < GV_U; ++u)
      gv_load<T, ZM, G64>(p, s_n, t0 + u, i_n < nsteps && t0 + u < KT, w[u], par[u], lane, gid);
    ++i_n;
    if (++st_n == spp) {
      st_n = 0;
      s_n += G;
    }
  };
  load(w_cur, p_cur);
  float acc0 = 0.f, acc2 = 0.f;
  int buf = 0;
  for (int i = 0; i < nsteps; ++i) {
    load(w_nxt, p_nxt);
    const int t0 = st * GV_W * GV_U + wi * GV_U;
#pragma unroll
    for (int u = 0; u < GV_U; ++u) {
      if (t0 + u < KT) {
        const uint4 *xb = reinterpret_cast<const uint4 *>(xs + ((t0 + u) * 4 + tid) * 8);
        gv_tile<T, ZM, G64>(acc0, acc2, w_cur[u], p_cur[u], xb[0], xb[1], zc_sym);
      }
    }
    if (++st == spp) {  // the stripe is done: its 16 sums over the warps, in warp order
      if (tid == 0) {
        red[(buf * GV_W + wi) * 16 + gid] = acc0;
        red[(buf * GV_W + wi) * 16 + gid + 8] = acc2;
      }
      __syncthreads();  // (also: every thread has read the other buffer, written two stripes ago)
      const int row = 16 * s + (int)threadIdx.x;
      if (threadIdx.x < 16 && row < p.N) {
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < GV_W; ++ww) v += red[(buf * GV_W + ww) * 16 + threadIdx.x];
        ((T *)p.y)[row] = from_f<T>(p.bias ? v + to_f(((const T *)p.bias)[row]) : v);
      }
      buf ^= 1;
      acc0 = acc2 = 0.f;
      st = 0;
      s += G;
    }
#pragma unroll
    for (int u = 0; u < GV_U; ++u) {
      w_cur[u] = w_nxt[u];
      p_cur[u] = p_nxt[u];
    }
  }
}

// ------------------------------------------------------------------------------------------------
// wgmma kernel (sm_90a, 4-bit, large M). A block is two warpgroups; each computes 64 weight rows (one quad of
// stripes) x BN tokens (64 or 128) with wgmma.m64nBNk16. The weights are wgmma's A operand from registers:
// layout v1's per-lane fragment of a 16 x 64 tile is exactly a warp's 16-row slice of A, so a tile needs no
// shuffle, only dequantization and scaling in the activation dtype (one rounding per weight, as Marlin does).
// The activations are the B operand from shared memory, K-major with the 128-byte swizzle. Everything a K tile
// needs (BN activation rows x 64 columns, the block's eight 512-byte weight tiles, the group parameters of
// its rows) arrives through cp.async in stages issued (stages - 1) tiles ahead. A warpgroup waits for its own
// wgmmas before it dequantizes the next tile (double-buffered A registers with wgmma.wait_group 1 made ptxas
// serialize the wgmmas: C7513); the overlap of dequantization and tensor-core work comes from the four
// warpgroups of the two blocks an SM holds. Grid: x = token tiles (blocks that share weights run together and
// hit L2), y = row tiles.
constexpr int WG_BM = 128;       // weight rows per block (two warpgroups)
constexpr int WG_WB = 8 * 512;   // a stage's weight bytes
constexpr int WG_PB = 4 * 2 * WG_BM * 2;  // a stage's parameter bytes: up to 4 groups x (scale, zero) x 128 rows
__host__ __device__ constexpr int wg_stage_bytes(int bn) { return bn * 128 + WG_WB + WG_PB; }
// stages (one K tile each): BN 64 fits two blocks per SM; BN 128 holds 64 accumulators per thread and, with
// two tiles' fragments live (KP 2), one block per SM
// AS: the dequantized weights go through shared memory (two buffers per warpgroup) so that a warpgroup's
// wgmmas on tile kt run while it dequantizes tile kt + 1 (token tile 64, one K tile per step)
__host__ __device__ constexpr int wg_stages(int bn, int kp, bool as = false) { return as ? 5 : bn == 64 ? 6 : kp == 2 ? 8 : 4; }
constexpr int WG_AB = 2 * 2 * 64 * 128;  // AS: 2 warpgroups x 2 buffers x 64 rows x 128 bytes
__host__ __device__ constexpr int wg_smem_bytes(int bn, int kp, bool as = false) {
  return wg_stages(bn, kp, as) * wg_stage_bytes(bn) + (as ? WG_AB : 0) + 1024;
}

__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  // K-major, 128-byte swizzle: start >> 4, LBO unused (1), SBO = 1024 B between 8-row groups, mode 1
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// wgmma.mma_async m64nNk16 with fp32 accumulators d[N / 2]; the fp16 and bf16 forms differ only in the
// type's PTX name. The bodies are empty outside sm_90a (the planner launches these kernels on 9.0 only).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define W4P_SM90A(...) __VA_ARGS__
#else
#define W4P_SM90A(...)
#endif
#define W4P_WG_ACC8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define W4P_WG_ACC16 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define W4P_WG_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define W4P_WG_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define W4P_WG_ACC32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), \
  "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), \
  "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
  "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define W4P_WG_ACC64_OF(v) "+f"(v[0]), "+f"(v[1]), "+f"(v[2]), "+f"(v[3]), "+f"(v[4]), "+f"(v[5]), "+f"(v[6]), "+f"(v[7]), "+f"(v[8]), \
  "+f"(v[9]), "+f"(v[10]), "+f"(v[11]), "+f"(v[12]), "+f"(v[13]), "+f"(v[14]), "+f"(v[15]), "+f"(v[16]), \
  "+f"(v[17]), "+f"(v[18]), "+f"(v[19]), "+f"(v[20]), "+f"(v[21]), "+f"(v[22]), "+f"(v[23]), "+f"(v[24]), \
  "+f"(v[25]), "+f"(v[26]), "+f"(v[27]), "+f"(v[28]), "+f"(v[29]), "+f"(v[30]), "+f"(v[31]), "+f"(v[32]), \
  "+f"(v[33]), "+f"(v[34]), "+f"(v[35]), "+f"(v[36]), "+f"(v[37]), "+f"(v[38]), "+f"(v[39]), "+f"(v[40]), \
  "+f"(v[41]), "+f"(v[42]), "+f"(v[43]), "+f"(v[44]), "+f"(v[45]), "+f"(v[46]), "+f"(v[47]), "+f"(v[48]), \
  "+f"(v[49]), "+f"(v[50]), "+f"(v[51]), "+f"(v[52]), "+f"(v[53]), "+f"(v[54]), "+f"(v[55]), "+f"(v[56]), \
  "+f"(v[57]), "+f"(v[58]), "+f"(v[59]), "+f"(v[60]), "+f"(v[61]), "+f"(v[62]), "+f"(v[63])
#define W4P_WG_ACC64 W4P_WG_ACC64_OF(d)
// m64n256: the second half through e = d + 64
#define W4P_WG_ACC128 W4P_WG_ACC64_OF(d), W4P_WG_ACC64_OF(e)
#define W4P_WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define W4P_WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define W4P_WG_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, " \
  "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, " \
  "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// A from registers (%ia: the four A registers, scale-d and the B descriptor follow the accumulators)
#define W4P_WGOP_RS(T, TY, N, DREGS, ACC, AREGS, SC, DESC)                                                       \
  template <> struct WgOp<T, N> {                                                                                \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc,         \
                                               int scale_d) {                                                    \
      float *const e = d + (N > 128 ? 64 : 0); /* the second 64 accumulators of m64n256 */                       \
      (void)e;                                                                                                   \
      W4P_SM90A(asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " SC ", 0;\n"                                   \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", " AREGS    \
                             ", " DESC ", p, 1, 1, 0;\n}\n"                                                      \
                             : ACC                                                                               \
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(desc));)            \
    }                                                                                                            \
  };
// A from shared memory as well (both operands K-major, 128-byte swizzle)
#define W4P_WGOP_SS(T, TY, N, DREGS, ACC, DA, DB, SC)                                                            \
  template <> struct WgOpSS<T, N> {                                                                              \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {       \
      float *const e = d + (N > 128 ? 64 : 0); /* the second 64 accumulators of m64n256 */                       \
      (void)e;                                                                                                   \
      W4P_SM90A(asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " SC ", 0;\n"                                   \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", " DA ", " \
                             DB ", p, 1, 1, 0, 0;\n}\n"                                                          \
                             : ACC                                                                               \
                             : "l"(da), "l"(db), "r"(scale_d));)                                                 \
    }                                                                                                            \
  };
// A warpgroup's wgmma D fragment out (both wgmma kernels): acc[4 i + c] is row (c < 2 ? r_lo : r_lo + 8),
// token tok0 + 8 i + 2 (lane & 3) + (c & 1). One split: y (+ bias).
template <typename T, int BN>
__device__ __forceinline__ void wg_store_y(const Params &p, const float (&acc)[BN / 2], int r_lo, int64_t tok0,
                                           int lane) {
  const int r_hi = r_lo + 8;
  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  const float b_lo = (bias && r_lo < p.N) ? to_f(bias[r_lo]) : 0.f;
  const float b_hi = (bias && r_hi < p.N) ? to_f(bias[r_hi]) : 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = c < 2 ? r_lo : r_hi;
      const int64_t tok = tok0 + 8 * i + 2 * (lane & 3) + (c & 1);
      if (row < p.N && tok < p.M) y[tok * p.ldy + row] = from_f<T>(acc[4 * i + c] + (c < 2 ? b_lo : b_hi));
    }
}
// Several splits: this split's fp32 partials, which split_reduce then adds in split order.
template <int BN>
__device__ __forceinline__ void wg_store_part(const Params &p, const float (&acc)[BN / 2], int r_lo, int64_t tok0,
                                              int lane) {
  const int r_hi = r_lo + 8;
  float *part = p.part + (size_t)blockIdx.z * p.M * p.Np;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = c < 2 ? r_lo : r_hi;
      const int64_t tok = tok0 + 8 * i + 2 * (lane & 3) + (c & 1);
      if (tok < p.M && row < p.Np) __stcg(part + tok * p.Np + row, acc[4 * i + c]);
    }
}

// The epilogue's staging tile (ws_store_y): one token row of R weight rows in the activation dtype, padded by 16
// bytes so that the 8 token rows of an stmatrix land in 8 different bank groups
__host__ __device__ constexpr int ws_ypitch(int r) { return (r + 8) * 2; }
__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3) : "memory");
}
template <typename T> __device__ __forceinline__ uint32_t pack_t2(float a, float b) {
  typename Tr<T, 4>::T2 v;
  v.x = from_f<T>(a);
  v.y = from_f<T>(b);
  return *reinterpret_cast<uint32_t *>(&v);
}
// One part of a wgmma_ws output tile into y through shared memory: the NW warps of the part (index wl within it)
// each hold 16 weight rows, rbase + 16 wl + {gid, gid + 8}, x BN tokens from tok0 (the m64nN D fragment). Each
// 8 x 8 block of the fragment (+ bias, rounded once to T) is stored transposed (stmatrix .trans), so that a
// token's 8 rows become one 16-byte run of the staging tile [BN][16 NW (+ 8)]; then the part's threads write it
// out token row by token row, 16 bytes a thread. Before, the fragment went to y in 2-byte stores (four 16-byte
// runs per warp instruction): 3.8-5.5 us of a 256 x 128 block's 50, 1.9-2.2 staged (H200 trace of 4096x11008 at
// M = 256, docs/CUDA.md section 7).
// The part's 32 NW threads synchronize on named barrier `bar` before and after staging, so the staging tile may be
// reused by the next part.
template <typename T, int BN, int NW>
__device__ __forceinline__ void ws_store_y(const Params &p, const float (&acc)[BN / 2], int rbase, int64_t tok0,
                                           uint32_t stg, const unsigned char *stg_g, int wl, int lane, int bar) {
  constexpr int R = 16 * NW, PITCH = ws_ypitch(R), CPR = R / 8;  // 16-byte chunks per token row
  const int r_lo = rbase + 16 * wl + (lane >> 2), r_hi = r_lo + 8;
  const T *bias = (const T *)p.bias;
  const float b_lo = (bias && r_lo < p.N) ? to_f(bias[r_lo]) : 0.f;
  const float b_hi = (bias && r_hi < p.N) ? to_f(bias[r_hi]) : 0.f;
  named_sync(bar, 32 * NW);  // the part's previous readers of the staging tile are done
  {
    const int q = lane >> 3;  // the lane's address: row (lane & 7) of matrix q: (i + q / 2, half q & 1)
    const uint32_t a0 = stg + (uint32_t)((8 * (q >> 1) + (lane & 7)) * PITCH + (16 * wl + 8 * (q & 1)) * 2);
#pragma unroll
    for (int i = 0; i < BN / 8; i += 2)
      stsm_x4_trans(a0 + (uint32_t)(8 * i * PITCH), pack_t2<T>(acc[4 * i] + b_lo, acc[4 * i + 1] + b_lo),
                    pack_t2<T>(acc[4 * i + 2] + b_hi, acc[4 * i + 3] + b_hi),
                    pack_t2<T>(acc[4 * i + 4] + b_lo, acc[4 * i + 5] + b_lo),
                    pack_t2<T>(acc[4 * i + 6] + b_hi, acc[4 * i + 7] + b_hi));
  }
  named_sync(bar, 32 * NW);
  T *y = (T *)p.y;
  const bool vec = (p.ldy & 7) == 0 && (reinterpret_cast<uintptr_t>(p.y) & 15) == 0;
  // a fixed trip count, the same for every lane: inside stream-K's segment loop a loop whose exit depends on the
  // lane made ptxas move the main loop's uniform arithmetic (wgmma descriptors) to per-thread registers
  static_assert(BN * CPR % (32 * NW) == 0, "whole rounds of the part's threads");
#pragma unroll
  for (int it = 0; it < BN * CPR / (32 * NW); ++it) {
    const int idx = it * 32 * NW + 32 * wl + lane;
    const int t = idx / CPR, c = idx - t * CPR;
    const int64_t tok = tok0 + t;
    const int row = rbase + 8 * c;
    if (tok < p.M && row < p.N) {
      const unsigned char *src = stg_g + t * PITCH + c * 16;
      T *dst = y + tok * p.ldy + row;
      if (vec && row + 8 <= p.N) {
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
      } else {
        const T *s = reinterpret_cast<const T *>(src);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (row + e < p.N) dst[e] = s[e];
      }
    }
  }
}

// A wgmma_ws block's whole output tile through ws_store_y. RS = 2: each consumer warpgroup stages its own 64-row
// parts in its own tile after the zero tile (`stg`), on its own barrier, so neither waits for the other. RS = 1:
// the 4 CW consumer warps (8, or 12 in 192-row blocks) share the stages (`stg`), free once all of them are past the
// main loop (the first barrier)
template <typename T, int BN, int RS, int CW = 2>
__device__ __forceinline__ void ws_store_tile(const Params &p, const float (&acc)[RS][BN / 2], int row0, int64_t tok0,
                                              uint32_t stg, const unsigned char *stg_g, int warp, int lane) {
  if constexpr (RS == 2) {
    const int w = warp >> 2;
    const int off = w * BN * ws_ypitch(64);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      ws_store_y<T, BN, 4>(p, acc[r], row0 + 128 * r + 64 * w, tok0, stg + (uint32_t)off, stg_g + off, warp & 3, lane,
                           2 + w);
  } else {
    ws_store_y<T, BN, 4 * CW>(p, acc[0], row0, tok0, stg, stg_g, warp, lane, 1);
  }
}

__device__ __forceinline__ unsigned sk_block() { return blockIdx.x; }
__device__ __forceinline__ unsigned sk_grid() { return gridDim.x; }
// Stream-K (wgmma_ws with p.sk tiles over a grid of resident blocks): the block whose share of the units
// (stages of tiles, tile by tile) holds unit u, for shares split as floor(b * U / G)
__device__ __forceinline__ int sk_owner(int64_t u, int64_t U, int G) { return (int)(((u + 1) * G - 1) / U); }
// Stream-K epilogue of one segment, run by each consumer warpgroup on its own (the producer has left): a
// warpgroup's rows of a tile (64 of each 128-row half) are summed apart from the other warpgroup's, so the two
// never wait for each other (they drift by up to a few stages). A whole tile goes to y. For a partial one the
// warpgroups holding its part w first take an arrival number (counters[2 tile + w]). All but the last store their
// accumulators in their block's workspace slot (0 for the block's first segment, 1 for its last; fragment order:
// for each 4-float group of a thread's accumulators, the 256 threads' groups side by side, 512 contiguous bytes
// per warp instruction; a warpgroup writes its own threads' groups) and count themselves stored
// (counters[SK_READY + 2 tile + w], at their next epilogue: sk_count_stored). The last waits for those, adds the
// slots to its own registers in block order, its own term in its place (bit-identical whoever arrives last), and
// writes y: its own partial never goes through memory. Every block's run holds at least one unit (the plan keeps G <= U), so the blocks of a tile are
// exactly those from the owner of its first unit to the owner of its last.
constexpr int SK_READY = 8192;  // the second half of the counters (MAX_COUNTERS): slots stored per tile part
// A warpgroup counts its last partial store stored (pend: its part, or -1) only at its next segment's epilogue or
// at the run's end: the stores drain while it runs the next segment, and the block that sums that tile arrives
// much later (at the end of its own run). The fence orders each thread's stores before the count.
__device__ __forceinline__ void sk_count_stored(const Params &p, int &pend, int warp) {
  __threadfence();
  named_sync(2 + (warp >> 2), 128);  // (also: every thread of the warpgroup is past its previous epilogue)
  if ((threadIdx.x & 127) == 0 && pend >= 0) atomicAdd(&p.counters[SK_READY + pend], 1u);
  pend = -1;
}
template <typename T, int RB, int BN, int RS>
__device__ __forceinline__ void sk_epilogue(const Params &p, float (&acc)[RS][BN / 2], int tile, int kb, int ke,
                                            int row0, int64_t tok0, int warp, int lane, int64_t u_beg, int SPT,
                                            uint32_t stg, const unsigned char *stg_g, int &pend) {
  static_assert(RS == 2, "stream-K runs the 256-row blocks");
  sk_count_stored(p, pend, warp);
  if (kb == 0 && ke == p.KT) {
    ws_store_tile<T, BN, RS>(p, acc, row0, tok0, stg, stg_g, warp, lane);
    return;
  }
  constexpr int TILE = BN * RB, NG = RS * BN / 8;  // floats per slot; 4-float groups per thread
  static_assert(NG * 4 * 256 == TILE, "a slot holds the 256 consumer threads' accumulators");
  const int w = warp >> 2, bar = 2 + w, part = 2 * tile + w;
  const bool lead = (threadIdx.x & 127) == 0;
  const int G = (int)sk_grid(), me = (int)sk_block();
  const int64_t U = (int64_t)p.sk * SPT;
  const int c_lo = sk_owner((int64_t)tile * SPT, U, G), c_hi = sk_owner((int64_t)(tile + 1) * SPT - 1, U, G);
  auto slot = [&](int cb) {
    return reinterpret_cast<float4 *>(p.part + ((size_t)cb * 2 + ((int64_t)cb * U / G / SPT == tile ? 0 : 1)) * TILE) +
           threadIdx.x;
  };
  const bool last = named_any(bar, 128, lead && atomicAdd(&p.counters[part], 1u) == (unsigned)(c_hi - c_lo));
  // (a vote: its result is known to be the same in every lane, so the branch keeps the segment loop's control
  // flow uniform for ptxas)
  if (!__any_sync(0xffffffffu, last)) {
    float4 *mine = slot(me);
#pragma unroll
    for (int r = 0; r < RS; ++r)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        __stcg(mine + (r * (BN / 8) + i) * 256,
               make_float4(acc[r][4 * i], acc[r][4 * i + 1], acc[r][4 * i + 2], acc[r][4 * i + 3]));
    pend = part;  // counted stored at the next segment's epilogue or the run's end
    return;
  }
  if (lead)  // the others have arrived: they are storing or have stored
    while (atomicOr(&p.counters[SK_READY + part], 0u) < (unsigned)(c_hi - c_lo)) __nanosleep(64);
  named_sync(bar, 128);
  __threadfence();
  if (c_hi - c_lo == 1) {
    // two blocks (the usual case): the other's slot, 8 groups in flight at once (four L2 round trips; 4 in flight
    // before took eight). One addition: its order does not change the result
    const float4 *other = slot(me == c_lo ? c_hi : c_lo);
#pragma unroll
    for (int i0 = 0; i0 < NG; i0 += 8) {
      float4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __ldcg(other + (i0 + i) * 256);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float *a = &acc[(i0 + i) / (BN / 8)][4 * ((i0 + i) % (BN / 8))];
        a[0] += v[i].x;
        a[1] += v[i].y;
        a[2] += v[i].z;
        a[3] += v[i].w;
      }
    }
  } else {
    constexpr int CH = 4;  // groups per chunk: loads of 16 bytes in flight per thread and slot
#pragma unroll
    for (int r = 0; r < RS; ++r)
#pragma unroll
      for (int i0 = 0; i0 < BN / 8; i0 += CH) {
        float4 pre[CH];  // the sum of the slots before this block's, in block order
        for (int cb = c_lo; cb < me; ++cb) {
          const float4 *src = slot(cb) + (r * (BN / 8) + i0) * 256;
          float4 v[CH];
#pragma unroll
          for (int i = 0; i < CH; ++i) v[i] = __ldcg(src + i * 256);
#pragma unroll
          for (int i = 0; i < CH; ++i)
            pre[i] = cb == c_lo ? v[i] : make_float4(pre[i].x + v[i].x, pre[i].y + v[i].y, pre[i].z + v[i].z,
                                                     pre[i].w + v[i].w);
        }
        if (me > c_lo)
#pragma unroll
          for (int i = 0; i < CH; ++i) {
            float *a = &acc[r][4 * (i0 + i)];
            a[0] = pre[i].x + a[0];
            a[1] = pre[i].y + a[1];
            a[2] = pre[i].z + a[2];
            a[3] = pre[i].w + a[3];
          }
        for (int cb = me + 1; cb <= c_hi; ++cb) {
          const float4 *src = slot(cb) + (r * (BN / 8) + i0) * 256;
          float4 v[CH];
#pragma unroll
          for (int i = 0; i < CH; ++i) v[i] = __ldcg(src + i * 256);
#pragma unroll
          for (int i = 0; i < CH; ++i) {
            float *a = &acc[r][4 * (i0 + i)];
            a[0] += v[i].x;
            a[1] += v[i].y;
            a[2] += v[i].z;
            a[3] += v[i].w;
          }
        }
      }
  }
  ws_store_tile<T, BN, RS>(p, acc, row0, tok0, stg, stg_g, warp, lane);
  if (lead) {  // ready for the next call / graph replay
    p.counters[part] = 0u;
    p.counters[SK_READY + part] = 0u;
  }
}

template <typename T, int BN> struct WgOp;
W4P_WGOP_RS(half, "f16", 16, W4P_WG_D8, W4P_WG_ACC8, "{%8, %9, %10, %11}", "%12", "%13")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 16, W4P_WG_D8, W4P_WG_ACC8, "{%8, %9, %10, %11}", "%12", "%13")
W4P_WGOP_RS(half, "f16", 32, W4P_WG_D16, W4P_WG_ACC16, "{%16, %17, %18, %19}", "%20", "%21")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 32, W4P_WG_D16, W4P_WG_ACC16, "{%16, %17, %18, %19}", "%20", "%21")
W4P_WGOP_RS(half, "f16", 64, W4P_WG_D32, W4P_WG_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 64, W4P_WG_D32, W4P_WG_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
W4P_WGOP_RS(half, "f16", 128, W4P_WG_D64, W4P_WG_ACC64, "{%64, %65, %66, %67}", "%68", "%69")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 128, W4P_WG_D64, W4P_WG_ACC64, "{%64, %65, %66, %67}", "%68", "%69")
W4P_WGOP_RS(half, "f16", 256, W4P_WG_D128, W4P_WG_ACC128, "{%128, %129, %130, %131}", "%132", "%133")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 256, W4P_WG_D128, W4P_WG_ACC128, "{%128, %129, %130, %131}", "%132", "%133")
template <typename T, int BN> struct WgOpSS;
W4P_WGOP_SS(half, "f16", 64, W4P_WG_D32, W4P_WG_ACC32, "%32", "%33", "%34")
W4P_WGOP_SS(__nv_bfloat16, "bf16", 64, W4P_WG_D32, W4P_WG_ACC32, "%32", "%33", "%34")
W4P_WGOP_SS(half, "f16", 128, W4P_WG_D64, W4P_WG_ACC64, "%64", "%65", "%66")
W4P_WGOP_SS(__nv_bfloat16, "bf16", 128, W4P_WG_D64, W4P_WG_ACC64, "%64", "%65", "%66")
W4P_WGOP_SS(half, "f16", 256, W4P_WG_D128, W4P_WG_ACC128, "%128", "%129", "%130")
W4P_WGOP_SS(__nv_bfloat16, "bf16", 256, W4P_WG_D128, W4P_WG_ACC128, "%128", "%129", "%130")

template <typename T, int ZMODE, int BN, int KP, bool AS = false>  // ZMODE: 0 none, 1 integer zeros, 2 float minima
__global__ void __launch_bounds__(256, (BN == 64 || KP == 1) ? 2 : 1) wgmma_kernel(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T2 = typename Tr<T, 4>::T2;
  constexpr int SB = wg_stage_bytes(BN), XB = BN * 128, NP = ZMODE != 0 ? 2 : 1, WGS = wg_stages(BN, KP, AS);
  static_assert(WGS % KP == 0, "stages come in groups of KP");
  static_assert(!AS || (BN == 64 && KP == 1), "AS: token tile 64, one K tile per step");
  constexpr int PD = AS ? WGS - 2 : WGS - KP;  // prefetch distance (AS: the stage of tile kt - 1 is still read)
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t sbase = (smem_u32(smem) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const unsigned char *sgen = smem + (sbase - smem_u32(smem));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2;
  const int nstripes = p.Np >> 4, KT = p.KT;
  const int row0 = blockIdx.y * WG_BM;              // first weight row of the block
  const int64_t tok0 = (int64_t)blockIdx.x * BN;
  const int kb = (int)((int64_t)blockIdx.z * KT / p.S), ke = (int)((int64_t)(blockIdx.z + 1) * KT / p.S);
  // one group per 64-column tile (group sizes that are multiples of 64, per channel): parameters once per tile
  const bool one_group = p.gs <= 0 || p.gs % 64 == 0;

  // this thread's copy sources, fixed but for the K offset: activation chunks (row r = token tok0 + r, 16-byte
  // chunk c stored at chunk c ^ (r & 7); rows past M read as zeros), one 16-byte piece of the block's weights,
  // and at most one 16-byte piece of the group parameters ([slot][scale, zero][128 rows])
  const T *xs[BN / 32];
  uint32_t xoff[BN / 32];
#pragma unroll
  for (int i = 0; i < BN / 32; ++i) {
    const int idx = tid + 256 * i, r = idx >> 3, c = idx & 7;
    xs[i] = tok0 + r < p.M ? (const T *)p.x + (tok0 + r) * p.ldx + c * 8 : nullptr;
    xoff[i] = r * 128 + ((c ^ (r & 7)) << 4);
  }
  const bool w_ok = (row0 >> 4) + (tid >> 5) < nstripes;
  const unsigned char *ws = reinterpret_cast<const unsigned char *>(p.qw) +
                            ((int64_t)((row0 >> 4) + (tid >> 5)) * KT) * 512 + lane * 16;
  const int pg = tid / (NP * 16), pwhich = (tid >> 4) % NP, pch = tid & 15;
  const bool p_ok = row0 + pch * 8 < p.Np;
  const T *ps_src = (const T *)(pwhich ? (ZMODE == 1 ? p.zeros : p.mins) : p.scales) + row0 + pch * 8;
  const uint32_t poff = XB + WG_WB + (pg * 2 + pwhich) * 256 + pch * 16;

  auto load_stage = [&](int kt, uint32_t st) {
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) {
      const T *src = xs[i] ? xs[i] + kt * 64 : (const T *)p.x;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(st + xoff[i]), "l"(src),
                   "r"(xs[i] ? 16 : 0) : "memory");
    }
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(st + XB + tid * 16),
                 "l"(w_ok ? ws + (int64_t)kt * 512 : (const unsigned char *)p.qw), "r"(w_ok ? 16 : 0) : "memory");
    const int g_lo = group_of(kt * 64, p.gmul), ng = group_of(kt * 64 + 63, p.gmul) - g_lo + 1;
    if (pg < ng)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(st + poff),
                   "l"(p_ok ? ps_src + (size_t)(g_lo + pg) * p.Np : (const T *)p.scales), "r"(p_ok ? 16 : 0) : "memory");
  };

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  // prologue: stages kb .. kb + PD - 1, one commit group each
#pragma unroll 1
  for (int s = 0; s < PD; ++s) {
    if (kb + s < ke) load_stage(kb + s, sbase + s * SB);
    cp_async_commit();
  }
  const ZC<T, 4> zc_sym = zc_make<T, 4>(8.f, 8.f);
  const int rl = (warp & 7) * 16 + gid;  // this lane's low row within the block (high row: rl + 8)
  const uint32_t w_lds = XB + (warp & 7) * 512 + lane * 16;

  // the A fragments of tile kt (stage at sg): (q - z) * s or s * q + m in the activation dtype
  auto dequant = [&](int kt, const unsigned char *sg, uint32_t (&a)[4][4]) {
    const uint4 wv = *reinterpret_cast<const uint4 *>(sg + w_lds);
    const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
    const T *prm = reinterpret_cast<const T *>(sg + XB + WG_WB);
    const int g_lo = one_group ? 0 : group_of(kt * 64, p.gmul);
    T2 s_lo, s_hi, z_lo, z_hi;
    ZC<T, 4> zc = zc_sym;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j == 0 || !one_group) {
        const int slot = one_group ? 0 : group_of(kt * 64 + 16 * j, p.gmul) - g_lo;
        const T *ps = prm + slot * 2 * WG_BM;
        s_lo = bcast2(ps[rl]);
        s_hi = bcast2(ps[rl + 8]);
        if (ZMODE == 2) {
          z_lo = bcast2(ps[WG_BM + rl]);
          z_hi = bcast2(ps[WG_BM + rl + 8]);
        } else if (ZMODE == 1) {
          zc = zc_make<T, 4>(to_f(ps[WG_BM + rl]), to_f(ps[WG_BM + rl + 8]));
        }
      }
      dq_scaled<T, ZMODE>(w, j, zc, s_lo, s_hi, z_lo, z_hi, a[j]);
    }
  };

  // KP tiles per step: wait for their stages, refill the stages of the previous step (its wgmmas are done),
  // dequantize every tile, then issue 4 wgmmas per tile and wait for them once
  uint32_t a[KP][4][4];
  int slot = 0;
  if constexpr (AS) {
    const int wgi = warp >> 2, wq = warp & 3, tid4 = lane & 3;
    const uint32_t abase = sbase + WGS * SB + wgi * 2 * 8192;
    for (int kt = kb; kt < ke; ++kt) {
      cp_async_wait<PD - 1>();
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();  // stage kt is complete; the wgmmas of tile kt - 2 are done (each warpgroup waited)
      {
        const int nk = kt + PD;
        int ns = slot + PD;
        if (ns >= WGS) ns -= WGS;
        if (nk < ke) load_stage(nk, sbase + ns * SB);
        cp_async_commit();
      }
      dequant(kt, sgen + slot * SB, a[0]);
      // A fragments -> this warpgroup's buffer (kt - kb) & 1, K-major rows of 128 bytes, 128-byte swizzle
      const uint32_t ab = abase + ((kt - kb) & 1) * 8192;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = wq * 16 + gid + 8 * (i & 1), chunk = 2 * j + (i >> 1);
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ab + row * 128 + ((chunk ^ (row & 7)) << 4) + 4 * tid4),
                       "r"(a[0][j][i]) : "memory");
        }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wgi) : "memory");  // the warpgroup's A tile is complete
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int j = 0; j < 4; ++j) WgOpSS<T, BN>::mma(acc, wg_desc(ab + j * 32), wg_desc(sbase + slot * SB + j * 32), 1);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // tile kt - 1 done
      if (++slot == WGS) slot = 0;
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  } else
  for (int kt = kb; kt < ke; kt += KP) {
    cp_async_wait<PD - KP>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async bytes -> the tensor cores' proxy
    __syncthreads();  // this step's stages are complete; every warpgroup's wgmmas of the previous step are done
    {
      int ns = slot - KP;
      if (ns < 0) ns += WGS;
#pragma unroll
      for (int u = 0; u < KP; ++u) {
        const int nk = kt + WGS - KP + u;
        if (nk < ke) load_stage(nk, sbase + (ns + u) * SB);
        cp_async_commit();
      }
    }
    const bool two = KP == 2 && kt + 1 < ke;
    dequant(kt, sgen + slot * SB, a[0]);
    if (KP == 2 && two) dequant(kt + 1, sgen + (slot + 1) * SB, a[KP - 1]);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < 4; ++j) WgOp<T, BN>::mma(acc, a[0][j], wg_desc(sbase + slot * SB + j * 32), 1);
    if (KP == 2 && two) {
#pragma unroll
      for (int j = 0; j < 4; ++j) WgOp<T, BN>::mma(acc, a[KP - 1][j], wg_desc(sbase + (slot + 1) * SB + j * 32), 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    slot += KP;
    if (slot == WGS) slot = 0;
  }
  cp_async_wait<0>();
  if (p.S == 1) {
    wg_store_y<T, BN>(p, acc, row0 + rl, tok0, lane);
  } else {
    wg_store_part<BN>(p, acc, row0 + rl, tok0, lane);
    split_reduce<T, WG_BM, BN>(p, blockIdx.y, blockIdx.x, row0, (int)tok0);
  }
#endif
}

// ------------------------------------------------------------------------------------------------
// Warp-specialized wgmma kernel (sm_90a, 4-bit; auto's choice on sm_90 from M = 9 where measured ahead, up to
// M = 1024 in 256-row blocks).
// The wgmma kernel's math, fed the Hopper way: one producer warp issues every copy of a stage with one thread
// (the activation tile through TMA with the 128-byte swizzle done by the copy engine and columns past K
// zero-filled, rows past M too, or left stale where a last token tile comes as a smaller box; the codes as one 3-D
// TMA box of the block's stripes x the stage's K tiles, the group parameters as one bulk copy per group row), all
// completing on the stage's mbarrier; the two consumer warpgroups wait on that barrier, compute the stage's KS K
// tiles (4 wgmmas per tile, one wgmma wait per two tiles, per stage in one-tile stages) and free the stage with one
// arrival per warp. No block-wide barrier in the main loop: the warpgroups
// drift apart and overlap each other's dequantization and tensor-core work.
// K tiles per stage (KS): 4 for the 16-, 32- and 64-token tiles on layers whose groups hold whole K tiles
// (group size a multiple of 64, or per channel: a stage then spans at most 4 groups), else 2. The longer stage
// halves the per-stage waits and makes each weight copy a 2 KB run: 8192x28672 at M = 16 went from 80 to
// 64 us (H200, docs/CUDA.md); 1 for the 256-token tile (ws_tok256_ks: its two-tile stages measured slower).
// Parameter bytes per stage: (scale, zero) x the block's rows per group, for 4 groups a tile (group size 16) at
// KS = 1 and 2 and 4 groups at KS = 4.
constexpr int WS_IL_BN = 32;  // up to this token tile each slice goes to the tensor cores as soon as it is ready
// RS: 16-row stripes per consumer warp, 1 (128-row blocks) or 2 (256-row blocks: each warpgroup runs two m64
// row tiles against the same activation tile, which halves the activations' L2 traffic per weight row)
// CW: consumer warpgroups, 2 or 3 (192-row blocks: RS = 1, the 128-token tile; more rows per block than 128 where
// 256-row blocks would leave a wave's SMs idle)
__host__ __device__ constexpr int ws_pb(int ks, int rs = 1, int cw = 2) {
  return rs * cw * (ks == 4 ? 1024 : ks * 1024);
}
__host__ __device__ constexpr int ws_stage_bytes(int bn, int ks, int rs = 1, int cw = 2) {
  return ks * (bn * 128 + 4 * cw * rs * 512) + ws_pb(ks, rs, cw);
}
__host__ __device__ constexpr int ws_stages(int bn, int ks, int rs = 1) {
  return rs == 2      ? 3
         : bn == 256 ? (ks == 1 ? 5 : 2)
         : ks == 4   ? (bn == 16 ? 4 : bn == 32 ? 3 : 2)
                     : (bn == 16 ? 6 : bn == 32 ? 4 : bn == 64 ? 3 : 4);
}
__host__ __device__ constexpr int ws_blocks_per_sm(int bn, int rs = 1) { return bn >= 128 || rs == 2 ? 1 : 2; }
// RS = 2 needs about 200 registers per consumer thread, past the 168 that 9 warps allow (three warps on a
// scheduler's 16K registers): a whole producer warpgroup (one active warp) gives its registers to the
// consumers (setmaxnreg 40 / 232)
// The 256-token tile (128 accumulators a thread, like RS = 2) does the same
__host__ __device__ constexpr bool ws_pwg(int bn, int rs) { return rs == 2 || bn == 256; }
__host__ __device__ constexpr int ws_threads(int rs, int cw = 2, int bn = 128) {
  return ws_pwg(bn, rs) ? 12 * 32 : (4 * cw + 1) * 32;
}
__host__ __device__ constexpr int ws_tile(int64_t m) { return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128; }
#ifndef W4P_WS_KS4_MAX_BN
#define W4P_WS_KS4_MAX_BN 64  // (the 128-token tile measured slower with four-tile stages: two stages only)
#endif
__host__ __device__ constexpr int ws_ks(int bn, int gs) {
  return bn <= W4P_WS_KS4_MAX_BN && (gs <= 0 || gs % 64 == 0) ? 4 : 2;
}
// + a zeroed activation tile: the B operand of the wgmmas past the K range in a stage's last tile; RS = 2: + a
// staging tile of 64 rows x bn tokens per consumer warpgroup (the stages stay busy there: stream-K's producer
// runs on into the next segment)
__host__ __device__ constexpr int ws_smem_bytes(int bn, int ks, int rs = 1, int cw = 2) {
  return 2048 + ws_stages(bn, ks, rs) * ws_stage_bytes(bn, ks, rs, cw) + bn * 128 + (rs == 2 ? 2 * bn * ws_ypitch(64) : 0);
}

// The activation tensor maps of a last token tile that ends past M: 8 << b token rows for b = 0..4 (wgmma_ws's
// producer; only the one its tile uses is encoded). xtail_box: the map for a tile of `rows` token rows out of bn,
// -1 for the whole tile's.
constexpr int XTAIL_MAPS = 5;
struct XTails {
  CUtensorMap m[XTAIL_MAPS];
};
__host__ __device__ constexpr int xtail_box(int bn, int rows) {
  int b = 0;
  while (b < XTAIL_MAPS && (8 << b) < rows) ++b;
  return (8 << b) >= bn ? -1 : b;
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void *src, unsigned bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// The register split between the producer warpgroup and the consumers (setmaxnreg) of the blocks that have one
// (ws_pwg: RS = 2 and the 256-token tile): stream-K's producer loop needs 56 (it spilled at 40)
__host__ __device__ constexpr int ws_preg(bool sk) { return sk ? 56 : 40; }
__host__ __device__ constexpr int ws_creg(bool sk) { return sk ? 224 : 232; }
// Per-block timeline (diagnostics builds only: nvcc -DW4P_WS_TRACE, as tools/ws_trace.py builds it). Thread 0 of
// each wgmma_ws block records %globaltimer and clock64 at its start (event 0: once the previous kernel on the stream
// has completed, pdl_start), at the end of each main loop or
// stream-K segment (odd events) and at the end of each epilogue (even events), and its SM in word 31. Ordinary
// builds compile W4P_WS_TR to nothing.
#ifdef W4P_WS_TRACE
constexpr int WS_TRACE_BLOCKS = 8192, WS_TRACE_EVENTS = 15;
__device__ unsigned long long g_ws_trace[WS_TRACE_BLOCKS][32];
__device__ __forceinline__ void ws_trace(int ev) {
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  unsigned long long g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  const unsigned long long c = clock64();
  if (b >= WS_TRACE_BLOCKS || ev >= WS_TRACE_EVENTS) return;
  g_ws_trace[b][2 * ev] = g;
  g_ws_trace[b][2 * ev + 1] = c;
  if (ev == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    g_ws_trace[b][31] = sm | (1ull << 32);
  }
}
#define W4P_WS_TR(ev) \
  do {                \
    if (threadIdx.x == 0) ws_trace(ev); \
  } while (0)
#else
#define W4P_WS_TR(ev) \
  do {                \
  } while (0)
#endif
template <typename T, int ZMODE, int BN, int KS, int RS, bool SK = false, int CW = 2>
__global__ void __launch_bounds__(ws_threads(RS, CW, BN), ws_blocks_per_sm(BN, RS))
    wgmma_ws_kernel(const Params p, const __grid_constant__ CUtensorMap xmap,
                    const __grid_constant__ CUtensorMap wmap, const __grid_constant__ XTails xtail) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T2 = typename Tr<T, 4>::T2;
  static_assert(CW == 2 || (CW == 3 && RS == 1 && BN == 128 && !SK), "192-row blocks: the 128-token tile, plain grid");
  static_assert(BN < 256 || (RS == 1 && CW == 2 && !SK && KS <= 2), "the 256-token tile: 128-row blocks, plain grid");
  constexpr int NCW = 4 * CW, RB = 64 * CW * RS;  // consumer warps; weight rows per block
  constexpr bool PWG = ws_pwg(BN, RS);  // a producer warpgroup whose registers go to the consumers
  constexpr int WS_KS = KS, NS = ws_stages(BN, KS, RS), SB = ws_stage_bytes(BN, KS, RS, CW), XT = BN * 128,
                XB = WS_KS * XT;
  constexpr int WOFF = XB, POFF = XB + (RB / 16) * WS_KS * 512, NP = ZMODE != 0 ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t sbase = (smem_u32(smem) + 1023u) & ~1023u;
  const unsigned char *sgen = smem + (sbase - smem_u32(smem));
  const uint32_t full0 = sbase, empty0 = sbase + 8 * NS, stages = sbase + 1024;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int KT = p.KT;
  const int row0 = blockIdx.y * RB;
  const int64_t tok0 = (int64_t)blockIdx.x * BN;
  const int kb = (int)((int64_t)blockIdx.z * KT / p.S), ke = (int)((int64_t)(blockIdx.z + 1) * KT / p.S);
  const int nsteps = (ke - kb + WS_KS - 1) / WS_KS;
  // Stream-K (SK, a grid of resident blocks instead of tiles x splits): units of one stage of one tile, tile by
  // tile, in equal contiguous runs per block. A run is a list of segments, each a K range of one tile: the end of
  // one tile, whole tiles, the start of another; sk_epilogue sums the partial ones.
  const int SPT = (KT + WS_KS - 1) / WS_KS;  // SK: stages per tile
  const int64_t U = SK ? (int64_t)p.sk * SPT : 1;
  const int64_t u_beg = SK ? (int64_t)sk_block() * U / sk_grid() : 0;
  const int64_t u_end = SK ? (int64_t)(sk_block() + 1) * U / sk_grid() : 1;
  struct Seg {
    int tile, kb, ke, row0;
    int64_t tok0, next;  // next: the unit after the segment
  };
  auto seg_at = [&](int64_t u) {
    Seg g;
    g.tile = (int)(u / SPT);
    g.next = min(u_end, (int64_t)(g.tile + 1) * SPT);
    g.kb = (int)(u - (int64_t)g.tile * SPT) * WS_KS;
    g.ke = min(KT, (int)(g.next - (int64_t)g.tile * SPT) * WS_KS);
    // token tile major: at a time the blocks take different row blocks of one token tile, and where the grid
    // holds the token tiles' runs in step (G a multiple of TB) blocks G / TB apart take one row block's same K
    // range together, so its weights are read once from DRAM as in the plain grid
    const int nrb = p.sk / p.TB;
    g.row0 = g.tile % nrb * RB;
    g.tok0 = (int64_t)(g.tile / nrb) * BN;
    return g;
  };
  const uint32_t zero_tile = stages + NS * SB;  // 1024-aligned, BN x 128 bytes of zeros
  const uint32_t ystage = RS == 2 ? zero_tile + XT : stages;  // the epilogue's staging (ws_store_tile)
  static_assert(RS == 2 || NS * SB >= BN * ws_ypitch(RB), "RS = 1 stages the output tile in the stages");
  for (int i = tid; i < XT / 16; i += blockDim.x)
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(zero_tile + i * 16), "r"(0u) : "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the zeros -> the tensor cores' proxy
  if (tid == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full0 + 8 * s, 1);   // the producer's arrival with the stage's byte count
      mbar_init(empty0 + 8 * s, NCW * 32);  // one arrival per consumer lane (each orders its own reads)
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  float acc[RS][BN / 2];  // stripe r of the warp: rows rl + 128 r
#pragma unroll
  for (int r = 0; r < RS; ++r)
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[r][i] = 0.f;
  const int gid = lane >> 2;
  const int rl = (warp % NCW) * 16 + gid;

  // PWG: the producer warpgroup's registers go to the consumers (ptxas honours setmaxnreg where the code after it
  // is reached from one side only: the producer leaves before the epilogue)
  if (warp >= NCW) {
    if constexpr (PWG) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(ws_preg(SK)) : "memory");
    if (warp == NCW && lane == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&xmap)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
    }
    pdl_start(p);
    if (warp == NCW && lane == 0) {
      const unsigned char *pbase[2] = {reinterpret_cast<const unsigned char *>(p.scales),
                                       reinterpret_cast<const unsigned char *>(ZMODE == 1 ? p.zeros : p.mins)};
      // one segment's stages, from the ring's stage gi on; returns their count
      auto produce = [&](int kb, int ke, int row0, int64_t tok0, int gi) {
        const int nsteps = (ke - kb + WS_KS - 1) / WS_KS;
        const unsigned prow = (unsigned)min(RB, p.Np - row0) * 2u;
        // a token tile that ends past M comes as one box of the fewest token rows, a power of two from 8, that
        // holds its rows (xtail), not the whole tile: TMA fills a box's rows past the tensor's end with zeros at
        // a cost (H200, copies only, 8192x28672 with 256-row blocks at M = 129: 131 against 67 us at M = 256).
        // (Its rows as several boxes cost more, each box about as much as the rows it saves; stream-K ran 2-5%
        // slower with the smaller box, and keeps the tile's.) The rows left unwritten hold whatever the stage held;
        // they meet only output columns of tokens past M, which are never stored.
        const int xb = SK ? -1 : xtail_box(BN, (int)min((int64_t)BN, p.M - tok0));  // the box's map, or -1
        const unsigned xbytes = xb < 0 ? (unsigned)XT : (8u << xb) * 128u;
        for (int ii = 0; ii < nsteps; ++ii) {
          const int i = gi + ii, s = i % NS;
          if (i >= NS) mbar_wait(empty0 + 8 * s, ((i / NS) - 1) & 1);
          const int t0 = kb + ii * WS_KS, nt = min(WS_KS, ke - t0);
          const int g_lo = group_of(t0 * 64, p.gmul);
          const int ng = group_of((t0 + nt) * 64 - 1, p.gmul) - g_lo + 1;
          const uint32_t st = stages + s * SB, full = full0 + 8 * s;
          // the codes: one box of the stage's WS_KS tiles x the block's RB / 16 stripes (tiles and stripes past
          // the layer's read as zeros, and count in full)
          mbar_expect_tx(full, (unsigned)nt * xbytes + (unsigned)((RB / 16) * WS_KS * 512) + (unsigned)(ng * NP) * prow);
          for (int u = 0; u < nt; ++u) {
            tma_load_2d(st + u * XT, xb < 0 ? &xmap : &xtail.m[xb], (t0 + u) * 64, (int)tok0, full);
          }
          tma_load_3d(st + WOFF, &wmap, 0, t0, row0 >> 4, full);
          for (int g = 0; g < ng; ++g)
            for (int w = 0; w < NP; ++w)
              bulk_copy(st + POFF + (g * 2 + w) * (RB * 2), pbase[w] + ((size_t)(g_lo + g) * p.Np + row0) * 2, prow,
                        full);
        }
        return nsteps;
      };
      if constexpr (SK) {
        int gi = 0;
        for (int64_t u = u_beg; u < u_end;) {
          const Seg sg = seg_at(u);
          u = sg.next;
          gi += produce(sg.kb, sg.ke, sg.row0, sg.tok0, gi);
        }
      } else {
        produce(kb, ke, row0, tok0, 0);
      }
    }
    __syncwarp();  // the producer warp reconverges before the epilogue's block barriers
    if constexpr (SK) return;  // (no cluster: the consumers sum each segment themselves)
    if constexpr (PWG) {  // the producer warpgroup leaves (its 40 registers hold no epilogue code)
      if (p.S > 1 && p.cl) {  // ... after its arrivals on cluster_reduce's two cluster barriers
        cluster_barrier();
        cluster_barrier();
      }
      return;
    }
  } else if (p.probe) {  // copies only (diagnostics)
    if constexpr (PWG) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws_creg(SK)) : "memory");
    pdl_start(p);
    W4P_WS_TR(0);
    int total = nsteps;
    if constexpr (SK) {
      total = 0;
      for (int64_t u = u_beg; u < u_end;) {
        const Seg sg = seg_at(u);
        u = sg.next;
        total += (sg.ke - sg.kb + WS_KS - 1) / WS_KS;
      }
    }
    probe_drain(full0, empty0, NS, total);
  } else {
    if constexpr (PWG) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws_creg(SK)) : "memory");
    pdl_start(p);
    W4P_WS_TR(0);
    const ZC<T, 4> zc_sym = zc_make<T, 4>(8.f, 8.f);
    // Four-tile stages are planned only for group sizes that hold whole K tiles, so the 16- and 32-token tiles
    // need no per-slice group test there (the 64-token tile keeps the test: without it, it spilled 12 bytes)
    const bool one_group = (WS_KS == 4 && BN <= 32) || p.gs <= 0 || p.gs % 64 == 0;
    constexpr bool IL = BN <= WS_IL_BN;
    // A fragments of two tiles at most: a four-tile stage waits for its first half's wgmmas before reusing them
    // (sixteen slices in flight made ptxas serialize the wgmmas: C7512)
    uint32_t a[2][4][4];
    constexpr bool HALVES = WS_KS == 4;
    // (Reading a stage's weights one stage ahead, before the previous stage's wgmma wait, measured no faster)
    const uint64_t dzero = wg_desc(zero_tile);
    const int woff = WOFF + warp * WS_KS * 512 + lane * 16;
    // one segment's stages, from the ring's stage gi on
    auto consume = [&](int kb, int ke, int gi) {
      const int nsteps = (ke - kb + WS_KS - 1) / WS_KS;
      for (int ii = 0; ii < nsteps; ++ii) {
        const int i = gi + ii, s = i % NS;
        const int t0 = kb + ii * WS_KS, nt = min(WS_KS, ke - t0);
        const int g_st = group_of(t0 * 64, p.gmul);
        const unsigned char *sg = sgen + 1024 + s * SB;
        const T *prm = reinterpret_cast<const T *>(sg + POFF);
        const uint64_t dst = wg_desc(stages + s * SB);
        mbar_wait(full0 + 8 * s, (i / NS) & 1);
        T2 s_lo[RS], s_hi[RS], z_lo[RS], z_hi[RS];
        ZC<T, 4> zc[RS];
#pragma unroll
        for (int r = 0; r < RS; ++r) zc[r] = zc_sym;
        auto load_group = [&](int g) {
          const T *ps = prm + (g - g_st) * 2 * RB;
#pragma unroll
          for (int r = 0; r < RS; ++r) {
            const int rr = rl + 128 * r;
            s_lo[r] = bcast2(ps[rr]);
            s_hi[r] = bcast2(ps[rr + 8]);
            if (ZMODE == 2) {
              z_lo[r] = bcast2(ps[RB + rr]);
              z_hi[r] = bcast2(ps[RB + rr + 8]);
            } else if (ZMODE == 1) {
              zc[r] = zc_load<T>(ps[RB + rr], ps[RB + rr + 8]);
            }
          }
        };
        auto dequant = [&](const uint32_t (&w)[4], int j, uint32_t (&av)[4], int r) {
          dq_scaled<T, ZMODE>(w, j, zc[r], s_lo[r], s_hi[r], z_lo[r], z_hi[r], av);
        };
        // Up to the 32-token tile (IL) each k16 slice goes to the tensor cores as soon as it is dequantized, so
        // the next slice is dequantized while that wgmma runs; larger tiles dequantize two K tiles, then issue
        // their 8 wgmmas back to back (slice by slice measured slower there). The group's constants are loaded
        // at the stage's start and again only where a slice starts a new group (never inside the usual stage,
        // which lies in one group: a single test per slice). A tile past the split's K range has zeroed or
        // (128- and 256-token tiles) stale codes, finite either way, against the zero tile. (Two copies of the wgmma
        // sequence, one per path, made ptxas serialize the wgmmas: C7520.)
        const bool one_stage_group = one_group && group_of((t0 + WS_KS) * 64 - 1, p.gmul) == g_st;
        load_group(g_st);
        int gcur = g_st;
#pragma unroll
        for (int u = 0; u < WS_KS; ++u) {
          uint32_t w[RS][4];
#pragma unroll
          for (int r = 0; r < RS; ++r) {
            // 128- and 256-token tiles: past the split's K range (u >= nt) a slot holds an earlier stage's codes,
            // or whatever the shared memory held; any bits are nibbles that dequantize to finite values, which meet
            // the zero tile. So the load needs no branch, and ptxas no longer recomputes its address behind one
            // (2-5% faster, docs/CUDA.md section 7). The smaller tiles keep the branch: without it, three of them
            // spilled 4-8 bytes at their 96-register cap (two blocks per SM).
            const uint4 *wp = reinterpret_cast<const uint4 *>(sg + woff + r * 8 * WS_KS * 512 + u * 512);
            const uint4 wu = BN >= 128 || u < nt ? *wp : make_uint4(0, 0, 0, 0);
            w[r][0] = wu.x;
            w[r][1] = wu.y;
            w[r][2] = wu.z;
            w[r][3] = wu.w;
          }
          const uint64_t du = u < nt ? dst + (uint64_t)(u * (XT >> 4)) : dzero;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            // the first half's A fragments are reused by the second (RS = 2: each tile's by the next)
            if ((HALVES && u == 2 && j == 0) || (RS == 2 && u > 0 && j == 0)) {
              asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
              asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            }
            if ((u > 0 || j > 0) && !one_stage_group && u < nt && (j == 0 || !one_group)) {
              const int g = group_of((t0 + u) * 64 + 16 * j, p.gmul);
              if (g != gcur) {
                gcur = g;
                load_group(g);
              }
            }
            if constexpr (RS == 2) {  // a tile of both stripes dequantized, then its 8 wgmmas
              dequant(w[0], j, a[0][j], 0);
              dequant(w[1], j, a[1][j], 1);
              if (j == 3) {
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                  for (int r = 0; r < 2; ++r) WgOp<T, BN>::mma(acc[r], a[r][jj], du + (uint64_t)(2 * jj), 1);
              }
            } else {
              dequant(w[0], j, a[u & 1][j], 0);
              if constexpr (IL) {
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
                WgOp<T, BN>::mma(acc[0], a[u & 1][j], du + (uint64_t)(2 * j), 1);
              } else if (((u & 1) == 1 || WS_KS == 1) && j == 3) {  // large token tiles: two tiles dequantized
                // (one in one-tile stages), then their wgmmas
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int v = u & ~1; v <= u; ++v) {
                  const uint64_t dv = v < nt ? dst + (uint64_t)(v * (XT >> 4)) : dzero;
#pragma unroll
                  for (int jj = 0; jj < 4; ++jj) WgOp<T, BN>::mma(acc[0], a[v & 1][jj], dv + (uint64_t)(2 * jj), 1);
                }
              }
            }
          }
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        // every lane frees the stage itself: with lane 0 arriving for its warp after __syncwarp, racecheck
        // (which does not follow __syncwarp) reported write-after-read hazards on refills; this costs nothing
        // measurable (docs/CUDA.md section 8)
        mbar_arrive(empty0 + 8 * s);
      }
      return nsteps;
    };
    if constexpr (SK) {
      int gi = 0, ev = 1, pend = -1;
      for (int64_t u = u_beg; u < u_end;) {
        const Seg sg = seg_at(u);
        u = sg.next;
#pragma unroll
        for (int r = 0; r < RS; ++r)
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) acc[r][i] = 0.f;
        gi += consume(sg.kb, sg.ke, gi);
        W4P_WS_TR(ev);
        sk_epilogue<T, RB, BN, RS>(p, acc, sg.tile, sg.kb, sg.ke, sg.row0, sg.tok0, warp, lane, u_beg, SPT, ystage,
                                   sgen + (ystage - sbase), pend);
        W4P_WS_TR(ev + 1);
        ev += 2;
      }
      sk_count_stored(p, pend, warp);
    } else {
      consume(kb, ke, 0);
      W4P_WS_TR(1);
    }
  }
  if constexpr (SK) return;
  // epilogue (the producer warp joins the split reduction's block barriers)
  const int r_lo = row0 + rl;
  if (p.S == 1) {
    if (warp < NCW) ws_store_tile<T, BN, RS, CW>(p, acc, row0, tok0, ystage, sgen + (ystage - sbase), warp, lane);
  } else if (p.cl) {
    // the stages become the exchange tile [BN][RB + 8] once every warp is past its last wgmma
    static_assert(NS * SB >= BN * (RB + 8) * 4, "the cluster exchange tile fits in the stages");
    block_or_named_sync(PWG ? 256 : 0);
    if (warp < NCW) {
      float *tg = (float *)(sgen + (stages - sbase));
#pragma unroll
      for (int r = 0; r < RS; ++r)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            tg[(8 * i + 2 * (lane & 3) + (c & 1)) * (RB + 8) + rl + 128 * r + (c < 2 ? 0 : 8)] = acc[r][4 * i + c];
    }
    cluster_reduce<T, RB, BN, PWG ? 256 : 0>(p, stages, row0, tok0);
  } else {
    if (warp < NCW)
#pragma unroll
      for (int r = 0; r < RS; ++r) wg_store_part<BN>(p, acc[r], r_lo + 128 * r, tok0, lane);
    split_reduce<T, RB, BN, 2, PWG ? 256 : 0>(p, blockIdx.y, blockIdx.x, row0, (int)tok0);
  }
  W4P_WS_TR(2);
#endif
}

// ------------------------------------------------------------------------------------------------
// wgmma_ss kernel (sm_90a, 4-bit, group sizes that hold whole K tiles: multiples of 64, or per channel). The
// other wgmma kernels' orientation turned around: the tokens are wgmma's A operand (M = 64 tokens per
// warpgroup) and the dequantized weights its B operand (N = 128 or 256 weight rows), both from shared memory.
// Why: a register-A wgmma (wgmma_ws) pays a fixed cost per instruction that dominates up to N = 128 tokens
// (docs/CUDA.md section 8); here one m64n256k16 covers 64 tokens x 256 rows, and with no operand in registers
// the dequantization of tile kt + 1 overlaps the wgmmas of tile kt (wait_group 1).
// A block holds 256 weight rows (16 stripes) and TOK tokens (64 or 128). One producer warp brings each stage's
// activations (TMA, 128-byte swizzle, rows past M and columns past K zero-filled), codes (one 3-D TMA copy of
// the block's 16 stripes) and group parameters (one bulk copy per K tile for the scales, one for the zeros)
// onto the stage's mbarrier. The two consumer warpgroups dequantize each K tile into a B buffer (a warpgroup 128 rows, each
// warp two stripes: the fragment of layout v1 is stmatrix's, so four stmatrix.x4 per stripe write the K-major
// 128-byte-swizzled rows wgmma reads), then issue 4 wgmmas on it.
// TOK 128: warpgroup w computes tokens 64w..64w+63 x all 256 rows (m64n256, 128 accumulators), so each B
//   buffer needs both warpgroups' halves: a 256-thread named barrier per K tile, and three buffers (a buffer
//   is rewritten only after both warpgroups' wgmmas of three tiles before are done).
// TOK 64: warpgroup w computes the 64 tokens x rows 128w..128w+127 (m64n128) from its own dequantization: a
//   128-thread barrier and two buffers.
constexpr int SS_BR = 256;  // weight rows per block
// K tiles per stage: 2 for the 64-token tile (the second tile's codes load while the first is dequantized);
// 1 for the 128-token tile, whose 128 accumulators leave no registers for a second tile's codes (ptxas caps a
// block of 9 warps at 168 registers per thread: it spilled)
__host__ __device__ constexpr int ss_ks(int tok) { return tok == 128 ? 1 : 2; }
__host__ __device__ constexpr int ss_nb(int tok) { return tok == 128 ? 3 : 2; }  // B buffers
__host__ __device__ constexpr int ss_stage_bytes(int tok) { return ss_ks(tok) * (tok * 128 + 16 * 512 + 2 * SS_BR * 2); }
__host__ __device__ constexpr int ss_stages(int tok) { return tok == 128 ? 4 : 3; }
__host__ __device__ constexpr int ss_smem_bytes(int tok) {
  return 1024 + 1024 + ss_nb(tok) * SS_BR * 128 + ss_stages(tok) * ss_stage_bytes(tok);  // align slack, barriers
}

__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// A consumer warpgroup's D fragment out: acc[4 i + c] is token tb + 8 (c >> 1), weight row rb + 8 i + (c & 1)
// (tb = the lane's first token, rb = its first row, even). One split: y (+ bias), pairs of rows as one store
// where y allows it; several: fp32 partials.
template <typename T, int NN>
__device__ __forceinline__ void ss_store(const Params &p, const float (&acc)[NN / 2], int rb, int64_t tb) {
  using T2 = typename Tr<T, 4>::T2;
  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  const bool pairs = y_pairs(p);
  float *part = p.part + (size_t)blockIdx.z * p.M * p.Np;
#pragma unroll
  for (int i = 0; i < NN / 8; ++i) {
    const int row = rb + 8 * i;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t tok = tb + 8 * h;
      if (tok >= p.M) continue;
      const float v0 = acc[4 * i + 2 * h], v1 = acc[4 * i + 2 * h + 1];
      if (p.S > 1) {
        if (row < p.Np) __stcg(reinterpret_cast<float2 *>(part + tok * p.Np + row), make_float2(v0, v1));
        continue;
      }
      const float b0 = (bias && row < p.N) ? to_f(bias[row]) : 0.f;
      const float b1 = (bias && row + 1 < p.N) ? to_f(bias[row + 1]) : 0.f;
      T *dst = y + tok * p.ldy + row;
      if (pairs && row + 1 < p.N) {
        T2 v;
        v.x = from_f<T>(v0 + b0);
        v.y = from_f<T>(v1 + b1);
        *reinterpret_cast<T2 *>(dst) = v;
      } else {
        if (row < p.N) dst[0] = from_f<T>(v0 + b0);
        if (row + 1 < p.N) dst[1] = from_f<T>(v1 + b1);
      }
    }
  }
}

template <typename T, int ZMODE, int TOK>
__global__ void __launch_bounds__(9 * 32, 1) wgmma_ss_kernel(const Params p, const __grid_constant__ CUtensorMap xmap,
                                                             const __grid_constant__ CUtensorMap wmap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T2 = typename Tr<T, 4>::T2;
  constexpr int KS = ss_ks(TOK), NB = ss_nb(TOK), NS = ss_stages(TOK), SB = ss_stage_bytes(TOK);
  constexpr int XT = TOK * 128, WOFF = KS * XT, POFF = WOFF + 16 * KS * 512, NP = ZMODE != 0 ? 2 : 1;
  constexpr int NN = TOK == 128 ? 256 : 128;  // the wgmma's N: weight rows per warpgroup
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t sbase = (smem_u32(smem) + 1023u) & ~1023u;
  const unsigned char *sgen = smem + (sbase - smem_u32(smem));
  const uint32_t full0 = sbase, empty0 = sbase + 8 * NS, bbase = sbase + 1024, stages = bbase + NB * SS_BR * 128;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int KT = p.KT;
  const int row0 = blockIdx.y * SS_BR;
  const int64_t tok0 = (int64_t)blockIdx.x * TOK;
  const int kb = (int)((int64_t)blockIdx.z * KT / p.S), ke = (int)((int64_t)(blockIdx.z + 1) * KT / p.S);
  const int nsteps = (ke - kb + KS - 1) / KS;
  if (tid == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full0 + 8 * s, 1);        // the producer's arrival with the stage's byte count
      mbar_init(empty0 + 8 * s, 8 * 32);  // one arrival per consumer lane
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  constexpr int NACC = NN / 2;
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  const int wg = warp >> 2, wq = warp & 3, gid = lane >> 2;
  const int tokoff = TOK == 128 ? 64 * wg : 0, rowoff = TOK == 128 ? 0 : 128 * wg;

  if (warp == 8) {
    if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&xmap)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
    }
    pdl_start(p);
    if (lane == 0) {
      const unsigned char *pbase[2] = {reinterpret_cast<const unsigned char *>(p.scales),
                                       reinterpret_cast<const unsigned char *>(ZMODE == 1 ? p.zeros : p.mins)};
      const unsigned prow = (unsigned)min(SS_BR, p.Np - row0) * 2u;
      for (int i = 0; i < nsteps; ++i) {
        const int s = i % NS;
        if (i >= NS) mbar_wait(empty0 + 8 * s, ((i / NS) - 1) & 1);
        const int t0 = kb + i * KS, nt = min(KS, ke - t0);
        const uint32_t st = stages + s * SB, full = full0 + 8 * s;
        // the codes of 16 stripes x KS tiles in one copy (the box's full size: stripes past the layer and tiles
        // past K arrive as zeros). One bulk copy per stripe measured slower: a copies-only run of 8192x28672 at
        // M = 64 took 65.7 against 39.4 us, the producer thread's issue rate was the limit
        mbar_expect_tx(full, (unsigned)(nt * XT + 16 * KS * 512) + (unsigned)(nt * NP) * prow);
        tma_load_3d(st + WOFF, &wmap, 0, t0, row0 >> 4, full);
        for (int u = 0; u < nt; ++u) tma_load_2d(st + u * XT, &xmap, (t0 + u) * 64, (int)tok0, full);
        for (int u = 0; u < nt; ++u) {
          const int g = group_of((t0 + u) * 64, p.gmul);
          for (int w = 0; w < NP; ++w)
            bulk_copy(st + POFF + u * 1024 + w * 512, pbase[w] + ((size_t)g * p.Np + row0) * 2, prow, full);
        }
      }
    }
    __syncwarp();
  } else if (p.probe) {  // copies only (diagnostics)
    pdl_start(p);
    probe_drain(full0, empty0, NS, nsteps);
  } else {
    pdl_start(p);
    const ZC<T, 4> zc_sym = zc_make<T, 4>(8.f, 8.f);
    // Everything but the stage, the K tile and the B buffer is fixed per lane, so the addresses are formed once.
    // Stripes past the layer are dequantized too (their codes arrive as zeros, their parameters are stale): they
    // only feed output columns that are never stored, and the loop stays free of branches.
    // stmatrix: matrix mi = lane / 8 (rows +8 for odd mi, columns +8 for mi >= 2), row lane % 8 of it
    const int mi = lane >> 3, mr = lane & 7;
    const int stp0 = 8 * wg + 2 * wq;  // this warp's two stripes: stp0, stp0 + 1
    const int woff = WOFF + stp0 * KS * 512 + lane * 16;  // + sp * KS * 512 + u * 512
    const int poff = POFF + (stp0 * 16 + gid) * 2;        // + sp * 32 (bytes) + u * 1024
    uint32_t stoff[4];  // per slice j: the lane's row address within a B buffer, stripe stp0
#pragma unroll
    for (int j = 0; j < 4; ++j)
      stoff[j] = (uint32_t)((stp0 * 16 + (mi & 1) * 8 + mr) * 128 + (((2 * j + (mi >> 1)) ^ mr) << 4));
    const uint64_t da0 = wg_desc(stages + tokoff * 128), db0 = wg_desc(bbase + rowoff * 128);
    int c = 0;  // K tiles done
    for (int i = 0; i < nsteps; ++i) {
      const int s = i % NS;
      const int t0 = kb + i * KS, nt = min(KS, ke - t0);
      const unsigned char *sg = sgen + (stages - sbase) + s * SB;
      mbar_wait(full0 + 8 * s, (i / NS) & 1);
      // the whole stage's codes and parameters into registers at once: the later tiles' loads are in flight
      // while the first is dequantized (the tiles past nt read stale bytes that are never used)
      uint4 wv[KS][2];
      T prv[KS][2][4];
#pragma unroll
      for (int u = 0; u < KS; ++u)
#pragma unroll
        for (int sp = 0; sp < 2; ++sp) {
          wv[u][sp] = *reinterpret_cast<const uint4 *>(sg + woff + sp * KS * 512 + u * 512);
          const T *prm = reinterpret_cast<const T *>(sg + poff + sp * 32 + u * 1024);
          prv[u][sp][0] = prm[0];
          prv[u][sp][1] = prm[8];
          prv[u][sp][2] = prm[SS_BR];
          prv[u][sp][3] = prm[SS_BR + 8];
        }
#pragma unroll
      for (int u = 0; u < KS; ++u) {
        if (u >= nt) break;
        const int b = c % NB;
        const uint32_t bb = bbase + (uint32_t)(b * SS_BR * 128);
#pragma unroll
        for (int sp = 0; sp < 2; ++sp) {
          const uint32_t w[4] = {wv[u][sp].x, wv[u][sp].y, wv[u][sp].z, wv[u][sp].w};
          const T2 s_lo = bcast2(prv[u][sp][0]), s_hi = bcast2(prv[u][sp][1]);
          T2 z_lo, z_hi;
          ZC<T, 4> zc = zc_sym;
          if (ZMODE == 2) {
            z_lo = bcast2(prv[u][sp][2]);
            z_hi = bcast2(prv[u][sp][3]);
          } else if (ZMODE == 1) {
            zc = zc_load<T>(prv[u][sp][2], prv[u][sp][3]);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t av[4];
            dq_scaled<T, ZMODE>(w, j, zc, s_lo, s_hi, z_lo, z_hi, av);
            stsm_x4(bb + stoff[j] + (uint32_t)(sp * 16 * 128), av);
          }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the B tile -> the tensor cores' proxy
        if (TOK == 128)
          asm volatile("bar.sync 1, 256;\n" ::: "memory");
        else
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        // descriptors advance in 16-byte units: the stage's activation tile u, B buffer b, k16 slice jj
        const uint64_t da = da0 + (uint64_t)((s * SB + u * XT) >> 4), db = db0 + (uint64_t)((b * SS_BR * 128) >> 4);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) WgOpSS<T, NN>::mma(acc, da + 2 * jj, db + 2 * jj, 1);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // tile c - 1 done
        if (u == 0 && i > 0) mbar_arrive(empty0 + 8 * ((i - 1) % NS));  // the previous stage's last tile is done
        ++c;
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  // epilogue (the producer warp joins the split reduction's block barriers)
  if (p.S > 1 && p.cl) {
    // the B buffers and stages become the exchange tile [TOK][SS_BR + 8] once every warp is past its wgmmas
    static_assert(NB * SS_BR * 128 + NS * SB >= TOK * (SS_BR + 8) * 4, "the cluster exchange tile fits");
    __syncthreads();
    if (warp < 8) {
      float *tg = (float *)(sgen + (bbase - sbase));
      const int rb = rowoff + 2 * (lane & 3), tb = tokoff + 16 * wq + gid;
#pragma unroll
      for (int i = 0; i < NN / 8; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2 *>(tg + (tb + 8 * h) * (SS_BR + 8) + rb + 8 * i) =
              make_float2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
    }
    cluster_reduce<T, SS_BR, TOK>(p, bbase, row0, tok0);
  } else {
    if (warp < 8) ss_store<T, NN>(p, acc, row0 + rowoff + 2 * (lane & 3), tok0 + tokoff + 16 * wq + gid);
    if (p.S > 1) split_reduce<T, SS_BR, TOK, 4>(p, blockIdx.y, blockIdx.x, row0, (int)tok0);
  }
#endif
}

// ------------------------------------------------------------------------------------------------
// Tiled kernel: 128 rows x 128 tokens per block, 8 warps as 4 (rows, 32 each) x 2 (tokens, 64 each).
constexpr int TBM = 128, TBN = 128, TST = 4, TXP = 72;  // TXP: smem pitch of a 64-wide activation row

template <int SB> struct TiledCfg {
  static constexpr int V = SB / 4;
  static constexpr int W_BYTES = 8 * 32 * V * 16;
  static constexpr int X_BYTES = TBN * TXP * 2;
  static constexpr int P_BYTES = 4 * TBM * 2;  // up to 4 groups per 64-wide step (group size >= 16)
  static constexpr int STAGE = W_BYTES + X_BYTES + 2 * P_BYTES;
  static constexpr int SMEM = STAGE * TST;
};

template <typename T, int SB>
__global__ void __launch_bounds__(256) tiled_kernel(const Params p) {
  using C = TiledCfg<SB>;
  constexpr int V = C::V;
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tid4 = lane & 3;
  const int wm = warp & 3, wn = warp >> 2;

  const int nrb = (p.Np + TBM - 1) / TBM;
  int bid = blockIdx.x;
  const int rb = bid % nrb;
  bid /= nrb;
  const int tb = bid % p.TB;
  const int split = bid / p.TB;
  const int kt0 = (int)((int64_t)p.KT * split / p.S), kt1 = (int)((int64_t)p.KT * (split + 1) / p.S);
  const int row0 = rb * TBM;
  const int64_t tok0 = (int64_t)tb * TBN;
  const int nstripes = p.Np >> 4;
  const T *x = (const T *)p.x;

  auto stage_ptr = [&](int st) { return smem + st * C::STAGE; };

  auto load_stage = [&](int st, int kt) {
    unsigned char *base = stage_ptr(st);
    uint4 *sW = reinterpret_cast<uint4 *>(base);
    T *sX = reinterpret_cast<T *>(base + C::W_BYTES);
    T *sS = reinterpret_cast<T *>(base + C::W_BYTES + C::X_BYTES);
    T *sZ = sS + 4 * TBM;
    {  // weights: 8 stripes x 32 lanes x V vectors
      const int s = threadIdx.x >> 5, l = threadIdx.x & 31;
      const int stripe = rb * 8 + s;
      const bool ok = stripe < nstripes;
      const uint4 *src = reinterpret_cast<const uint4 *>(p.qw) + ((size_t)(ok ? stripe : 0) * p.KT + kt) * (32 * V) + l * V;
#pragma unroll
      for (int v = 0; v < V; ++v) cp_async16(sW + (s * 32 + l) * V + v, src + v, ok);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // activations: 128 tokens x 8 vectors of 8
      const int idx = threadIdx.x + i * 256;
      const int r = idx >> 3, c = idx & 7;
      const int64_t tok = tok0 + r;
      const int k = kt * 64 + c * 8;
      const bool ok = tok < p.M && k < p.kx;
      const T *src = ok ? x + tok * p.ldx + k : x;
      cp_async16(sX + r * TXP + c * 8, src, ok);
    }
    {  // group parameters: up to 4 groups x 128 rows, 16 vectors per group
      const int g0 = group_of(kt * 64, p.gmul);
      const int g1 = group_of(kt * 64 + 63, p.gmul);
      const int which = threadIdx.x >> 7, rem = threadIdx.x & 127;
      const int gi = rem >> 4, c = rem & 15;
      if (gi <= g1 - g0 && (which == 0 || p.zm != 0)) {
        const int row = row0 + c * 8;
        const bool ok = row < p.Np;
        const T *srcb = (const T *)(which == 0 ? p.scales : (p.zm == 1 ? p.zeros : p.mins));
        const T *src = ok ? srcb + (size_t)(g0 + gi) * p.Np + row : srcb;
        cp_async16((which == 0 ? sS : sZ) + gi * TBM + c * 8, src, ok);
      }
    }
  };

  float acc[2][8][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.f;

#pragma unroll
  for (int s = 0; s < TST - 1; ++s) {
    if (kt0 + s < kt1) load_stage(s, kt0 + s);
    cp_async_commit();
  }
  const float zdef = (float)(1 << (SB == 4 ? 3 : 7));
  using T2 = typename Tr<T, SB>::T2;

  for (int kt = kt0; kt < kt1; ++kt) {
    cp_async_wait<TST - 2>();
    __syncthreads();
    {
      const int nk = kt + TST - 1;
      if (nk < kt1) load_stage((nk - kt0) % TST, nk);
      cp_async_commit();
    }
    unsigned char *base = stage_ptr((kt - kt0) % TST);
    const uint4 *sW = reinterpret_cast<const uint4 *>(base);
    const T *sX = reinterpret_cast<const T *>(base + C::W_BYTES);
    const T *sS = reinterpret_cast<const T *>(base + C::W_BYTES + C::X_BYTES);
    const T *sZ = sS + 4 * TBM;
    uint4 wv[2][V];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int v = 0; v < V; ++v) wv[mi][v] = sW[((wm * 2 + mi) * 32 + lane) * V + v];
    const int g0 = group_of(kt * 64, p.gmul);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int gi = group_of(kt * 64 + j * 16, p.gmul) - g0;
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int rl = (wm * 2 + mi) * 16 + gid;
        const T s_lo = sS[gi * TBM + rl], s_hi = sS[gi * TBM + rl + 8];
        const uint32_t *wd = reinterpret_cast<const uint32_t *>(&wv[mi][0]);
        if (p.zm != 2) {
          const float zl = p.zm == 1 ? to_f(sZ[gi * TBM + rl]) : zdef, zh = p.zm == 1 ? to_f(sZ[gi * TBM + rl + 8]) : zdef;
          const ZC<T, SB> zc = zc_make<T, SB>(zl, zh);
          dq_int<T, SB>(wd, j, zc, a[mi]);
          const T2 sl = bcast2(s_lo), sh = bcast2(s_hi);
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mi][i] = as_u32(__hmul2(as_t2<T2>(a[mi][i]), (i & 1) ? sh : sl));
        } else {
          dq_float<T, SB>(wd, j, bcast2(s_lo), bcast2(s_hi), bcast2(sZ[gi * TBM + rl]), bcast2(sZ[gi * TBM + rl + 8]),
                          a[mi]);
        }
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        const int q = lane >> 3;
        const T *ptr = sX + (wn * 64 + np * 16 + (q >> 1) * 8 + (lane & 7)) * TXP + j * 16 + (q & 1) * 8;
        ldsm_x4(smem_u32(ptr), b0, b1, b2, b3);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma<T>(acc[mi][2 * np], a[mi], b0, b1);
          mma<T>(acc[mi][2 * np + 1], a[mi], b2, b3);
        }
      }
    }
  }
  cp_async_wait<0>();

  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  if (p.S == 1) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int row = row0 + (wm * 2 + mi) * 16 + gid + (c >> 1) * 8;
          const int64_t tok = tok0 + wn * 64 + ni * 8 + tid4 * 2 + (c & 1);
          if (row < p.N && tok < p.M) {
            float v = acc[mi][ni][c];
            if (bias) v += to_f(bias[row]);
            y[tok * p.ldy + row] = from_f<T>(v);
          }
        }
    return;
  }
  float *part = p.part + (size_t)split * p.M * p.Np;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = row0 + (wm * 2 + mi) * 16 + gid + (c >> 1) * 8;
        const int64_t tok = tok0 + wn * 64 + ni * 8 + tid4 * 2 + (c & 1);
        if (row < p.Np && tok < p.M) __stcg(part + tok * p.Np + row, acc[mi][ni][c]);
      }
  split_reduce<T, TBM, TBN>(p, rb, tb, row0, (int)tok0);
}

// Dequantization to a dense [N][ldw] matrix in the original K order (act-order undone), for the large-M
// path (dense GEMM by the caller's BLAS) and for checks. One warp per 16x64 tile: fp32 math, one rounding,
// staged through shared memory so the rows go out as 16-byte stores.
template <typename T, int SB>
__global__ void __launch_bounds__(256) dequant_kernel(const Params p, T *w, int64_t ldw) {
  constexpr int V = SB / 4;
  __shared__ __align__(16) T tile[8][16][64 + 8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tid4 = lane & 3;
  const int64_t id = (int64_t)blockIdx.x * 8 + warp;
  const int64_t ntiles = (int64_t)(p.Np >> 4) * p.KT;
  if (id >= ntiles) return;
  const int stripe = (int)(id / p.KT), kt = (int)(id % p.KT);
  const uint4 *src = reinterpret_cast<const uint4 *>(p.qw) + (size_t)id * (32 * V) + lane * V;
  uint32_t wd[4 * V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const uint4 q = ld_stream(src + v);
    wd[4 * v] = q.x;
    wd[4 * v + 1] = q.y;
    wd[4 * v + 2] = q.z;
    wd[4 * v + 3] = q.w;
  }
  const T *sc = (const T *)p.scales;
  const T *zp = (const T *)(p.zm == 1 ? p.zeros : p.mins);
  const float zdef = (float)(1 << (SB == 4 ? 3 : 7));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int g = group_of(kt * 64 + j * 16, p.gmul);
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int row = stripe * 16 + gid + rh * 8;
      const size_t off = (size_t)g * p.Np + row;
      const float s = to_f(sc[off]);
      const float z = p.zm == 0 ? zdef : to_f(zp[off]);
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const int i = kh * 2 + rh;  // register pair a_i
        float q0, q1;
        if (SB == 4) {
          q0 = (float)((wd[j] >> (4 * i)) & 15u);
          q1 = (float)((wd[j] >> (4 * i + 16)) & 15u);
        } else {
          const uint32_t x = wd[2 * j + (i >> 1)];
          q0 = (float)((x >> (16 * (i & 1))) & 255u);
          q1 = (float)((x >> (16 * (i & 1) + 8)) & 255u);
        }
        const float v0 = p.zm == 2 ? fmaf(s, q0, z) : s * (q0 - z);
        const float v1 = p.zm == 2 ? fmaf(s, q1, z) : s * (q1 - z);
        T *d = &tile[warp][gid + rh * 8][j * 16 + kh * 8 + tid4 * 2];
        d[0] = from_f<T>(v0);
        d[1] = from_f<T>(v1);
      }
    }
  }
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int idx = lane + 32 * q;
    const int r = idx >> 3, c = idx & 7;
    const int grow = stripe * 16 + r;
    const int gk = kt * 64 + c * 8;
    if (grow >= p.N || gk >= p.K) continue;
    const T *sv = &tile[warp][r][c * 8];
    T *drow = w + (int64_t)grow * ldw;
    if (!p.perm && gk + 8 <= p.K && p.xvec) {
      *reinterpret_cast<uint4 *>(drow + gk) = *reinterpret_cast<const uint4 *>(sv);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (gk + e < p.K) drow[p.perm ? p.perm[gk + e] : gk + e] = sv[e];
    }
  }
}

// Activation gather for the tiled kernel: xg[m][k] = x[m][perm[k]] (or x[m][k]) for k < K, 0 up to Kp.
template <typename T>
__global__ void gather_kernel(const T *x, int64_t ldx, T *xg, int64_t M, int K, int Kp, const int32_t *perm) {
  const int64_t total = M * Kp;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t m = i / Kp;
    const int k = (int)(i - m * Kp);
    T v = from_f<T>(0.f);
    if (k < K) v = x[m * ldx + (perm ? perm[k] : k)];
    xg[i] = v;
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: planning and dispatch.
constexpr size_t COUNTER_BYTES = 64 * 1024;  // 16384 tile counters at the start of the workspace
constexpr int MAX_COUNTERS = (int)(COUNTER_BYTES / 4);
static_assert(2 * SK_READY == MAX_COUNTERS, "stream-K's two counters per tile");
constexpr int RING_MAX_M = 8;   // auto: the ring kernel up to this M (measured, docs/CUDA.md)
constexpr int RING_LMIN = 4;    // ring: at least this many units per warp
constexpr int WS_AUTO_MIN_M = 8, WG_AUTO_MAX_M = 256;  // auto: the wgmma kernels' M range (sm_90)
constexpr int WIDE_AUTO_MAX_M = 512;  // auto: up to this M where one wave of blocks fills the SMs (sm_90)
constexpr int SS_AUTO_MIN_M = 65, SS_AUTO_DENSE_M = 160;   // auto: the wgmma_ss kernel's M ranges (sm_90)
constexpr int RING_MIN_UNITS = 12;  // auto: the ring kernel only when each resident warp gets this many units
constexpr int BULK_MAX_M = 16;      // the bulk kernel takes up to this M (two n8 blocks of tokens)
constexpr int BULK_AUTO_M = 4;      // auto: the bulk kernel up to this M on sm_90+ (measured, docs/CUDA.md)

struct DevInfo {
  int sms = 0;
  int cc = 0;  // compute capability, major * 10 + minor
  int smem_sm = 0, smem_block = 0, smem_reserved = 0;  // shared memory per SM, per block (opt-in), reserved
  bool tma = true;  // the driver gives the TMA descriptor encoder (the wgmma_ws kernel; described devices: yes)
  bool init = false;
  // a block of `bytes` dynamic shared memory fits (the system's reserved share counts against the opt-in limit)
  bool fits(size_t bytes) const { return bytes + (size_t)smem_reserved <= (size_t)smem_block; }
};
bool tma_encoder_available();
// W4P_CUDA_NO_TMA=1: plan as on a driver without the TMA encoder (tests of auto's fallback; read at each call)
bool no_tma_env() {
  const char *e = getenv("W4P_CUDA_NO_TMA");
  return e && e[0] == '1';
}
// W4P_CUDA_CLUSTER=0: the wgmma_ws / wgmma_ss splits sum through the workspace, not within a cluster (A/B runs)
bool no_cluster_env() {
  const char *e = getenv("W4P_CUDA_CLUSTER");
  return e && e[0] == '0';
}
// W4P_CUDA_WS_ROWS=128|192|256 (or W4P_CUDA_WS_RS=1|2: 128 or 256): the wgmma_ws 128-token tile's rows per block
// instead of the planner's choice (A/B runs, tests; read at each call). Returns 1 (128), 2 (256), 3 (192) or 0.
int ws_rs_env() {
  if (const char *e = getenv("W4P_CUDA_WS_ROWS")) {
    const int v = atoi(e);
    if (v == 128 || v == 192 || v == 256) return v == 128 ? 1 : v == 256 ? 2 : 3;
  }
  const char *e = getenv("W4P_CUDA_WS_RS");
  const int v = e ? atoi(e) : 0;
  return v == 1 || v == 2 ? v : 0;
}
// W4P_CUDA_WS_TOK=256: wgmma_ws's 256-token tile (128-row blocks) from M = 129 instead of the planner's choice;
// W4P_CUDA_WS_TOK=128: never (A/B runs, tests). Returns 256, 128 or 0. W4P_CUDA_WS_TOK_KS=1|2: its K tiles per
// stage.
int ws_tok_env() {
  const char *e = getenv("W4P_CUDA_WS_TOK");
  const int v = e ? atoi(e) : 0;
  return v == 256 || v == 128 ? v : 0;
}
int ws_tok256_ks() {
  const char *e = getenv("W4P_CUDA_WS_TOK_KS");
  return e && strcmp(e, "2") == 0 ? 2 : 1;
}
// W4P_CUDA_WS_SK=0|1: wgmma_ws's 256-row blocks stream-K or not, instead of the planner's choice (A/B runs, tests;
// where the 256-token tile's rule takes a plan, it holds: the wave model ranks forced stream-K among the others)
int ws_sk_env() {
  const char *e = getenv("W4P_CUDA_WS_SK");
  return e && (e[0] == '0' || e[0] == '1') && e[1] == 0 ? e[0] - '0' : -1;
}
// W4P_CUDA_PDL=0|1|2: the sm_90 kernels' programmatic dependent launch (pdl_start): 0 off, 1 (the default) with
// the early trigger of the next launch, 2 without it (A/B runs and tests; read at each call)
int pdl_env() {
  const char *e = getenv("W4P_CUDA_PDL");
  return e && e[0] >= '0' && e[0] <= '2' && e[1] == 0 ? e[0] - '0' : 1;
}
// The gemv kernel's resident blocks (zero mode none's launch bound, and shared memory)
int64_t gv_grid(const DevInfo &di, int KT, int gs) {
  const size_t smem = (size_t)gv_smem(KT);
  return (int64_t)di.sms * std::max(1, std::min(gv_minb(0, gs <= 0 || gs % 64 == 0),
                                                (int)(di.smem_sm / (smem + di.smem_reserved))));
}
// "auto" takes the gemv kernel where its whole-stripe blocks fill their rounds: at least one and a half rounds of
// stripes, the rounds 85% full or more on average (stripes >= 0.85 x rounds x blocks), and short stripes (K up to
// 6144). The grid is zero mode none's (three blocks per SM; int and float layers run two, so their rule is
// evaluated for a grid they do not launch: measured with zero mode none only). Measured on an H200 at M = 1
// (docs/CUDA.md, 396 blocks): 4096x11008 (688 stripes of 64 tiles) 12.1 against 13.6 us for the bulk kernel and
// 4096x12288 (768) 12.3 against 15.1; level on 8192x28672 (1792 stripes of 128 tiles, 45.2 against 44.5);
// behind where the stripes take 0.65 of a second round: 28672x8192 (512 stripes) 59.4 against 45.2, 11008x4096
// (256) 17.5 against 13.5, 4096x4096 (256) 7.6 against 6.8.
bool gemv_auto(const DevInfo &di, int ns, int KT, int gs) {
  const int64_t g = gv_grid(di, KT, gs), rounds = (ns + g - 1) / g;
  return KT <= 96 && 2 * (int64_t)ns >= 3 * g && (double)ns >= 0.85 * (double)(rounds * g);
}
// W4P_CUDA_GEMV=0: "auto" does not take the gemv kernel (A/B runs and tests; read at each call)
int gemv_env() {
  const char *e = getenv("W4P_CUDA_GEMV");
  return e && e[0] == '0' && e[1] == 0 ? 0 : 1;
}
// W4P_CUDA_BULK_CT=8|12|16: the bulk kernel's tiles per unit on 4-bit layers instead of the planner's choice
// (sweeps and tests; read at each call)
int bulk_ct_env() {
  const char *e = getenv("W4P_CUDA_BULK_CT");
  const int v = e ? atoi(e) : 0;
  return v == 8 || v == 12 || v == 16 ? v : 0;
}
// W4P_CUDA_BULK_QS=1|4: the bulk kernel's stripes per unit instead of the planner's choice (sweeps and tests;
// read at each call; 1 only on 4-bit layers at M <= 8)
int bulk_qs_env() {
  const char *e = getenv("W4P_CUDA_BULK_QS");
  const int v = e ? atoi(e) : 0;
  return v == 1 || v == 4 ? v : 0;
}
DevInfo g_dev[64];
std::mutex g_mu;

int dev_info(int device, DevInfo *out) {
  if (device < 0 || device >= 64) return fail(W4P_EINVAL, "device index %d out of range", device);
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_dev[device].init) {
    int sms = 0;
    cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaDeviceGetAttribute(device %d): %s", device, cudaGetErrorString(e));
    }
    int a = 0, b = 0, c = 0;
    if (cudaDeviceGetAttribute(&a, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&b, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&c, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaDeviceGetAttribute(device %d): shared memory limits unavailable", device);
    }
    int ccmaj = 0, ccmin = 0;
    if (cudaDeviceGetAttribute(&ccmaj, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&ccmin, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaDeviceGetAttribute(device %d): compute capability unavailable", device);
    }
    g_dev[device].cc = ccmaj * 10 + ccmin;
    g_dev[device].sms = sms;
    g_dev[device].tma = tma_encoder_available();
    g_dev[device].smem_sm = a;
    g_dev[device].smem_block = b;
    g_dev[device].smem_reserved = c;
    g_dev[device].init = true;
  }
  *out = g_dev[device];
  return W4P_OK;
}

// group_of's multiplier for group size gs on K columns; false where one multiply-high would not be exact
// (group sizes that are not powers of two, with K * gs >= 2^32: far beyond any real layer)
bool gmul_of(int gs, int kp, unsigned *gmul) {
  if (gs <= 0 || gs >= kp) {
    *gmul = 0;  // one group
    return true;
  }
  const uint64_t two32 = (uint64_t)1 << 32;
  *gmul = (unsigned)((two32 + (uint64_t)gs - 1) / (uint64_t)gs);
  return (gs & (gs - 1)) == 0 || (uint64_t)kp * (uint64_t)gs < two32;
}
int set_gmul(Params *p, int gs, int k) {
  if (!gmul_of(gs, p->Kp, &p->gmul))
    return fail(W4P_EUNSUPPORTED, "group size %d with K = %d: K * group size must stay below 2^32", gs, k);
  return W4P_OK;
}

struct Plan {
  int kernel = 0;  // 1 stream, 2 tiled, 3 ring, 4 bulk, 10/11 probes (stream kernel variants)
  int64_t W = 0;   // ring: workers (warps)
  int ct = 8;      // bulk kernel: tiles per unit
  int qs = 4;      // bulk kernel: stripes per unit
  int kg = 8;      // bulk kernel: tiles per stream-K granule
  int S = 1, TB = 1, NI = 1, MI = 1, KC = 8;
  int tiles = 0;   // output tiles (counters)
  int bn = 0, kp = 1;  // wgmma kernel: token tile, K tiles per step
  int rs = 1;          // wgmma_ws: 16-row stripes per consumer warp (2: 256-row blocks)
  int cw = 2;          // wgmma_ws: consumer warpgroups (3: 192-row blocks)
  bool as = false;     // wgmma kernel: A through shared memory
  bool cl = false;     // wgmma_ws, wgmma_ss: the splits of a tile launched as one cluster (cluster_reduce)
  int sk = 0;          // wgmma_ws stream-K: its grid of resident blocks (0: a grid of tiles x splits)
  int sk_plain_S = 1;  // ... and the plain grid's split count, where the workspace cannot hold stream-K's slots
  bool gather = false;
  bool pdl = false;    // gemv: programmatic dependent launch (sm_90)
  size_t smem = 0;
  size_t ws_part = 0, ws_gather = 0, ws_total = 0;
};

int ceil_div(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

// The tiles the busiest of W blocks gets when the bulk kernel's stream-K granule is a whole unit of ct tiles
// (nq quads of KT tiles): ceil(units / W) whole units. (A quad's last unit may be shorter; this bound ignores
// that, which keeps it O(1): the planner runs on every call. On the Llama shapes it ranks the unit sizes as
// the exact per-block count does.)
int64_t bulk_max_tiles(int nq, int KT, int ct, int64_t W) {
  const int64_t total = (int64_t)nq * ((KT + ct - 1) / ct);
  return (total + W - 1) / W * ct;
}

// The bulk kernel's tiles per unit. 8-bit layers and M > 8 keep 8 (a 16-tile stage would not fit twice per
// block; two n8 token blocks with 16 tiles spill registers). 4-bit layers of 2^26 weights or more (the 70B
// shapes) take 16; smaller ones the unit size that gives the busiest block the fewest tiles, 12 before 16
// before 8 where they tie. Measured on an H200 (docs/CUDA.md, M = 1-8): 16 took 43.6 against 48.6 us at
// M = 1 on 8192x28672 and 47 against 57-60 at M = 6-8; on the 7B shapes the unit that balances the blocks
// best was fastest or within 3%, except 4096x12288 at M = 2-4 (16 there, 4-7% behind 8).
int bulk_ct(int sbits, int m, int np, int kp, int sms, bool large) {
  if (sbits != 4 || m > 8) return 8;
  if (large) return 16;
  const int nq = (np / 16 + BQ - 1) / BQ, KT = kp / 64;
  int best = 12;
  int64_t best_t = bulk_max_tiles(nq, KT, 12, (int64_t)sms * BBPS);
  for (int ct : {16, 8}) {
    const int64_t t = bulk_max_tiles(nq, KT, ct, (int64_t)sms * BBPS);
    if (t < best_t) {
      best = ct;
      best_t = t;
    }
  }
  return best;
}

// The bulk kernel's stream-K granule: whole stripes for units of one stripe (each block owns at most one), single
// tiles on layers of 2^26 weights or more (every block the same work to within a tile: 3% faster at M = 4-8 on
// the 70B shapes), else whole units (fewer chunks and shared quads per block: 5-10% faster on the 7B shapes).
// W4P_CUDA_BULK_GRANULE=tile|unit|quad forces it (tests, sweeps; quad: a whole stripe group's K range).
int bulk_granule(int ct, bool large, bool single, int KT) {
  const char *e = getenv("W4P_CUDA_BULK_GRANULE");
  if (e && strcmp(e, "tile") == 0) return 1;
  if (e && strcmp(e, "unit") == 0) return ct;
  if (e && strcmp(e, "quad") == 0) return KT;
  return single ? KT : large ? 1 : ct;
}

// Two stages of a bulk unit (ct tiles of qs stripes) fit `budget` bytes of shared memory: a block's share
bool bulk_two_stages_fit(int sbits, int m, int gs, int ct, int qs, int budget) {
  return bulk_fix(m > 8 ? 2 : 1, qs) + 2 * bulk_stage_bytes(sbits, m, gs, ct, qs) <= budget;
}

// Clusters of s blocks (s >= 3) an sm_90 device holds for `slots` plain blocks, estimated for planning: a
// cluster's blocks share one GPC, and an H200 holds 39 / 30 / 15 clusters of 3 / 4 / 8 one-per-SM blocks
// (132 SMs) and 79 / 62 / 30 of two-per-SM ones, at least 88% of slots / s. The launch checks the real count.
int64_t cluster_fill_estimate(int64_t slots, int s) { return (int64_t)(0.88 * (double)slots / s); }

// Split-K count of the wgmma kernels: `splits` when forced, else enough to fill the resident slots when the
// tiles fill less than half of them (splitting a grid that already fills half measured slower), each split
// keeping at least kmin K tiles
int wg_splits(int splits, int64_t tiles, int64_t slots, int KT, int kmin = 8) {
  int S = splits;
  if (S <= 0) {
    S = 1;
    if (2 * tiles < slots) {
      S = (int)(slots / tiles);
      const int smax = KT / kmin > 0 ? KT / kmin : 1;
      if (S > smax) S = smax;
    }
  }
  if (S > KT) S = KT;
  if (S > 65535) S = 65535;
  return S;
}

// The wgmma_ws kernel's split count for `tiles` output tiles on `slots` resident blocks (splits > 0: forced)
int ws_split_count(const DevInfo &di, int64_t tiles, int64_t slots, int KT, int bn, int splits) {
  // from the 32-token tile, split grids that leave more than half the SMs idle (with the workspace's sums,
  // 4096x11008 and 4096x12288, 86 and 96 row tiles, ran M = 32-64 in 22.5-28.3 us unsplit against 25.8-40.4
  // us with 2-3 splits: H200); with the 16-token tile the splits were level or ahead
  const bool may_split = splits > 0 || bn == 16 || 2 * tiles < di.sms;
  // at least 16 K tiles per split: 4096x4096 at M = 16-64 took 10.5-17.1 us with 4 splits against 11.2-19.9
  // with 8 (H200)
  int S = may_split ? wg_splits(splits, tiles, slots, KT, 16) : 1;
  // where the unsplit grid fills half the SMs and two splits still fit in one wave, two splits summed in a
  // cluster (sm_90): 4096x11008 and 4096x12288 at M = 32-64 took 21.0-25.8 against 22.9-28.5 us unsplit
  if (splits <= 0 && S == 1 && di.cc == 90 && !no_cluster_env() && KT >= 32 && 2 * tiles <= slots)
    S = 2;
  // from the 64-token tile, where the auto split count's clusters would not fit in one wave (their sums
  // then go through the workspace, whose partial tiles grow with the token tile), fewer splits whose
  // clusters fit, unless the longer K range per block costs more: per block about 0.5 us per K tile against
  // about 0.0186 us per split and token for the workspace sums (H200: 4096x4096 and 11008x4096 at M = 96-128
  // took 16.9-17.4 and 35.0-35.2 us with 3 cluster splits against 21.1-24.3 and 35.7-39.0 with 4 through the
  // workspace; 28672x8192 at M = 64 82.2 with 4 against 96.8 with 3)
  if (splits <= 0 && S >= 3 && bn >= 64 && di.cc == 90 && !no_cluster_env()) {
    auto fits = [&](int s) { return tiles <= (s == 2 ? slots / 2 : cluster_fill_estimate(slots, s)); };
    if (!fits(S))
      for (int s = S - 1; s >= 2; --s)
        if (fits(s)) {
          if (KT * (1.0 / s - 1.0 / S) < 0.037 * S * bn) S = s;
          break;
        }
  }
  return S;
}

// The wgmma_ws 128-token tile in 256-row blocks (RS = 2) fits a block's shared memory
bool ws_rows256_fit(const DevInfo &di, int bn, int ks) {
  return bn == 128 && ks == 2 && di.fits(ws_smem_bytes(bn, ks, 2));
}
// The 256-token tile (128-row blocks, one or two K tiles per stage) fits a block's shared memory
bool ws_tok256_fit(const DevInfo &di) {
  return di.fits(ws_smem_bytes(256, 1)) && di.fits(ws_smem_bytes(256, 2));
}
// ... and in 192-row blocks (three consumer warpgroups)
bool ws_rows192_fit(const DevInfo &di, int bn, int ks) {
  return bn == 128 && ks == 2 && di.fits(ws_smem_bytes(bn, ks, 1, 3));
}
// wgmma_ws takes 256-row blocks where their grid, split in two at most, fills the waves it takes to 84% or
// more (90% past M = 512, where the dense path is level), up to M = 1024 on layers of 2^25 weights or more, and
// from M = 769 on layers of 2^24 or more. Each block then reads its activation tile once for twice the rows: the
// copies of 128-row blocks were bound by L2 (H200, 8192x28672 at M = 128: 90 us for the copies alone,
// 6.6 TB/s; with 256-row blocks 69 us). Measured against the previous choice (docs/CUDA.md): 8192x28672
// M = 65-512 (112 row blocks, 85%) 109-436 against 118-468 us, M = 896 (99%) 666 against 719; 28672x8192
// M = 160-256 (2 splits) 189-193 against 215-219, M = 512 and 1024. 85% past M = 512 lost to the dense path
// (8192x28672 M = 640-768: 556-666 against 539-630), and so did split 7B layers. With the staged epilogue
// (thirteenth session) the 7B layers whose grid fills 97% at M = 1024 run ahead of the dense path: 4096x4096
// 51.1-57.5 against 58.1-60.2 us, 11008x4096 145.4-152.4 against 149.5-158.6, 4096x12288 157.6-177.2 against
// 174.3-181.5 (five alternating rounds; 4096x11008, 87%, stays behind: 164-189 against 156-161)
bool ws_rows256(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights) {
  const int bn = ws_tile(m);
  if (di.cc != 90 || !ws_rows256_fit(di, bn, ws_ks(bn, gs)) || weights < ((int64_t)1 << 24) ||
      (weights < ((int64_t)1 << 25) && m <= 768) || m > 1024)
    return false;
  const int64_t tiles = (int64_t)ceil_div(np, 2 * WG_BM) * ceil_div(m, bn);
  const int S = ws_split_count(di, tiles, di.sms, KT, bn, 0);
  const int64_t blocks = tiles * S;
  return S <= 2 && (double)blocks >= (m > 512 ? 0.9 : 0.84) * (double)((blocks + di.sms - 1) / di.sms * di.sms);
}

// Stream-K for wgmma_ws's 256-row blocks where the plain grid (`blocks`: tiles x splits) fills less than 90% of
// the waves of `slots` resident blocks it takes, and the tiles are at least as many as the slots (each block's
// run at least a tile). Measured on an H200 (docs/CUDA.md section 7), same-run A/B against the plain grid:
// 8192x28672 M = 256 190.5-190.9 against 200.0-200.1 us, M = 512 372.7-373.3 against 397.6-420.5; slower where
// the runs are shorter than a tile (M = 128 108-114 against 102, 4096x11008 M = 256 55.6-56.7 against 53.3-53.8)
bool ws_sk_auto(int64_t tiles, int64_t blocks, int64_t slots) {
  return tiles >= slots && (double)blocks < 0.9 * (double)((blocks + slots - 1) / slots * slots);
}

// wgmma_ws takes 192-row blocks (three consumer warpgroups) for the 128-token tile up to M = 1024 on layers of 2^24
// weights or more, where its grid costs at least 5% less than every other wgmma_ws grid by a wave model: T blocks
// of R rows on `slots` SMs (one per SM) take ceil(T / slots) waves, a wave of R-row blocks 0.57 / 0.79 / 1 of a
// 256-row block's time for R = 128 / 192 / 256 (H200, 1.14 / 0.79 / 1.0 on 4096x11008 at M = 256: 54.2 / 37.7 /
// 47.5 us, the ratios held on 11008x4096 and 28672x8192); two splits summed in a cluster within one wave half a
// wave of their rows (+ 0.05; for 192 rows up to M = 128, as measured, where ws_split_count gives exactly two);
// stream-K, where the 256-row grid is the planner's (rows256) and the plan would run it (W4P_CUDA_WS_SK as there),
// T / slots + 0.25 waves of 256-row blocks. Measured on an H200 (docs/CUDA.md) against the previous choice:
// 4096x11008 at M = 129-256 36.5-41.5 against 47.3-61.5 us, M = 512 79.0-80.9 against 93.6-95.1; 4096x12288 at
// M = 129-256 39.2-42.8 against 48.1-66.1, M = 384-512 74.2-82.5 against 86.2-108.2; 28672x8192 at M = 384
// 254.1-258.7 against 347.0-361.9; at M = 576-768, against dequantize + cuBLAS, 8192x28672 440-581 against 542-686,
// 4096x4096 36.5-40.8 against 42.2-53.2, 11008x4096 94-114 against 109-138, 28672x8192 489-578 against 507-676
// (level at M = 576), 4096x12288 123-131 against 137-146 (M = 704-768). Where it loses (8192x28672 with stream-K at
// M = 129-256, 218-231 against 178-193; 4096x12288 at M = 576-640, 4096x11008 at M = 640-1024, the 256-row grids
// at M = 1024) the model ranks the other grid first. With two splits (M = 65-128 on 4096x11008 and 4096x12288: 116
// and 128 blocks in one wave) 25.2-26.3 against 28.0-28.6 for 128-row blocks unsplit (86 and 96 blocks).
// The wave model's costs of wgmma_ws's grids at M (in waves of 256-row blocks of the 128-token tile): `others`
// the cheapest of the 128- and 256-row grids, `r192` the 192-row grid's (where it fits). rows256 as ws_rows192's.
struct WsCosts {
  double others, r192;
};
// The waves that t blocks take on `slots` resident blocks (the wave model's unit)
double ws_waves(int64_t t, int64_t slots) { return (double)((t + slots - 1) / slots); }
WsCosts ws_costs(const DevInfo &di, int64_t m, int np, int KT, int gs, bool rows256) {
  const int bn = ws_tile(m), ks = ws_ks(bn, gs);
  const int64_t slots = di.sms, tb = ceil_div(m, bn);
  auto waves = [&](int64_t t) { return ws_waves(t, slots); };
  const int64_t t128 = ceil_div(np, 128) * tb, t192 = ceil_div(np, 192) * tb, t256 = ceil_div(np, 256) * tb;
  WsCosts c;
  c.others = waves(t128) * 0.57;
  if (2 * t128 <= slots) c.others = std::min(c.others, 0.57 / 2 + 0.05);
  c.r192 = 1e30;
  if (bn == 128 && ws_rows192_fit(di, bn, ks)) {
    c.r192 = waves(t192) * 0.79;
    if (m <= 128 && 2 * t192 <= slots && ws_split_count(di, t192, slots, KT, bn, 0) == 2)
      c.r192 = std::min(c.r192, 0.79 / 2 + 0.05);
  }
  if (ws_rows256_fit(di, bn, ks)) {
    c.others = std::min(c.others, waves(t256));
    if (2 * t256 <= slots) c.others = std::min(c.others, 0.5 + 0.05);
    const int sk_env = ws_sk_env();  // (as the plan's stream-K condition)
    if (rows256 && sk_env != 0 && t256 <= MAX_COUNTERS / 4 && (sk_env == 1 || ws_sk_auto(t256, t256, slots)))
      c.others = std::min(c.others, (double)t256 / (double)slots + 0.25);
  }
  return c;
}
bool ws_rows192(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights, bool rows256) {
  const int bn = ws_tile(m);
  if (di.cc != 90 || bn != 128 || m > 1024 || weights < ((int64_t)1 << 24) || !ws_rows192_fit(di, bn, ws_ks(bn, gs)))
    return false;
  const WsCosts c = ws_costs(di, m, np, KT, gs, rows256);
  return c.r192 < 0.95 * c.others;
}

// wgmma_ws takes the 256-token tile (128-row blocks, one K tile a stage) at M = 192-1024 on layers of 2^24 weights or
// more, where its last token tile is at least three quarters full and the wave model above ranks its grid 5% ahead
// of the 128-token tile's: T blocks take ceil(T / slots) waves of 0.89 (H200: 128 blocks in one wave 47.7-49.1
// against 51.1-57.5 us for 256-row blocks on 4096x4096 at M = 1024, 126.0-132.0 against 141.6-148.5 on 11008x4096);
// two splits summed in a cluster, where they fill one wave, 0.89 x (1/2 + 8 / KT): the sum of a 128 x 256 tile costs
// about 6 us whatever K (4096x4096 at M = 512: 30.8 against 27.7 for 128-row blocks; 11008x4096: 68.7 against 73.7;
// 28672x8192 at M = 256: 164.4 against 177.3). A grid whose last token tile is partly empty ran slower than a full
// one (8192x28672: 217 us at M = 129, 200 at 160, 178 at 176, 170 at 192, 178 at 256; 28672x8192: 178 at 129, 155
// at 192), and the other grids shrink with M, so past a multiple of 256 it lost up to three quarters (M = 129-176 on
// 8192x28672 and 8192x8192, 257-384 on 11008x4096, 513-576 on 4096x11008, 769 on 4096x12288 and 28672x8192).
// Returns its splits (1 or 2), or 0 where it is not taken. Measured rules and A/B runs: docs/CUDA.md section 7.
int ws_tok256(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights, bool rows256) {
  if (di.cc != 90 || m <= 128 || m > 1024 || (m % 256 != 0 && m % 256 < 192) || weights < ((int64_t)1 << 24) ||
      !ws_tok256_fit(di))
    return 0;
  const int64_t slots = di.sms, t = (int64_t)ceil_div(np, 128) * ceil_div(m, 256);
  double mine = ws_waves(t, slots) * 0.89;
  int S = 1;
  const double split2 = 0.89 * (0.5 + 8.0 / KT);  // (summed in a cluster: not with W4P_CUDA_CLUSTER=0)
  if (2 * t <= slots && split2 < mine && !no_cluster_env()) {
    mine = split2;
    S = 2;
  }
  const WsCosts c = ws_costs(di, m, np, KT, gs, rows256);
  return mine < 0.95 * std::min(c.others, c.r192) ? S : 0;
}

// kernel: 0 auto, 1 stream, 2 tiled, 10/11 probes. splits: 0 auto. ws_avail: bytes available (SIZE_MAX = plan only).
int make_plan(const DevInfo &di, int64_t m, int n, int k, int sbits, int gs, bool act_order, bool x_aligned,
              int kernel, int splits, size_t ws_avail, Plan *pl) {
  const int sms = di.sms;
  const int np = ceil_div(n, 16) * 16, kp = ceil_div(k, 64) * 64;
  const int KT = kp / 64;
  int kind = kernel;
  // the stream kernel takes group sizes that are multiples of 32 (one group per 32-wide half tile)
  const bool stream_ok = gs <= 0 || gs % 32 == 0;
  const int nstripes = np / 16;
  const bool ring_ok = stream_ok && m <= 8 && (nstripes + RQ - 1) / RQ <= MAX_COUNTERS;
  // ring kernel capacity: resident warps (shared memory per block and the launch bound)
  const size_t ring_blk = (size_t)RW * ring_warp_bytes(sbits, (int)std::min<int64_t>(m, 8));
  const int ring_per_sm = std::max(1, std::min(RING_MINB, (int)(di.smem_sm / (ring_blk + di.smem_reserved))));
  const int64_t ring_cap = (int64_t)sms * ring_per_sm * RW;
  const int64_t ring_units = (int64_t)((nstripes + RQ - 1) / RQ) * KT;
  // bulk kernel (sm_90+): BBPS blocks of 9 warps per SM, as many stages as fit (at most BMAXS)
  const bool bulk_ok = stream_ok && m <= BULK_MAX_M && di.cc >= 90 && (nstripes + BQ - 1) / BQ <= MAX_COUNTERS;
  // one-stripe units (4-bit, M <= 8): where every block can own a whole stripe (at most one stripe per block)
  // on layers under 2^25 weights, and two of their stages fit a block's share of the SM (BBPS blocks per SM;
  // on an H200 they fit up to M = 8 with every group size). No block then shares its rows with another and
  // the split reduction through global memory disappears. Measured on an H200 (docs/CUDA.md): 4096x4096
  // M = 1 8.0 against 9.2 us with four-stripe units, M = 4 9.1-9.2 against 10.2; 4096 rows x K 2048 M = 1 5.7
  // against 7.6; level or slower on the larger layers, where blocks share stripes anyway
  const bool bulk_big = (int64_t)np * kp >= ((int64_t)1 << 25);
  // BBPS blocks per SM share its shared memory; where two stages do not fit that share (8-bit, M > 8), one
  // block per SM takes the whole of it
  const int bulk_budget = std::min(di.smem_block, di.smem_sm / BBPS - di.smem_reserved);
  const bool bulk_one = sbits == 4 && !bulk_big && nstripes <= sms * BBPS && m <= 8 &&
                        bulk_two_stages_fit(sbits, (int)m, gs, BCT1, 1, bulk_budget);
  // auto: up to M = 4, up to M = 8 on layers of 2^25 weights or more (measured on an H200 with units of 12 or
  // 16 tiles: 45-47 against 57-60 us for the ring and wgmma_ws kernels at M = 6-8 on the 70B shapes, 16-19
  // against 18-22 us on the 7B MLP shapes) and on the layers of one-stripe units (4096x4096 at M = 5-8:
  // 9.5-9.9 against 10.4-10.9 us for the stream kernel)
  // gemv kernel (M = 1, 4-bit, sm_80+): its activations staged in shared memory must fit a block
  const bool gemv_ok = sbits == 4 && m == 1 && di.cc >= 80 && stream_ok && di.fits((size_t)gv_smem(KT));
  // auto, sm_90: the gemv kernel at M = 1 (measured on an H200, docs/CUDA.md)
  if (kind == W4P_CUDA_KERNEL_AUTO && gemv_ok && di.cc == 90 && gemv_env() != 0 && gemv_auto(di, nstripes, KT, gs))
    kind = W4P_CUDA_KERNEL_GEMV;
  if (kind == W4P_CUDA_KERNEL_AUTO && bulk_ok && (m <= BULK_AUTO_M || ((bulk_big || bulk_one) && m <= 8)))
    kind = W4P_CUDA_KERNEL_BULK;
  // auto, sm_90: the warp-specialized wgmma kernel from M = 9 (the bulk kernel takes M = 8 where it led), up to
  // M = 32 on every layer, up to M = 128 on layers of 2^25 weights or more (the 7B MLP shapes) and up to M = 256
  // on layers of 2^26 or more (the 70B shapes). Measured on an H200 (docs/CUDA.md): from M = 9 it is ahead of
  // the stream kernel on every Llama shape (its time hardly grows with M up to 16), at M = 8 ahead of the ring
  // kernel on the large layers only, and in its M ranges ahead of the one-pass wgmma kernel and of dequantize +
  // cuBLAS. Smaller layers from M = 33 and every layer from M = 257 take dequantize + cuBLAS (the Python side's
  // dense path when this plan says "tiled"). Without the driver's TMA encoder the wgmma kernel takes its place.
  // With TMA it also takes M = 33-512 on layers of 2^24 weights or more where its blocks fit in one wave:
  // 4096x4096 M = 48-512 in 15.7-34.7 against 21.7-37.5 us, 11008x4096 M = 129-512 in 52.2-88.9 against
  // 65.4-93.9 us for dequantize + cuBLAS; 4096x12288 M = 384 (288 blocks) took 106.9 against 87.9.
  const bool wg_tma = di.tma && !no_tma_env();
  // wgmma_ws in 256-row blocks by their rule, for auto's choices below and for the wgmma_ws plan itself, and in
  // 192-row blocks by theirs (ahead of the 256-row rule where both hold). A forced height (W4P_CUDA_WS_ROWS, or
  // W4P_CUDA_WS_RS) keeps its own rule for auto's kernel choice and turns the others off: 128 rows both, 256 the
  // 192-row rule, 192 the 256-row rules. The 256-token tile by its rule (ws_tok256: its split count), ahead of both;
  // off where a height is forced or W4P_CUDA_WS_TOK=128, and for every M past 128 with W4P_CUDA_WS_TOK=256 (its
  // rule still decides auto's kernel choice)
  const int rs_env = ws_rs_env(), tok_env = ws_tok_env();
  const bool rule256 = ws_rows256(di, m, np, KT, gs, (int64_t)np * kp);
  const int tok256_S = rs_env == 0 && tok_env != 128 ? ws_tok256(di, m, np, KT, gs, (int64_t)np * kp, rule256) : 0;
  const bool rows256 = (rs_env == 0 || rs_env == 2) && rule256;
  const bool rows192 = (rs_env == 0 || rs_env == 3) && ws_rows192(di, m, np, KT, gs, (int64_t)np * kp, rule256);
  if (kind == W4P_CUDA_KERNEL_AUTO && di.cc == 90 && sbits == 4 && (gs <= 0 || gs % 16 == 0) && m >= WS_AUTO_MIN_M) {
    const int64_t weights = (int64_t)np * kp;
    const bool large = weights >= ((int64_t)1 << 25);
    // (past M = 256 only where the last token tile is more than half full: 4096x4096 and 11008x4096 at
    // M = 257-320 took 33.4 and 82.3 us against 29.2-32.5 and 74.2-75.4 for dequantize + cuBLAS)
    const bool one_wave = wg_tma && weights >= ((int64_t)1 << 24) && m <= WIDE_AUTO_MAX_M &&
                          (m <= WG_AUTO_MAX_M || m % 128 == 0 || m % 128 > 64) &&
                          (int64_t)ceil_div(np, WG_BM) * ceil_div(m, ws_tile(m)) <=
                              (int64_t)sms * ws_blocks_per_sm(ws_tile(m));
    if ((m > WS_AUTO_MIN_M || large) &&
        (m <= 32 || (m <= 128 && large) || (m <= WG_AUTO_MAX_M && weights >= ((int64_t)1 << 26)) || one_wave))
      kind = wg_tma ? W4P_CUDA_KERNEL_WGMMA_WS : W4P_CUDA_KERNEL_WGMMA;
  }
  // auto, sm_90: the wgmma_ss kernel where its blocks (256 rows x 128 tokens) fill at least half the SMs without
  // splitting K (group sizes of whole K tiles): in wgmma_ws's range from M = SS_AUTO_MIN_M, and in the dense
  // path's from M = SS_AUTO_DENSE_M. Measured on an H200 (docs/CUDA.md): 8192x28672 (112 row blocks) M = 65-256
  // 116.6-234.2 against 126.8-257.2 us for wgmma_ws (M = 64: 87.2 against 79.9); at M = 160-256 4096x11008
  // 61.9-62.3 against 64.3-65.6 and 4096x12288 62.3-62.6 against 68.2-75.9 for dequantize + cuBLAS (M = 129:
  // 62.6 against 60.9 on 4096x11008). Grids that need a split (28672x8192; the 7B shapes at M = 128) were slower
  // than wgmma_ws; past M = 256 on 8192x28672 it was level or slower than the dense path (M = 384: 441.9
  // against 396.5).
  if (kernel == W4P_CUDA_KERNEL_AUTO && (gs <= 0 || gs % 64 == 0) && m >= SS_AUTO_MIN_M && m <= WG_AUTO_MAX_M &&
      (kind == W4P_CUDA_KERNEL_WGMMA_WS || (kind == W4P_CUDA_KERNEL_AUTO && m >= SS_AUTO_DENSE_M && di.cc == 90 &&
                                             sbits == 4 && di.tma && !no_tma_env())) &&
      di.fits(ss_smem_bytes(m <= 64 ? 64 : 128)) &&
      2 * (int64_t)ceil_div(np, SS_BR) * ceil_div(m, m <= 64 ? 64 : 128) >= sms)
    kind = W4P_CUDA_KERNEL_WGMMA_SS;
  // ... and there wgmma_ws in 256-row blocks where those run unsplit too (the same 256 x 128 tiles, on layers
  // of 2^25 weights or more): 4096x11008 and 4096x12288 at M = 192-256 took 57.9-60.3 against 61.4-63.8 us
  // (H200, same runs)
  bool rows256_auto = false;
  if (kernel == W4P_CUDA_KERNEL_AUTO && kind == W4P_CUDA_KERNEL_WGMMA_SS && m > 64 && (rs_env == 0 || rs_env == 2) &&
      ws_rows256_fit(di, 128, ws_ks(128, gs)) && (int64_t)np * kp >= ((int64_t)1 << 25) &&
      ws_split_count(di, (int64_t)ceil_div(np, 2 * WG_BM) * ceil_div(m, 128), sms, KT, 128, 0) == 1) {
    kind = W4P_CUDA_KERNEL_WGMMA_WS;
    rows256_auto = true;
  }
  // M = 257-512: wgmma_ss where its blocks fill the waves they take: at least 80% unsplit, else at least 90%
  // with 4 splits of 64 K tiles or more. Its time is its waves' count times one block's time, so the fill
  // decides. Measured on an H200 against the previous choice: 8192x28672 M = 384 (336 blocks, 85%) 351.0
  // against 408.2 us for dequantize + cuBLAS, M = 512 467.9 against 474.5; 28672x8192 M = 384 (4 splits, 97%)
  // 339.4 against 400.4, M = 512 (unsplit, 97%) 394.9 against 484.1; 4096x11008 M = 384 (129 blocks) 65.1
  // against 77.6 (M = 512, 172 blocks: 127.2 against 99.5; 4096x12288 M = 384, 144 blocks: 127.4 against 86.4).
  int ss_auto_splits = 0;
  if (kernel == W4P_CUDA_KERNEL_AUTO && (gs <= 0 || gs % 64 == 0) && m > WG_AUTO_MAX_M && m <= WIDE_AUTO_MAX_M &&
      di.cc == 90 && sbits == 4 && wg_tma && (kind == W4P_CUDA_KERNEL_AUTO || kind == W4P_CUDA_KERNEL_WGMMA_WS) &&
      di.fits(ss_smem_bytes(128))) {
    const int64_t blocks = (int64_t)ceil_div(np, SS_BR) * ceil_div(m, 128);
    auto fill = [&](int64_t b) { return (double)b / (double)(ceil_div(b, (int64_t)sms) * sms); };
    if (fill(blocks) >= 0.8) {
      kind = W4P_CUDA_KERNEL_WGMMA_SS;
      ss_auto_splits = 1;
    } else if (KT / 4 >= 64 && fill(4 * blocks) >= 0.9) {
      kind = W4P_CUDA_KERNEL_WGMMA_SS;
      ss_auto_splits = 4;
    }
  }
  // auto, sm_90: wgmma_ws in 256-row or 192-row blocks or the 256-token tile over the choices above, where
  // ws_rows256 / ws_rows192 / ws_tok256 take them
  if (kernel == W4P_CUDA_KERNEL_AUTO && di.cc == 90 && sbits == 4 && wg_tma && (gs <= 0 || gs % 16 == 0) &&
      m > 64 && (rows256 || rows192 || tok256_S))
    kind = W4P_CUDA_KERNEL_WGMMA_WS;
  if (kind == W4P_CUDA_KERNEL_AUTO) {
    // Measured on an H200 (docs/CUDA.md): the ring kernel wins where every resident warp gets a long run of
    // units (70B-sized layers); on smaller layers the block-split stream kernel's shorter ramp wins
    const bool ring_wins = ring_ok && m <= RING_MAX_M && ring_units >= RING_MIN_UNITS * ring_cap;
    kind = ring_wins ? 3 : (m <= 32 && stream_ok) ? 1 : 2;
  }
  // probes run their kernel's plan (and get its errors)
  if (kind == W4P_CUDA_PROBE_BULK) kind = W4P_CUDA_KERNEL_BULK;
  if (kind == W4P_CUDA_PROBE_WS) kind = W4P_CUDA_KERNEL_WGMMA_WS;
  if (kind == W4P_CUDA_PROBE_SS) kind = W4P_CUDA_KERNEL_WGMMA_SS;
  if (kind != 2 && kind != W4P_CUDA_KERNEL_WGMMA && kind != W4P_CUDA_KERNEL_WGMMA_WS &&
      kind != W4P_CUDA_KERNEL_WGMMA_SS && kind != W4P_CUDA_KERNEL_GEMV && !stream_ok)
    return fail(W4P_EUNSUPPORTED, "group size %d: the stream kernel needs a multiple of 32 (use auto or tiled)", gs);
  if (kind == 3 && !ring_ok)
    return fail(W4P_EUNSUPPORTED, "the ring kernel takes M <= 8 and at most %d row stripes (m=%lld, n=%d)",
                MAX_COUNTERS * RQ, (long long)m, n);
  if (kind == W4P_CUDA_KERNEL_GEMV && !gemv_ok)
    return fail(W4P_EUNSUPPORTED, "the gemv kernel takes M = 1, 4-bit layers, compute capability 8.0 or newer (this "
                "device: %d.%d), a group size that is a multiple of 32 or per channel, and K up to %d (m=%lld, k=%d)",
                di.cc / 10, di.cc % 10, (di.smem_block - di.smem_reserved - GV_RED) / 128 * 64, (long long)m, k);
  pl->kernel = kind;
  if (kind == W4P_CUDA_KERNEL_GEMV) {
    // whole stripes per block: as many blocks as the SMs hold (launch bound and shared memory), at most one per
    // stripe (the launch takes the blocks per SM from the occupancy of the kernel it runs: the launch bound
    // differs by zero mode, which the plan does not know; this is zero mode none's)
    pl->W = std::min<int64_t>(nstripes, gv_grid(di, KT, gs));
    pl->smem = (size_t)gv_smem(KT);
    pl->tiles = nstripes;
    pl->pdl = di.cc >= 90;
    pl->ws_total = COUNTER_BYTES;
    return W4P_OK;
  }
  if (kind == W4P_CUDA_KERNEL_BULK && !bulk_ok)
    return fail(W4P_EUNSUPPORTED, "the bulk kernel needs compute capability 9.0 or newer (this device: %d.%d), "
                "M <= %d and a group size that is a multiple of 32", di.cc / 10, di.cc % 10, BULK_MAX_M);
  if (kind == W4P_CUDA_KERNEL_BULK) {
    // splits > 0 forces the number of stages (sweeps, tests); else two for units of 12 or 16 tiles (measured
    // faster than three or four on every Llama shape: fewer bytes in flight per SM did better), as many as fit
    // for units of 8 (at most BMAXS)
    const int mm = (int)m;
    // stripes per unit: one on the layers of bulk_one (above), else four. W4P_CUDA_BULK_QS=1|4 forces it (1: any
    // 4-bit layer at M <= 8, whatever W4P_CUDA_BULK_CT says); without it a forced W4P_CUDA_BULK_CT (a unit size
    // of four-stripe units) implies four.
    const bool large = (int64_t)np * kp >= ((int64_t)1 << 26);
    const int forced = sbits == 4 && m <= 8 ? bulk_ct_env() : 0;
    const int qs_env = bulk_qs_env();
    const bool single = sbits == 4 && m <= 8 &&
                        (qs_env == 1 || (qs_env == 0 && !forced && bulk_one));
    const int qs = single ? 1 : BQ;
    if ((nstripes + qs - 1) / qs > MAX_COUNTERS)
      return fail(W4P_EUNSUPPORTED, "bulk kernel: %d stripes exceed its %d counters", nstripes, MAX_COUNTERS * qs);
    const int fix = bulk_fix(m > 8 ? 2 : 1, qs);
    // units of one stripe are 32 tiles long (16 and 64 measured no faster); of four stripes, longer units only
    // where two of their stages fit a block's share (group 32 at M = 8 takes 12, not 16), unless
    // W4P_CUDA_BULK_CT forces the size
    int ct = single ? BCT1 : forced ? forced : bulk_ct(sbits, mm, np, kp, sms, large);
    while (!single && !forced && ct > 8 && splits <= 0 && !bulk_two_stages_fit(sbits, mm, gs, ct, qs, bulk_budget))
      ct = ct == 16 ? 12 : 8;
    const int per_stage = bulk_stage_bytes(sbits, mm, gs, ct, qs);
    int ns = splits > 0 ? splits : ct > 8 ? 2 : (bulk_budget - fix) / per_stage;
    if (splits <= 0 && ns < 2) ns = (di.smem_block - fix) / per_stage;
    ns = std::min(ns, BMAXS);
    if (ns < 2 || (size_t)bulk_smem_bytes(sbits, mm, gs, ns, ct, qs) > (size_t)di.smem_block)
      return fail(W4P_EUNSUPPORTED, "bulk kernel: %d stages of %d bytes do not fit the device's %d bytes of shared "
                  "memory per block", std::max(ns, 2), per_stage, di.smem_block);
    const int nq = (nstripes + qs - 1) / qs;
    pl->qs = qs;
    const int kg = bulk_granule(ct, large, single, KT);
    const int64_t total = (int64_t)nq * ((KT + kg - 1) / kg);
    pl->ct = ct;
    pl->kg = kg;
    pl->W = std::min<int64_t>(total, (int64_t)sms * BBPS);
    pl->S = ns;
    pl->KC = ns;
    pl->NI = m > 8 ? 2 : 1;
    pl->TB = 1;
    pl->tiles = nq;
    pl->smem = bulk_smem_bytes(sbits, mm, gs, ns, ct, qs);
    pl->gather = act_order || !x_aligned || (k % 64) != 0;
    pl->ws_gather = pl->gather ? (((size_t)m * kp * 2 + 255) / 256) * 256 : 0;
    pl->ws_part = (size_t)pl->W * 2 * m * qs * 16 * 4;
    pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
    return W4P_OK;
  }
  if (kind == 3) {
    // Stream-K over resident warps: grid = what fits on the GPU at once (shared memory and the launch
    // bound), each warp at least RING_LMIN units (fewer partial sums on small layers); splits > 0 forces
    // the units per warp (sweeps, tests).
    const size_t blk = ring_blk;
    if (blk > (size_t)di.smem_block)
      return fail(W4P_EUNSUPPORTED, "ring kernel: %zu bytes of shared memory per block exceed the device's %d", blk,
                  di.smem_block);
    const int64_t total = ring_units, cap = ring_cap;
    int64_t L = splits > 0 ? splits : std::max<int64_t>(RING_LMIN, (total + cap - 1) / cap);
    int64_t W = (total + L - 1) / L;
    if (W > total) W = total;
    if (W < 1) W = 1;
    pl->W = W;
    pl->S = (int)std::min<int64_t>(W, 1 << 30);
    pl->NI = 1;
    pl->TB = 1;
    pl->tiles = (nstripes + RQ - 1) / RQ;
    pl->smem = blk;
    pl->gather = act_order || !x_aligned || (k % 8) != 0;
    pl->ws_gather = pl->gather ? (((size_t)m * kp * 2 + 255) / 256) * 256 : 0;
    pl->ws_part = (size_t)W * 2 * m * RQ * 16 * 4;
    pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
    return W4P_OK;
  }
  if (kind == 1 || kind == W4P_CUDA_PROBE_LOAD || kind == W4P_CUDA_PROBE_DEQUANT) {
    int NI = (int)(m > 16 ? 4 : ceil_div(m, 8));  // 1, 2 or 4 n8 tiles of tokens per block
    if (kind != 1) NI = 1;                        // probes: the M <= 8 kernel
    const int MI = NI == 1 ? 1 : 2;
    const int V = sbits / 4;
    const int U = (8 / (MI * V)) > 0 ? 8 / (MI * V) : 1;
    const int KC = NI == 1 ? 24 : NI == 2 ? 16 : 8;  // ~25-33 KB of activations per chunk buffer; multiple of U
    const int RB = SW * MI * 16;
    const int TB = ceil_div(m, NI * 8);
    const int nrb = ceil_div(np, RB);
    pl->NI = NI;
    pl->MI = MI;
    pl->KC = KC;
    pl->TB = TB;
    pl->tiles = nrb * TB;
    int S = splits;
    if (S <= 0) {
      // Measured on an H200 (docs/CUDA.md): M <= 8 is fastest with about one wave of resident blocks
      // (4 per SM, never more: a partial second wave is a tail); larger M with about two blocks per SM and
      // at least 16 tiles per warp.
      if (NI == 1) {
        S = (int)((int64_t)sms * 4 / pl->tiles);
      } else {
        S = (int)(((int64_t)sms * 2 + pl->tiles / 2) / pl->tiles);
      }
      const int smax = NI == 1 ? (KT / 8 > 0 ? KT / 8 : 1) : (KT / 16 > 0 ? KT / 16 : 1);
      if (S > smax) S = smax;
      if (S < 1) S = 1;
    }
    if (S > KT) S = KT;
    pl->S = S;
    pl->smem = 2 * stream_buf_bytes(NI, MI, KC, gs);
  } else if (kind == 2) {
    const int TB = ceil_div(m, TBN);
    const int nrb = ceil_div(np, TBM);
    pl->TB = TB;
    pl->tiles = nrb * TB;
    int S = splits;
    if (S <= 0) {
      S = 1;
      if (pl->tiles < sms) {
        S = ceil_div(sms, pl->tiles);
        const int smax = KT / 8 > 0 ? KT / 8 : 1;
        if (S > smax) S = smax;
      }
    }
    if (S > KT) S = KT;
    pl->S = S;
    pl->gather = act_order || !x_aligned || (k % 8) != 0;
    pl->smem = sbits == 4 ? TiledCfg<4>::SMEM : TiledCfg<8>::SMEM;
  } else if (kind == W4P_CUDA_KERNEL_WGMMA) {
    if (di.cc != 90 || sbits != 4 || !(gs <= 0 || gs % 16 == 0))
      return fail(W4P_EUNSUPPORTED, "the wgmma kernel needs compute capability 9.0 (this device: %d.%d), 4-bit "
                  "storage and a group size that is a multiple of 16", di.cc / 10, di.cc % 10);
    // token tile 64 up to M = 64 (two blocks per SM), else 128; W4P_CUDA_WGMMA_KP=1|2 overrides the K tiles
    // per step (tuning)
    const int bn = m <= 64 ? 64 : 128;
    int kpt = 1;  // one K tile per step: measured ahead of two (which holds both tiles' fragments) at M = 16..256
    if (const char *e = getenv("W4P_CUDA_WGMMA_KP")) kpt = e[0] == '2' ? 2 : 1;
    bool as = false;  // W4P_CUDA_WGMMA_AS=1: the A-through-shared-memory variant (token tile 64; tuning)
    if (const char *e = getenv("W4P_CUDA_WGMMA_AS")) as = e[0] == '1' && bn == 64;
    if (as) kpt = 1;
    if (!di.fits(wg_smem_bytes(bn, kpt, as)))
      return fail(W4P_EUNSUPPORTED, "the wgmma kernel needs %d bytes of shared memory per block",
                  wg_smem_bytes(bn, kpt, as));
    const int nrb = ceil_div(np, WG_BM);
    if (nrb > 65535) return fail(W4P_EUNSUPPORTED, "the wgmma kernel takes at most %d rows", 65535 * WG_BM);
    pl->bn = bn;
    pl->kp = kpt;
    pl->as = as;
    pl->TB = ceil_div(m, bn);
    pl->tiles = nrb * pl->TB;
    pl->S = wg_splits(splits, pl->tiles, (int64_t)sms * ((bn == 64 || kpt == 1) ? 2 : 1), KT);
    pl->smem = wg_smem_bytes(bn, kpt, as);
    pl->gather = act_order || !x_aligned || (k % 64) != 0;
  } else if (kind == W4P_CUDA_KERNEL_WGMMA_WS) {
    // token tile 16 / 32 / 64 / 128 by M, or 256 (ws_tok256, W4P_CUDA_WS_TOK); split K as the wgmma kernel
    if (di.cc != 90 || sbits != 4 || !(gs <= 0 || gs % 16 == 0))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel needs compute capability 9.0 (this device: %d.%d), 4-bit "
                  "storage and a group size that is a multiple of 16", di.cc / 10, di.cc % 10);
    const bool tok256 = (m > 128 && tok_env == 256 && rs_env == 0 && ws_tok256_fit(di)) || tok256_S > 0;
    const int bn = tok256 ? 256 : ws_tile(m);
    const int ks = tok256 ? ws_tok256_ks() : ws_ks(bn, gs);
    if (!di.fits(ws_smem_bytes(bn, ks)))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel needs %d bytes of shared memory per block",
                  ws_smem_bytes(bn, ks));
    const int rs = tok256                                                         ? 1
                   : rs_env == 2 && ws_rows256_fit(di, bn, ks)                     ? 2
                   : rs_env == 0 && !rows192 && (rows256_auto || rows256) ? 2
                                                                          : 1;
    const int cw = !tok256 && rs == 1 && (rs_env == 3 || rows192) && ws_rows192_fit(di, bn, ks) ? 3 : 2;
    pl->rs = rs;
    pl->cw = cw;
    const int rb = 64 * cw * rs;  // rows per block
    const int nrb = ceil_div(np, rb);
    if (nrb > 65535)
      return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel takes at most %d rows", 65535 * rb);
    pl->bn = bn;
    pl->TB = ceil_div(m, bn);
    pl->tiles = nrb * pl->TB;
    const int64_t slots = (int64_t)sms * ws_blocks_per_sm(bn, rs);
    pl->S = tok256_S && splits <= 0 && tok_env != 256 ? tok256_S : ws_split_count(di, pl->tiles, slots, KT, bn, splits);
    pl->smem = ws_smem_bytes(bn, ks, rs, cw);
    pl->kp = ks;
    // stream-K for the 256-row blocks: one block per SM, each taking an equal run of the tiles' stages (the
    // partial tiles at the runs' ends summed through the workspace), where the plain grid's waves would leave
    // SMs idle
    const int sk_env = ws_sk_env();
    const int64_t units = (int64_t)pl->tiles * ceil_div(KT, ks);
    if (rs == 2 && kernel != W4P_CUDA_PROBE_WS && splits <= 0 && pl->tiles <= MAX_COUNTERS / 4 &&
        (sk_env == 1 || (sk_env < 0 && ws_sk_auto(pl->tiles, pl->tiles * pl->S, slots)))) {
      pl->sk = (int)std::min<int64_t>(slots, units);
      pl->sk_plain_S = pl->S;
      pl->S = 1;
    }
    pl->gather = act_order || !x_aligned;  // TMA zero-fills columns past K: no gather for ragged K
  } else if (kind == W4P_CUDA_KERNEL_WGMMA_SS) {
    // 256 weight rows x 64 tokens per block up to M = 64, else x 128 (W4P_CUDA_SS_TOK=64|128 forces it); one
    // block per SM; split K as the other wgmma kernels
    if (di.cc != 90 || sbits != 4 || !(gs <= 0 || gs % 64 == 0))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs compute capability 9.0 (this device: %d.%d), 4-bit "
                  "storage and a group size that is a multiple of 64 (or per channel)", di.cc / 10, di.cc % 10);
    if (!di.tma)
      return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs the driver's TMA descriptor encoder (this driver has none)");
    int tok = m <= 64 ? 64 : 128;
    if (const char *e = getenv("W4P_CUDA_SS_TOK")) tok = strcmp(e, "64") == 0 ? 64 : strcmp(e, "128") == 0 ? 128 : tok;
    if (!di.fits(ss_smem_bytes(tok)))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs %d bytes of shared memory per block", ss_smem_bytes(tok));
    const int nrb = ceil_div(np, SS_BR);
    if (nrb > 65535) return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel takes at most %d rows", 65535 * SS_BR);
    pl->bn = tok;
    pl->kp = ss_ks(tok);
    pl->TB = ceil_div(m, tok);
    pl->tiles = nrb * pl->TB;
    pl->S = wg_splits(splits > 0 ? splits : ss_auto_splits, pl->tiles, (int64_t)sms, KT);
    pl->smem = ss_smem_bytes(tok);
    pl->gather = act_order || !x_aligned;  // TMA zero-fills columns past K
  } else {
    return fail(W4P_EINVAL, "unknown kernel %d", kernel);
  }
  if (pl->S > 1 && pl->tiles > MAX_COUNTERS) pl->S = 1;
  pl->ws_gather = pl->gather ? (((size_t)m * kp * 2 + 255) / 256) * 256 : 0;
  auto part_bytes = [&](int S) { return S > 1 ? (size_t)S * m * np * 4 : 0; };
  // stream-K's two slots per block, or the plain grid where a caller's workspace cannot hold them
  const size_t sk_bytes = (size_t)2 * pl->sk * pl->bn * WG_BM * pl->rs * 4;
  if (pl->sk && COUNTER_BYTES + pl->ws_gather + sk_bytes > ws_avail) {
    pl->sk = 0;
    pl->S = pl->sk_plain_S;
  }
  // shrink splits until the workspace holds them
  while (pl->S > 1 && COUNTER_BYTES + pl->ws_gather + part_bytes(pl->S) > ws_avail) pl->S = pl->S / 2 > 1 ? pl->S / 2 : 1;
  pl->ws_part = pl->sk ? sk_bytes : part_bytes(pl->S);
  pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
  // the wgmma_ws / wgmma_ss splits of one tile as a cluster that sums them in shared memory (launch_splits
  // falls back on the workspace where the device holds fewer clusters than plain blocks)
  pl->cl = (pl->kernel == W4P_CUDA_KERNEL_WGMMA_WS || pl->kernel == W4P_CUDA_KERNEL_WGMMA_SS) && pl->S > 1 &&
           pl->S <= CLUSTER_MAX && !no_cluster_env();
  return W4P_OK;
}

// W4P_CUDA_DEBUG=1: print each kernel configuration's resident blocks per SM once (stderr), for tuning
template <typename F> void debug_occupancy(F fn, const char *what, int threads, size_t smem) {
  const char *env = getenv("W4P_CUDA_DEBUG");
  if (!env || env[0] != '1') return;
  static std::mutex mu;
  static std::set<std::pair<const void *, size_t>> seen;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (!seen.insert({(const void *)fn, smem}).second) return;
  }
  int nb = 0;
  cudaFuncAttributes fa;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, threads, smem) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, fn) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  fprintf(stderr, "w4p_cuda: %s: %d threads, %zu B dynamic smem, %d registers: %d blocks per SM\n", what, threads, smem,
          fa.numRegs, nb);
}

template <typename T, int SB, int MI, int NI, int MODE>
cudaError_t launch_stream_t(const Params &p, const Plan &pl, cudaStream_t st) {
  auto fn = stream_kernel<T, SB, MI, NI, MODE, false>;
  if constexpr (MODE == 0) {
    if (p.zm == 2) fn = stream_kernel<T, SB, MI, NI, MODE, true>;
  } else {
    if (p.zm == 2) return cudaErrorNotSupported;
  }
  if (pl.smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
    if (e != cudaSuccess) return e;
  }
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  if (e != cudaSuccess) return e;
  debug_occupancy(fn, "stream", SW * 32, pl.smem);
  const int64_t blocks = (int64_t)pl.tiles * pl.S;
  fn<<<(unsigned)blocks, SW * 32, pl.smem, st>>>(p);
  return cudaGetLastError();
}

template <typename T, int SB, int MODE>
cudaError_t launch_stream_m(const Params &p, const Plan &pl, cudaStream_t st) {
  if constexpr (MODE != 0) {
    return launch_stream_t<T, SB, 1, 1, MODE>(p, pl, st);  // probes: M <= 8
  } else {
    switch (pl.NI) {
      case 1: return launch_stream_t<T, SB, 1, 1, MODE>(p, pl, st);
      case 2: return launch_stream_t<T, SB, 2, 2, MODE>(p, pl, st);
      default: return launch_stream_t<T, SB, 2, 4, MODE>(p, pl, st);
    }
  }
}

template <typename T, int SB>
cudaError_t launch_tiled_t(const Params &p, const Plan &pl, cudaStream_t st) {
  auto fn = tiled_kernel<T, SB>;
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
  if (e != cudaSuccess) return e;
  const int64_t blocks = (int64_t)pl.tiles * pl.S;
  fn<<<(unsigned)blocks, 256, pl.smem, st>>>(p);
  return cudaGetLastError();
}

template <typename T, int SB>
cudaError_t launch_ring(const Params &p, const Plan &pl, cudaStream_t st) {
  auto fn = p.zm == 2 ? ring_kernel<T, SB, true> : ring_kernel<T, SB, false>;
  if (pl.smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
    if (e != cudaSuccess) return e;
  }
  // the grid is sized for the whole shared memory of each SM (many small blocks): ask for the largest carveout
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  if (e != cudaSuccess) return e;
  debug_occupancy(fn, "ring", RW * 32, pl.smem);
  const int64_t blocks = (pl.W + RW - 1) / RW;
  fn<<<(unsigned)blocks, RW * 32, pl.smem, st>>>(p);
  return cudaGetLastError();
}

template <typename T, int SB, int NI, int CT, int QS = BQ>
cudaError_t launch_bulk_t(const Params &p, const Plan &pl, cudaStream_t st) {
  const bool g64 = p.gs < 0 || p.gs % 64 == 0;
  auto fn = p.zm == 2 ? (g64 ? bulk_kernel<T, SB, true, NI, true, CT, QS> : bulk_kernel<T, SB, true, NI, false, CT, QS>)
                      : (g64 ? bulk_kernel<T, SB, false, NI, true, CT, QS> : bulk_kernel<T, SB, false, NI, false, CT, QS>);
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
  if (e != cudaSuccess) return e;
  debug_occupancy(fn, "bulk", (BNC + BNP) * 32, pl.smem);
  return launch_ex(fn, dim3((unsigned)pl.W), (BNC + BNP) * 32, pl.smem, st, 1, p);
}

template <typename T, int SB, int CT>
cudaError_t launch_bulk_ct(const Params &p, const Plan &pl, cudaStream_t st) {
  return pl.NI == 1 ? launch_bulk_t<T, SB, 1, CT>(p, pl, st) : launch_bulk_t<T, SB, 2, CT>(p, pl, st);
}
template <typename T, int SB>
cudaError_t launch_bulk(const Params &p, const Plan &pl, cudaStream_t st) {
  if constexpr (SB == 4) {  // (units of 12 or 16 tiles: M <= 8 only, one n8 block of tokens)
    if (pl.qs == 1) return launch_bulk_t<T, SB, 1, BCT1, 1>(p, pl, st);
    if (pl.ct == 16 && pl.NI == 1) return launch_bulk_t<T, SB, 1, 16>(p, pl, st);
    if (pl.ct == 12 && pl.NI == 1) return launch_bulk_t<T, SB, 1, 12>(p, pl, st);
  }
  return launch_bulk_ct<T, SB, 8>(p, pl, st);
}

template <typename T, int BN, int KP, bool AS = false>
cudaError_t launch_wgmma_t(const Params &p, const Plan &pl, cudaStream_t st) {
  auto fn = p.zm == 2   ? wgmma_kernel<T, 2, BN, KP, AS>
            : p.zm == 1 ? wgmma_kernel<T, 1, BN, KP, AS>
                        : wgmma_kernel<T, 0, BN, KP, AS>;
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
  if (e != cudaSuccess) return e;
  debug_occupancy(fn, "wgmma", 256, pl.smem);
  fn<<<dim3((unsigned)pl.TB, (unsigned)(pl.tiles / pl.TB), (unsigned)pl.S), 256, pl.smem, st>>>(p);
  return cudaGetLastError();
}
template <typename T>
cudaError_t launch_wgmma(const Params &p, const Plan &pl, cudaStream_t st) {
  if (pl.bn == 64 && pl.as) return launch_wgmma_t<T, 64, 1, true>(p, pl, st);
  if (pl.bn == 64) return pl.kp == 1 ? launch_wgmma_t<T, 64, 1>(p, pl, st) : launch_wgmma_t<T, 64, 2>(p, pl, st);
  return pl.kp == 1 ? launch_wgmma_t<T, 128, 1>(p, pl, st) : launch_wgmma_t<T, 128, 2>(p, pl, st);
}

// The activation tile's TMA descriptor: [M][kx] in T, row stride ldx, boxes of 64 columns x BN rows with the
// 128-byte swizzle, out-of-bounds elements read as zeros. The encoder comes from the driver at run time.
typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                  const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiledFn tma_encoder() {
  static EncodeTiledFn fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (EncodeTiledFn)f;
    else
      cudaGetLastError();
  });
  return fn;
}
bool tma_encoder_available() { return tma_encoder() != nullptr; }
cudaError_t encode_x_map(CUtensorMap *map, const void *x, bool bf16, int64_t m, int64_t kx, int64_t ldx, int bn) {
  const EncodeTiledFn fn = tma_encoder();
  if (!fn) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {(cuuint64_t)kx, (cuuint64_t)m};
  const cuuint64_t strides[1] = {(cuuint64_t)ldx * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)bn};
  const cuuint32_t estr[2] = {1, 1};
  const CUresult r = fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                        const_cast<void *>(x), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The codes of layout v1 as a 3-D tensor of 32-bit words [stripes][K tiles][128] for the wgmma_ws and wgmma_ss
// kernels: boxes of ks tiles x bs stripes, no swizzle (the smem copy keeps the global order), out-of-range parts
// of a box read as zeros.
cudaError_t encode_w_map(CUtensorMap *map, const void *qw, int KT, int nstripes, int ks, int bs = 16) {
  const EncodeTiledFn fn = tma_encoder();
  if (!fn) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {128, (cuuint64_t)KT, (cuuint64_t)nstripes};
  const cuuint64_t strides[2] = {512, (cuuint64_t)KT * 512};
  const cuuint32_t box[3] = {128, (cuuint32_t)ks, (cuuint32_t)bs};
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, const_cast<void *>(qw), dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A launch's configuration: clusters of cz blocks along z where cz > 1, programmatic dependent launch where pdl
// (the kernel then calls pdl_start before it touches global memory). at holds two attributes.
cudaLaunchConfig_t launch_config(cudaLaunchAttribute *at, dim3 grid, int threads, size_t smem, cudaStream_t st,
                                 int cz, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  unsigned n = 0;
  if (cz > 1) {
    at[n].id = cudaLaunchAttributeClusterDimension;
    at[n].val.clusterDim.x = 1;
    at[n].val.clusterDim.y = 1;
    at[n].val.clusterDim.z = (unsigned)cz;
    ++n;
  }
  if (pdl) {
    at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = n ? at : nullptr;
  cfg.numAttrs = n;
  return cfg;
}

// fn<<<grid, threads, smem, st>>>(p, rest...) with the attributes of launch_config
template <typename... Args, typename... Rest>
cudaError_t launch_ex(void (*fn)(Args...), dim3 grid, int threads, size_t smem, cudaStream_t st, int cz,
                      const Params &p, Rest &&...rest) {
  if (cz <= 1 && !p.pdl) {
    fn<<<grid, threads, smem, st>>>(p, std::forward<Rest>(rest)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute at[2];
  const cudaLaunchConfig_t cfg = launch_config(at, grid, threads, smem, st, cz, p.pdl != 0);
  return cudaLaunchKernelEx(&cfg, fn, p, std::forward<Rest>(rest)...);
}

// Whether clusters of cz blocks take no more waves than the plain launch. A cluster's blocks must share one GPC,
// so fewer of them may be resident than plain blocks (cudaOccupancyMaxActiveClusters); measured on an H200,
// such a launch ran up to 2x slower (docs/CUDA.md). Cached per kernel, shared memory, cluster size and device.
template <typename... Args>
bool cluster_fits(void (*fn)(Args...), dim3 grid, int threads, size_t smem, int cz) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return cudaGetLastError(), false;
  static std::mutex mu;
  static std::map<std::tuple<const void *, size_t, int, int>, std::pair<int, int>> cache;
  const auto key = std::make_tuple((const void *)fn, smem, cz, dev);
  std::pair<int, int> got{0, 0};  // (clusters resident, plain blocks resident)
  bool hit;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(key);
    hit = it != cache.end();
    if (hit) got = it->second;
  }
  if (!hit) {
    int nb = 0, sms = 0, nc = 0;
    cudaLaunchAttribute at[2];
    const cudaLaunchConfig_t cfg = launch_config(at, grid, threads, smem, nullptr, cz, false);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, threads, smem) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&nc, fn, &cfg) != cudaSuccess) {
      cudaGetLastError();
      nc = 0;
    }
    got = {nc, nb * sms};
    const char *env = getenv("W4P_CUDA_DEBUG");
    if (env && env[0] == '1')
      fprintf(stderr, "w4p_cuda: clusters of %d, %zu B dynamic smem: %d clusters resident (plain: %d blocks)\n", cz,
              smem, nc, nb * sms);
    std::lock_guard<std::mutex> lk(mu);
    cache[key] = got;
  }
  if (got.first <= 0 || got.second <= 0) return false;
  const int64_t blocks = (int64_t)grid.x * grid.y * grid.z;
  return ceil_div(blocks / cz, got.first) <= ceil_div(blocks, got.second);
}

// The wgmma_ws / wgmma_ss launch: with a cluster plan (pl.cl), the splits of each tile (blocks along z) as one
// cluster where the device holds the clusters in as few waves as the plain blocks; else plain blocks that sum
// through the workspace (which the plan always sizes for the splits)
template <typename... Args, typename... Rest>
cudaError_t launch_splits(void (*fn)(Args...), int threads, const Plan &pl, cudaStream_t st, Params p,
                          Rest &&...rest) {
  const dim3 grid((unsigned)pl.TB, (unsigned)(pl.tiles / pl.TB), (unsigned)pl.S);
  p.cl = pl.cl && cluster_fits(fn, grid, threads, pl.smem, pl.S) ? 1 : 0;
  return launch_ex(fn, grid, threads, pl.smem, st, p.cl ? pl.S : 1, p, std::forward<Rest>(rest)...);
}

template <typename T, int BN, int KS, int RS = 1, bool SK = false, int CW = 2>
cudaError_t launch_wgmma_ws_t(const Params &p, const Plan &pl, cudaStream_t st) {
  CUtensorMap map, wmap;
  cudaError_t e = encode_x_map(&map, p.x, std::is_same<T, __nv_bfloat16>::value, p.M, p.kx, p.ldx, BN);
  if (e != cudaSuccess) return e;
  e = encode_w_map(&wmap, p.qw, p.KT, p.Np / 16, KS, 4 * CW * RS);
  if (e != cudaSuccess) return e;
  XTails tail;  // the box of a last token tile that ends past M
  memset(&tail, 0, sizeof(tail));
  if constexpr (!SK) {  // (stream-K keeps the whole tile's box)
    const int xb = xtail_box(BN, (int)(p.M - (p.M - 1) / BN * BN));
    if (xb >= 0) {
      e = encode_x_map(&tail.m[xb], p.x, std::is_same<T, __nv_bfloat16>::value, p.M, p.kx, p.ldx, 8 << xb);
      if (e != cudaSuccess) return e;
    }
  }
  auto fn = p.zm == 2   ? wgmma_ws_kernel<T, 2, BN, KS, RS, SK, CW>
            : p.zm == 1 ? wgmma_ws_kernel<T, 1, BN, KS, RS, SK, CW>
                        : wgmma_ws_kernel<T, 0, BN, KS, RS, SK, CW>;
  e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
  if (e != cudaSuccess) return e;
  constexpr int NTH = ws_threads(RS, CW, BN);
  debug_occupancy(fn, "wgmma_ws", NTH, pl.smem);
  if constexpr (SK) {  // one block per resident slot, each its run of the tiles' stages
    Params q = p;
    q.sk = pl.tiles;
    return launch_ex(fn, dim3((unsigned)pl.sk), NTH, pl.smem, st, 1, q, map, wmap, tail);
  } else {
    return launch_splits(fn, NTH, pl, st, p, map, wmap, tail);
  }
}

template <typename T> cudaError_t launch_wgmma_ws(const Params &p, const Plan &pl, cudaStream_t st) {
  if (pl.rs == 2) return pl.sk ? launch_wgmma_ws_t<T, 128, 2, 2, true>(p, pl, st) : launch_wgmma_ws_t<T, 128, 2, 2>(p, pl, st);
  if (pl.bn == 256) return pl.kp == 1 ? launch_wgmma_ws_t<T, 256, 1>(p, pl, st) : launch_wgmma_ws_t<T, 256, 2>(p, pl, st);
  if (pl.cw == 3) return launch_wgmma_ws_t<T, 128, 2, 1, false, 3>(p, pl, st);
  if (pl.bn == 16) return pl.kp == 4 ? launch_wgmma_ws_t<T, 16, 4>(p, pl, st) : launch_wgmma_ws_t<T, 16, 2>(p, pl, st);
  if (pl.bn == 32) return pl.kp == 4 ? launch_wgmma_ws_t<T, 32, 4>(p, pl, st) : launch_wgmma_ws_t<T, 32, 2>(p, pl, st);
#if W4P_WS_KS4_MAX_BN >= 64
  if (pl.bn == 64) return pl.kp == 4 ? launch_wgmma_ws_t<T, 64, 4>(p, pl, st) : launch_wgmma_ws_t<T, 64, 2>(p, pl, st);
#endif
#if W4P_WS_KS4_MAX_BN >= 128
  if (pl.bn == 128) return pl.kp == 4 ? launch_wgmma_ws_t<T, 128, 4>(p, pl, st) : launch_wgmma_ws_t<T, 128, 2>(p, pl, st);
#endif
  return pl.bn == 64 ? launch_wgmma_ws_t<T, 64, 2>(p, pl, st) : launch_wgmma_ws_t<T, 128, 2>(p, pl, st);
}

template <typename T, int TOK>
cudaError_t launch_wgmma_ss_t(const Params &p, const Plan &pl, cudaStream_t st) {
  CUtensorMap map, wmap;
  cudaError_t e = encode_x_map(&map, p.x, std::is_same<T, __nv_bfloat16>::value, p.M, p.kx, p.ldx, TOK);
  if (e != cudaSuccess) return e;
  e = encode_w_map(&wmap, p.qw, p.KT, p.Np / 16, ss_ks(TOK));
  if (e != cudaSuccess) return e;
  auto fn = p.zm == 2   ? wgmma_ss_kernel<T, 2, TOK>
            : p.zm == 1 ? wgmma_ss_kernel<T, 1, TOK>
                        : wgmma_ss_kernel<T, 0, TOK>;
  e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
  if (e != cudaSuccess) return e;
  debug_occupancy(fn, "wgmma_ss", 9 * 32, pl.smem);
  return launch_splits(fn, 9 * 32, pl, st, p, map, wmap);
}

template <typename T, int ZM, bool G64>
cudaError_t launch_gemv_t(const Params &p, const Plan &pl, cudaStream_t st) {
  auto fn = gemv_kernel<T, ZM, G64>;
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
  if (e != cudaSuccess) return e;
  int dev = 0, sms = 0, per_sm = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, GV_W * 32, pl.smem)) != cudaSuccess) return e;
  const int64_t grid = std::min<int64_t>(pl.tiles, (int64_t)sms * std::max(1, per_sm));
  debug_occupancy(fn, "gemv", GV_W * 32, pl.smem);
  return launch_ex(fn, dim3((unsigned)grid), GV_W * 32, pl.smem, st, 1, p);
}
template <typename T>
cudaError_t launch_gemv(const Params &p, const Plan &pl, cudaStream_t st) {
  const bool g64 = p.gs <= 0 || p.gs % 64 == 0;
  if (p.zm == 1) return g64 ? launch_gemv_t<T, 1, true>(p, pl, st) : launch_gemv_t<T, 1, false>(p, pl, st);
  if (p.zm == 2) return g64 ? launch_gemv_t<T, 2, true>(p, pl, st) : launch_gemv_t<T, 2, false>(p, pl, st);
  return g64 ? launch_gemv_t<T, 0, true>(p, pl, st) : launch_gemv_t<T, 0, false>(p, pl, st);
}

template <typename T>
cudaError_t launch_all(Params &p, const Plan &pl, int sbits, void *ws_gather, cudaStream_t st) {
  if (pl.kernel == W4P_CUDA_KERNEL_GEMV) {  // (gathers the activations itself)
    p.pdl = pl.pdl ? pdl_env() : 0;
    return launch_gemv<T>(p, pl, st);
  }
  if (pl.kernel == 2 || pl.kernel == 3 || pl.kernel == W4P_CUDA_KERNEL_BULK || pl.kernel == W4P_CUDA_KERNEL_WGMMA ||
      pl.kernel == W4P_CUDA_KERNEL_WGMMA_WS || pl.kernel == W4P_CUDA_KERNEL_WGMMA_SS) {
    if (pl.gather) {
      T *xg = (T *)ws_gather;
      const int64_t total = p.M * (int64_t)p.Kp;
      int blocks = (int)((total + 255) / 256);
      if (blocks > 65535 * 8) blocks = 65535 * 8;
      gather_kernel<T><<<blocks, 256, 0, st>>>((const T *)p.x, p.ldx, xg, p.M, p.K, p.Kp, p.perm);
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      p.x = xg;
      p.ldx = p.Kp;
      p.kx = p.Kp;
      p.perm = nullptr;
    } else {
      p.kx = p.K;
    }
    if (pl.kernel == W4P_CUDA_KERNEL_BULK || pl.kernel == W4P_CUDA_KERNEL_WGMMA_WS ||
        pl.kernel == W4P_CUDA_KERNEL_WGMMA_SS)
      p.pdl = pdl_env();
    if (pl.kernel == W4P_CUDA_KERNEL_BULK) return sbits == 4 ? launch_bulk<T, 4>(p, pl, st) : launch_bulk<T, 8>(p, pl, st);
    if (pl.kernel == W4P_CUDA_KERNEL_WGMMA) return launch_wgmma<T>(p, pl, st);
    if (pl.kernel == W4P_CUDA_KERNEL_WGMMA_WS) return launch_wgmma_ws<T>(p, pl, st);
    if (pl.kernel == W4P_CUDA_KERNEL_WGMMA_SS)
      return pl.bn == 64 ? launch_wgmma_ss_t<T, 64>(p, pl, st) : launch_wgmma_ss_t<T, 128>(p, pl, st);
    if (pl.kernel != 2) return sbits == 4 ? launch_ring<T, 4>(p, pl, st) : launch_ring<T, 8>(p, pl, st);
    return sbits == 4 ? launch_tiled_t<T, 4>(p, pl, st) : launch_tiled_t<T, 8>(p, pl, st);
  }
  const int mode = pl.kernel == W4P_CUDA_PROBE_LOAD ? 1 : pl.kernel == W4P_CUDA_PROBE_DEQUANT ? 2 : 0;
  if (mode != 0) {  // diagnostics: fp16, 4-bit, M <= 8 only (keeps the fatbin small)
    if (!std::is_same<T, half>::value || sbits != 4) return cudaErrorNotSupported;
    if (mode == 1) return launch_stream_m<half, 4, 1>(p, pl, st);
    return launch_stream_m<half, 4, 2>(p, pl, st);
  }
  if (sbits == 4) return launch_stream_m<T, 4, 0>(p, pl, st);
  return launch_stream_m<T, 8, 0>(p, pl, st);
}

// the stream kernel takes the group size (a multiple of 32, or per channel): the fallback of an "auto" call whose
// plan gathers the activations into a workspace too small for them
bool stream_gathers(int gs) { return gs <= 0 || gs % 32 == 0; }

// the plan on a device (real or described); argument checks shared by both entry points
// The plan for checked arguments (plan_on, describe_on)
int checked_plan(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                 int x_aligned, int kernel, int splits, Plan *pl) {
  if (m < 1 || n < 1 || k < 1) return fail(W4P_EINVAL, "bad shape m=%lld n=%d k=%d", (long long)m, n, k);
  if (storage_bits != 4 && storage_bits != 8) return fail(W4P_EINVAL, "storage_bits must be 4 or 8");
  if (group_size != -1 && (group_size < 16 || group_size % 16)) return fail(W4P_EINVAL, "group_size %d", group_size);
  return make_plan(di, m, n, k, storage_bits, group_size, act_order != 0, x_aligned != 0, kernel, splits,
                   (size_t)-1, pl);
}

int plan_on(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order, int x_aligned,
            int kernel, int splits, int *kernel_out, int *splits_out, size_t *workspace_bytes) {
  Plan pl;
  int rc = checked_plan(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, &pl);
  if (rc) return rc;
  if (kernel_out) *kernel_out = pl.kernel;
  if (splits_out) *splits_out = pl.S;
  if (workspace_bytes) *workspace_bytes = pl.ws_total;
  return W4P_OK;
}
int describe_on(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                int x_aligned, int kernel, int splits, char *buf, size_t len) {
  if (!buf || len == 0) return fail(W4P_EINVAL, "describe: no buffer");
  buf[0] = 0;
  Plan pl;
  int rc = checked_plan(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, &pl);
  if (rc) return rc;
  static const char *names[] = {"auto", "stream", "tiled", "ring", "bulk", "wgmma", "wgmma_ws", "wgmma_ss", "gemv"};
  const char *name = pl.kernel >= 0 && pl.kernel <= 8 ? names[pl.kernel] : "probe";
  if (pl.kernel == W4P_CUDA_KERNEL_GEMV)
    snprintf(buf, len, "gemv blocks=%lld stripes=%d smem=%zu workspace=%zu", (long long)pl.W, pl.tiles, pl.smem,
             pl.ws_total);
  else if (pl.kernel == W4P_CUDA_KERNEL_BULK)
    snprintf(buf, len, "bulk unit=%d granule=%d stages=%d stripes=%d blocks=%lld smem=%zu workspace=%zu", pl.ct,
             pl.kg, pl.S, pl.qs, (long long)pl.W, pl.smem, pl.ws_total);
  else if (pl.kernel == 3)
    snprintf(buf, len, "ring workers=%lld smem=%zu workspace=%zu", (long long)pl.W, pl.smem, pl.ws_total);
  else if (pl.sk)
    snprintf(buf, len, "%s stream-k=%d%s tiles=%d smem=%zu workspace=%zu", name, pl.sk, pl.rs == 2 ? " rows=256" : "",
             pl.tiles, pl.smem, pl.ws_total);
  else
    snprintf(buf, len, "%s splits=%d%s%s tiles=%d smem=%zu workspace=%zu", name, pl.S,
             pl.S == 1 ? "" : pl.cl ? " sum=cluster" : " sum=workspace",
             pl.rs == 2 ? " rows=256" : pl.cw == 3 ? " rows=192" : pl.bn == 256 ? " tokens=256" : "", pl.tiles,
             pl.smem, pl.ws_total);
  return W4P_OK;
}
DevInfo described(int sms, int cc, int smem_sm, int smem_block, int smem_reserved) {
  DevInfo di;
  di.sms = sms;
  di.cc = cc;
  di.smem_sm = smem_sm;
  di.smem_block = smem_block;
  di.smem_reserved = smem_reserved;
  di.init = true;
  return di;
}
bool bad_description(int sms, int cc, int smem_sm, int smem_block, int smem_reserved) {
  if (sms < 1 || cc < 10 || smem_sm < 1 || smem_block < 1 || smem_reserved < 0) {
    fail(W4P_EINVAL, "bad device description (sms %d, cc %d, shared memory %d / %d / %d)", sms, cc, smem_sm,
         smem_block, smem_reserved);
    return true;
  }
  return false;
}
}  // namespace

// ------------------------------------------------------------------------------------------------
extern "C" {

int w4p_cuda_abi_version(void) { return W4P_CUDA_ABI; }

#ifdef W4P_WS_TRACE
// Diagnostics builds only (not part of the ABI in w4pack.h): clear the wgmma_ws block timeline (clear != 0), or
// copy up to `bytes` of it ([8192][32] uint64, see ws_trace) to `host`. Returns a cudaError_t.
__attribute__((visibility("default"))) int w4p_cuda_ws_trace(void *host, size_t bytes, int clear) {
  if (clear) {
    static unsigned long long zeros[WS_TRACE_BLOCKS][32];
    return (int)cudaMemcpyToSymbol(g_ws_trace, zeros, sizeof zeros);
  }
  return (int)cudaMemcpyFromSymbol(host, g_ws_trace, bytes < sizeof(g_ws_trace) ? bytes : sizeof(g_ws_trace));
}
#endif

const char *w4p_cuda_last_error(void) { return g_err; }

int w4p_cuda_device_count(int *count) {
  if (!count) return fail(W4P_EINVAL, "count is NULL");
  *count = 0;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(W4P_ENODEVICE, "no CUDA device: %s", cudaGetErrorString(e));
  }
  if (n == 0) return fail(W4P_ENODEVICE, "no CUDA device: the driver reports none");
  *count = n;
  return W4P_OK;
}


int w4p_cuda_plan(int device, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                  int x_aligned, int kernel, int splits, int *kernel_out, int *splits_out, size_t *workspace_bytes) {
  DevInfo di;
  int rc = dev_info(device, &di);
  if (rc) return rc;
  return plan_on(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, kernel_out, splits_out,
                 workspace_bytes);
}

int w4p_cuda_plan_for(int sms, int cc, int smem_sm, int smem_block, int smem_reserved, int64_t m, int n, int k,
                      int storage_bits, int group_size, int act_order, int x_aligned, int kernel, int splits,
                      int *kernel_out, int *splits_out, size_t *workspace_bytes) {
  if (bad_description(sms, cc, smem_sm, smem_block, smem_reserved)) return W4P_EINVAL;
  return plan_on(described(sms, cc, smem_sm, smem_block, smem_reserved), m, n, k, storage_bits, group_size,
                 act_order, x_aligned, kernel, splits, kernel_out, splits_out, workspace_bytes);
}

int w4p_cuda_plan_describe(int device, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                           int x_aligned, int kernel, int splits, char *buf, size_t len) {
  DevInfo di;
  int rc = dev_info(device, &di);
  if (rc) return rc;
  return describe_on(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, buf, len);
}

int w4p_cuda_plan_describe_for(int sms, int cc, int smem_sm, int smem_block, int smem_reserved, int64_t m, int n,
                               int k, int storage_bits, int group_size, int act_order, int x_aligned, int kernel,
                               int splits, char *buf, size_t len) {
  if (bad_description(sms, cc, smem_sm, smem_block, smem_reserved)) return W4P_EINVAL;
  return describe_on(described(sms, cc, smem_sm, smem_block, smem_reserved), m, n, k, storage_bits, group_size,
                     act_order, x_aligned, kernel, splits, buf, len);
}

int w4p_cuda_gemm(int device, void *stream, int dtype, int64_t m, int n, int k, const void *x, int64_t ldx,
                  void *y, int64_t ldy, const int32_t *qweight, int storage_bits, int group_size, int zero_mode,
                  const void *scales, const void *zeros, const void *mins, const int32_t *perm, const void *bias,
                  void *workspace, size_t workspace_bytes, int kernel, int splits) {
  if (m < 1 || n < 1 || k < 1) return fail(W4P_EINVAL, "bad shape m=%lld n=%d k=%d", (long long)m, n, k);
  if (dtype != W4P_DT_F16 && dtype != W4P_DT_BF16) return fail(W4P_EUNSUPPORTED, "dtype %d: fp16 or bf16 only", dtype);
  if (storage_bits != 4 && storage_bits != 8) return fail(W4P_EINVAL, "storage_bits must be 4 or 8, got %d", storage_bits);
  if (group_size != -1 && (group_size < 16 || group_size % 16))
    return fail(W4P_EINVAL, "group_size %d: must be -1 or a positive multiple of 16", group_size);
  if (zero_mode < 0 || zero_mode > 2) return fail(W4P_EINVAL, "zero_mode %d", zero_mode);
  if (!x || !y || !qweight || !scales) return fail(W4P_EINVAL, "x, y, qweight and scales are required");
  if (zero_mode == 1 && !zeros) return fail(W4P_EINVAL, "zero_mode int needs zeros");
  if (zero_mode == 2 && !mins) return fail(W4P_EINVAL, "zero_mode float needs mins");
  if (ldx < k || ldy < n) return fail(W4P_EINVAL, "ldx %lld < k %d or ldy %lld < n %d", (long long)ldx, k, (long long)ldy, n);
  if (((uintptr_t)qweight | (uintptr_t)scales | (uintptr_t)zeros | (uintptr_t)mins) & 15)
    return fail(W4P_EINVAL, "qweight, scales, zeros and mins must be 16-byte aligned");
  if (!workspace || workspace_bytes < COUNTER_BYTES)
    return fail(W4P_EINVAL, "workspace of at least %zu zero-filled bytes is required", COUNTER_BYTES);
  if ((uintptr_t)workspace & 255) return fail(W4P_EINVAL, "workspace must be 256-byte aligned");
  if (m > (int64_t)1 << 30) return fail(W4P_EINVAL, "m too large");

  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(W4P_ENODEVICE, "no CUDA device: %s", cudaGetErrorString(e));
  }
  if (cur != device) {
    e = cudaSetDevice(device);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
    }
  }
  DevInfo di;
  int rc = dev_info(device, &di);
  if (rc) return rc;
  const bool x_aligned = (((uintptr_t)x & 15) == 0) && (ldx % 8 == 0);
  Plan pl;
  rc = make_plan(di, m, n, k, storage_bits, group_size, perm != nullptr, x_aligned, kernel, splits,
                 workspace_bytes, &pl);
  if (rc) return rc;
  if (pl.ws_total > workspace_bytes) {
    if (kernel == 0 && pl.gather && stream_gathers(group_size)) {
      // not enough room to gather the activations: the stream kernel gathers on the fly
      rc = make_plan(di, m, n, k, storage_bits, group_size, perm != nullptr, x_aligned, 1, splits, workspace_bytes, &pl);
      if (rc) return rc;
    }
    if (pl.ws_total > workspace_bytes)
      return fail(W4P_EINVAL, "workspace too small: %zu bytes, this call needs %zu", workspace_bytes, pl.ws_total);
  }

  Params p{};
  memset(&p, 0, sizeof p);
  p.x = x;
  p.y = y;
  p.qw = reinterpret_cast<const uint32_t *>(qweight);
  p.scales = scales;
  p.zeros = zeros;
  p.mins = mins;
  p.bias = bias;
  p.perm = perm;
  unsigned char *ws = (unsigned char *)workspace;
  p.counters = (unsigned *)ws;
  void *ws_gather = ws + COUNTER_BYTES;
  p.part = (float *)(ws + COUNTER_BYTES + pl.ws_gather);
  p.ldx = ldx;
  p.ldy = ldy;
  p.M = m;
  p.N = n;
  p.K = k;
  p.Np = ceil_div(n, 16) * 16;
  p.Kp = ceil_div(k, 64) * 64;
  p.KT = p.Kp / 64;
  p.gs = group_size;
  p.zm = zero_mode;
  if ((rc = set_gmul(&p, group_size, k)) != W4P_OK) return rc;
  p.S = pl.S;
  p.TB = pl.TB;
  p.KC = pl.KC;
  p.xvec = x_aligned ? 1 : 0;
  p.kx = k;
  p.W = pl.W;
  p.sink = 0x9E3779B9u;
  p.probe = kernel == W4P_CUDA_PROBE_BULK || kernel == W4P_CUDA_PROBE_WS || kernel == W4P_CUDA_PROBE_SS ? 1 : 0;
  p.kg = pl.kg;

  cudaStream_t st = (cudaStream_t)stream;
  e = dtype == W4P_DT_F16 ? launch_all<half>(p, pl, storage_bits, ws_gather, st)
                          : launch_all<__nv_bfloat16>(p, pl, storage_bits, ws_gather, st);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(W4P_ECUDA, "kernel launch failed: %s", cudaGetErrorString(e));
  }
  return W4P_OK;
}


int w4p_cuda_dequantize(int device, void *stream, int dtype, int n, int k, const int32_t *qweight, int storage_bits,
                        int group_size, int zero_mode, const void *scales, const void *zeros, const void *mins,
                        const int32_t *perm, void *w, int64_t ldw) {
  if (n < 1 || k < 1) return fail(W4P_EINVAL, "bad shape n=%d k=%d", n, k);
  if (dtype != W4P_DT_F16 && dtype != W4P_DT_BF16) return fail(W4P_EUNSUPPORTED, "dtype %d: fp16 or bf16 only", dtype);
  if (storage_bits != 4 && storage_bits != 8) return fail(W4P_EINVAL, "storage_bits must be 4 or 8, got %d", storage_bits);
  if (group_size != -1 && (group_size < 16 || group_size % 16))
    return fail(W4P_EINVAL, "group_size %d: must be -1 or a positive multiple of 16", group_size);
  if (zero_mode < 0 || zero_mode > 2) return fail(W4P_EINVAL, "zero_mode %d", zero_mode);
  if (!qweight || !scales || !w) return fail(W4P_EINVAL, "qweight, scales and w are required");
  if ((zero_mode == 1 && !zeros) || (zero_mode == 2 && !mins)) return fail(W4P_EINVAL, "zeros/mins missing");
  if (ldw < k) return fail(W4P_EINVAL, "ldw %lld < k %d", (long long)ldw, k);
  if ((uintptr_t)qweight & 15) return fail(W4P_EINVAL, "qweight must be 16-byte aligned");
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(W4P_ENODEVICE, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
  }
  Params p{};
  memset(&p, 0, sizeof p);
  p.qw = reinterpret_cast<const uint32_t *>(qweight);
  p.scales = scales;
  p.zeros = zeros;
  p.mins = mins;
  p.perm = perm;
  p.N = n;
  p.K = k;
  p.Np = ceil_div(n, 16) * 16;
  p.Kp = ceil_div(k, 64) * 64;
  p.KT = p.Kp / 64;
  p.gs = group_size;
  p.zm = zero_mode;
  if (const int rc = set_gmul(&p, group_size, k)) return rc;
  p.xvec = (((uintptr_t)w & 15) == 0 && ldw % 8 == 0) ? 1 : 0;
  const int64_t tiles = (int64_t)(p.Np / 16) * p.KT;
  const unsigned blocks = (unsigned)((tiles + 7) / 8);
  cudaStream_t st = (cudaStream_t)stream;
  if (dtype == W4P_DT_F16) {
    if (storage_bits == 4) dequant_kernel<half, 4><<<blocks, 256, 0, st>>>(p, (half *)w, ldw);
    else dequant_kernel<half, 8><<<blocks, 256, 0, st>>>(p, (half *)w, ldw);
  } else {
    if (storage_bits == 4) dequant_kernel<__nv_bfloat16, 4><<<blocks, 256, 0, st>>>(p, (__nv_bfloat16 *)w, ldw);
    else dequant_kernel<__nv_bfloat16, 8><<<blocks, 256, 0, st>>>(p, (__nv_bfloat16 *)w, ldw);
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) return fail(W4P_ECUDA, "dequantize launch failed: %s", cudaGetErrorString(e));
  return W4P_OK;
}

}  // extern "C"
