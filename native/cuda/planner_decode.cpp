// The planner's rules for the decode kernels (gemv, bulk): which grid the gemv kernel fills, the bulk kernel's
// unit, granule and stages. Host-only C++.
#include <string.h>
#include <algorithm>
#include "planner.h"
#include "planner_rules.h"
#include "switches.h"
#include "planner_parts.h"

namespace w4p {

// The gemv kernel's resident blocks at M tokens: its launch bound (zero mode none's) and shared memory
int64_t gv_grid(const DevInfo &di, int KT, int m) {
  const size_t smem = gv_smem(KT, m, gv_ring(0, GV_U));
  return (int64_t)di.sms * std::max(1, std::min(GV_B, (int)(di.smem_sm / (smem + di.smem_reserved))));
}
// Whether the gemv kernel's whole-stripe blocks fill the GPU well enough: at least `sms` stripes per SM and, on
// layers of SIZE_L weights or more, rounds of blocks `full` full on average (stripes >= full x rounds x blocks).
// A block sums whole stripes: with fewer stripes than SMs some SMs idle, and a round costs as much however few of
// its blocks have work, which counts where the stripes are long. The bulk kernel splits K instead and keeps every
// SM busy, at a lower rate per byte and with a larger fixed cost per call. The grid is zero mode none's (the
// heavier kinds run one block per SM: their rule is evaluated for a grid they do not launch, as measured with
// zero mode none only).
static bool gemv_fills(const DevInfo &di, int ns, int KT, int64_t weights, double sms, double full) {
  const int64_t g = gv_grid(di, KT, 1), rounds = (ns + g - 1) / g;
  if ((double)ns < sms * (double)di.sms) return false;
  return weights < SIZE_L || (double)ns >= full * (double)(rounds * g);
}

// "auto" takes the gemv kernel at M = 1 from 32 stripes on 132 SMs and, on L+, where its rounds are 60% full. With
// the row staged 8 activations a load, gemv led bulk on every layer measured below the M = 3-8 threshold, on an
// H200 (journal section 20, us, gemv / bulk): 4096x512 2.9 / 3.2, 4096x1024 3.0-3.1 / 3.6, 8192x1024 5.0 / 5.9,
// 14336x1024 7.7 / 8.4, 2048x1024 2.0 / 2.6, 13824x5120 (2^26 weights in two rounds 61% full) 17.0-17.4 /
// 19.6-19.7. Fewer stripes were not measured.
bool gemv_auto(const DevInfo &di, int ns, int KT, int64_t weights) {
  return gemv_fills(di, ns, KT, weights, GEMV_SMS, GEMV_FULL);
}

// "auto" takes the gemv kernel at M = 2-8 (one token per MMA column) where its blocks fill the GPU and the staged
// rows leave it the resident blocks per SM it has at M = 1. Filling: at M = 2 from the M = 1 rule's stripes per SM,
// at M = 3-8 from the older threshold (journal section 9), and on L+ rounds 70% full at M = 2-8. Against the bulk
// kernel (H100, docs/journal/2026-cuda.md sections 17 and 18): 7-31% less time on the 7B shapes wherever that
// holds (4096x4096 at M = 8 7.0 against 8.7 us, 4096x12288 13.8 against 18.2); 2-21% on the larger ones to M = 4
// (8192x8192 at M = 2 15.2 against 19.2 us, 8192x28672 47.1 against 48.8) and at M = 6 all but 8192x28672 (50.1
// against 49.5); with one block per SM fewer from level to 4-7% either way (11008x4096 at M = 8 16.6 against 16.2
// us), and 15% behind on 28672x8192 at M = 2 (57 against 49.5). On the layers of fewer stripes (sections 20, 21),
// at M = 2 gemv led or was level on both GPUs (H100: 4096x1024 3.4 against 3.8 us, 2048x1024 2.2 against 2.8,
// 4096x512 3.3 both) except 13824x5120 (rounds 61% full: H100 21.0 against 19.8, H200 17.8 against 18.8), which
// the 70% keeps on bulk; mixed at M = 4 and behind at M = 8 (H200, 4096x512 4.6 against 3.9): from M = 3 they
// keep bulk.
bool gemv_auto_tokens(const DevInfo &di, int m, int ns, int KT, int64_t weights) {
  return m >= 2 && m <= GV_MAX_M && gv_grid(di, KT, m) == gv_grid(di, KT, 1) &&
         gemv_fills(di, ns, KT, weights, m == 2 ? GEMV_SMS : GEMV_TOK_SMS, GEMV_TOK_FULL);
}

// The tiles the busiest of W blocks gets when the bulk kernel's stream-K granule is a whole unit of ct tiles
// (nq quads of KT tiles): ceil(units / W) whole units. (A quad's last unit may be shorter; this bound ignores
// that, which keeps it O(1): the planner runs on every call. On the Llama shapes it ranks the unit sizes as
// the exact per-block count does.)
int64_t bulk_max_tiles(int nq, int KT, int ct, int64_t W) {
  const int64_t total = (int64_t)nq * ((KT + ct - 1) / ct);
  return (total + W - 1) / W * ct;
}

// The bulk kernel's tiles per unit. 8-bit layers and M > 8 keep 8 (a 16-tile stage would not fit twice per
// block; two n8 token blocks with 16 tiles spill registers). 4-bit layers of 2^26 weights or more (the 70B
// shapes) take 16; smaller ones the unit size that gives the busiest block the fewest tiles, 12 before 16
// before 8 where they tie. Measured on an H200 (docs/journal/2026-cuda.md, M = 1-8): 16 took 43.6 against 48.6 us at
// M = 1 on 8192x28672 and 47 against 57-60 at M = 6-8; on the 7B shapes the unit that balances the blocks
// best was fastest or within 3%, except 4096x12288 at M = 2-4 (16 there, 4-7% behind 8).
int bulk_ct(int sbits, int m, int np, int kp, int sms, bool large) {
  if (sbits != 4 || m > 8) return 8;
  if (large) return 16;
  const int nq = (np / 16 + BQ - 1) / BQ, KT = kp / 64;
  int best = 12;
  int64_t best_t = bulk_max_tiles(nq, KT, 12, (int64_t)sms * BBPS);
  for (int ct : {16, 8}) {
    const int64_t t = bulk_max_tiles(nq, KT, ct, (int64_t)sms * BBPS);
    if (t < best_t) {
      best = ct;
      best_t = t;
    }
  }
  return best;
}

// The bulk kernel's stream-K granule: whole stripes for units of one stripe (each block owns at most one), single
// tiles on layers of 2^26 weights or more (every block the same work to within a tile: 3% faster at M = 4-8 on
// the 70B shapes), else whole units (fewer chunks and shared quads per block: 5-10% faster on the 7B shapes).
// W4P_CUDA_BULK_GRANULE=tile|unit|quad forces it (tests, sweeps; quad: a whole stripe group's K range).
int bulk_granule(int ct, bool large, bool single, int KT) {
  const char *e = bulk_granule_env();
  if (e && strcmp(e, "tile") == 0) return 1;
  if (e && strcmp(e, "unit") == 0) return ct;
  if (e && strcmp(e, "quad") == 0) return KT;
  return single ? KT : large ? 1 : ct;
}

// Two stages of a bulk unit (ct tiles of qs stripes) fit `budget` bytes of shared memory: a block's share
bool bulk_two_stages_fit(int sbits, int m, int gs, int ct, int qs, int budget) {
  return bulk_fix(m > 8 ? 2 : 1, qs) + 2 * bulk_stage_bytes(sbits, m, gs, ct, qs) <= budget;
}

}  // namespace w4p
