// The launch table's interface: one launcher per kernel (each defined beside its kernel, for fp16 and
// bf16), the TMA descriptor encoders and the dispatch of a plan (launch.cu).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "params.h"
#include "planner.h"

namespace w4p {

template <typename T> cudaError_t launch_stream(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
// the stream kernel's diagnostics probes (mode 1: copies only, 2: dequantization only): fp16, 4-bit, M <= 8
cudaError_t launch_stream_probe(const Params &p, const Plan &pl, int mode, cudaStream_t st);
template <typename T> cudaError_t launch_tiled(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
template <typename T> cudaError_t launch_ring(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
template <typename T> cudaError_t launch_bulk(const Params &p, const Plan &pl, int sbits, cudaStream_t st);
template <typename T> cudaError_t launch_gemv(const Params &p, const Plan &pl, cudaStream_t st);
template <typename T> cudaError_t launch_wgmma(const Params &p, const Plan &pl, cudaStream_t st);
template <typename T> cudaError_t launch_wgmma_ws(const Params &p, const Plan &pl, cudaStream_t st);
template <typename T> cudaError_t launch_wgmma_ss(const Params &p, const Plan &pl, cudaStream_t st);
// the activations gathered into xg ([M][Kp], act-order's permutation applied, zeros past K)
template <typename T> cudaError_t launch_gather(const Params &p, T *xg, cudaStream_t st);
// the dense [N][ldw] dequantized matrix
template <typename T> void launch_dequant(const Params &p, int sbits, T *w, int64_t ldw, unsigned blocks,
                                          cudaStream_t st);
// one token's attention over its KV cache (kernel_attention.cu)
template <typename T> cudaError_t launch_decode_attention(const AttnParams &a, cudaStream_t st);
// the plan's kernel (the gather first where the plan asks for it)
template <typename T> cudaError_t launch_all(Params &p, const Plan &pl, int sbits, void *ws_gather, cudaStream_t st);

bool tma_encoder_available();
cudaError_t encode_x_map(CUtensorMap *map, const void *x, bool bf16, int64_t m, int64_t kx, int64_t ldx, int bn);
cudaError_t encode_w_map(CUtensorMap *map, const void *qw, int KT, int nstripes, int ks, int bs = 16);

}  // namespace w4p
