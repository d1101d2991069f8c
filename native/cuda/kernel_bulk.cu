// Bulk kernel (sm_90+, M <= 16). A stage holds one chunk: QS stripes (four, or one on small layers) x up to CT
// tiles (QS contiguous runs of up to CT * 512 bytes of weights) and one run per activation row, copied by the
// bulk copy engine (completing on the stage's mbarrier), plus the chunk's group parameters, copied with cp.async by the lanes
// of the producer warps (which arrive on the same mbarrier when their copies land). NS stages per block,
// BBPS blocks of BNP producer + 8 consumer warps per SM. Stream-K over blocks: each block owns one contiguous
// range of tiles numbered along K within each quad of stripes, cut into chunks at CT-aligned unit boundaries.
// Quads shared by several blocks are reduced as in the ring kernel (pieces summed in block order by the last
// to arrive); within a block, the BNC / QS warps that share a stripe sum in warp order. ("Quad" below means a
// unit's group of QS stripes.) Numerics are the stream kernel's.
#include "epilogue.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

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
          const int nv = M * QS * 16;
          float *piece = sk_piece(p, blk, q == first_quad ? 0 : 1, nv);
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
          const SkQuad sq = sk_quad(q, NG, total, p.W);
          // the last piece of this quad: its warps sum the pieces in block order
          if (named_any(2, QS * 32, threadIdx.x == 0 && atomicAdd(&p.counters[q], 1u) == sq.others())) {
            __threadfence();
            sk_sum_pieces<T, 1, QS * 32>(p, sq, nv, QS * 16, row0, threadIdx.x);
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
cudaError_t launch_bulk_sb(const Params &p, const Plan &pl, cudaStream_t st) {
  if constexpr (SB == 4) {  // (units of 12 or 16 tiles: M <= 8 only, one n8 block of tokens)
    if (pl.qs == 1) return launch_bulk_t<T, SB, 1, BCT1, 1>(p, pl, st);
    if (pl.ct == 16 && pl.NI == 1) return launch_bulk_t<T, SB, 1, 16>(p, pl, st);
    if (pl.ct == 12 && pl.NI == 1) return launch_bulk_t<T, SB, 1, 12>(p, pl, st);
  }
  return launch_bulk_ct<T, SB, 8>(p, pl, st);
}

}  // namespace

template <typename T> cudaError_t launch_bulk(const Params &p, const Plan &pl, int sbits, cudaStream_t st) {
  return sbits == 4 ? launch_bulk_sb<T, 4>(p, pl, st) : launch_bulk_sb<T, 8>(p, pl, st);
}

template cudaError_t launch_bulk<half>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
template cudaError_t launch_bulk<__nv_bfloat16>(const Params &p, const Plan &pl, int sbits, cudaStream_t st);

}  // namespace w4p
