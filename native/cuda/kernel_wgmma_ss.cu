// wgmma_ss kernel (sm_90a, 4-bit, group sizes that hold whole K tiles: multiples of 64, or per channel). The
// other wgmma kernels' orientation turned around: the tokens are wgmma's A operand (M = 64 tokens per
// warpgroup) and the dequantized weights its B operand (N = 128 or 256 weight rows), both from shared memory.
// Why: a register-A wgmma (wgmma_ws) pays a fixed cost per instruction that dominates up to N = 128 tokens
// (docs/journal/2026-cuda.md section 8); here one m64n256k16 covers 64 tokens x 256 rows, and with no operand in registers
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
#include "wgmma.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

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

}  // namespace

template <typename T> cudaError_t launch_wgmma_ss(const Params &p, const Plan &pl, cudaStream_t st) {
  return pl.bn == 64 ? launch_wgmma_ss_t<T, 64>(p, pl, st) : launch_wgmma_ss_t<T, 128>(p, pl, st);
}

template cudaError_t launch_wgmma_ss<half>(const Params &p, const Plan &pl, cudaStream_t st);
template cudaError_t launch_wgmma_ss<__nv_bfloat16>(const Params &p, const Plan &pl, cudaStream_t st);

}  // namespace w4p
