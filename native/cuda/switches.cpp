#include <stdlib.h>
#include <string.h>
#include "switches.h"

namespace w4p {

// W4P_CUDA_NO_TMA=1: plan as on a driver without the TMA encoder (tests of auto's fallback; read at each call)
bool no_tma_env() {
  const char *e = getenv("W4P_CUDA_NO_TMA");
  return e && e[0] == '1';
}
// W4P_CUDA_CLUSTER=0: the wgmma_ws / wgmma_ss splits sum through the workspace, not within a cluster (A/B runs)
bool no_cluster_env() {
  const char *e = getenv("W4P_CUDA_CLUSTER");
  return e && e[0] == '0';
}
// W4P_CUDA_WS_ROWS=128|192|256 (or W4P_CUDA_WS_RS=1|2: 128 or 256): the wgmma_ws 128-token tile's rows per block
// instead of the planner's choice (A/B runs, tests; read at each call). Returns 1 (128), 2 (256), 3 (192) or 0.
int ws_rs_env() {
  if (const char *e = getenv("W4P_CUDA_WS_ROWS")) {
    const int v = atoi(e);
    if (v == 128 || v == 192 || v == 256) return v == 128 ? 1 : v == 256 ? 2 : 3;
  }
  const char *e = getenv("W4P_CUDA_WS_RS");
  const int v = e ? atoi(e) : 0;
  return v == 1 || v == 2 ? v : 0;
}
// W4P_CUDA_WS_TOK=256: wgmma_ws's 256-token tile (128-row blocks) from M = 129 instead of the planner's choice;
// W4P_CUDA_WS_TOK=128: never (A/B runs, tests). Returns 256, 128 or 0. W4P_CUDA_WS_TOK_KS=1|2: its K tiles per
// stage.
int ws_tok_env() {
  const char *e = getenv("W4P_CUDA_WS_TOK");
  const int v = e ? atoi(e) : 0;
  return v == 256 || v == 128 ? v : 0;
}
int ws_tok256_ks() {
  const char *e = getenv("W4P_CUDA_WS_TOK_KS");
  return e && strcmp(e, "2") == 0 ? 2 : 1;
}
// W4P_CUDA_WS_SK=0|1: wgmma_ws's 256-row blocks stream-K or not, instead of the planner's choice (A/B runs, tests;
// where the 256-token tile's rule takes a plan, it holds: the wave model ranks forced stream-K among the others)
int ws_sk_env() {
  const char *e = getenv("W4P_CUDA_WS_SK");
  return e && (e[0] == '0' || e[0] == '1') && e[1] == 0 ? e[0] - '0' : -1;
}
// W4P_CUDA_PDL=0|1|2: the sm_90 kernels' programmatic dependent launch (pdl_start): 0 off, 1 (the default) with
// the early trigger of the next launch, 2 without it (A/B runs and tests; read at each call)
int pdl_env() {
  const char *e = getenv("W4P_CUDA_PDL");
  return e && e[0] >= '0' && e[0] <= '2' && e[1] == 0 ? e[0] - '0' : 1;
}
// W4P_CUDA_GEMV=0: "auto" does not take the gemv kernel (A/B runs and tests; read at each call)
int gemv_env() {
  const char *e = getenv("W4P_CUDA_GEMV");
  return e && e[0] == '0' && e[1] == 0 ? 0 : 1;
}
// W4P_CUDA_BULK_CT=8|12|16: the bulk kernel's tiles per unit on 4-bit layers instead of the planner's choice
// (sweeps and tests; read at each call)
int bulk_ct_env() {
  const char *e = getenv("W4P_CUDA_BULK_CT");
  const int v = e ? atoi(e) : 0;
  return v == 8 || v == 12 || v == 16 ? v : 0;
}
// W4P_CUDA_BULK_QS=1|4: the bulk kernel's stripes per unit instead of the planner's choice (sweeps and tests;
// read at each call; 1 only on 4-bit layers at M <= 8)
int bulk_qs_env() {
  const char *e = getenv("W4P_CUDA_BULK_QS");
  const int v = e ? atoi(e) : 0;
  return v == 1 || v == 4 ? v : 0;
}
// W4P_CUDA_BULK_GRANULE=tile|unit|quad: the bulk kernel's stream-K granule (bulk_granule)
const char *bulk_granule_env() { return getenv("W4P_CUDA_BULK_GRANULE"); }
// W4P_CUDA_WGMMA_KP=1|2: the wgmma kernel's K tiles per step (tuning)
const char *wgmma_kp_env() { return getenv("W4P_CUDA_WGMMA_KP"); }
// W4P_CUDA_WGMMA_AS=1: the wgmma kernel's A-through-shared-memory variant (token tile 64; tuning)
const char *wgmma_as_env() { return getenv("W4P_CUDA_WGMMA_AS"); }
// W4P_CUDA_SS_TOK=64|128: the wgmma_ss kernel's token tile
const char *ss_tok_env() { return getenv("W4P_CUDA_SS_TOK"); }
bool debug_env() {
  const char *env = getenv("W4P_CUDA_DEBUG");
  return env && env[0] == '1';
}

}  // namespace w4p
