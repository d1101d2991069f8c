// The rules make_plan applies, by kernel family (planner_decode.cpp, planner_wgmma.cpp). Host-only C++.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "planner.h"

namespace w4p {

// decode kernels (planner_decode.cpp)
int64_t gv_grid(const DevInfo &di, int KT, int m);
bool gemv_auto(const DevInfo &di, int ns, int KT, int64_t weights);
bool gemv_auto_tokens(const DevInfo &di, int m, int ns, int KT, int64_t weights);
int64_t bulk_max_tiles(int nq, int KT, int ct, int64_t W);
int bulk_ct(int sbits, int m, int np, int kp, int sms, bool large);
int bulk_granule(int ct, bool large, bool single, int KT);
bool bulk_two_stages_fit(int sbits, int m, int gs, int ct, int qs, int budget);

// wgmma kernels (planner_wgmma.cpp)
struct WsCosts {
  double others, r192;
};
int64_t cluster_fill_estimate(int64_t slots, int s);
int wg_splits(int splits, int64_t tiles, int64_t slots, int KT, int kmin = 8);
int ws_split_count(const DevInfo &di, int64_t tiles, int64_t slots, int KT, int bn, int splits);
bool ws_rows256_fit(const DevInfo &di, int bn, int ks);
bool ws_tok256_fit(const DevInfo &di);
bool ws_rows192_fit(const DevInfo &di, int bn, int ks);
bool ws_rows256(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights);
bool ws_sk_auto(int64_t tiles, int64_t blocks, int64_t slots);
double ws_waves(int64_t t, int64_t slots);
WsCosts ws_costs(const DevInfo &di, int64_t m, int np, int KT, int gs, bool rows256);
bool ws_rows192(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights, bool rows256);
int ws_tok256(const DevInfo &di, int64_t m, int np, int KT, int gs, int64_t weights, bool rows256);

}  // namespace w4p
