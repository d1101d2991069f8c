// The planner (planner.h): make_plan picks the kernel (the auto steps below, in order), then sizes its grid,
// split and workspace (one function per kernel). The conditions the steps test are in planner_decode.cpp and
// planner_wgmma.cpp, their thresholds in planner_rules.h, each with the measurement that set it. Host-only C++.
#include <stdio.h>
#include <string.h>
#include <algorithm>
#include "planner.h"
#include "planner_rules.h"
#include "switches.h"
#include "planner_parts.h"

namespace w4p {
namespace {

// The layer as every step sees it: padded geometry, which kernels can take it, and the row-block rules' verdicts
struct Layer {
  const DevInfo &di;
  int64_t m;
  int n, k, sbits, gs;
  bool act_order, x_aligned;
  int sms = 0, np = 0, kp = 0, KT = 0, nstripes = 0;
  int64_t weights = 0;                             // np x kp: the size class
  bool stream_ok = false, ring_ok = false, bulk_ok = false, gemv_ok = false;
  size_t ring_blk = 0;                             // one ring block's shared memory
  int64_t ring_cap = 0, ring_units = 0;            // resident ring warps, ring work units
  bool bulk_big = false, bulk_one = false;         // L+ layers; one-stripe units (every block owns a stripe)
  int bulk_budget = 0;                             // a bulk block's share of the SM's shared memory
  bool wg_tma = false;                             // the wgmma_ws kernel's TMA path is there
  int rs_env = 0, tok_env = 0;                     // forced wgmma_ws row height / token tile (switches.h)
  bool rule256 = false, rows256 = false, rows192 = false;  // wgmma_ws 256- and 192-row blocks by their rules
  int tok256_S = 0;  // wgmma_ws 256-token tile by its rule: its split count (0: not taken)
};

Layer describe_layer(const DevInfo &di, int64_t m, int n, int k, int sbits, int gs, bool act_order,
                     bool x_aligned) {
  Layer L{di, m, n, k, sbits, gs, act_order, x_aligned};
  L.sms = di.sms;
  L.np = ceil_div(n, 16) * 16;
  L.kp = ceil_div(k, 64) * 64;
  L.KT = L.kp / 64;
  L.nstripes = L.np / 16;
  L.weights = (int64_t)L.np * L.kp;
  // the stream kernel takes group sizes that are multiples of 32 (one group per 32-wide half tile)
  L.stream_ok = gs <= 0 || gs % 32 == 0;
  L.ring_ok = L.stream_ok && m <= 8 && (L.nstripes + RQ - 1) / RQ <= MAX_COUNTERS;
  L.ring_blk = (size_t)RW * ring_warp_bytes(sbits, (int)std::min<int64_t>(m, 8));
  const int ring_per_sm = std::max(1, std::min(RING_MINB, (int)(di.smem_sm / (L.ring_blk + di.smem_reserved))));
  L.ring_cap = (int64_t)L.sms * ring_per_sm * RW;
  L.ring_units = (int64_t)((L.nstripes + RQ - 1) / RQ) * L.KT;
  L.bulk_ok = L.stream_ok && m <= BULK_MAX_M && di.cc >= 90 && (L.nstripes + BQ - 1) / BQ <= MAX_COUNTERS;
  L.bulk_big = L.weights >= SIZE_L;
  // BBPS blocks per SM share its shared memory; where two stages do not fit that share (8-bit, M > 8), one block
  // per SM takes the whole of it
  L.bulk_budget = std::min(di.smem_block, di.smem_sm / BBPS - di.smem_reserved);
  L.bulk_one = sbits == 4 && !L.bulk_big && L.nstripes <= L.sms * BBPS && m <= 8 &&
               bulk_two_stages_fit(sbits, (int)m, gs, BCT1, 1, L.bulk_budget);
  // the gemv kernel's activations staged in shared memory must fit a block (with a ring build's ring, the
  // largest of the group size's: zero points or minima, which the planner is not told)
  L.gemv_ok = sbits == 4 && m <= GV_MAX_M && di.cc >= 80 && L.stream_ok &&
              di.fits(gv_smem(L.KT, (int)m, gv_ring(2, gv_ts(gs))));
  L.wg_tma = di.tma && !no_tma_env();
  // A forced height (W4P_CUDA_WS_ROWS / _RS) keeps its own rule for auto's kernel choice and turns the others off;
  // the 256-token tile is off where a height is forced or W4P_CUDA_WS_TOK=128
  L.rs_env = ws_rs_env();
  L.tok_env = ws_tok_env();
  L.rule256 = ws_rows256(di, m, L.np, L.KT, gs, L.weights);
  L.tok256_S = L.rs_env == 0 && L.tok_env != 128 ? ws_tok256(di, m, L.np, L.KT, gs, L.weights, L.rule256) : 0;
  L.rows256 = (L.rs_env == 0 || L.rs_env == 2) && L.rule256;
  L.rows192 = (L.rs_env == 0 || L.rs_env == 3) && ws_rows192(di, m, L.np, L.KT, gs, L.weights, L.rule256);
  return L;
}

// The auto choice as it is built: the kernel and what some steps decide beside it
struct Choice {
  int kind = W4P_CUDA_KERNEL_AUTO;
  bool rows256 = false;    // wgmma_ws in 256-row blocks taken over wgmma_ss (step ws_over_ss)
  int ss_splits = 0;       // wgmma_ss's split count (step ss_wide)
};

bool undecided(const Choice &c) { return c.kind == W4P_CUDA_KERNEL_AUTO; }
bool sm90_4bit(const Layer &L) { return L.di.cc == 90 && L.sbits == 4; }

// gemv on sm_90 at M = 1 where its whole-stripe blocks fill the SMs and their rounds (gemv_auto); at M = 2-8 also
// where the staged rows leave its blocks per SM (gemv_auto_tokens)
void step_gemv(const Layer &L, Choice &c) {
  if (undecided(c) && L.gemv_ok && L.di.cc == 90 && gemv_env() != 0 &&
      (L.m == 1 ? gemv_auto(L.di, L.nstripes, L.KT, L.weights)
                : gemv_auto_tokens(L.di, (int)L.m, L.nstripes, L.KT, L.weights)))
    c.kind = W4P_CUDA_KERNEL_GEMV;
}

// bulk to M = BULK_AUTO_M, to M = 8 on L+ layers and where every block owns a whole stripe
void step_bulk(const Layer &L, Choice &c) {
  if (undecided(c) && L.bulk_ok && (L.m <= BULK_AUTO_M || ((L.bulk_big || L.bulk_one) && L.m <= 8)))
    c.kind = W4P_CUDA_KERNEL_BULK;
}

// wgmma_ws (wgmma without TMA) from M = 9 (8 on L+): to 32 everywhere, 128 on L+, WG_AUTO_MAX_M on XL, and to
// WIDE_AUTO_MAX_M on M+ where one wave of its blocks holds the grid (past WG_AUTO_MAX_M only where the last
// token tile is more than half full)
void step_wgmma(const Layer &L, Choice &c) {
  const int64_t m = L.m;
  if (!undecided(c) || !sm90_4bit(L) || !(L.gs <= 0 || L.gs % 16 == 0) || m < WS_AUTO_MIN_M) return;
  const bool large = L.weights >= SIZE_L;
  const bool one_wave = L.wg_tma && L.weights >= SIZE_M && m <= WIDE_AUTO_MAX_M &&
                        (m <= WG_AUTO_MAX_M || m % 128 == 0 || m % 128 > 64) &&
                        (int64_t)ceil_div(L.np, WG_BM) * ceil_div(m, ws_tile(m)) <=
                            (int64_t)L.sms * ws_blocks_per_sm(ws_tile(m));
  if ((m > WS_AUTO_MIN_M || large) &&
      (m <= 32 || (m <= 128 && large) || (m <= WG_AUTO_MAX_M && L.weights >= SIZE_XL) || one_wave))
    c.kind = L.wg_tma ? W4P_CUDA_KERNEL_WGMMA_WS : W4P_CUDA_KERNEL_WGMMA;
}

// wgmma_ss where its blocks (256 rows x 64/128 tokens) fill half the SMs unsplit: in wgmma_ws's range from
// M = SS_AUTO_MIN_M, in the dense path's from M = SS_AUTO_DENSE_M, to WG_AUTO_MAX_M
void step_ss(const Layer &L, Choice &c) {
  const int64_t m = L.m;
  if (!(L.gs <= 0 || L.gs % 64 == 0) || m < SS_AUTO_MIN_M || m > WG_AUTO_MAX_M) return;
  const bool in_range = c.kind == W4P_CUDA_KERNEL_WGMMA_WS ||
                        (undecided(c) && m >= SS_AUTO_DENSE_M && sm90_4bit(L) && L.di.tma && !no_tma_env());
  const int tok = m <= 64 ? 64 : 128;
  if (in_range && L.di.fits(ss_smem_bytes(tok)) && 2 * (int64_t)ceil_div(L.np, SS_BR) * ceil_div(m, tok) >= L.sms)
    c.kind = W4P_CUDA_KERNEL_WGMMA_SS;
}

// ... and wgmma_ws in 256-row blocks there where those run unsplit too (L+ layers)
void step_ws_over_ss(const Layer &L, Choice &c) {
  if (c.kind == W4P_CUDA_KERNEL_WGMMA_SS && L.m > 64 && (L.rs_env == 0 || L.rs_env == 2) &&
      ws_rows256_fit(L.di, 128, ws_ks(128, L.gs)) && L.weights >= SIZE_L &&
      ws_split_count(L.di, (int64_t)ceil_div(L.np, 2 * WG_BM) * ceil_div(L.m, 128), L.sms, L.KT, 128, 0) == 1) {
    c.kind = W4P_CUDA_KERNEL_WGMMA_WS;
    c.rows256 = true;
  }
}

// M = WG_AUTO_MAX_M + 1 to WIDE_AUTO_MAX_M: wgmma_ss where its blocks fill the waves they take (80% unsplit, or
// 90% with 4 splits of 64+ K tiles): its time is its waves' count times one block's
void step_ss_wide(const Layer &L, Choice &c) {
  const int64_t m = L.m;
  if (!(L.gs <= 0 || L.gs % 64 == 0) || m <= WG_AUTO_MAX_M || m > WIDE_AUTO_MAX_M || !sm90_4bit(L) || !L.wg_tma ||
      !(undecided(c) || c.kind == W4P_CUDA_KERNEL_WGMMA_WS) || !L.di.fits(ss_smem_bytes(128)))
    return;
  const int64_t blocks = (int64_t)ceil_div(L.np, SS_BR) * ceil_div(m, 128);
  auto fill = [&](int64_t b) { return (double)b / (double)(ceil_div(b, (int64_t)L.sms) * L.sms); };
  if (fill(blocks) >= 0.8) {
    c.kind = W4P_CUDA_KERNEL_WGMMA_SS;
    c.ss_splits = 1;
  } else if (L.KT / 4 >= 64 && fill(4 * blocks) >= 0.9) {
    c.kind = W4P_CUDA_KERNEL_WGMMA_SS;
    c.ss_splits = 4;
  }
}

// wgmma_ws in 256-row or 192-row blocks or the 256-token tile over the choices above, where their rules take them
void step_ws_blocks(const Layer &L, Choice &c) {
  if (sm90_4bit(L) && L.wg_tma && (L.gs <= 0 || L.gs % 16 == 0) && L.m > 64 &&
      (L.rows256 || L.rows192 || L.tok256_S))
    c.kind = W4P_CUDA_KERNEL_WGMMA_WS;
}

// what is left: the ring kernel where every resident warp gets a long run of units, else the stream kernel to
// M = 32, else the tiled plan (dequantize + cuBLAS on the Python side from M = 33)
void step_fallback(const Layer &L, Choice &c) {
  if (!undecided(c)) return;
  const bool ring_wins = L.ring_ok && L.m <= RING_MAX_M && L.ring_units >= RING_MIN_UNITS * L.ring_cap;
  c.kind = ring_wins ? W4P_CUDA_KERNEL_RING
           : (L.m <= 32 && L.stream_ok) ? W4P_CUDA_KERNEL_STREAM
                                        : W4P_CUDA_KERNEL_TILED;
}

// The auto steps in the order they apply; a later step may override an earlier one's choice
struct AutoStep {
  const char *name;
  void (*apply)(const Layer &, Choice &);
};
constexpr AutoStep AUTO_STEPS[] = {
    {"gemv", step_gemv},   {"bulk", step_bulk},           {"wgmma", step_wgmma},         {"ss", step_ss},
    {"ws_over_ss", step_ws_over_ss}, {"ss_wide", step_ss_wide}, {"ws_blocks", step_ws_blocks},
    {"fallback", step_fallback},
};

Choice choose(const Layer &L, int kernel) {
  Choice c;
  if (kernel != W4P_CUDA_KERNEL_AUTO) {
    // probes run their kernel's plan (and get its errors)
    c.kind = kernel == W4P_CUDA_PROBE_BULK ? W4P_CUDA_KERNEL_BULK
             : kernel == W4P_CUDA_PROBE_WS ? W4P_CUDA_KERNEL_WGMMA_WS
             : kernel == W4P_CUDA_PROBE_SS ? W4P_CUDA_KERNEL_WGMMA_SS
                                           : kernel;
    return c;
  }
  for (const AutoStep &s : AUTO_STEPS) s.apply(L, c);
  return c;
}

// Refusals of a forced kernel the layer or device cannot take (auto never picks one)
int refuse(const Layer &L, int kind) {
  const DevInfo &di = L.di;
  if (kind != W4P_CUDA_KERNEL_TILED && kind != W4P_CUDA_KERNEL_WGMMA && kind != W4P_CUDA_KERNEL_WGMMA_WS &&
      kind != W4P_CUDA_KERNEL_WGMMA_SS && kind != W4P_CUDA_KERNEL_GEMV && !L.stream_ok)
    return fail(W4P_EUNSUPPORTED, "group size %d: the stream kernel needs a multiple of 32 (use auto or tiled)", L.gs);
  if (kind == W4P_CUDA_KERNEL_RING && !L.ring_ok)
    return fail(W4P_EUNSUPPORTED, "the ring kernel takes M <= 8 and at most %d row stripes (m=%lld, n=%d)",
                MAX_COUNTERS * RQ, (long long)L.m, L.n);
  if (kind == W4P_CUDA_KERNEL_GEMV && !L.gemv_ok && L.m > GV_MAX_M)
    return fail(W4P_EUNSUPPORTED, "the gemv kernel takes M <= %d (m=%lld)", GV_MAX_M, (long long)L.m);
  const long long ring = (long long)gv_ring(2, gv_ts(L.gs));  // (a ring build's, as gemv_ok counts it)
  if (kind == W4P_CUDA_KERNEL_GEMV && !L.gemv_ok)
    return fail(W4P_EUNSUPPORTED, "the gemv kernel takes M <= %d, 4-bit layers, compute capability 8.0 or newer "
                "(this device: %d.%d), a group size that is a multiple of 32 or per channel, and K up to %lld at "
                "this M (its rows are staged in shared memory; m=%lld, k=%d)", GV_MAX_M, di.cc / 10, di.cc % 10,
                L.m == 1 ? (di.smem_block - di.smem_reserved - ring - GV_RED) / 128 * 64
                         : ((di.smem_block - di.smem_reserved - ring) / L.m - GV_RED - 16) / 128 * 64,
                (long long)L.m, L.k);
  if (kind == W4P_CUDA_KERNEL_BULK && !L.bulk_ok)
    return fail(W4P_EUNSUPPORTED, "the bulk kernel needs compute capability 9.0 or newer (this device: %d.%d), "
                "M <= %d and a group size that is a multiple of 32", di.cc / 10, di.cc % 10, BULK_MAX_M);
  return W4P_OK;
}

size_t gather_bytes(const Layer &L) { return (((size_t)L.m * L.kp * 2 + 255) / 256) * 256; }

// gemv: whole stripes per block, as many blocks as the SMs hold (zero mode none's launch bound and shared memory;
// the launch takes the blocks per SM from the kernel's occupancy: one fewer for the heavier kinds), at most one
// per stripe
int plan_gemv(const Layer &L, Plan *pl) {
  pl->W = std::min<int64_t>(L.nstripes, gv_grid(L.di, L.KT, (int)L.m));
  pl->smem = gv_smem(L.KT, (int)L.m, gv_ring(0, gv_ts(L.gs)));
  pl->tiles = L.nstripes;
  pl->pdl = L.di.cc >= 90;
  pl->ws_total = COUNTER_BYTES;
  return W4P_OK;
}

// bulk: units of one stripe (bulk_one, or W4P_CUDA_BULK_QS=1) or four; two stages for units of 12 or 16 tiles,
// as many as fit for units of 8 (at most BMAXS); splits > 0 forces the stages (sweeps, tests)
int plan_bulk(const Layer &L, int splits, Plan *pl) {
  const DevInfo &di = L.di;
  const int mm = (int)L.m, sbits = L.sbits;
  const bool large = L.weights >= SIZE_XL;
  const int forced = sbits == 4 && L.m <= 8 ? bulk_ct_env() : 0;  // W4P_CUDA_BULK_CT: a four-stripe unit size
  const int qs_env = bulk_qs_env();
  const bool single = sbits == 4 && L.m <= 8 && (qs_env == 1 || (qs_env == 0 && !forced && L.bulk_one));
  const int qs = single ? 1 : BQ;
  if ((L.nstripes + qs - 1) / qs > MAX_COUNTERS)
    return fail(W4P_EUNSUPPORTED, "bulk kernel: %d stripes exceed its %d counters", L.nstripes, MAX_COUNTERS * qs);
  const int fix = bulk_fix(L.m > 8 ? 2 : 1, qs);
  // longer four-stripe units only where two of their stages fit a block's share
  int ct = single ? BCT1 : forced ? forced : bulk_ct(sbits, mm, L.np, L.kp, L.sms, large);
  while (!single && !forced && ct > 8 && splits <= 0 && !bulk_two_stages_fit(sbits, mm, L.gs, ct, qs, L.bulk_budget))
    ct = ct == 16 ? 12 : 8;
  const int per_stage = bulk_stage_bytes(sbits, mm, L.gs, ct, qs);
  int ns = splits > 0 ? splits : ct > 8 ? 2 : (L.bulk_budget - fix) / per_stage;
  if (splits <= 0 && ns < 2) ns = (di.smem_block - fix) / per_stage;
  ns = std::min(ns, BMAXS);
  if (ns < 2 || (size_t)bulk_smem_bytes(sbits, mm, L.gs, ns, ct, qs) > (size_t)di.smem_block)
    return fail(W4P_EUNSUPPORTED, "bulk kernel: %d stages of %d bytes do not fit the device's %d bytes of shared "
                "memory per block", std::max(ns, 2), per_stage, di.smem_block);
  const int nq = (L.nstripes + qs - 1) / qs;
  const int kg = bulk_granule(ct, large, single, L.KT);
  const int64_t total = (int64_t)nq * ((L.KT + kg - 1) / kg);
  pl->qs = qs;
  pl->ct = ct;
  pl->kg = kg;
  pl->W = std::min<int64_t>(total, (int64_t)L.sms * BBPS);
  pl->S = ns;
  pl->KC = ns;
  pl->NI = L.m > 8 ? 2 : 1;
  pl->TB = 1;
  pl->tiles = nq;
  pl->smem = bulk_smem_bytes(sbits, mm, L.gs, ns, ct, qs);
  pl->gather = L.act_order || !L.x_aligned || (L.k % 64) != 0;
  pl->ws_gather = pl->gather ? gather_bytes(L) : 0;
  pl->ws_part = (size_t)pl->W * 2 * L.m * qs * 16 * 4;
  pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
  return W4P_OK;
}

// ring: stream-K over resident warps, grid = what fits at once, each warp at least RING_LMIN units; splits > 0
// forces the units per warp (sweeps, tests)
int plan_ring(const Layer &L, int splits, Plan *pl) {
  if (L.ring_blk > (size_t)L.di.smem_block)
    return fail(W4P_EUNSUPPORTED, "ring kernel: %zu bytes of shared memory per block exceed the device's %d",
                L.ring_blk, L.di.smem_block);
  const int64_t total = L.ring_units, cap = L.ring_cap;
  const int64_t per_warp = splits > 0 ? splits : std::max<int64_t>(RING_LMIN, (total + cap - 1) / cap);
  int64_t W = (total + per_warp - 1) / per_warp;
  if (W > total) W = total;
  if (W < 1) W = 1;
  pl->W = W;
  pl->S = (int)std::min<int64_t>(W, 1 << 30);
  pl->NI = 1;
  pl->TB = 1;
  pl->tiles = (L.nstripes + RQ - 1) / RQ;
  pl->smem = L.ring_blk;
  pl->gather = L.act_order || !L.x_aligned || (L.k % 8) != 0;
  pl->ws_gather = pl->gather ? gather_bytes(L) : 0;
  pl->ws_part = (size_t)W * 2 * L.m * RQ * 16 * 4;
  pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
  return W4P_OK;
}

// stream (and its probes, the M <= 8 variant): split K to about one wave of resident blocks at M <= 8 (4 per
// SM, never more: a partial second wave is a tail), about two blocks per SM and 16+ tiles per warp above
void plan_stream(const Layer &L, int kind, int splits, Plan *pl) {
  int NI = (int)(L.m > 16 ? 4 : ceil_div(L.m, 8));  // 1, 2 or 4 n8 tiles of tokens per block
  if (kind != W4P_CUDA_KERNEL_STREAM) NI = 1;
  const int MI = NI == 1 ? 1 : 2;
  const int KC = NI == 1 ? 24 : NI == 2 ? 16 : 8;  // ~25-33 KB of activations per chunk buffer
  pl->NI = NI;
  pl->MI = MI;
  pl->KC = KC;
  pl->TB = ceil_div(L.m, NI * 8);
  pl->tiles = ceil_div(L.np, SW * MI * 16) * pl->TB;
  int S = splits;
  if (S <= 0) {
    S = NI == 1 ? (int)((int64_t)L.sms * 4 / pl->tiles) : (int)(((int64_t)L.sms * 2 + pl->tiles / 2) / pl->tiles);
    const int smax = std::max(1, NI == 1 ? L.KT / 8 : L.KT / 16);
    S = std::max(1, std::min(S, smax));
  }
  pl->S = std::min(S, L.KT);
  pl->smem = 2 * stream_buf_bytes(NI, MI, KC, L.gs);
}

// tiled: one block per output tile, split K only to fill the SMs (at least 8 K tiles a split)
void plan_tiled(const Layer &L, int splits, Plan *pl) {
  pl->TB = ceil_div(L.m, TBN);
  pl->tiles = ceil_div(L.np, TBM) * pl->TB;
  int S = splits;
  if (S <= 0) {
    S = 1;
    if (pl->tiles < L.sms) S = std::min(ceil_div(L.sms, pl->tiles), std::max(1, L.KT / 8));
  }
  pl->S = std::min(S, L.KT);
  pl->gather = L.act_order || !L.x_aligned || (L.k % 8) != 0;
  pl->smem = L.sbits == 4 ? TiledCfg<4>::SMEM : TiledCfg<8>::SMEM;
}

int needs_sm90_4bit(const Layer &L, const char *name, int gs_multiple) {
  if (L.di.cc != 90 || L.sbits != 4 || !(L.gs <= 0 || L.gs % gs_multiple == 0))
    return fail(W4P_EUNSUPPORTED, "the %s kernel needs compute capability 9.0 (this device: %d.%d), 4-bit "
                "storage and a group size that is a multiple of %d%s", name, L.di.cc / 10, L.di.cc % 10,
                gs_multiple, gs_multiple == 64 ? " (or per channel)" : "");
  return W4P_OK;
}

// wgmma (without TMA): token tile 64 to M = 64 (two blocks per SM), else 128; W4P_CUDA_WGMMA_KP / _AS tuning
int plan_wgmma(const Layer &L, int splits, Plan *pl) {
  if (int rc = needs_sm90_4bit(L, "wgmma", 16)) return rc;
  const int bn = L.m <= 64 ? 64 : 128;
  int kpt = 1;  // one K tile per step (two hold both tiles' fragments: slower at M = 16..256)
  if (const char *e = wgmma_kp_env()) kpt = e[0] == '2' ? 2 : 1;
  bool as = false;
  if (const char *e = wgmma_as_env()) as = e[0] == '1' && bn == 64;
  if (as) kpt = 1;
  if (!L.di.fits(wg_smem_bytes(bn, kpt, as)))
    return fail(W4P_EUNSUPPORTED, "the wgmma kernel needs %d bytes of shared memory per block",
                wg_smem_bytes(bn, kpt, as));
  const int nrb = ceil_div(L.np, WG_BM);
  if (nrb > 65535) return fail(W4P_EUNSUPPORTED, "the wgmma kernel takes at most %d rows", 65535 * WG_BM);
  pl->bn = bn;
  pl->kp = kpt;
  pl->as = as;
  pl->TB = ceil_div(L.m, bn);
  pl->tiles = nrb * pl->TB;
  pl->S = wg_splits(splits, pl->tiles, (int64_t)L.sms * ((bn == 64 || kpt == 1) ? 2 : 1), L.KT);
  pl->smem = wg_smem_bytes(bn, kpt, as);
  pl->gather = L.act_order || !L.x_aligned || (L.k % 64) != 0;
  return W4P_OK;
}

// wgmma_ws: token tile 16/32/64/128 by M, or 256 (ws_tok256, W4P_CUDA_WS_TOK); 128-, 192- or 256-row blocks by
// their rules or the forced height; split K as the wgmma kernel, or stream-K over resident 256-row blocks where
// the plain grid's waves would leave SMs idle
int plan_ws(const Layer &L, int kernel, int splits, bool rows256_auto, Plan *pl) {
  if (int rc = needs_sm90_4bit(L, "wgmma_ws", 16)) return rc;
  const DevInfo &di = L.di;
  const int rs_env = L.rs_env, tok_env = L.tok_env;
  const bool tok256 = (L.m > 128 && tok_env == 256 && rs_env == 0 && ws_tok256_fit(di)) || L.tok256_S > 0;
  const int bn = tok256 ? 256 : ws_tile(L.m);
  const int ks = tok256 ? ws_tok256_ks() : ws_ks(bn, L.gs);
  if (!di.fits(ws_smem_bytes(bn, ks)))
    return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel needs %d bytes of shared memory per block",
                ws_smem_bytes(bn, ks));
  const int rs = tok256                                                    ? 1
                 : rs_env == 2 && ws_rows256_fit(di, bn, ks)               ? 2
                 : rs_env == 0 && !L.rows192 && (rows256_auto || L.rows256) ? 2
                                                                           : 1;
  const int cw = !tok256 && rs == 1 && (rs_env == 3 || L.rows192) && ws_rows192_fit(di, bn, ks) ? 3 : 2;
  pl->rs = rs;
  pl->cw = cw;
  const int rb = 64 * cw * rs;  // rows per block
  const int nrb = ceil_div(L.np, rb);
  if (nrb > 65535) return fail(W4P_EUNSUPPORTED, "the wgmma_ws kernel takes at most %d rows", 65535 * rb);
  pl->bn = bn;
  pl->TB = ceil_div(L.m, bn);
  pl->tiles = nrb * pl->TB;
  const int64_t slots = (int64_t)L.sms * ws_blocks_per_sm(bn, rs);
  pl->S = L.tok256_S && splits <= 0 && tok_env != 256 ? L.tok256_S
                                                       : ws_split_count(di, pl->tiles, slots, L.KT, bn, splits);
  pl->smem = ws_smem_bytes(bn, ks, rs, cw);
  pl->kp = ks;
  const int sk_env = ws_sk_env();
  const int64_t units = (int64_t)pl->tiles * ceil_div(L.KT, ks);
  if (rs == 2 && kernel != W4P_CUDA_PROBE_WS && splits <= 0 && pl->tiles <= MAX_COUNTERS / 4 &&
      (sk_env == 1 || (sk_env < 0 && ws_sk_auto(pl->tiles, pl->tiles * pl->S, slots)))) {
    pl->sk = (int)std::min<int64_t>(slots, units);
    pl->sk_plain_S = pl->S;
    pl->S = 1;
  }
  pl->gather = L.act_order || !L.x_aligned;  // TMA zero-fills columns past K: no gather for ragged K
  return W4P_OK;
}

// wgmma_ss: 256 weight rows x 64 tokens per block to M = 64, else x 128 (W4P_CUDA_SS_TOK forces it); one block
// per SM; split K as the other wgmma kernels
int plan_ss(const Layer &L, int splits, int ss_auto_splits, Plan *pl) {
  if (int rc = needs_sm90_4bit(L, "wgmma_ss", 64)) return rc;
  if (!L.di.tma)
    return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs the driver's TMA descriptor encoder (this driver has none)");
  int tok = L.m <= 64 ? 64 : 128;
  if (const char *e = ss_tok_env()) tok = strcmp(e, "64") == 0 ? 64 : strcmp(e, "128") == 0 ? 128 : tok;
  if (!L.di.fits(ss_smem_bytes(tok)))
    return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel needs %d bytes of shared memory per block", ss_smem_bytes(tok));
  const int nrb = ceil_div(L.np, SS_BR);
  if (nrb > 65535) return fail(W4P_EUNSUPPORTED, "the wgmma_ss kernel takes at most %d rows", 65535 * SS_BR);
  pl->bn = tok;
  pl->kp = ss_ks(tok);
  pl->TB = ceil_div(L.m, tok);
  pl->tiles = nrb * pl->TB;
  pl->S = wg_splits(splits > 0 ? splits : ss_auto_splits, pl->tiles, (int64_t)L.sms, L.KT);
  pl->smem = ss_smem_bytes(tok);
  pl->gather = L.act_order || !L.x_aligned;  // TMA zero-fills columns past K
  return W4P_OK;
}

// The workspace of the split kernels: counters, gathered activations, partial sums (stream-K's two slots per
// block, or the plain grid where the caller's workspace cannot hold them; splits halved until it holds them),
// and whether a tile's splits sum in a cluster's shared memory
void size_workspace(const Layer &L, size_t ws_avail, Plan *pl) {
  if (pl->S > 1 && pl->tiles > MAX_COUNTERS) pl->S = 1;
  pl->ws_gather = pl->gather ? gather_bytes(L) : 0;
  auto part_bytes = [&](int S) { return S > 1 ? (size_t)S * L.m * L.np * 4 : 0; };
  const size_t sk_bytes = (size_t)2 * pl->sk * pl->bn * WG_BM * pl->rs * 4;
  if (pl->sk && COUNTER_BYTES + pl->ws_gather + sk_bytes > ws_avail) {
    pl->sk = 0;
    pl->S = pl->sk_plain_S;
  }
  while (pl->S > 1 && COUNTER_BYTES + pl->ws_gather + part_bytes(pl->S) > ws_avail)
    pl->S = pl->S / 2 > 1 ? pl->S / 2 : 1;
  pl->ws_part = pl->sk ? sk_bytes : part_bytes(pl->S);
  pl->ws_total = COUNTER_BYTES + pl->ws_gather + pl->ws_part;
  pl->cl = (pl->kernel == W4P_CUDA_KERNEL_WGMMA_WS || pl->kernel == W4P_CUDA_KERNEL_WGMMA_SS) && pl->S > 1 &&
           pl->S <= CLUSTER_MAX && !no_cluster_env();
}

}  // namespace

int make_plan(const DevInfo &di, int64_t m, int n, int k, int sbits, int gs, bool act_order, bool x_aligned,
              int kernel, int splits, size_t ws_avail, Plan *pl) {
  const Layer L = describe_layer(di, m, n, k, sbits, gs, act_order, x_aligned);
  const Choice c = choose(L, kernel);
  if (int rc = refuse(L, c.kind)) return rc;
  pl->kernel = c.kind;
  int rc = W4P_OK;
  switch (c.kind) {
    case W4P_CUDA_KERNEL_GEMV: return plan_gemv(L, pl);
    case W4P_CUDA_KERNEL_BULK: return plan_bulk(L, splits, pl);
    case W4P_CUDA_KERNEL_RING: return plan_ring(L, splits, pl);
    case W4P_CUDA_KERNEL_STREAM:
    case W4P_CUDA_PROBE_LOAD:
    case W4P_CUDA_PROBE_DEQUANT: plan_stream(L, c.kind, splits, pl); break;
    case W4P_CUDA_KERNEL_TILED: plan_tiled(L, splits, pl); break;
    case W4P_CUDA_KERNEL_WGMMA: rc = plan_wgmma(L, splits, pl); break;
    case W4P_CUDA_KERNEL_WGMMA_WS: rc = plan_ws(L, kernel, splits, c.rows256, pl); break;
    case W4P_CUDA_KERNEL_WGMMA_SS: rc = plan_ss(L, splits, c.ss_splits, pl); break;
    default: return fail(W4P_EINVAL, "unknown kernel %d", kernel);
  }
  if (rc) return rc;
  size_workspace(L, ws_avail, pl);
  return W4P_OK;
}

bool stream_gathers(int gs) { return gs <= 0 || gs % 32 == 0; }

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
