// The arguments of every GEMM kernel, filled by the ABI (abi.cu) and the launch table. Plain C++.
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace w4p {

struct Params {
  const void *x;      // [M][ldx]
  void *y;            // [M][ldy]
  const uint32_t *qw; // layout v1
  const void *scales, *zeros, *mins, *bias;
  const int32_t *perm;
  float *part;        // [S][M][Np] fp32 partial sums (split-K)
  unsigned *counters; // one per output tile
  int64_t ldx, ldy, M;
  int N, K, Np, Kp, KT;  // KT = Kp / 64
  int gs, zm;            // group size (-1: per channel), zero mode
  unsigned gmul;         // group_of's multiplier: ceil(2^32 / gs), 0 per channel
  int S, TB;             // splits, token blocks
  int KC;                // stream kernel: tiles per staged chunk
  int xvec;              // stream: x rows 16-byte loadable; tiled: x readable with cp.async (else gathered)
  int kx;                // tiled: valid K extent of the (possibly gathered) activations
  unsigned sink;         // probe modes: a value the checksum never equals
  int64_t W;             // ring kernel: workers (warps) sharing the weight stream
  int probe;             // bulk, wgmma_ws kernels: 1 = copies only, no arithmetic (the copy pipeline's rate)
  int kg;                // bulk kernel: tiles per stream-K granule (1, or the unit size: whole units per block)
  int cl;                // wgmma_ws, wgmma_ss with splits: launched as clusters of the S splits (cluster_reduce)
  int sk;                // wgmma_ws stream-K: its output tiles (over a grid of resident blocks); 0 otherwise
  int pdl;               // bulk, wgmma_ws, wgmma_ss: launched with programmatic dependent launch (pdl_start)
  int pro;               // gemv: W4P_ROW_* applied to x while staged (w4p_cuda_gemm_row), 0 none
  const void *nw;        // gemv, W4P_ROW_RMSNORM: the norm weight [K]
  float neps;            // gemv, W4P_ROW_RMSNORM: its epsilon
  int radd;              // gemv, W4P_ROW_RESIDUAL: bias is a residual, added after the sum's rounding
};

// The decode attention kernel's arguments (w4p_cuda_decode_attention).
struct AttnParams {
  const void *qkv;          // [heads + 2 kv_heads][head_dim]: queries, keys, values of the token
  const void *cos, *sin;    // [max_len][head_dim] rotary tables, or NULL (q and k already rotated)
  const int64_t *pos;       // the token's position (device memory)
  void *k_cache, *v_cache;  // [kv_heads][max_len][head_dim]
  void *out;                // [heads][head_dim]
  void *ws;                 // counters [kv_heads], then the splits' partial results from byte ws_counters
  size_t ws_counters;
  int64_t max_len;
  int heads, kv_heads, head_dim, splits;
  float scaling;
};
// the workspace's counters region (its partial results start after it, 256-byte aligned)
inline size_t attn_counter_bytes(int kv_heads) { return ((size_t)kv_heads * sizeof(unsigned) + 255) / 256 * 256; }

}  // namespace w4p
