// gemv kernel, second form (M = 1, 4-bit; variant 3 runs by default, W4P_CUDA_GEMV_CFG=0..5 picks the first form
// in kernel_gemv.cu or another variant for A/B runs). Same work split and numerics contract as the first form: blocks of
// W warps own whole 16-row stripes summed in warp order, a stripe walked in steps of W * U tiles, warp w taking U
// consecutive tiles (a "chunk") of each step, the activations staged once per block in shared memory in B-fragment
// order. The first form was bound by its instructions per tile (docs/journal/2026-cuda.md, seventeenth session:
// 110 SASS instructions per tile on fp16, zero mode none, group 128); this one issues fewer:
//   * the group parameters once per group segment (TS tiles of one group; half tiles where groups end inside a
//     tile), not once per tile, and the scale applied to the segment's MMA sums in fp32 once;
//   * 32-bit offsets with immediate per-tile displacements instead of 64-bit address arithmetic per tile;
//   * the double buffer as two named register sets (the loop body runs two steps), so no register copies;
//   * a step-level test for the last partial chunk of a stripe instead of one branch per tile;
//   * the first step's weights requested before the activations are staged (after the dependent-launch wait);
//   * FOLD variants: the zero point and the code bias folded out of the per-weight arithmetic. The MMA takes the
//     biased codes as they come out of one LOP3 (fp16: 1024 + q in rows gid, 1024 + 16 q in rows gid + 8; bf16:
//     128 + q), and each segment subtracts (bias + z) * sum(x over the segment) in fp32, from sums staged with the
//     activations. Exact codes are no longer what the MMA sees: the cancellation costs about log2(bias / |q - z|)
//     bits of the fp32 sum over at most one chunk (256 columns), far inside the 1e-3 bound on random data and
//     checked against the float64 reference by the same GPU tests (tests/test_gemv2_emulator.py checks the index
//     and constant arithmetic offline).
#include "epilogue.cuh"
#include <type_traits>
#include "launch.cuh"

namespace w4p {
namespace {

// A variant: W warps per block, U tiles per warp and step, B blocks per SM asked of the compiler (launch bound),
// FOLD: zero point folded out of the per-weight arithmetic
template <int W_, int U_, int B_, bool FOLD_> struct Gv2Cfg {
  static constexpr int W = W_, U = U_, B = B_;
  static constexpr bool FOLD = FOLD_;
};
// launch bound per variant and layer kind: one block fewer per SM where a chunk has more than two segments
// (groups of 64 columns or fewer: more parameters in registers), where the float minima are applied per weight
// and for bf16 with integer zero points unfolded, as the first form does for its heavier kinds (gv_minb); without
// it ptxas spills those (tools/cuda_sass_loop.py shows registers and stack per kernel)
template <typename T, class C, int ZM, int TS> constexpr int gv2_minb() {
  constexpr bool heavy = TS <= 1 || (ZM == 2 && !C::FOLD) || (ZM == 1 && !C::FOLD && sizeof(T) == 2 &&
                                                              !std::is_same<T, half>::value);
  return heavy && C::B > 1 ? C::B - 1 : C::B;
}

template <int ZM, int TS, class C> struct Gv2Shape {
  static constexpr int NSEG = TS ? C::U / TS : 2 * C::U;  // group segments per chunk
  static constexpr int NV = ZM == 0 ? 2 : 4;              // raw 16-bit parameters per segment (rows gid, gid + 8)
};
// one step's registers: the chunk's weights (one 16-byte load per lane and tile) and its segments' parameters
template <int ZM, int TS, class C> struct Gv2Buf {
  uint4 w[C::U];
  uint32_t par[Gv2Shape<ZM, TS, C>::NSEG][Gv2Shape<ZM, TS, C>::NV];
};

__device__ __forceinline__ uint32_t ld_u16g(const unsigned short *p) {
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}
template <typename T> __device__ __forceinline__ T t_of2(uint32_t raw) {
  const unsigned short b = (unsigned short)raw;
  return *reinterpret_cast<const T *>(&b);
}

// The loads of one chunk (stripe s, tiles t0 .. t0 + U - 1, of which nv < U are inside K unless FULL). woff: the
// 32-bit index of the lane's 16 bytes of tile t0 in uint4 units.
template <int ZM, int TS, class C, bool FULL>
__device__ __forceinline__ void gv2_load(const Params &p, uint32_t woff, uint32_t poff, int t0, int nv,
                                         Gv2Buf<ZM, TS, C> &b) {
  using S = Gv2Shape<ZM, TS, C>;
  const uint4 *wp = reinterpret_cast<const uint4 *>(p.qw) + woff;
#pragma unroll
  for (int u = 0; u < C::U; ++u) b.w[u] = FULL || u < nv ? ld_stream(wp + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
  const unsigned short *sc = (const unsigned short *)p.scales;
  const unsigned short *zp = (const unsigned short *)(ZM == 1 ? p.zeros : p.mins);
#pragma unroll
  for (int g = 0; g < S::NSEG; ++g) {
    const int first = TS ? g * TS : g / 2;  // the segment's first tile in the chunk
    const bool ok = FULL || first < nv;
    const int col = TS ? 64 * (t0 + first) : 64 * t0 + 32 * g;
    const uint32_t off = (uint32_t)group_of(col, p.gmul) * (uint32_t)p.Np + poff;
    b.par[g][0] = ok ? ld_u16g(sc + off) : 0u;
    b.par[g][1] = ok ? ld_u16g(sc + off + 8) : 0u;
    if (ZM != 0) {
      b.par[g][2] = ok ? ld_u16g(zp + off) : 0u;
      b.par[g][3] = ok ? ld_u16g(zp + off + 8) : 0u;
    }
  }
}

// The folded codes of k16 slice j: the raw biased values, no subtraction. fp16: rows gid get 1024 + q (nibbles
// 0-3 of each byte), rows gid + 8 get 1024 + 16 q (nibbles 4-7 kept in place); bf16: 128 + q in both.
template <typename T> __device__ __forceinline__ void fold_codes(const uint32_t *w, int j, uint32_t (&a)[4]);
template <> __device__ __forceinline__ void fold_codes<half>(const uint32_t *w, int j, uint32_t (&a)[4]) {
  const uint32_t x = w[j], y = x >> 8;
  a[0] = and_or(x, 0x000f000fu, 0x64006400u);
  a[1] = and_or(x, 0x00f000f0u, 0x64006400u);
  a[2] = and_or(y, 0x000f000fu, 0x64006400u);
  a[3] = and_or(y, 0x00f000f0u, 0x64006400u);
}
template <> __device__ __forceinline__ void fold_codes<__nv_bfloat16>(const uint32_t *w, int j, uint32_t (&a)[4]) {
  Codes<__nv_bfloat16, 4>::get(w, j, a);
}

// Folded constants: what the MMA sum of a row over a segment holds beyond the exact sum of (q - z) x, as
// rsc * (d - c * Sx) = sum (q - z) x: fp16 rows gid: c = 1024 + z, rsc = 1; rows gid + 8: c = 1024 + 16 z,
// rsc = 1/16; bf16: c = 128 + z, rsc = 1
template <typename T> struct FoldK;
template <> struct FoldK<half> {
  static constexpr float BLO = 1024.f, BHI = 1024.f, ZHI = 16.f, RHI = 0.0625f;
};
template <> struct FoldK<__nv_bfloat16> {
  static constexpr float BLO = 128.f, BHI = 128.f, ZHI = 1.f, RHI = 1.f;
};

// One chunk: acc[0] / acc[2] (rows gid / gid + 8) += its products with the activations. xb: the lane's B pairs
// of tile t0 (two uint4 per tile); sx: the staged activation sums of the chunk's segments (FOLD).
template <typename T, int ZM, int TS, class C, bool FULL>
__device__ __forceinline__ void gv2_chunk(float (&acc)[4], const Gv2Buf<ZM, TS, C> &b, const uint4 *xb,
                                          const float *sx, int nv, const ZC<T, 4> &zc_sym) {
  using S = Gv2Shape<ZM, TS, C>;
  using T2 = typename Tr<T, 4>::T2;
  constexpr int TPS = TS ? TS : 1;  // tiles per segment (a half-tile segment covers one tile's half)
#pragma unroll
  for (int g = 0; g < S::NSEG; ++g) {
    const int first = TS ? g * TS : g / 2;
    if (!FULL && first >= nv) break;
    const uint32_t *pr = b.par[g];
    float d[4] = {0.f, 0.f, 0.f, 0.f};  // the segment's MMA sums (one chain: two would cost four registers)
    ZC<T, 4> zc = zc_sym;
    T2 slo, shi, mlo, mhi;
    if (!C::FOLD && ZM == 1) zc = zc_load<T>(t_of2<T>(pr[2]), t_of2<T>(pr[3]));
    if (!C::FOLD && ZM == 2) {
      slo = bcast2(t_of2<T>(pr[0]));
      shi = bcast2(t_of2<T>(pr[1]));
      mlo = bcast2(t_of2<T>(pr[2]));
      mhi = bcast2(t_of2<T>(pr[3]));
    }
#pragma unroll
    for (int tt = 0; tt < TPS; ++tt) {
      const int u = first + tt;
      if (!FULL && TS > 1 && u >= nv) break;
      const uint4 b01 = xb[8 * u], b23 = xb[8 * u + 1];  // (a tile's 32 pair slots are 8 uint4)
      const uint32_t wd[4] = {b.w[u].x, b.w[u].y, b.w[u].z, b.w[u].w};
      const uint32_t bb[4][2] = {{b01.x, b01.y}, {b01.z, b01.w}, {b23.x, b23.y}, {b23.z, b23.w}};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (TS == 0 && h != (g & 1)) continue;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int j = 2 * h + jj;
          uint32_t a[4];
          if (C::FOLD)
            fold_codes<T>(wd, j, a);
          else if (ZM == 2)
            dq_float<T, 4>(wd, j, slo, shi, mlo, mhi, a);
          else
            dq_int<T, 4>(wd, j, zc, a);
          if (!C::FOLD && ZM == 2)
            mma<T>(acc, a, bb[j][0], bb[j][1]);  // (scaled per weight: straight into the stripe's sums)
          else
            mma<T>(d, a, bb[j][0], bb[j][1]);
        }
      }
    }
    if (!C::FOLD && ZM == 2) continue;
    const float dlo = d[0], dhi = d[2];
    const float s_lo = to_f(t_of2<T>(pr[0])), s_hi = to_f(t_of2<T>(pr[1]));
    if (!C::FOLD) {
      acc[0] = fmaf(s_lo, dlo, acc[0]);
      acc[2] = fmaf(s_hi, dhi, acc[2]);
    } else {
      using K = FoldK<T>;
      const float sxg = sx[g];
      const float z_lo = ZM == 0 ? 8.f : ZM == 1 ? to_f(t_of2<T>(pr[2])) : 0.f;
      const float z_hi = ZM == 0 ? 8.f : ZM == 1 ? to_f(t_of2<T>(pr[3])) : 0.f;
      const float c_lo = K::BLO + z_lo, c_hi = K::BHI + K::ZHI * z_hi;  // (exact in fp32)
      acc[0] = fmaf(s_lo, fmaf(-c_lo, sxg, dlo), acc[0]);
      acc[2] = fmaf(s_hi * K::RHI, fmaf(-c_hi, sxg, dhi), acc[2]);
      if (ZM == 2) {  // s q + m: the minima times the segment's activation sum
        acc[0] = fmaf(to_f(t_of2<T>(pr[2])), sxg, acc[0]);
        acc[2] = fmaf(to_f(t_of2<T>(pr[3])), sxg, acc[2]);
      }
    }
  }
}

template <typename T, int ZM, int TS, class C>
__global__ void __launch_bounds__(C::W * 32, (gv2_minb<T, C, ZM, TS>())) gemv2_kernel(const Params p) {
  constexpr int W = C::W, U = C::U, NT = W * 32;
  using Buf = Gv2Buf<ZM, TS, C>;
  extern __shared__ __align__(16) unsigned char smem[];
  float *red = reinterpret_cast<float *>(smem);                       // [2][W][16]
  uint32_t *xs = reinterpret_cast<uint32_t *>(smem + 2 * W * 16 * 4);  // [KT][4 tid][4 slices][2]: B pairs
  const int lane = threadIdx.x & 31, gid = lane >> 2, tid = lane & 3, wi = threadIdx.x >> 5;
  const int G = (int)gridDim.x, NS = p.Np / 16, KT = p.KT;
  float *sxs = reinterpret_cast<float *>(xs + KT * 32);  // FOLD: the activation sum of each segment of K
  const int spp = (KT + W * U - 1) / (W * U);            // steps per stripe
  const int nsteps = (int)blockIdx.x < NS ? (NS - (int)blockIdx.x + G - 1) / G * spp : 0;
#if __CUDA_ARCH__ >= 900
  if (lane == 0 && nsteps > 0 && wi * U < KT)
    prefetch_l2(p.qw + ((int64_t)blockIdx.x * KT + wi * U) * 128, 512u * (unsigned)min(U, KT - wi * U));
#endif
  pdl_start(p);
  // the load cursor: stripe, step within it, steps loaded
  int s_n = (int)blockIdx.x, st_n = 0, i_n = 0;
  auto load = [&](Buf &b) {
    if (i_n < nsteps) {
      const int t0 = st_n * W * U + wi * U, nv = KT - t0;
      const uint32_t woff = (uint32_t)(s_n * KT + t0) * 32u + (uint32_t)lane, poff = (uint32_t)(16 * s_n + gid);
      if (nv >= U)
        gv2_load<ZM, TS, C, true>(p, woff, poff, t0, nv, b);
      else if (nv > 0)
        gv2_load<ZM, TS, C, false>(p, woff, poff, t0, nv, b);
    }
    ++i_n;
    if (++st_n == spp) {
      st_n = 0;
      s_n += G;
    }
  };
  Buf A, B;
  load(A);  // (weights do not depend on the previous kernel's output; requested before the staging below)
  {  // the activations in fragment order: pair (k, k + 1) of tile kb goes to slot ((kb * 4 + tid) * 4 + j) * 2 + hi
    const T *x = (const T *)p.x;
    for (int c = (int)threadIdx.x; c < KT * 32; c += NT) {
      const int k = 2 * c, kb = k >> 6, r = k & 63, j = r >> 4, hi = (r >> 3) & 1, t = (r & 7) >> 1;
      typename Tr<T, 4>::T2 pr;
      pr.x = k < p.K ? x[p.perm ? p.perm[k] : k] : from_f<T>(0.f);
      pr.y = k + 1 < p.K ? x[p.perm ? p.perm[k + 1] : k + 1] : from_f<T>(0.f);
      xs[((kb * 4 + t) * 4 + j) * 2 + hi] = as_u32(pr);
    }
  }
  __syncthreads();
  if (C::FOLD) {  // each segment's activation sum (fp32, fixed order): segment e covers columns [e L, e L + L)
    constexpr int HPS = TS ? 2 * TS : 1;  // 32-wide halves per segment
    const int nseg = TS ? (KT + TS - 1) / TS : 2 * KT;
    for (int e = (int)threadIdx.x; e < nseg; e += NT) {
      float a4[4] = {0.f, 0.f, 0.f, 0.f};
      for (int hh = 0; hh < HPS; ++hh) {
        const int hx = e * HPS + hh, kb = hx >> 1, h = hx & 1;
        if (kb >= KT) break;
#pragma unroll
        for (int t = 0; t < 4; ++t) {  // half h of tile kb: slices 2h, 2h + 1 of each tid: one uint4
          const uint4 v = *reinterpret_cast<const uint4 *>(xs + (kb * 4 + t) * 8 + 4 * h);
          const uint32_t vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const typename Tr<T, 4>::T2 pq = as_t2<typename Tr<T, 4>::T2>(vv[q]);
            a4[q] += to_f(pq.x) + to_f(pq.y);
          }
        }
      }
      sxs[e] = (a4[0] + a4[1]) + (a4[2] + a4[3]);
    }
    __syncthreads();
  }
  const ZC<T, 4> zc_sym = zc_make<T, 4>(8.f, 8.f);
  const uint4 *xs4 = reinterpret_cast<const uint4 *>(xs) + 2 * tid;
  constexpr int SEGS_PER_TILE_X = TS ? 1 : 2;  // sxs index of tile t0: t0 / TS, or 2 t0 for half-tile segments
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int s = (int)blockIdx.x, st = 0, buf = 0;
  auto step = [&](const Buf &b) {
    const int t0 = st * W * U + wi * U, nv = KT - t0;
    const uint4 *xb = xs4 + t0 * 8;
    const float *sx = sxs + (TS ? t0 / (TS ? TS : 1) : SEGS_PER_TILE_X * t0);
    if (nv >= U)
      gv2_chunk<T, ZM, TS, C, true>(acc, b, xb, sx, nv, zc_sym);
    else if (nv > 0)
      gv2_chunk<T, ZM, TS, C, false>(acc, b, xb, sx, nv, zc_sym);
    if (++st == spp) {  // the stripe is done: its 16 sums over the warps, in warp order
      if (tid == 0) {
        red[(buf * W + wi) * 16 + gid] = acc[0];
        red[(buf * W + wi) * 16 + gid + 8] = acc[2];
      }
      __syncthreads();  // (also: every thread has read the other buffer, written two stripes ago)
      const int row = 16 * s + (int)threadIdx.x;
      if (threadIdx.x < 16 && row < p.N) {
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < W; ++ww) v += red[(buf * W + ww) * 16 + threadIdx.x];
        ((T *)p.y)[row] = from_f<T>(p.bias ? v + to_f(((const T *)p.bias)[row]) : v);
      }
      buf ^= 1;
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      st = 0;
      s += G;
    }
  };
  for (int i = 0; i < nsteps; i += 2) {  // two steps per pass: the buffers alternate by name, not by copy
    load(B);
    step(A);
    if (i + 1 >= nsteps) break;
    load(A);
    step(B);
  }
}

// dynamic shared memory of a variant: the stripe sums' two buffers, the staged activations, the segment sums
template <class C, int TS> size_t gv2_smem(int KT) {
  const size_t nseg = TS ? (size_t)(KT + TS - 1) / TS : 2 * (size_t)KT;
  return (size_t)2 * C::W * 16 * 4 + (size_t)KT * 128 + (C::FOLD ? 4 * nseg : 0);
}

template <typename T, int ZM, int TS, class C>
cudaError_t launch_gemv2_t(const Params &p, const Plan &pl, cudaStream_t st) {
  auto fn = gemv2_kernel<T, ZM, TS, C>;
  const size_t smem = gv2_smem<C, TS>(p.KT);
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return e;
  int dev = 0, sms = 0, per_sm = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, C::W * 32, smem)) != cudaSuccess) return e;
  const int64_t grid = std::min<int64_t>(pl.tiles, (int64_t)sms * std::max(1, per_sm));
  debug_occupancy(fn, "gemv2", C::W * 32, smem);
  return launch_ex(fn, dim3((unsigned)grid), C::W * 32, smem, st, 1, p);
}
// the segment length: whole chunks where every group holds whole chunks (or per channel), else pairs of tiles,
// single tiles, or 32-wide halves where groups end inside a tile
template <typename T, int ZM, class C> cudaError_t launch_gemv2_ts(const Params &p, const Plan &pl, cudaStream_t st) {
  if (p.gs <= 0 || p.gs % (64 * C::U) == 0) return launch_gemv2_t<T, ZM, C::U, C>(p, pl, st);
  if (C::U > 2 && p.gs % 128 == 0) return launch_gemv2_t<T, ZM, (C::U > 2 ? 2 : 1), C>(p, pl, st);
  if (p.gs % 64 == 0) return launch_gemv2_t<T, ZM, 1, C>(p, pl, st);
  return launch_gemv2_t<T, ZM, 0, C>(p, pl, st);
}
template <typename T, class C> cudaError_t launch_gemv2_c(const Params &p, const Plan &pl, cudaStream_t st) {
  if ((uint64_t)(p.Np / 16) * (uint64_t)p.KT * 32u >= (1ull << 32) ||
      (uint64_t)((p.Kp + (p.gs > 0 ? p.gs : p.Kp) - 1) / (p.gs > 0 ? p.gs : p.Kp)) * (uint64_t)p.Np >= (1ull << 32))
    return cudaErrorInvalidValue;  // (32-bit offsets: layers of 2^37 weights; none exists)
  if (p.zm == 1) return launch_gemv2_ts<T, 1, C>(p, pl, st);
  if (p.zm == 2) return launch_gemv2_ts<T, 2, C>(p, pl, st);
  return launch_gemv2_ts<T, 0, C>(p, pl, st);
}

}  // namespace

// W4P_CUDA_GEMV_CFG=1..5 (gemv_cfg_env): the variants, measured against the first form (0) on a GPU
template <typename T> cudaError_t launch_gemv2(const Params &p, const Plan &pl, cudaStream_t st, int cfg) {
  switch (cfg) {
    case 1: return launch_gemv2_c<T, Gv2Cfg<8, 4, 3, false>>(p, pl, st);   // exact, first form's block shape
    case 2: return launch_gemv2_c<T, Gv2Cfg<8, 4, 3, true>>(p, pl, st);    // folded, same shape
    case 3: return launch_gemv2_c<T, Gv2Cfg<16, 2, 2, false>>(p, pl, st);  // exact, two blocks of 16 warps per SM
    case 4: return launch_gemv2_c<T, Gv2Cfg<16, 2, 2, true>>(p, pl, st);   // folded, two blocks of 16 warps
    default: return launch_gemv2_c<T, Gv2Cfg<8, 2, 4, true>>(p, pl, st);   // folded, four blocks of 8 warps
  }
}

template cudaError_t launch_gemv2<half>(const Params &p, const Plan &pl, cudaStream_t st, int cfg);
template cudaError_t launch_gemv2<__nv_bfloat16>(const Params &p, const Plan &pl, cudaStream_t st, int cfg);

}  // namespace w4p
