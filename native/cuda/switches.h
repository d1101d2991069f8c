// Run-time switches (W4P_CUDA_* environment variables) for A/B runs, sweeps and tests: each forces one planner
// or launch choice, read at each call. Ordinary use sets none of them. The full list, with what each forces, is
// in docs/CUDA.md ("Switches"); the build's own variables (W4P_CUDA_ARCHS, _OUT, _FORCE, _DEFINES) are not
// read here.
#pragma once

namespace w4p {

bool no_tma_env();       // W4P_CUDA_NO_TMA=1
bool no_cluster_env();   // W4P_CUDA_CLUSTER=0
int ws_rs_env();         // W4P_CUDA_WS_ROWS, W4P_CUDA_WS_RS
int ws_tok_env();        // W4P_CUDA_WS_TOK
int ws_tok256_ks();      // W4P_CUDA_WS_TOK_KS
int ws_sk_env();         // W4P_CUDA_WS_SK
int pdl_env();           // W4P_CUDA_PDL
int gemv_env();          // W4P_CUDA_GEMV
int bulk_ct_env();       // W4P_CUDA_BULK_CT
int bulk_qs_env();       // W4P_CUDA_BULK_QS
const char *bulk_granule_env();  // W4P_CUDA_BULK_GRANULE
const char *wgmma_kp_env();      // W4P_CUDA_WGMMA_KP
const char *wgmma_as_env();      // W4P_CUDA_WGMMA_AS
const char *ss_tok_env();        // W4P_CUDA_SS_TOK
bool debug_env();                // W4P_CUDA_DEBUG=1 (launch.cuh: occupancy and cluster residency on stderr)

}  // namespace w4p
