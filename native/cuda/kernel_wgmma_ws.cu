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
// 64 us (H200, docs/journal/2026-cuda.md); 1 for the 256-token tile (ws_tok256_ks: its two-tile stages measured slower).
// Parameter bytes per stage: (scale, zero) x the block's rows per group, for 4 groups a tile (group size 16) at
// KS = 1 and 2 and 4 groups at KS = 4.
#include "wgmma.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

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
            // (2-5% faster, docs/journal/2026-cuda.md section 7). The smaller tiles keep the branch: without it, three of them
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
            if constexpr (WS_GRP == 1 && RS == 1) {  // tile u - 2's wgmmas must be done, tile u - 1's may run
              if constexpr (IL) {  // (one group per wgmma: tile u - 1's four are the newest)
                if (HALVES && u >= 2 && j == 0) asm volatile("wgmma.wait_group.sync.aligned 4;\n" ::: "memory");
              } else {  // (one group per tile; at tile 3, tile 1's is the newest issued)
                if (HALVES && u == 2 && j == 0) asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (HALVES && u == 3 && j == 0) asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
              }
            } else if ((HALVES && u == 2 && j == 0) || (RS == 2 && u > 0 && j == 0)) {
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
                if (WS_GRP == 1) asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
              } else if (((u & 1) == 1 || WS_KS == 1) && j == 3) {  // large token tiles: two tiles dequantized
                // (one in one-tile stages), then their wgmmas
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int v = u & ~1; v <= u; ++v) {
                  const uint64_t dv = v < nt ? dst + (uint64_t)(v * (XT >> 4)) : dzero;
#pragma unroll
                  for (int jj = 0; jj < 4; ++jj) WgOp<T, BN>::mma(acc[0], a[v & 1][jj], dv + (uint64_t)(2 * jj), 1);
                  if (WS_GRP == 1) asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                }
              }
            }
          }
        }
        if (WS_GRP == 0 || RS == 2) asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        // every lane frees the stage itself: with lane 0 arriving for its warp after __syncwarp, racecheck
        // (which does not follow __syncwarp) reported write-after-read hazards on refills; this costs nothing
        // measurable (docs/journal/2026-cuda.md section 8)
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

template <typename T> cudaError_t launch_wgmma_ws_bn(const Params &p, const Plan &pl, cudaStream_t st) {
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

}  // namespace

template <typename T> cudaError_t launch_wgmma_ws(const Params &p, const Plan &pl, cudaStream_t st) {
  return launch_wgmma_ws_bn<T>(p, pl, st);
}

template cudaError_t launch_wgmma_ws<half>(const Params &p, const Plan &pl, cudaStream_t st);
template cudaError_t launch_wgmma_ws<__nv_bfloat16>(const Params &p, const Plan &pl, cudaStream_t st);

}  // namespace w4p

extern "C" {
#ifdef W4P_WS_TRACE
// Diagnostics builds only (not part of the ABI in w4pack.h): clear the wgmma_ws block timeline (clear != 0), or
// copy up to `bytes` of it ([8192][32] uint64, see ws_trace) to `host`. Returns a cudaError_t.
__attribute__((visibility("default"))) int w4p_cuda_ws_trace(void *host, size_t bytes, int clear) {
  if (clear) {
    static unsigned long long zeros[w4p::WS_TRACE_BLOCKS][32];
    return (int)cudaMemcpyToSymbol(w4p::g_ws_trace, zeros, sizeof zeros);
  }
  return (int)cudaMemcpyFromSymbol(host, w4p::g_ws_trace, bytes < sizeof(w4p::g_ws_trace) ? bytes : sizeof(w4p::g_ws_trace));
}
#endif
}  // extern "C"
