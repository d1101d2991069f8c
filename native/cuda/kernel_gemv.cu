// gemv kernel (M = 1 to 8, 4-bit, group sizes that are multiples of 32 or per channel; sm_80 and newer). Blocks of
// GV_W warps own whole 16-row stripes (block b: stripes b, b + grid, ...), so each stripe is summed inside its
// block in warp order: no workspace, no counters, deterministic. A stripe is walked in steps of GV_W * GV_U
// tiles, warp w taking GV_U consecutive tiles (a "chunk") of each step, and every warp loads the next step's
// weights and group parameters into registers (plain 16-byte loads) before it computes this one. The
// activations are staged once per block in shared memory in B-fragment order (gathered by act-order's
// permutation, zeros past K), so a lane's B fragments of a tile are two 16-byte shared-memory loads.
// Why this shape (docs/journal/2026-cuda.md): at M = 1 the order in which the GPU as a whole requests the
// weights sets the read rate (whole stripes per block read faster than the bulk kernel's copy engine or one
// contiguous range per warp: section 4), and a warp's instructions per tile delay its next request (ncu: warps wait
// mostly for the next step's weights, with about half the issue slots used: section 20). So it issues few of them:
//   * the group parameters once per group segment (GV_U tiles of one group; single tiles, or half tiles where
//     groups end inside a tile), not once per tile, and the scale applied to the segment's MMA sums in fp32 once;
//     their two rows' loads allocate in L1, so the second finds the sector the first asked for (GV_PAR);
//   * 32-bit offsets with immediate per-tile displacements instead of 64-bit address arithmetic per tile;
//   * the double buffer as two named register sets (the loop body runs two steps), so no register copies (three
//     with GV_STAGES = 3: loads two steps ahead);
//   * a step-level test for the last partial chunk of a stripe instead of one branch per tile;
//   * the first step's weights requested before the activations are staged (after the dependent-launch wait).
// 16 warps x 2 tiles, two blocks per SM: it beat the earlier 8-warp x 4-tile kernel (parameters per tile, three
// blocks per SM) on every measured shape, H100 and H200 (section 9). Whole stripes leave SMs idle where the
// stripes are fewer than the SMs, and a partial last round of blocks: "auto" weighs both (gemv_auto).
// tests/test_gemv_emulator.py emulates it lane by lane (index, offset and segment arithmetic) without a GPU.
#include "epilogue.cuh"
#include <type_traits>
#include "launch.cuh"

namespace w4p {
namespace {

// launch bound per layer kind: one block fewer per SM where a chunk has more than one segment per tile (groups of
// 64 columns or fewer: more parameters in registers), where the float minima are applied per weight and for bf16
// with integer zero points; without it ptxas spills those (tools/cuda_sass_loop.py shows registers and stack per
// kernel)
template <typename T, int ZM, int TS> W4P_HD constexpr int gv_minb() {
  constexpr bool heavy = TS <= 1 || ZM == 2 || (ZM == 1 && sizeof(T) == 2 && !std::is_same<T, half>::value);
  return heavy && GV_B > 1 ? GV_B - 1 : GV_B;
}

// register buffers of the layer kind: GV_STAGES, but two where a third does not fit the launch bound's registers
// (fp16 with integer zero points at two blocks per SM spills with three)
template <typename T, int ZM, int TS> W4P_HD constexpr int gv_stages() {
  return GV_STAGES == 3 && ZM == 1 && gv_minb<T, ZM, TS>() == GV_B ? 2 : GV_STAGES;
}

template <int ZM, int TS> struct GvShape {
  static constexpr int NSEG = TS ? GV_U / TS : 2 * GV_U;  // group segments per chunk
  static constexpr int NV = ZM == 0 ? 2 : 4;              // raw 16-bit parameters per segment (rows gid, gid + 8)
};
// one step's registers: the chunk's weights (one 16-byte load per lane and tile) and its segments' parameters
template <int ZM, int TS> struct GvBuf {
  uint4 w[GV_U];
  uint32_t par[GvShape<ZM, TS>::NSEG][GvShape<ZM, TS>::NV];
};

__device__ __forceinline__ uint32_t ld_u16g(const unsigned short *p) {
  unsigned short v;
  if constexpr (GV_PAR == 2)
    asm volatile("ld.global.nc.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}
template <typename T> __device__ __forceinline__ T t_of(uint32_t raw) {
  const unsigned short b = (unsigned short)raw;
  return *reinterpret_cast<const T *>(&b);
}

// Segment g of a chunk from tile t0: its first tile in the chunk, and the offset of its group parameters (row
// poff) in the [groups][Np] tensors
template <int TS> __device__ __forceinline__ int gv_seg_first(int g) { return TS ? g * TS : g / 2; }
template <int TS>
__device__ __forceinline__ uint32_t gv_seg_off(const Params &p, int t0, int g, uint32_t poff) {
  const int col = TS ? 64 * (t0 + gv_seg_first<TS>(g)) : 64 * t0 + 32 * g;
  return (uint32_t)group_of(col, p.gmul) * (uint32_t)p.Np + poff;
}

// The loads of one chunk (stripe s, tiles t0 .. t0 + GV_U - 1, of which nv < GV_U are inside K unless FULL).
// woff: the 32-bit index of the lane's 16 bytes of tile t0 in uint4 units.
template <int ZM, int TS, bool FULL>
__device__ __forceinline__ void gv_load(const Params &p, uint32_t woff, uint32_t poff, int t0, int nv,
                                        GvBuf<ZM, TS> &b) {
  using S = GvShape<ZM, TS>;
  const uint4 *wp = reinterpret_cast<const uint4 *>(p.qw) + woff;
#pragma unroll
  for (int u = 0; u < GV_U; ++u) b.w[u] = FULL || u < nv ? ld_stream(wp + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
  const unsigned short *sc = (const unsigned short *)p.scales;
  const unsigned short *zp = (const unsigned short *)(ZM == 1 ? p.zeros : p.mins);
#pragma unroll
  for (int g = 0; g < (GV_PROBE >= 2 ? 0 : S::NSEG); ++g) {
    const bool ok = FULL || gv_seg_first<TS>(g) < nv;
    const uint32_t off = gv_seg_off<TS>(p, t0, g, poff);
    b.par[g][0] = ok ? ld_u16g(sc + off) : 0u;  // (GV_PAR 1: poff holds the lane's row, gid or gid + 8)
    if (GV_PAR != 1) b.par[g][1] = ok ? ld_u16g(sc + off + 8) : 0u;
    if (ZM != 0) {
      b.par[g][2] = ok ? ld_u16g(zp + off) : 0u;
      if (GV_PAR != 1) b.par[g][3] = ok ? ld_u16g(zp + off + 8) : 0u;
    }
  }
}

// The ring (GV_RING > 0): thread t's step slot j holds its GV_U weight pieces at w[(j * GV_U + u) * NT + t] and
// its parameter words at par[((j * NSEG + g) * NV + v) * NT + t] (consecutive threads, consecutive words: no bank
// conflicts). A 16-bit parameter is copied as the aligned 32-bit word that holds it; which half it is does not
// change along a stripe (the offsets differ by multiples of the even Np), so each lane keeps one shift per tensor.
template <int ZM, int TS> struct GvRing {
  using S = GvShape<ZM, TS>;
  uint4 *w;
  uint32_t *par;
  static constexpr int NT = GV_W * 32;
  __device__ __forceinline__ uint4 *wp(int j, int u) const { return w + (j * GV_U + u) * NT + threadIdx.x; }
  __device__ __forceinline__ uint32_t *pp(int j, int g, int v) const {
    return par + ((j * S::NSEG + g) * S::NV + v) * NT + threadIdx.x;
  }
};
__device__ __forceinline__ const void *word_of(const unsigned short *p) {
  return reinterpret_cast<const void *>(reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)3);
}
__device__ __forceinline__ uint32_t half_shift(const void *base, int gid) {
  return (((uint32_t)(reinterpret_cast<uintptr_t>(base) >> 1) + (uint32_t)gid) & 1u) ? 16u : 0u;
}
// gv_load's copies into ring slot j: the chunk's tiles inside K and the parameters of its segments inside K (the
// rest is never read: gv_chunk stops at nv)
template <int ZM, int TS>
__device__ __forceinline__ void gv_ring_load(const Params &p, const GvRing<ZM, TS> &r, int j, uint32_t woff,
                                             uint32_t poff, int t0, int nv) {
  using S = GvShape<ZM, TS>;
  const uint4 *wp = reinterpret_cast<const uint4 *>(p.qw) + woff;
#pragma unroll
  for (int u = 0; u < GV_U; ++u)
    if (u < nv) cp_async16(r.wp(j, u), wp + 32 * u, true);
  const unsigned short *sc = (const unsigned short *)p.scales;
  const unsigned short *zp = (const unsigned short *)(ZM == 1 ? p.zeros : p.mins);
#pragma unroll
  for (int g = 0; g < S::NSEG; ++g) {
    if (gv_seg_first<TS>(g) >= nv) break;
    const uint32_t off = gv_seg_off<TS>(p, t0, g, poff);
    cp_async4(r.pp(j, g, 0), word_of(sc + off));
    cp_async4(r.pp(j, g, 1), word_of(sc + off + 8));
    if (ZM != 0) {
      cp_async4(r.pp(j, g, 2), word_of(zp + off));
      cp_async4(r.pp(j, g, 3), word_of(zp + off + 8));
    }
  }
}
// ring slot j into the registers gv_chunk takes (the 16-bit values in the low halves)
template <int ZM, int TS>
__device__ __forceinline__ void gv_ring_get(const GvRing<ZM, TS> &r, int j, uint32_t sh_s, uint32_t sh_z,
                                            GvBuf<ZM, TS> &b) {
  using S = GvShape<ZM, TS>;
#pragma unroll
  for (int u = 0; u < GV_U; ++u) b.w[u] = *r.wp(j, u);
#pragma unroll
  for (int g = 0; g < S::NSEG; ++g) {
    b.par[g][0] = *r.pp(j, g, 0) >> sh_s;
    b.par[g][1] = *r.pp(j, g, 1) >> sh_s;
    if (ZM != 0) {
      b.par[g][2] = *r.pp(j, g, 2) >> sh_z;
      b.par[g][3] = *r.pp(j, g, 3) >> sh_z;
    }
  }
}

// One chunk: acc[0] / acc[2] (rows gid / gid + 8; with MT > 1 acc[1] / acc[3] too: the MMA's tokens 2 tid and
// 2 tid + 1) += its products with the activations. xb: the lane's B pairs of tile t0 (two uint4 per tile).
template <typename T, int ZM, int TS, int MT, bool FULL>
__device__ __forceinline__ void gv_chunk(float (&acc)[4], const GvBuf<ZM, TS> &b, const uint4 *xb, int nv,
                                         const ZC<T, 4> &zc_sym) {
  using S = GvShape<ZM, TS>;
  using T2 = typename Tr<T, 4>::T2;
  constexpr int TPS = TS ? TS : 1;  // tiles per segment (a half-tile segment covers one tile's half)
  if constexpr (GV_PROBE > 0) {  // (the weights and parameters consumed, so each step still waits for its loads)
    uint32_t v = 0u;
#pragma unroll
    for (int u = 0; u < GV_U; ++u)
      if (FULL || u < nv) v ^= b.w[u].x ^ b.w[u].y ^ b.w[u].z ^ b.w[u].w;
#pragma unroll
    for (int g = 0; g < S::NSEG; ++g)
      if (GV_PROBE < 2) v ^= b.par[g][0] ^ (b.par[g][1] << 16);
    acc[0] += __uint_as_float(v & 0x007fffffu);
    return;
  }
#pragma unroll
  for (int g = 0; g < S::NSEG; ++g) {
    const int first = gv_seg_first<TS>(g);
    if (!FULL && first >= nv) break;
    const uint32_t *pr = b.par[g];
    uint32_t xch[4];
    if constexpr (GV_PAR == 1) {  // (the lane loaded one row's values, its odd or even neighbour the other's)
      const bool odd = threadIdx.x & 1u;
#pragma unroll
      for (int v = 0; v < S::NV / 2; ++v) {
        const uint32_t mine = b.par[g][2 * v], theirs = __shfl_xor_sync(0xffffffffu, mine, 1);
        xch[2 * v] = odd ? theirs : mine;
        xch[2 * v + 1] = odd ? mine : theirs;
      }
      pr = xch;
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};  // the segment's MMA sums (one chain: two would cost four registers)
    ZC<T, 4> zc = zc_sym;
    T2 slo, shi, mlo, mhi;
    if (ZM == 1) zc = zc_load<T>(t_of<T>(pr[2]), t_of<T>(pr[3]));
    if (ZM == 2) {
      slo = bcast2(t_of<T>(pr[0]));
      shi = bcast2(t_of<T>(pr[1]));
      mlo = bcast2(t_of<T>(pr[2]));
      mhi = bcast2(t_of<T>(pr[3]));
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
          if (ZM == 2)
            dq_float<T, 4>(wd, j, slo, shi, mlo, mhi, a);
          else
            dq_int<T, 4>(wd, j, zc, a);
          if (ZM == 2)
            mma<T>(acc, a, bb[j][0], bb[j][1]);  // (scaled per weight: straight into the stripe's sums)
          else
            mma<T>(d, a, bb[j][0], bb[j][1]);
        }
      }
    }
    if (ZM == 2) continue;
    const float dlo = d[0], dhi = d[2];
    const float s_lo = to_f(t_of<T>(pr[0])), s_hi = to_f(t_of<T>(pr[1]));
    acc[0] = fmaf(s_lo, dlo, acc[0]);
    acc[2] = fmaf(s_hi, dhi, acc[2]);
    if (MT > 1) {
      acc[1] = fmaf(s_lo, d[1], acc[1]);
      acc[3] = fmaf(s_hi, d[3], acc[3]);
    }
  }
}

// PRO, what is applied to the activation row while it is staged (p.pro; a decode layer's neighbours of the GEMM,
// so they cost no kernel of their own): W4P_ROW_RMSNORM as transformers' RMSNorm (p.nw, p.neps): in fp32 by the
// row's root mean square, rounded to T, times the norm weight, rounded to T; every block reduces the whole row (it
// stages the whole row anyway). W4P_ROW_SWIGLU: x holds [gate (K) | up (K)], staged as silu(gate) rounded to T,
// times up, rounded to T (transformers' act_fn(gate_proj(x)) * up_proj(x) in eager arithmetic).
//
// MT: the tokens a call may have, 1 or GV_MAX_M. With MT > 1 the p.M <= MT activation rows are staged one after
// the other and lane (gid, tid) reads row min(gid, M - 1)'s B pairs: the MMA's column gid is token gid, so the
// weights' loads and dequantization serve every token at once. No row prologues there (one-row decode only).
template <typename T, int ZM, int TS, int PRO, int MT>
__global__ void __launch_bounds__(GV_W * 32, (GV_PROBE >= 4 ? 3 : gv_minb<T, ZM, TS>()))
    gemv_kernel(const Params p) {
  static_assert(MT == 1 || (MT == GV_MAX_M && PRO == W4P_ROW_PLAIN), "several tokens: plain rows only");
  constexpr int W = GV_W, U = GV_U, NT = W * 32;
  using Buf = GvBuf<ZM, TS>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int M = MT == 1 ? 1 : (int)p.M;
  float *red = reinterpret_cast<float *>(smem);                    // [2][W][16][M]
  uint32_t *xs = reinterpret_cast<uint32_t *>(smem + GV_RED * M);  // [M][KT][4 tid][4 slices][2] (+ pad): B pairs
  const int lane = threadIdx.x & 31, gid = lane >> 2, tid = lane & 3, wi = threadIdx.x >> 5;
  const int G = (int)gridDim.x, NS = p.Np / 16, KT = p.KT;
  const int spp = (KT + W * U - 1) / (W * U);  // steps per stripe
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
      const uint32_t woff = (uint32_t)(s_n * KT + t0) * 32u + (uint32_t)lane;
      const uint32_t poff = (uint32_t)(16 * s_n + gid) + (GV_PAR == 1 ? 8u * (uint32_t)(lane & 1) : 0u);
      if (nv >= U)
        gv_load<ZM, TS, true>(p, woff, poff, t0, nv, b);
      else if (nv > 0)
        gv_load<ZM, TS, false>(p, woff, poff, t0, nv, b);
    }
    ++i_n;
    if (++st_n == spp) {
      st_n = 0;
      s_n += G;
    }
  };
  // the ring's copies of the next step into slot j (GV_RING > 0), one commit group per step, empty past the end
  GvRing<ZM, TS> ring{reinterpret_cast<uint4 *>(smem + gv_smem(KT, M)),
                      reinterpret_cast<uint32_t *>(smem + gv_smem(KT, M) + (size_t)GV_RING * GV_U * NT * 16)};
  auto rload = [&](int j) {
    if (i_n < nsteps) {
      const int t0 = st_n * W * U + wi * U, nv = KT - t0;
      if (nv > 0)
        gv_ring_load<ZM, TS>(p, ring, j, (uint32_t)(s_n * KT + t0) * 32u + (uint32_t)lane,
                             (uint32_t)(16 * s_n + gid), t0, nv);
    }
    cp_async_commit();
    ++i_n;
    if (++st_n == spp) {
      st_n = 0;
      s_n += G;
    }
  };
  Buf A, B, C;
  constexpr int STAGES = gv_stages<T, ZM, TS>();
  if (GV_RING > 0) {  // (weights do not depend on the previous kernel's output; requested before the staging below)
#pragma unroll
    for (int j = 0; j < GV_RING - 1; ++j) rload(j);
  } else {
    load(A);
    if (STAGES == 3) load(B);
  }
  {  // the activations in fragment order: pair (k, k + 1) of tile kb goes to slot ((kb * 4 + tid) * 4 + j) * 2 + hi
    const T *x = (const T *)p.x;
    float rms = 1.f;
    if (PRO == W4P_ROW_RMSNORM) {  // 1 / the row's root mean square, the same in every thread (warp sums added in warp order)
      float ss = 0.f;
      for (int k = (int)threadIdx.x; k < p.K; k += NT) {
        const float v = to_f(x[k]);
        ss = fmaf(v, v, ss);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) red[wi] = ss;  // (red's first stripe sums are written after the staging barrier below)
      __syncthreads();
      float tot = 0.f;
#pragma unroll
      for (int ww = 0; ww < W; ++ww) tot += red[ww];
      rms = rsqrtf(tot / (float)p.K + p.neps);
    }
    auto act = [&](int k) -> T {
      if (k >= p.K) return from_f<T>(0.f);
      const int kk = p.perm ? p.perm[k] : k;
      if (PRO == W4P_ROW_RMSNORM) {
        const T h = from_f<T>(to_f(x[kk]) * rms);
        return from_f<T>(to_f(((const T *)p.nw)[kk]) * to_f(h));
      }
      if (PRO == W4P_ROW_SWIGLU) {
        const float g = to_f(x[kk]);
        const T a = from_f<T>(g / (1.f + expf(-g)));
        return from_f<T>(to_f(a) * to_f(x[p.K + kk]));
      }
      return x[kk];
    };
    const bool vec = !p.perm && p.K % 8 == 0 && ((uintptr_t)x & 15) == 0 &&
                     (PRO != W4P_ROW_RMSNORM || ((uintptr_t)p.nw & 15) == 0);
    if (MT == 1 && vec) {
      // 8 activations a load (pairs t = 0..3 of one slice half, slots 8 apart), each made as act() makes it. The
      // staging runs while only the first step's weights are in flight, so its trips (in proportion to K) delay
      // the main loop: this loop takes a quarter of the pair loop's
      auto act8 = [&](const T *v, const T *u, int i) -> T {  // element i of x (v) and of the up half or norm weight
        if (PRO == W4P_ROW_RMSNORM) return from_f<T>(to_f(u[i]) * to_f(from_f<T>(to_f(v[i]) * rms)));
        if (PRO == W4P_ROW_SWIGLU) {
          const float g = to_f(v[i]);
          return from_f<T>(to_f(from_f<T>(g / (1.f + expf(-g)))) * to_f(u[i]));
        }
        return v[i];
      };
#pragma unroll 4
      for (int c = (int)threadIdx.x; c < KT * 8; c += NT) {
        const int k = 8 * c, kb = k >> 6, r = k & 63, j = r >> 4, hi = (r >> 3) & 1;
        uint4 o = make_uint4(0u, 0u, 0u, 0u);
        if (k < p.K) {
          const uint4 v = *reinterpret_cast<const uint4 *>(x + k);
          if (PRO == W4P_ROW_PLAIN) {
            o = v;
          } else {
            const uint4 u = PRO == W4P_ROW_SWIGLU ? *reinterpret_cast<const uint4 *>(x + p.K + k)
                                                  : *reinterpret_cast<const uint4 *>((const T *)p.nw + k);
            const T *vt = reinterpret_cast<const T *>(&v), *ut = reinterpret_cast<const T *>(&u);
            uint32_t w4[4];
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              typename Tr<T, 4>::T2 pr;
              pr.x = act8(vt, ut, 2 * t);
              pr.y = act8(vt, ut, 2 * t + 1);
              w4[t] = as_u32(pr);
            }
            o = make_uint4(w4[0], w4[1], w4[2], w4[3]);
          }
        }
        uint32_t *d = xs + (kb * 16 + j) * 2 + hi;
        d[0] = o.x;
        d[8] = o.y;
        d[16] = o.z;
        d[24] = o.w;
      }
    } else if (MT == 1) {
      for (int c = (int)threadIdx.x; c < KT * 32; c += NT) {
        const int k = 2 * c, kb = k >> 6, r = k & 63, j = r >> 4, hi = (r >> 3) & 1, t = (r & 7) >> 1;
        typename Tr<T, 4>::T2 pr;
        pr.x = act(k);
        pr.y = act(k + 1);
        xs[((kb * 4 + t) * 4 + j) * 2 + hi] = as_u32(pr);
      }
    } else if (!p.perm && p.K % 8 == 0 && p.ldx % 8 == 0 && ((uintptr_t)x & 15) == 0) {
      // (the rows one after the other, 16 bytes a load: 8 activations are the pairs t = 0..3 of one slice half,
      // slots 8 apart; zeros past K. One loop over all rows: a row of K = 4096 is one load per thread, and the
      // loads of one loop unroll together)
      for (int c = (int)threadIdx.x; c < M * KT * 8; c += NT) {
        const int m = c / (KT * 8), k = 8 * (c - m * KT * 8), kb = k >> 6, r = k & 63, j = r >> 4, hi = (r >> 3) & 1;
        const uint4 v =
            k < p.K ? *reinterpret_cast<const uint4 *>(x + (int64_t)m * p.ldx + k) : make_uint4(0u, 0u, 0u, 0u);
        uint32_t *d = xs + m * gv_pitch(KT) + (kb * 16 + j) * 2 + hi;
        d[0] = v.x;
        d[8] = v.y;
        d[16] = v.z;
        d[24] = v.w;
      }
    } else {  // (the rows one after the other, the same order within each, element by element)
      for (int m = 0; m < M; ++m) {
        const T *xm = x + (int64_t)m * p.ldx;
        uint32_t *xsm = xs + m * gv_pitch(KT);
        auto at = [&](int k) -> T { return k < p.K ? xm[p.perm ? p.perm[k] : k] : from_f<T>(0.f); };
        for (int c = (int)threadIdx.x; c < KT * 32; c += NT) {
          const int k = 2 * c, kb = k >> 6, r = k & 63, j = r >> 4, hi = (r >> 3) & 1, t = (r & 7) >> 1;
          typename Tr<T, 4>::T2 pr;
          pr.x = at(k);
          pr.y = at(k + 1);
          xsm[((kb * 4 + t) * 4 + j) * 2 + hi] = as_u32(pr);
        }
      }
    }
  }
  __syncthreads();
  const ZC<T, 4> zc_sym = zc_make<T, 4>(8.f, 8.f);
  // (the lane's token row: gv_pitch(KT) slots = KT * 8 + 1 uint4 a row)
  const uint4 *xs4 = reinterpret_cast<const uint4 *>(xs) + 2 * tid + (MT == 1 ? 0 : min(gid, M - 1) * (KT * 8 + 1));
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int s = (int)blockIdx.x, st = 0, buf = 0;
  auto step = [&](const Buf &b) {
    const int t0 = st * W * U + wi * U, nv = KT - t0;
    const uint4 *xb = xs4 + t0 * 8;
    if (nv >= U)
      gv_chunk<T, ZM, TS, MT, true>(acc, b, xb, nv, zc_sym);
    else if (nv > 0)
      gv_chunk<T, ZM, TS, MT, false>(acc, b, xb, nv, zc_sym);
    if (++st == spp) {  // the stripe is done: its 16 sums (per token) over the warps, in warp order
      if constexpr (GV_PROBE >= 3) {  // (the probe: warp 0's sums, no barrier)
        if (wi == 0 && tid == 0 && 16 * s + gid < p.N) ((T *)p.y)[16 * s + gid] = from_f<T>(acc[0]);
      } else {
        if (MT == 1) {
          if (tid == 0) {
            red[(buf * W + wi) * 16 + gid] = acc[0];
            red[(buf * W + wi) * 16 + gid + 8] = acc[2];
          }
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (2 * tid + h < M) {
              red[((buf * W + wi) * 16 + gid) * M + 2 * tid + h] = acc[h];
              red[((buf * W + wi) * 16 + gid + 8) * M + 2 * tid + h] = acc[2 + h];
            }
        }
        __syncthreads();  // (also: every thread has read the other buffer, written two stripes ago)
        const int r = MT == 1 ? (int)threadIdx.x : (int)threadIdx.x / M, tok = (int)threadIdx.x - r * M;
        const int row = 16 * s + r;
        if ((MT == 1 ? threadIdx.x < 16 : r < 16) && row < p.N) {
          float v = 0.f;
#pragma unroll
          for (int ww = 0; ww < W; ++ww) v += red[((buf * W + ww) * 16 + r) * M + tok];
          float o = v;
          if (p.bias) {  // a layer's bias into the one rounding; a residual after it (p.radd, M = 1)
            const float b = to_f(((const T *)p.bias)[row]);
            o = p.radd ? to_f(from_f<T>(v)) + b : v + b;
          }
          ((T *)p.y)[(int64_t)tok * p.ldy + row] = from_f<T>(o);
        }
        buf ^= 1;
      }
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      st = 0;
      s += G;
    }
  };
  if (GV_RING > 0) {
    const uint32_t sh_s = half_shift(p.scales, gid), sh_z = half_shift(ZM == 1 ? p.zeros : p.mins, gid);
    int j = 0;  // the slot of step i; step i + GV_RING - 1 refills the slot step i - 1 was read from
    for (int i = 0; i < nsteps; ++i) {
      cp_async_wait_mem<GV_RING - 2>();  // (this thread's copies of step i have landed)
      gv_ring_get<ZM, TS>(ring, j, sh_s, sh_z, A);
      rload(j == 0 ? GV_RING - 1 : j - 1);
      step(A);
      j = j == GV_RING - 1 ? 0 : j + 1;
    }
  } else if (STAGES == 2) {
    for (int i = 0; i < nsteps; i += 2) {  // two steps per pass: the buffers alternate by name, not by copy
      load(B);
      step(A);
      if (i + 1 >= nsteps) break;
      load(A);
      step(B);
    }
  } else {
    for (int i = 0; i < nsteps; i += 3) {  // three per pass: step i computes while i + 1 and i + 2 load
      load(C);
      step(A);
      if (i + 1 >= nsteps) break;
      load(A);
      step(B);
      if (i + 2 >= nsteps) break;
      load(B);
      step(C);
    }
  }
}

template <typename T, int ZM, int TS> cudaError_t launch_gemv_t(const Params &p, const Plan &pl, cudaStream_t st) {
  if (p.M > 1 && (p.M > GV_MAX_M || p.pro != W4P_ROW_PLAIN || p.radd)) return cudaErrorInvalidValue;
  auto fn = p.M > 1                   ? gemv_kernel<T, ZM, TS, W4P_ROW_PLAIN, GV_MAX_M>
            : p.pro == W4P_ROW_RMSNORM ? gemv_kernel<T, ZM, TS, W4P_ROW_RMSNORM, 1>
            : p.pro == W4P_ROW_SWIGLU  ? gemv_kernel<T, ZM, TS, W4P_ROW_SWIGLU, 1>
                                       : gemv_kernel<T, ZM, TS, W4P_ROW_PLAIN, 1>;
  const size_t smem = gv_smem(p.KT, (int)p.M, gv_ring(ZM, TS));
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return e;
  int dev = 0, sms = 0, per_sm = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, GV_W * 32, smem)) != cudaSuccess) return e;
  if (GV_PROBE > 0 && GV_PROBE < 4) per_sm = std::min(per_sm, gv_minb<T, ZM, TS>());  // (the kernel's bound)
  const int64_t grid = std::min<int64_t>(pl.tiles, (int64_t)sms * std::max(1, per_sm));
  debug_occupancy(fn, "gemv", GV_W * 32, smem);
  return launch_ex(fn, dim3((unsigned)grid), GV_W * 32, smem, st, 1, p);
}
// the segment length: whole chunks where every group holds whole chunks (or per channel), else single tiles, or
// 32-wide halves where groups end inside a tile
template <typename T, int ZM> cudaError_t launch_gemv_ts(const Params &p, const Plan &pl, cudaStream_t st) {
  static_assert(GV_U == 2, "segments of whole chunks, single tiles or halves: a longer chunk needs more lengths");
  if (p.gs <= 0 || p.gs % (64 * GV_U) == 0) return launch_gemv_t<T, ZM, GV_U>(p, pl, st);
  if (p.gs % 64 == 0) return launch_gemv_t<T, ZM, 1>(p, pl, st);
  return launch_gemv_t<T, ZM, 0>(p, pl, st);
}

}  // namespace

template <typename T> cudaError_t launch_gemv(const Params &p, const Plan &pl, cudaStream_t st) {
  if ((uint64_t)(p.Np / 16) * (uint64_t)p.KT * 32u >= (1ull << 32) ||
      (uint64_t)((p.Kp + (p.gs > 0 ? p.gs : p.Kp) - 1) / (p.gs > 0 ? p.gs : p.Kp)) * (uint64_t)p.Np >= (1ull << 32))
    return cudaErrorInvalidValue;  // (32-bit offsets: layers of 2^37 weights; none exists)
  if (p.zm == 1) return launch_gemv_ts<T, 1>(p, pl, st);
  if (p.zm == 2) return launch_gemv_ts<T, 2>(p, pl, st);
  return launch_gemv_ts<T, 0>(p, pl, st);
}

template cudaError_t launch_gemv<half>(const Params &p, const Plan &pl, cudaStream_t st);
template cudaError_t launch_gemv<__nv_bfloat16>(const Params &p, const Plan &pl, cudaStream_t st);

}  // namespace w4p
