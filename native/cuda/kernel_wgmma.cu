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
#include "wgmma.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

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
cudaError_t launch_wgmma_bn(const Params &p, const Plan &pl, cudaStream_t st) {
  if (pl.bn == 64 && pl.as) return launch_wgmma_t<T, 64, 1, true>(p, pl, st);
  if (pl.bn == 64) return pl.kp == 1 ? launch_wgmma_t<T, 64, 1>(p, pl, st) : launch_wgmma_t<T, 64, 2>(p, pl, st);
  return pl.kp == 1 ? launch_wgmma_t<T, 128, 1>(p, pl, st) : launch_wgmma_t<T, 128, 2>(p, pl, st);
}

}  // namespace

template <typename T> cudaError_t launch_wgmma(const Params &p, const Plan &pl, cudaStream_t st) {
  return launch_wgmma_bn<T>(p, pl, st);
}

template cudaError_t launch_wgmma<half>(const Params &p, const Plan &pl, cudaStream_t st);
template cudaError_t launch_wgmma<__nv_bfloat16>(const Params &p, const Plan &pl, cudaStream_t st);

}  // namespace w4p
