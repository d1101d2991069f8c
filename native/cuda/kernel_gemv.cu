// gemv kernel (M = 1, 4-bit, group sizes that are multiples of 32 or per channel; sm_80 and newer). Blocks of
// GV_W warps own whole 16-row stripes (block b: stripes b, b + grid, ...), so each stripe is summed inside its
// block in warp order: no workspace, no counters, deterministic. A stripe is walked in steps of GV_W * GV_U
// tiles, warp w taking GV_U consecutive tiles of each step, and every warp loads the next step's weights and
// group parameters into registers (plain 16-byte loads) before it computes this one. Measured on an H200
// (docs/journal/2026-cuda.md): the order in which the GPU as a whole requests the weights sets the read rate at this size:
// whole stripes per block read a 117 MB layer in 29.9 us against 37.4 for the bulk kernel's copy engine and 39.7
// for one contiguous range per warp (the stream-K order of the ring and bulk kernels). And the arithmetic per
// tile must stay small: with the activations as 8 L1 loads per tile the kernel issued 137 instructions a tile
// and ran at 57 us; here a lane's B fragments of a tile are two 16-byte shared-memory loads of the activations,
// staged once per block in fragment order (gathered by act-order's permutation, zeros past K). Whole stripes
// leave a partial last round of blocks where the stripes are few for the grid: "auto" takes the kernel only
// where they fill the rounds (gemv_auto).
#include "epilogue.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

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
cudaError_t launch_gemv_zm(const Params &p, const Plan &pl, cudaStream_t st) {
  const bool g64 = p.gs <= 0 || p.gs % 64 == 0;
  if (p.zm == 1) return g64 ? launch_gemv_t<T, 1, true>(p, pl, st) : launch_gemv_t<T, 1, false>(p, pl, st);
  if (p.zm == 2) return g64 ? launch_gemv_t<T, 2, true>(p, pl, st) : launch_gemv_t<T, 2, false>(p, pl, st);
  return g64 ? launch_gemv_t<T, 0, true>(p, pl, st) : launch_gemv_t<T, 0, false>(p, pl, st);
}

}  // namespace

// The second form (kernel_gemv2.cu) runs unless W4P_CUDA_GEMV_CFG=0 asks for this one (A/B runs)
template <typename T> cudaError_t launch_gemv(const Params &p, const Plan &pl, cudaStream_t st) {
  if (const int cfg = gemv_cfg_env()) return launch_gemv2<T>(p, pl, st, cfg);
  return launch_gemv_zm<T>(p, pl, st);
}

template cudaError_t launch_gemv<half>(const Params &p, const Plan &pl, cudaStream_t st);
template cudaError_t launch_gemv<__nv_bfloat16>(const Params &p, const Plan &pl, cudaStream_t st);

}  // namespace w4p
