// The planner's rules for the wgmma kernels: split counts, cluster sums, and the wave model that picks wgmma_ws's
// block height (128, 192 or 256 rows), token tile (128 or 256) and stream-K. Host-only C++.
#include <algorithm>
#include "planner.h"
#include "planner_rules.h"
#include "switches.h"
#include "planner_parts.h"

namespace w4p {

// Clusters of s blocks (s >= 3) an sm_90 device holds for `slots` plain blocks, estimated for planning: a
// cluster's blocks share one GPC, and an H200 holds 39 / 30 / 15 clusters of 3 / 4 / 8 one-per-SM blocks
// (132 SMs) and 79 / 62 / 30 of two-per-SM ones, at least 88% of slots / s. The launch checks the real count.
int64_t cluster_fill_estimate(int64_t slots, int s) { return (int64_t)(0.88 * (double)slots / s); }

// Split-K count of the wgmma kernels: `splits` when forced, else enough to fill the resident slots when the
// tiles fill less than half of them (splitting a grid that already fills half measured slower), each split
// keeping at least kmin K tiles
int wg_splits(int splits, int64_t tiles, int64_t slots, int KT, int kmin) {
  int S = splits;
  if (S <= 0) {
    S = 1;
    if (2 * tiles < slots) {
      S = (int)(slots / tiles);
      const int smax = KT / kmin > 0 ? KT / kmin : 1;
      if (S > smax) S = smax;
    }
  }
  if (S > KT) S = KT;
  if (S > 65535) S = 65535;
  return S;
}

// The wgmma_ws kernel's split count for `tiles` output tiles on `slots` resident blocks (splits > 0: forced)
int ws_split_count(const DevInfo &di, int64_t tiles, int64_t slots, int KT, int bn, int splits) {
  // from the 32-token tile, split grids that leave more than half the SMs idle (with the workspace's sums,
  // 4096x11008 and 4096x12288, 86 and 96 row tiles, ran M = 32-64 in 22.5-28.3 us unsplit against 25.8-40.4
  // us with 2-3 splits: H200); with the 16-token tile the splits were level or ahead
  const bool may_split = splits > 0 || bn == 16 || 2 * tiles < di.sms;
  // at least 16 K tiles per split: 4096x4096 at M = 16-64 took 10.5-17.1 us with 4 splits against 11.2-19.9
  // with 8 (H200)
  int S = may_split ? wg_splits(splits, tiles, slots, KT, 16) : 1;
  // where the unsplit grid fills half the SMs and two splits still fit in one wave, two splits summed in a
  // cluster (sm_90): 4096x11008 and 4096x12288 at M = 32-64 took 21.0-25.8 against 22.9-28.5 us unsplit
  if (splits <= 0 && S == 1 && di.cc == 90 && !no_cluster_env() && KT >= 32 && 2 * tiles <= slots)
    S = 2;
  // from the 64-token tile, where the auto split count's clusters would not fit in one wave (their sums
  // then go through the workspace, whose partial tiles grow with the token tile), fewer splits whose
  // clusters fit, unless the longer K range per block costs more: per block about 0.5 us per K tile against
  // about 0.0186 us per split and token for the workspace sums (H200: 4096x4096 and 11008x4096 at M = 96-128
  // took 16.9-17.4 and 35.0-35.2 us with 3 cluster splits against 21.1-24.3 and 35.7-39.0 with 4 through the
  // workspace; 28672x8192 at M = 64 82.2 with 4 against 96.8 with 3)
  if (splits <= 0 && S >= 3 && bn >= 64 && di.cc == 90 && !no_cluster_env()) {
    auto fits = [&](int s) { return tiles <= (s == 2 ? slots / 2 : cluster_fill_estimate(slots, s)); };
    if (!fits(S))
      for (int s = S - 1; s >= 2; --s)
        if (fits(s)) {
          if (KT * (1.0 / s - 1.0 / S) < 0.037 * S * bn) S = s;
          break;
        }
  }
  return S;
}

// The wgmma_ws 128-token tile in 256-row blocks (RS = 2) fits a block's shared memory
bool ws_rows256_fit(const DevInfo &di, int bn, int ks) {
  return bn == 128 && ks == 2 && di.fits(ws_smem_bytes(bn, ks, 2));
}
// The 256-token tile (128-row blocks, one or two K tiles per stage) fits a block's shared memory
bool ws_tok256_fit(const DevInfo &di) {
  return di.fits(ws_smem_bytes(256, 1)) && di.fits(ws_smem_bytes(256, 2));
}
// ... and in 192-row blocks (three consumer warpgroups)
bool ws_rows192_fit(const DevInfo &di, int bn, int ks) {
  return bn == 128 && ks == 2 && di.fits(ws_smem_bytes(bn, ks, 1, 3));
}
// wgmma_ws takes 256-row blocks where their grid, split in two at most, fills the waves it takes to 84% or
// more (90% past M = 512, where the dense path is level), up to M = 1024 on layers of 2^25 weights or more, and
// from M = 769 on layers of 2^24 or more. Each block then reads its activation tile once for twice the rows: the
// copies of 128-row blocks were bound by L2 (H200, 8192x28672 at M = 128: 90 us for the copies alone,
// 6.6 TB/s; with 256-row blocks 69 us). Measured against the previous choice (docs/journal/2026-cuda.md): 8192x28672
// M = 65-512 (112 row blocks, 85%) 109-436 against 118-468 us, M = 896 (99%) 666 against 719; 28672x8192
// M = 160-256 (2 splits) 189-193 against 215-219, M = 512 and 1024. 85% past M = 512 lost to the dense path
// (8192x28672 M = 640-768: 556-666 against 539-630), and so did split 7B layers. With the staged epilogue
// (thirteenth session) the 7B layers whose grid fills 97% at M = 1024 run ahead of the dense path: 4096x4096
// 51.1-57.5 against 58.1-60.2 us, 11008x4096 145.4-152.4 against 149.5-158.6, 4096x12288 157.6-177.2 against
// 174.3-181.5 (five alternating rounds; 4096x11008, 87%, stays behind: 164-189 against 156-161)
bool ws_rows256(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights) {
  const int bn = ws_tile(m);
  if (di.cc != 90 || !ws_rows256_fit(di, bn, ws_ks(bn, gs)) || weights < SIZE_M ||
      (weights < SIZE_L && m <= 768) || m > 1024)
    return false;
  const int64_t tiles = (int64_t)ceil_div(np, 2 * WG_BM) * ceil_div(m, bn);
  const int S = ws_split_count(di, tiles, di.sms, KT, bn, 0);
  const int64_t blocks = tiles * S;
  return S <= 2 && (double)blocks >= (m > 512 ? 0.9 : 0.84) * (double)((blocks + di.sms - 1) / di.sms * di.sms);
}

// Stream-K for wgmma_ws's 256-row blocks where the plain grid (`blocks`: tiles x splits) fills less than 90% of
// the waves of `slots` resident blocks it takes, and the tiles are at least as many as the slots (each block's
// run at least a tile). Measured on an H200 (docs/journal/2026-cuda.md section 7), same-run A/B against the plain grid:
// 8192x28672 M = 256 190.5-190.9 against 200.0-200.1 us, M = 512 372.7-373.3 against 397.6-420.5; slower where
// the runs are shorter than a tile (M = 128 108-114 against 102, 4096x11008 M = 256 55.6-56.7 against 53.3-53.8)
bool ws_sk_auto(int64_t tiles, int64_t blocks, int64_t slots) {
  return tiles >= slots && (double)blocks < 0.9 * (double)((blocks + slots - 1) / slots * slots);
}

// wgmma_ws takes 192-row blocks (three consumer warpgroups) for the 128-token tile up to M = 1024 on layers of 2^24
// weights or more, where its grid costs at least 5% less than every other wgmma_ws grid by a wave model: T blocks
// of R rows on `slots` SMs (one per SM) take ceil(T / slots) waves, a wave of R-row blocks 0.57 / 0.79 / 1 of a
// 256-row block's time for R = 128 / 192 / 256 (H200, 1.14 / 0.79 / 1.0 on 4096x11008 at M = 256: 54.2 / 37.7 /
// 47.5 us, the ratios held on 11008x4096 and 28672x8192); two splits summed in a cluster within one wave half a
// wave of their rows (+ 0.05; for 192 rows up to M = 128, as measured, where ws_split_count gives exactly two);
// stream-K, where the 256-row grid is the planner's (rows256) and the plan would run it (W4P_CUDA_WS_SK as there),
// T / slots + 0.25 waves of 256-row blocks. Measured on an H200 (docs/journal/2026-cuda.md) against the previous choice:
// 4096x11008 at M = 129-256 36.5-41.5 against 47.3-61.5 us, M = 512 79.0-80.9 against 93.6-95.1; 4096x12288 at
// M = 129-256 39.2-42.8 against 48.1-66.1, M = 384-512 74.2-82.5 against 86.2-108.2; 28672x8192 at M = 384
// 254.1-258.7 against 347.0-361.9; at M = 576-768, against dequantize + cuBLAS, 8192x28672 440-581 against 542-686,
// 4096x4096 36.5-40.8 against 42.2-53.2, 11008x4096 94-114 against 109-138, 28672x8192 489-578 against 507-676
// (level at M = 576), 4096x12288 123-131 against 137-146 (M = 704-768). Where it loses (8192x28672 with stream-K at
// M = 129-256, 218-231 against 178-193; 4096x12288 at M = 576-640, 4096x11008 at M = 640-1024, the 256-row grids
// at M = 1024) the model ranks the other grid first. With two splits (M = 65-128 on 4096x11008 and 4096x12288: 116
// and 128 blocks in one wave) 25.2-26.3 against 28.0-28.6 for 128-row blocks unsplit (86 and 96 blocks).
// The wave model's costs of wgmma_ws's grids at M (in waves of 256-row blocks of the 128-token tile): `others`
// the cheapest of the 128- and 256-row grids, `r192` the 192-row grid's (where it fits). rows256 as ws_rows192's.
// The waves that t blocks take on `slots` resident blocks (the wave model's unit)
double ws_waves(int64_t t, int64_t slots) { return (double)((t + slots - 1) / slots); }
WsCosts ws_costs(const DevInfo &di, int64_t m, int np, int KT, int gs, bool rows256) {
  const int bn = ws_tile(m), ks = ws_ks(bn, gs);
  const int64_t slots = di.sms, tb = ceil_div(m, bn);
  auto waves = [&](int64_t t) { return ws_waves(t, slots); };
  const int64_t t128 = ceil_div(np, 128) * tb, t192 = ceil_div(np, 192) * tb, t256 = ceil_div(np, 256) * tb;
  WsCosts c;
  c.others = waves(t128) * 0.57;
  if (2 * t128 <= slots) c.others = std::min(c.others, 0.57 / 2 + 0.05);
  c.r192 = 1e30;
  if (bn == 128 && ws_rows192_fit(di, bn, ks)) {
    c.r192 = waves(t192) * 0.79;
    if (m <= 128 && 2 * t192 <= slots && ws_split_count(di, t192, slots, KT, bn, 0) == 2)
      c.r192 = std::min(c.r192, 0.79 / 2 + 0.05);
  }
  if (ws_rows256_fit(di, bn, ks)) {
    c.others = std::min(c.others, waves(t256));
    if (2 * t256 <= slots) c.others = std::min(c.others, 0.5 + 0.05);
    const int sk_env = ws_sk_env();  // (as the plan's stream-K condition)
    if (rows256 && sk_env != 0 && t256 <= MAX_COUNTERS / 4 && (sk_env == 1 || ws_sk_auto(t256, t256, slots)))
      c.others = std::min(c.others, (double)t256 / (double)slots + 0.25);
  }
  return c;
}
bool ws_rows192(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights, bool rows256) {
  const int bn = ws_tile(m);
  if (di.cc != 90 || bn != 128 || m > 1024 || weights < SIZE_M || !ws_rows192_fit(di, bn, ws_ks(bn, gs)))
    return false;
  const WsCosts c = ws_costs(di, m, np, KT, gs, rows256);
  return c.r192 < 0.95 * c.others;
}

// wgmma_ws takes the 256-token tile (128-row blocks, one K tile a stage) at M = 192-1024 on layers of 2^24 weights or
// more, where its last token tile is at least three quarters full and the wave model above ranks its grid 5% ahead
// of the 128-token tile's: T blocks take ceil(T / slots) waves of 0.89 (H200: 128 blocks in one wave 47.7-49.1
// against 51.1-57.5 us for 256-row blocks on 4096x4096 at M = 1024, 126.0-132.0 against 141.6-148.5 on 11008x4096);
// two splits summed in a cluster, where they fill one wave, 0.89 x (1/2 + 8 / KT): the sum of a 128 x 256 tile costs
// about 6 us whatever K (4096x4096 at M = 512: 30.8 against 27.7 for 128-row blocks; 11008x4096: 68.7 against 73.7;
// 28672x8192 at M = 256: 164.4 against 177.3). A grid whose last token tile is partly empty ran slower than a full
// one (8192x28672: 217 us at M = 129, 200 at 160, 178 at 176, 170 at 192, 178 at 256; 28672x8192: 178 at 129, 155
// at 192), and the other grids shrink with M, so past a multiple of 256 it lost up to three quarters (M = 129-176 on
// 8192x28672 and 8192x8192, 257-384 on 11008x4096, 513-576 on 4096x11008, 769 on 4096x12288 and 28672x8192).
// Returns its splits (1 or 2), or 0 where it is not taken. Measured rules and A/B runs: docs/journal/2026-cuda.md section 7.
int ws_tok256(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights, bool rows256) {
  if (di.cc != 90 || m <= 128 || m > 1024 || (m % 256 != 0 && m % 256 < 192) || weights < SIZE_M ||
      !ws_tok256_fit(di))
    return 0;
  const int64_t slots = di.sms, t = (int64_t)ceil_div(np, 128) * ceil_div(m, 256);
  double mine = ws_waves(t, slots) * 0.89;
  int S = 1;
  const double split2 = 0.89 * (0.5 + 8.0 / KT);  // (summed in a cluster: not with W4P_CUDA_CLUSTER=0)
  if (2 * t <= slots && split2 < mine && !no_cluster_env()) {
    mine = split2;
    S = 2;
  }
  const WsCosts c = ws_costs(di, m, np, KT, gs, rows256);
  return mine < 0.95 * std::min(c.others, c.r192) ? S : 0;
}

}  // namespace w4p
