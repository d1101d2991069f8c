// Stream kernel: 4 warps, each owning MI consecutive 16-row stripes and streaming them along the block's
// K range. Weights: bursts of U tiles per warp, double-buffered in registers (the next U are in flight
// while these are computed). Activations and group parameters: K-chunks of KC tiles, double-buffered in
// shared memory with cp.async (chunk c+1 lands while chunk c is computed). Zero modes none/int: the MMA
// takes exact (q - z) values and the fp32 accumulator gets the group's scale once per group; float
// minima: the weights are dequantized (s * q + m) in the activation dtype.
#include "epilogue.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

template <int MI, int SB> struct StreamCfg {
  static constexpr int V = SB / 4;                                 // uint4 per lane per tile
  static constexpr int U = (8 / (MI * V)) > 0 ? 8 / (MI * V) : 1;  // tiles in flight per warp (16 measured slower)
  static constexpr int RB = SW * MI * 16;                          // rows per block
};

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

}  // namespace

template <typename T> cudaError_t launch_stream(const Params &p, const Plan &pl, int sbits, cudaStream_t st) {
  if (sbits == 4) return launch_stream_m<T, 4, 0>(p, pl, st);
  return launch_stream_m<T, 8, 0>(p, pl, st);
}
cudaError_t launch_stream_probe(const Params &p, const Plan &pl, int mode, cudaStream_t st) {
  if (mode == 1) return launch_stream_m<half, 4, 1>(p, pl, st);
  return launch_stream_m<half, 4, 2>(p, pl, st);
}

template cudaError_t launch_stream<half>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
template cudaError_t launch_stream<__nv_bfloat16>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);

}  // namespace w4p
