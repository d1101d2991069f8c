// Ring kernel (M <= 8, the decode regime): every warp is an independent worker with its own contiguous
// range of work units; a unit is one 64-wide K tile of four consecutive 16-row stripes (2 KiB of 4-bit
// weights), units in quad-major order, so a worker's range runs along K and may cross into the next quad
// (stream-K). The grid is sized to the resident warps, so each worker pays its prologue once. Per warp
// a shared-memory ring of RD slots, refilled with cp.async one slot per computed slot (a unit's weights,
// its group parameters and its activation columns, shared by the four stripes), keeps RD - 1 units in
// flight with no block barriers: only the warp's own lanes write and read its ring. A quad shared by
// several workers is reduced deterministically: each stores its fp32 piece, the last to arrive
// (per-quad counter) sums the pieces in worker order and writes y.
#include "epilogue.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

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
        const int nv = M * RQ * 16;
        float *piece = sk_piece(p, gw, q == first_quad ? 0 : 1, nv);
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
        const SkQuad sq = sk_quad(q, p.KT, total, p.W);
        unsigned prev = 0;
        if (lane == 0) prev = atomicAdd(&p.counters[q], 1u);
        prev = __shfl_sync(0xffffffffu, prev, 0);
        if (prev == sq.others()) {  // last piece of this quad: one warp sums (16 values a lane: M <= 8 x 64 rows)
          __threadfence();
          sk_sum_pieces<T, 16, 32>(p, sq, nv, RQ * 16, row0, lane);
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

template <typename T, int SB>
cudaError_t launch_ring_t(const Params &p, const Plan &pl, cudaStream_t st) {
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

}  // namespace

template <typename T> cudaError_t launch_ring(const Params &p, const Plan &pl, int sbits, cudaStream_t st) {
  return sbits == 4 ? launch_ring_t<T, 4>(p, pl, st) : launch_ring_t<T, 8>(p, pl, st);
}

template cudaError_t launch_ring<half>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
template cudaError_t launch_ring<__nv_bfloat16>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);

}  // namespace w4p
