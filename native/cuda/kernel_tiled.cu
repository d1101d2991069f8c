// Tiled kernel: 128 rows x 128 tokens per block, 8 warps as 4 (rows, 32 each) x 2 (tokens, 64 each).
#include "epilogue.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

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

template <typename T, int SB>
cudaError_t launch_tiled_t(const Params &p, const Plan &pl, cudaStream_t st) {
  auto fn = tiled_kernel<T, SB>;
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pl.smem);
  if (e != cudaSuccess) return e;
  const int64_t blocks = (int64_t)pl.tiles * pl.S;
  fn<<<(unsigned)blocks, 256, pl.smem, st>>>(p);
  return cudaGetLastError();
}

}  // namespace

template <typename T> cudaError_t launch_tiled(const Params &p, const Plan &pl, int sbits, cudaStream_t st) {
  return sbits == 4 ? launch_tiled_t<T, 4>(p, pl, st) : launch_tiled_t<T, 8>(p, pl, st);
}

template cudaError_t launch_tiled<half>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
template cudaError_t launch_tiled<__nv_bfloat16>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);

}  // namespace w4p
