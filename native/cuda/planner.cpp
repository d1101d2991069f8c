// The planner (planner.h): make_plan picks the kernel and sizes its grid, split and workspace; the rules it
// applies are in planner_decode.cpp and planner_wgmma.cpp, their thresholds in planner_rules.h. Host-only C++.
#include <stdio.h>
#include <string.h>
#include <algorithm>
#include "planner.h"
#include "planner_rules.h"
#include "switches.h"
#include "planner_parts.h"

namespace w4p {


int make_plan(const DevInfo &di, int64_t m, int n, int k, int sbits, int gs, bool act_order, bool x_aligned,
              int kernel, int splits, size_t ws_avail, Plan *pl) {
  const int sms = di.sms;
  const int np = ceil_div(n, 16) * 16, kp = ceil_div(k, 64) * 64;
  const int KT = kp / 64;
  int kind = kernel;
  // the stream kernel takes group sizes that are multiples of 32 (one group per 32-wide half tile)
  const bool stream_ok = gs <= 0 || gs % 32 == 0;
  const int nstripes = np / 16;
  const bool ring_ok = stream_ok && m <= 8 && (nstripes + RQ - 1) / RQ <= MAX_COUNTERS;
  // ring kernel capacity: resident warps (shared memory per block and the launch bound)
  const size_t ring_blk = (size_t)RW * ring_warp_bytes(sbits, (int)std::min<int64_t>(m, 8));
  const int ring_per_sm = std::max(1, std::min(RING_MINB, (int)(di.smem_sm / (ring_blk + di.smem_reserved))));
  const int64_t ring_cap = (int64_t)sms * ring_per_sm * RW;
  const int64_t ring_units = (int64_t)((nstripes + RQ - 1) / RQ) * KT;
  // bulk kernel (sm_90+): BBPS blocks of 9 warps per SM, as many stages as fit (at most BMAXS)
  const bool bulk_ok = stream_ok && m <= BULK_MAX_M && di.cc >= 90 && (nstripes + BQ - 1) / BQ <= MAX_COUNTERS;
  // one-stripe units (4-bit, M <= 8): where every block can own a whole stripe (at most one stripe per block)
  // on layers under 2^25 weights, and two of their stages fit a block's share of the SM (BBPS blocks per SM;
  // on an H200 they fit up to M = 8 with every group size). No block then shares its rows with another and
  // the split reduction through global memory disappears. Measured on an H200 (docs/journal/2026-cuda.md): 4096x4096
  // M = 1 8.0 against 9.2 us with four-stripe units, M = 4 9.1-9.2 against 10.2; 4096 rows x K 2048 M = 1 5.7
  // against 7.6; level or slower on the larger layers, where blocks share stripes anyway
  const bool bulk_big = (int64_t)np * kp >= SIZE_L;
  // BBPS blocks per SM share its shared memory; where two stages do not fit that share (8-bit, M > 8), one
  // block per SM takes the whole of it
  const int bulk_budget = std::min(di.smem_block, di.smem_sm / BBPS - di.smem_reserved);
  const bool bulk_one = sbits == 4 && !bulk_big && nstripes <= sms * BBPS && m <= 8 &&
                        bulk_two_stages_fit(sbits, (int)m, gs, BCT1, 1, bulk_budget);
  // auto: up to M = 4, up to M = 8 on layers of 2^25 weights or more (measured on an H200 with units of 12 or
  // 16 tiles: 45-47 against 57-60 us for the ring and wgmma_ws kernels at M = 6-8 on the 70B shapes, 16-19
  // against 18-22 us on the 7B MLP shapes) and on the layers of one-stripe units (4096x4096 at M = 5-8:
  // 9.5-9.9 against 10.4-10.9 us for the stream kernel)
  // gemv kernel (M = 1, 4-bit, sm_80+): its activations staged in shared memory must fit a block
  const bool gemv_ok = sbits == 4 && m == 1 && di.cc >= 80 && stream_ok && di.fits((size_t)gv_smem(KT));
  // auto, sm_90: the gemv kernel at M = 1 (measured on an H200, docs/journal/2026-cuda.md)
  if (kind == W4P_CUDA_KERNEL_AUTO && gemv_ok && di.cc == 90 && gemv_env() != 0 && gemv_auto(di, nstripes, KT, gs))
    kind = W4P_CUDA_KERNEL_GEMV;
  if (kind == W4P_CUDA_KERNEL_AUTO && bulk_ok && (m <= BULK_AUTO_M || ((bulk_big || bulk_one) && m <= 8)))
    kind = W4P_CUDA_KERNEL_BULK;
  // auto, sm_90: the warp-specialized wgmma kernel from M = 9 (the bulk kernel takes M = 8 where it led), up to
  // M = 32 on every layer, up to M = 128 on layers of 2^25 weights or more (the 7B MLP shapes) and up to M = 256
  // on layers of 2^26 or more (the 70B shapes). Measured on an H200 (docs/journal/2026-cuda.md): from M = 9 it is ahead of
  // the stream kernel on every Llama shape (its time hardly grows with M up to 16), at M = 8 ahead of the ring
  // kernel on the large layers only, and in its M ranges ahead of the one-pass wgmma kernel and of dequantize +
  // cuBLAS. Smaller layers from M = 33 and every layer from M = 257 take dequantize + cuBLAS (the Python side's
  // dense path when this plan says "tiled"). Without the driver's TMA encoder the wgmma kernel takes its place.
  // With TMA it also takes M = 33-512 on layers of 2^24 weights or more where its blocks fit in one wave:
  // 4096x4096 M = 48-512 in 15.7-34.7 against 21.7-37.5 us, 11008x4096 M = 129-512 in 52.2-88.9 against
  // 65.4-93.9 us for dequantize + cuBLAS; 4096x12288 M = 384 (288 blocks) took 106.9 against 87.9.
  const bool wg_tma = di.tma && !no_tma_env();
  // wgmma_ws in 256-row blocks by their rule, for auto's choices below and for the wgmma_ws plan itself, and in
  // 192-row blocks by theirs (ahead of the 256-row rule where both hold). A forced height (W4P_CUDA_WS_ROWS, or
  // W4P_CUDA_WS_RS) keeps its own rule for auto's kernel choice and turns the others off: 128 rows both, 256 the
  // 192-row rule, 192 the 256-row rules. The 256-token tile by its rule (ws_tok256: its split count), ahead of both;
  // off where a height is forced or W4P_CUDA_WS_TOK=128, and for every M past 128 with W4P_CUDA_WS_TOK=256 (its
  // rule still decides auto's kernel choice)
  const int rs_env = ws_rs_env(), tok_env = ws_tok_env();
  const bool rule256 = ws_rows256(di, m, np, KT, gs, (int64_t)np * kp);
  const int tok256_S = rs_env == 0 && tok_env != 128 ? ws_tok256(di, m, np, KT, gs, (int64_t)np * kp, rule256) : 0;
  const bool rows256 = (rs_env == 0 || rs_env == 2) && rule256;
  const bool rows192 = (rs_env == 0 || rs_env == 3) && ws_rows192(di, m, np, KT, gs, (int64_t)np * kp, rule256);
  if (kind == W4P_CUDA_KERNEL_AUTO && di.cc == 90 && sbits == 4 && (gs <= 0 || gs % 16 == 0) && m >= WS_AUTO_MIN_M) {
    const int64_t weights = (int64_t)np * kp;
    const bool large = weights >= SIZE_L;
    // (past M = 256 only where the last token tile is more than half full: 4096x4096 and 11008x4096 at
    // M = 257-320 took 33.4 and 82.3 us against 29.2-32.5 and 74.2-75.4 for dequantize + cuBLAS)
    const bool one_wave = wg_tma && weights >= SIZE_M && m <= WIDE_AUTO_MAX_M &&
                          (m <= WG_AUTO_MAX_M || m % 128 == 0 || m % 128 > 64) &&
                          (int64_t)ceil_div(np, WG_BM) * ceil_div(m, ws_tile(m)) <=
                              (int64_t)sms * ws_blocks_per_sm(ws_tile(m));
    if ((m > WS_AUTO_MIN_M || large) &&
        (m <= 32 || (m <= 128 && large) || (m <= WG_AUTO_MAX_M && weights >= SIZE_XL) || one_wave))
      kind = wg_tma ? W4P_CUDA_KERNEL_WGMMA_WS : W4P_CUDA_KERNEL_WGMMA;
  }
  // auto, sm_90: the wgmma_ss kernel where its blocks (256 rows x 128 tokens) fill at least half the SMs without
  // splitting K (group sizes of whole K tiles): in wgmma_ws's range from M = SS_AUTO_MIN_M, and in the dense
  // path's from M = SS_AUTO_DENSE_M. Measured on an H200 (docs/journal/2026-cuda.md): 8192x28672 (112 row blocks) M = 65-256
  // 116.6-234.2 against 126.8-257.2 us for wgmma_ws (M = 64: 87.2 against 79.9); at M = 160-256 4096x11008
  // 61.9-62.3 against 64.3-65.6 and 4096x12288 62.3-62.6 against 68.2-75.9 for dequantize + cuBLAS (M = 129:
  // 62.6 against 60.9 on 4096x11008). Grids that need a split (28672x8192; the 7B shapes at M = 128) were slower
  // than wgmma_ws; past M = 256 on 8192x28672 it was level or slower than the dense path (M = 384: 441.9
  // against 396.5).
  if (kernel == W4P_CUDA_KERNEL_AUTO && (gs <= 0 || gs % 64 == 0) && m >= SS_AUTO_MIN_M && m <= WG_AUTO_MAX_M &&
      (kind == W4P_CUDA_KERNEL_WGMMA_WS || (kind == W4P_CUDA_KERNEL_AUTO && m >= SS_AUTO_DENSE_M && di.cc == 90 &&
                                             sbits == 4 && di.tma && !no_tma_env())) &&
      di.fits(ss_smem_bytes(m <= 64 ? 64 : 128)) &&
      2 * (int64_t)ceil_div(np, SS_BR) * ceil_div(m, m <= 64 ? 64 : 128) >= sms)
    kind = W4P_CUDA_KERNEL_WGMMA_SS;
  // ... and there wgmma_ws in 256-row blocks where those run unsplit too (the same 256 x 128 tiles, on layers
  // of 2^25 weights or more): 4096x11008 and 4096x12288 at M = 192-256 took 57.9-60.3 against 61.4-63.8 us
  // (H200, same runs)
  bool rows256_auto = false;
  if (kernel == W4P_CUDA_KERNEL_AUTO && kind == W4P_CUDA_KERNEL_WGMMA_SS && m > 64 && (rs_env == 0 || rs_env == 2) &&
      ws_rows256_fit(di, 128, ws_ks(128, gs)) && (int64_t)np * kp >= SIZE_L &&
      ws_split_count(di, (int64_t)ceil_div(np, 2 * WG_BM) * ceil_div(m, 128), sms, KT, 128, 0) == 1) {
    kind = W4P_CUDA_KERNEL_WGMMA_WS;
    rows256_auto = true;
  }
  // M = 257-512: wgmma_ss where its blocks fill the waves they take: at least 80% unsplit, else at least 90%
  // with 4 splits of 64 K tiles or more. Its time is its waves' count times one block's time, so the fill
  // decides. Measured on an H200 against the previous choice: 8192x28672 M = 384 (336 blocks, 85%) 351.0
  // against 408.2 us for dequantize + cuBLAS, M = 512 467.9 against 474.5; 28672x8192 M = 384 (4 splits, 97%)
  // 339.4 against 400.4, M = 512 (unsplit, 97%) 394.9 against 484.1; 4096x11008 M = 384 (129 blocks) 65.1
  // against 77.6 (M = 512, 172 blocks: 127.2 against 99.5; 4096x12288 M = 384, 144 blocks: 127.4 against 86.4).
  int ss_auto_splits = 0;
  if (kernel == W4P_CUDA_KERNEL_AUTO && (gs <= 0 || gs % 64 == 0) && m > WG_AUTO_MAX_M && m <= WIDE_AUTO_MAX_M &&
      di.cc == 90 && sbits == 4 && wg_tma && (kind == W4P_CUDA_KERNEL_AUTO || kind == W4P_CUDA_KERNEL_WGMMA_WS) &&
      di.fits(ss_smem_bytes(128))) {
    const int64_t blocks = (int64_t)ceil_div(np, SS_BR) * ceil_div(m, 128);
    auto fill = [&](int64_t b) { return (double)b / (double)(ceil_div(b, (int64_t)sms) * sms); };
    if (fill(blocks) >= 0.8) {
      kind = W4P_CUDA_KERNEL_WGMMA_SS;
      ss_auto_splits = 1;
    } else if (KT / 4 >= 64 && fill(4 * blocks) >= 0.9) {
      kind = W4P_CUDA_KERNEL_WGMMA_SS;
      ss_auto_splits = 4;
    }
  }
  // auto, sm_90: wgmma_ws in 256-row or 192-row blocks or the 256-token tile over the choices above, where
  // ws_rows256 / ws_rows192 / ws_tok256 take them
  if (kernel == W4P_CUDA_KERNEL_AUTO && di.cc == 90 && sbits == 4 && wg_tma && (gs <= 0 || gs % 16 == 0) &&
      m > 64 && (rows256 || rows192 || tok256_S))
    kind = W4P_CUDA_KERNEL_WGMMA_WS;
  if (kind == W4P_CUDA_KERNEL_AUTO) {
    // Measured on an H200 (docs/journal/2026-cuda.md): the ring kernel wins where every resident warp gets a long run of
    // units (70B-sized layers); on smaller layers the block-split stream kernel's shorter ramp wins
    const bool ring_wins = ring_ok && m <= RING_MAX_M && ring_units >= RING_MIN_UNITS * ring_cap;
    kind = ring_wins ? 3 : (m <= 32 && stream_ok) ? 1 : 2;
  }
  // probes run their kernel's plan (and get its errors)
  if (kind == W4P_CUDA_PROBE_BULK) kind = W4P_CUDA_KERNEL_BULK;
  if (kind == W4P_CUDA_PROBE_WS) kind = W4P_CUDA_KERNEL_WGMMA_WS;
  if (kind == W4P_CUDA_PROBE_SS) kind = W4P_CUDA_KERNEL_WGMMA_SS;
  if (kind != 2 && kind != W4P_CUDA_KERNEL_WGMMA && kind != W4P_CUDA_KERNEL_WGMMA_WS &&
      kind != W4P_CUDA_KERNEL_WGMMA_SS && kind != W4P_CUDA_KERNEL_GEMV && !stream_ok)
    return fail(W4P_EUNSUPPORTED, "group size %d: the stream kernel needs a multiple of 32 (use auto or tiled)", gs);
  if (kind == 3 && !ring_ok)
    return fail(W4P_EUNSUPPORTED, "the ring kernel takes M <= 8 and at most %d row stripes (m=%lld, n=%d)",
                MAX_COUNTERS * RQ, (long long)m, n);
  if (kind == W4P_CUDA_KERNEL_GEMV && !gemv_ok)
    return fail(W4P_EUNSUPPORTED, "the gemv kernel takes M = 1, 4-bit layers, compute capability 8.0 or newer (this "
                "device: %d.%d), a group size that is a multiple of 32 or per channel, and K up to %d (m=%lld, k=%d)",
                di.cc / 10, di.cc % 10, (di.smem_block - di.smem_reserved - GV_RED) / 128 * 64, (long long)m, k);
  pl->kernel = kind;
  if (kind == W4P_CUDA_KERNEL_GEMV) {
    // whole stripes per block: as many blocks as the SMs hold (launch bound and shared memory), at most one per
    // stripe (the launch takes the blocks per SM from the occupancy of the kernel it runs: the launch bound
    // differs by zero mode, which the plan does not know; this is zero mode none's)
    pl->W = std::min<int64_t>(nstripes, gv_grid(di, KT, gs));
    pl->smem = (size_t)gv_smem(KT);
    pl->tiles = nstripes;
    pl->pdl = di.cc >= 90;
    pl->ws_total = COUNTER_BYTES;
    return W4P_OK;
  }
  if (kind == W4P_CUDA_KERNEL_BULK && !bulk_ok)
    return fail(W4P_EUNSUPPORTED, "the bulk kernel needs compute capability 9.0 or newer (this device: %d.%d), "
                "M <= %d and a group size that is a multiple of 32", di.cc / 10, di.cc % 10, BULK_MAX_M);
  if (kind == W4P_CUDA_KERNEL_BULK) {
    // splits > 0 forces the number of stages (sweeps, tests); else two for units of 12 or 16 tiles (measured
    // faster than three or four on every Llama shape: fewer bytes in flight per SM did better), as many as fit
    // for units of 8 (at most BMAXS)
    const int mm = (int)m;
    // stripes per unit: one on the layers of bulk_one (above), else four. W4P_CUDA_BULK_QS=1|4 forces it (1: any
    // 4-bit layer at M <= 8, whatever W4P_CUDA_BULK_CT says); without it a forced W4P_CUDA_BULK_CT (a unit size
    // of four-stripe units) implies four.
    const bool large = (int64_t)np * kp >= SIZE_XL;
    const int forced = sbits == 4 && m <= 8 ? bulk_ct_env() : 0;
    const int qs_env = bulk_qs_env();
    const bool single = sbits == 4 && m <= 8 &&
                        (qs_env == 1 || (qs_env == 0 && !forced && bulk_one));
    const int qs = single ? 1 : BQ;
    if ((nstripes + qs - 1) / qs > MAX_COUNTERS)
      return fail(W4P_EUNSUPPORTED, "bulk kernel: %d stripes exceed its %d counters", nstripes, MAX_COUNTERS * qs);
    const int fix = bulk_fix(m > 8 ? 2 : 1, qs);
    // units of one stripe are 32 tiles long (16 and 64 measured no faster); of four stripes, longer units only
    // where two of their stages fit a block's share (group 32 at M = 8 takes 12, not 16), unless
    // W4P_CUDA_BULK_CT forces the size
    int ct = single ? BCT1 : forced ? forced : bulk_ct(sbits, mm, np, kp, sms, large);
    while (!single && !forced && ct > 8 && splits <= 0 && !bulk_two_stages_fit(sbits, mm, gs, ct, qs, bulk_budget))
      ct = ct == 16 ? 12 : 8;
    const int per_stage = bulk_stage_bytes(sbits, mm, gs, ct, qs);
    int ns = splits > 0 ? splits : ct > 8 ? 2 : (bulk_budget - fix) / per_stage;
    if (splits <= 0 && ns < 2) ns = (di.smem_block - fix) / per_stage;
    ns = std::min(ns, BMAXS);
    if (ns < 2 || (size_t)bulk_smem_bytes(sbits, mm, gs, ns, ct, qs) > (size_t)di.smem_block)
      return fail(W4P_EUNSUPPORTED, "bulk kernel: %d stages of %d bytes do not fit the device's %d bytes of shared "
                  "memory per block", std::max(ns, 2), per_stage, di.smem_block);
    const int nq = (nstripes + qs - 1) / qs;
    pl->qs = qs;
    const int kg = bulk_granule(ct, large, single, KT);
    const int64_t total = (int64_t)nq * ((KT + kg - 1) / kg);
    pl->ct = ct;
    pl->kg = kg;
    pl->W = std::min<int64_t>(total, (int64_t)sms * BBPS);
    pl->S = ns;
    pl->KC = ns;
    pl->NI = m > 8 ? 2 : 1;
    pl->TB = 1;
    pl->tiles = nq;
    pl->smem = bulk_smem_bytes(sbits, mm, gs, ns, ct, qs);
    pl->gather = act_order || !x_aligned || (k % 64) != 0;
    pl->ws_gather = pl->gather ? (((size_t)m * kp * 2 + 255) / 256) * 256 : 0;
    pl->ws_part = (size_t)pl->W * 2 * m * qs * 16 * 4;
    pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
    return W4P_OK;
  }
  if (kind == 3) {
    // Stream-K over resident warps: grid = what fits on the GPU at once (shared memory and the launch
    // bound), each warp at least RING_LMIN units (fewer partial sums on small layers); splits > 0 forces
    // the units per warp (sweeps, tests).
    const size_t blk = ring_blk;
    if (blk > (size_t)di.smem_block)
      return fail(W4P_EUNSUPPORTED, "ring kernel: %zu bytes of shared memory per block exceed the device's %d", blk,
                  di.smem_block);
    const int64_t total = ring_units, cap = ring_cap;
    int64_t L = splits > 0 ? splits : std::max<int64_t>(RING_LMIN, (total + cap - 1) / cap);
    int64_t W = (total + L - 1) / L;
    if (W > total) W = total;
    if (W < 1) W = 1;
    pl->W = W;
    pl->S = (int)std::min<int64_t>(W, 1 << 30);
    pl->NI = 1;
    pl->TB = 1;
    pl->tiles = (nstripes + RQ - 1) / RQ;
    pl->smem = blk;
    pl->gather = act_order || !x_aligned || (k % 8) != 0;
    pl->ws_gather = pl->gather ? (((size_t)m * kp * 2 + 255) / 256) * 256 : 0;
    pl->ws_part = (size_t)W * 2 * m * RQ * 16 * 4;
    pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
    return W4P_OK;
  }
  if (kind == 1 || kind == W4P_CUDA_PROBE_LOAD || kind == W4P_CUDA_PROBE_DEQUANT) {
    int NI = (int)(m > 16 ? 4 : ceil_div(m, 8));  // 1, 2 or 4 n8 tiles of tokens per block
    if (kind != 1) NI = 1;                        // probes: the M <= 8 kernel
    const int MI = NI == 1 ? 1 : 2;
    const int V = sbits / 4;
    const int U = (8 / (MI * V)) > 0 ? 8 / (MI * V) : 1;
    const int KC = NI == 1 ? 24 : NI == 2 ? 16 : 8;  // ~25-33 KB of activations per chunk buffer; multiple of U
    const int RB = SW * MI * 16;
    const int TB = ceil_div(m, NI * 8);
    const int nrb = ceil_div(np, RB);
    pl->NI = NI;
    pl->MI = MI;
    pl->KC = KC;
    pl->TB = TB;
    pl->tiles = nrb * TB;
    int S = splits;
    if (S <= 0) {
      // Measured on an H200 (docs/journal/2026-cuda.md): M <= 8 is fastest with about one wave of resident blocks
      // (4 per SM, never more: a partial second wave is a tail); larger M with about two blocks per SM and
      // at least 16 tiles per warp.
      if (NI == 1) {
        S = (int)((int64_t)sms * 4 / pl->tiles);
      } else {
        S = (int)(((int64_t)sms * 2 + pl->tiles / 2) / pl->tiles);
      }
      const int smax = NI == 1 ? (KT / 8 > 0 ? KT / 8 : 1) : (KT / 16 > 0 ? KT / 16 : 1);
      if (S > smax) S = smax;
      if (S < 1) S = 1;
    }
    if (S > KT) S = KT;
    pl->S = S;
    pl->smem = 2 * stream_buf_bytes(NI, MI, KC, gs);
  } else if (kind == 2) {
    const int TB = ceil_div(m, TBN);
    const int nrb = ceil_div(np, TBM);
    pl->TB = TB;
    pl->tiles = nrb * TB;
    int S = splits;
    if (S <= 0) {
      S = 1;
      if (pl->tiles < sms) {
        S = ceil_div(sms, pl->tiles);
        const int smax = KT / 8 > 0 ? KT / 8 : 1;
        if (S > smax) S = smax;
      }
    }
    if (S > KT) S = KT;
    pl->S = S;
    pl->gather = act_order || !x_aligned || (k % 8) != 0;
    pl->smem = sbits == 4 ? TiledCfg<4>::SMEM : TiledCfg<8>::SMEM;
  } else if (kind == W4P_CUDA_KERNEL_WGMMA) {
    if (di.cc != 90 || sbits != 4 || !(gs <= 0 || gs % 16 == 0))
      return fail(W4P_EUNSUPPORTED, "the wgmma kernel needs compute capability 9.0 (this device: %d.%d), 4-bit "
                  "storage and a group size that is a multiple of 16", di.cc / 10, di.cc % 10);
    // token tile 64 up to M = 64 (two blocks per SM), else 128; W4P_CUDA_WGMMA_KP=1|2 overrides the K tiles
    // per step (tuning)
    const int bn = m <= 64 ? 64 : 128;
    int kpt = 1;  // one K tile per step: measured ahead of two (which holds both tiles' fragments) at M = 16..256
    if (const char *e = wgmma_kp_env()) kpt = e[0] == '2' ? 2 : 1;
    bool as = false;  // W4P_CUDA_WGMMA_AS=1: the A-through-shared-memory variant (token tile 64; tuning)
    if (const char *e = wgmma_as_env()) as = e[0] == '1' && bn == 64;
    if (as) kpt = 1;
    if (!di.fits(wg_smem_bytes(bn, kpt, as)))
      return fail(W4P_EUNSUPPORTED, "the wgmma kernel needs %d bytes of shared memory per block",
                  wg_smem_bytes(bn, kpt, as));
    const int nrb = ceil_div(np, WG_BM);
    if (nrb > 65535) return fail(W4P_EUNSUPPORTED, "the wgmma kernel takes at most %d rows", 65535 * WG_BM);
    pl->bn = bn;
    pl->kp = kpt;
    pl->as = as;
    pl->TB = ceil_div(m, bn);
    pl->tiles = nrb * pl->TB;
    pl->S = wg_splits(splits, pl->tiles, (int64_t)sms * ((bn == 64 || kpt == 1) ? 2 : 1), KT);
    pl->smem = wg_smem_bytes(bn, kpt, as);
    pl->gather = act_order || !x_aligned || (k % 64) != 0;
  } else if (kind == W4P_CUDA_KERNEL_WGMMA_WS) {
    // token tile 16 / 32 / 64 / 128 by M, or 256 (ws_tok256, W4P_CUDA_WS_TOK); split K as the wgmma kernel
    if (di.cc != 90 || sbits != 4 || !(gs <= 0 || gs % 16 == 0))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel needs compute capability 9.0 (this device: %d.%d), 4-bit "
                  "storage and a group size that is a multiple of 16", di.cc / 10, di.cc % 10);
    const bool tok256 = (m > 128 && tok_env == 256 && rs_env == 0 && ws_tok256_fit(di)) || tok256_S > 0;
    const int bn = tok256 ? 256 : ws_tile(m);
    const int ks = tok256 ? ws_tok256_ks() : ws_ks(bn, gs);
    if (!di.fits(ws_smem_bytes(bn, ks)))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel needs %d bytes of shared memory per block",
                  ws_smem_bytes(bn, ks));
    const int rs = tok256                                                         ? 1
                   : rs_env == 2 && ws_rows256_fit(di, bn, ks)                     ? 2
                   : rs_env == 0 && !rows192 && (rows256_auto || rows256) ? 2
                                                                          : 1;
    const int cw = !tok256 && rs == 1 && (rs_env == 3 || rows192) && ws_rows192_fit(di, bn, ks) ? 3 : 2;
    pl->rs = rs;
    pl->cw = cw;
    const int rb = 64 * cw * rs;  // rows per block
    const int nrb = ceil_div(np, rb);
    if (nrb > 65535)
      return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel takes at most %d rows", 65535 * rb);
    pl->bn = bn;
    pl->TB = ceil_div(m, bn);
    pl->tiles = nrb * pl->TB;
    const int64_t slots = (int64_t)sms * ws_blocks_per_sm(bn, rs);
    pl->S = tok256_S && splits <= 0 && tok_env != 256 ? tok256_S : ws_split_count(di, pl->tiles, slots, KT, bn, splits);
    pl->smem = ws_smem_bytes(bn, ks, rs, cw);
    pl->kp = ks;
    // stream-K for the 256-row blocks: one block per SM, each taking an equal run of the tiles' stages (the
    // partial tiles at the runs' ends summed through the workspace), where the plain grid's waves would leave
    // SMs idle
    const int sk_env = ws_sk_env();
    const int64_t units = (int64_t)pl->tiles * ceil_div(KT, ks);
    if (rs == 2 && kernel != W4P_CUDA_PROBE_WS && splits <= 0 && pl->tiles <= MAX_COUNTERS / 4 &&
        (sk_env == 1 || (sk_env < 0 && ws_sk_auto(pl->tiles, pl->tiles * pl->S, slots)))) {
      pl->sk = (int)std::min<int64_t>(slots, units);
      pl->sk_plain_S = pl->S;
      pl->S = 1;
    }
    pl->gather = act_order || !x_aligned;  // TMA zero-fills columns past K: no gather for ragged K
  } else if (kind == W4P_CUDA_KERNEL_WGMMA_SS) {
    // 256 weight rows x 64 tokens per block up to M = 64, else x 128 (W4P_CUDA_SS_TOK=64|128 forces it); one
    // block per SM; split K as the other wgmma kernels
    if (di.cc != 90 || sbits != 4 || !(gs <= 0 || gs % 64 == 0))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs compute capability 9.0 (this device: %d.%d), 4-bit "
                  "storage and a group size that is a multiple of 64 (or per channel)", di.cc / 10, di.cc % 10);
    if (!di.tma)
      return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs the driver's TMA descriptor encoder (this driver has none)");
    int tok = m <= 64 ? 64 : 128;
    if (const char *e = ss_tok_env()) tok = strcmp(e, "64") == 0 ? 64 : strcmp(e, "128") == 0 ? 128 : tok;
    if (!di.fits(ss_smem_bytes(tok)))
      return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs %d bytes of shared memory per block", ss_smem_bytes(tok));
    const int nrb = ceil_div(np, SS_BR);
    if (nrb > 65535) return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel takes at most %d rows", 65535 * SS_BR);
    pl->bn = tok;
    pl->kp = ss_ks(tok);
    pl->TB = ceil_div(m, tok);
    pl->tiles = nrb * pl->TB;
    pl->S = wg_splits(splits > 0 ? splits : ss_auto_splits, pl->tiles, (int64_t)sms, KT);
    pl->smem = ss_smem_bytes(tok);
    pl->gather = act_order || !x_aligned;  // TMA zero-fills columns past K
  } else {
    return fail(W4P_EINVAL, "unknown kernel %d", kernel);
  }
  if (pl->S > 1 && pl->tiles > MAX_COUNTERS) pl->S = 1;
  pl->ws_gather = pl->gather ? (((size_t)m * kp * 2 + 255) / 256) * 256 : 0;
  auto part_bytes = [&](int S) { return S > 1 ? (size_t)S * m * np * 4 : 0; };
  // stream-K's two slots per block, or the plain grid where a caller's workspace cannot hold them
  const size_t sk_bytes = (size_t)2 * pl->sk * pl->bn * WG_BM * pl->rs * 4;
  if (pl->sk && COUNTER_BYTES + pl->ws_gather + sk_bytes > ws_avail) {
    pl->sk = 0;
    pl->S = pl->sk_plain_S;
  }
  // shrink splits until the workspace holds them
  while (pl->S > 1 && COUNTER_BYTES + pl->ws_gather + part_bytes(pl->S) > ws_avail) pl->S = pl->S / 2 > 1 ? pl->S / 2 : 1;
  pl->ws_part = pl->sk ? sk_bytes : part_bytes(pl->S);
  pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
  // the wgmma_ws / wgmma_ss splits of one tile as a cluster that sums them in shared memory (launch_splits
  // falls back on the workspace where the device holds fewer clusters than plain blocks)
  pl->cl = (pl->kernel == W4P_CUDA_KERNEL_WGMMA_WS || pl->kernel == W4P_CUDA_KERNEL_WGMMA_SS) && pl->S > 1 &&
           pl->S <= CLUSTER_MAX && !no_cluster_env();
  return W4P_OK;
}

bool stream_gathers(int gs) { return gs <= 0 || gs % 32 == 0; }

// the plan on a device (real or described); argument checks shared by both entry points
// The plan for checked arguments (plan_on, describe_on)
int checked_plan(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                 int x_aligned, int kernel, int splits, Plan *pl) {
  if (m < 1 || n < 1 || k < 1) return fail(W4P_EINVAL, "bad shape m=%lld n=%d k=%d", (long long)m, n, k);
  if (storage_bits != 4 && storage_bits != 8) return fail(W4P_EINVAL, "storage_bits must be 4 or 8");
  if (group_size != -1 && (group_size < 16 || group_size % 16)) return fail(W4P_EINVAL, "group_size %d", group_size);
  return make_plan(di, m, n, k, storage_bits, group_size, act_order != 0, x_aligned != 0, kernel, splits,
                   (size_t)-1, pl);
}

int plan_on(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order, int x_aligned,
            int kernel, int splits, int *kernel_out, int *splits_out, size_t *workspace_bytes) {
  Plan pl;
  int rc = checked_plan(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, &pl);
  if (rc) return rc;
  if (kernel_out) *kernel_out = pl.kernel;
  if (splits_out) *splits_out = pl.S;
  if (workspace_bytes) *workspace_bytes = pl.ws_total;
  return W4P_OK;
}
int describe_on(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                int x_aligned, int kernel, int splits, char *buf, size_t len) {
  if (!buf || len == 0) return fail(W4P_EINVAL, "describe: no buffer");
  buf[0] = 0;
  Plan pl;
  int rc = checked_plan(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, &pl);
  if (rc) return rc;
  static const char *names[] = {"auto", "stream", "tiled", "ring", "bulk", "wgmma", "wgmma_ws", "wgmma_ss", "gemv"};
  const char *name = pl.kernel >= 0 && pl.kernel <= 8 ? names[pl.kernel] : "probe";
  if (pl.kernel == W4P_CUDA_KERNEL_GEMV)
    snprintf(buf, len, "gemv blocks=%lld stripes=%d smem=%zu workspace=%zu", (long long)pl.W, pl.tiles, pl.smem,
             pl.ws_total);
  else if (pl.kernel == W4P_CUDA_KERNEL_BULK)
    snprintf(buf, len, "bulk unit=%d granule=%d stages=%d stripes=%d blocks=%lld smem=%zu workspace=%zu", pl.ct,
             pl.kg, pl.S, pl.qs, (long long)pl.W, pl.smem, pl.ws_total);
  else if (pl.kernel == 3)
    snprintf(buf, len, "ring workers=%lld smem=%zu workspace=%zu", (long long)pl.W, pl.smem, pl.ws_total);
  else if (pl.sk)
    snprintf(buf, len, "%s stream-k=%d%s tiles=%d smem=%zu workspace=%zu", name, pl.sk, pl.rs == 2 ? " rows=256" : "",
             pl.tiles, pl.smem, pl.ws_total);
  else
    snprintf(buf, len, "%s splits=%d%s%s tiles=%d smem=%zu workspace=%zu", name, pl.S,
             pl.S == 1 ? "" : pl.cl ? " sum=cluster" : " sum=workspace",
             pl.rs == 2 ? " rows=256" : pl.cw == 3 ? " rows=192" : pl.bn == 256 ? " tokens=256" : "", pl.tiles,
             pl.smem, pl.ws_total);
  return W4P_OK;
}
DevInfo described(int sms, int cc, int smem_sm, int smem_block, int smem_reserved) {
  DevInfo di;
  di.sms = sms;
  di.cc = cc;
  di.smem_sm = smem_sm;
  di.smem_block = smem_block;
  di.smem_reserved = smem_reserved;
  di.init = true;
  return di;
}
bool bad_description(int sms, int cc, int smem_sm, int smem_block, int smem_reserved) {
  if (sms < 1 || cc < 10 || smem_sm < 1 || smem_block < 1 || smem_reserved < 0) {
    fail(W4P_EINVAL, "bad device description (sms %d, cc %d, shared memory %d / %d / %d)", sms, cc, smem_sm,
         smem_block, smem_reserved);
    return true;
  }
  return false;
}

}  // namespace w4p
