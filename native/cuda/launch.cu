// The launch table: a plan's kernel (planner.h) to its launcher (launch.h), each defined beside its kernel in
// kernel_<name>.cu, after the activations' gather where the plan asks for it. The kernels (docs/CUDA.md, section
// 4): gemv (M <= 8), bulk (sm_90, M <= 16), ring (M <= 8), stream (M <= 32), wgmma_ws, wgmma_ss and wgmma
// (sm_90a, 4-bit), tiled (any M); the dense path (dequant) is the Python side's.
#include <type_traits>
#include "launch.h"
#include "switches.h"

namespace w4p {

template <typename T>
cudaError_t launch_all(Params &p, const Plan &pl, int sbits, void *ws_gather, cudaStream_t st) {
  if (pl.kernel == W4P_CUDA_KERNEL_GEMV) {  // (gathers the activations itself)
    p.pdl = pl.pdl ? pdl_env() : 0;
    return launch_gemv<T>(p, pl, st);
  }
  if (pl.kernel == 2 || pl.kernel == 3 || pl.kernel == W4P_CUDA_KERNEL_BULK || pl.kernel == W4P_CUDA_KERNEL_WGMMA ||
      pl.kernel == W4P_CUDA_KERNEL_WGMMA_WS || pl.kernel == W4P_CUDA_KERNEL_WGMMA_SS) {
    if (pl.gather) {
      T *xg = (T *)ws_gather;
      cudaError_t e = launch_gather<T>(p, xg, st);
      if (e != cudaSuccess) return e;
      p.x = xg;
      p.ldx = p.Kp;
      p.kx = p.Kp;
      p.perm = nullptr;
    } else {
      p.kx = p.K;
    }
    if (pl.kernel == W4P_CUDA_KERNEL_BULK || pl.kernel == W4P_CUDA_KERNEL_WGMMA_WS ||
        pl.kernel == W4P_CUDA_KERNEL_WGMMA_SS)
      p.pdl = pdl_env();
    if (pl.kernel == W4P_CUDA_KERNEL_BULK) return launch_bulk<T>(p, pl, sbits, st);
    if (pl.kernel == W4P_CUDA_KERNEL_WGMMA) return launch_wgmma<T>(p, pl, st);
    if (pl.kernel == W4P_CUDA_KERNEL_WGMMA_WS) return launch_wgmma_ws<T>(p, pl, st);
    if (pl.kernel == W4P_CUDA_KERNEL_WGMMA_SS)
      return launch_wgmma_ss<T>(p, pl, st);
    if (pl.kernel != 2) return launch_ring<T>(p, pl, sbits, st);
    return launch_tiled<T>(p, pl, sbits, st);
  }
  const int mode = pl.kernel == W4P_CUDA_PROBE_LOAD ? 1 : pl.kernel == W4P_CUDA_PROBE_DEQUANT ? 2 : 0;
  if (mode != 0) {  // diagnostics: fp16, 4-bit, M <= 8 only (keeps the fatbin small)
    if (!std::is_same<T, half>::value || sbits != 4) return cudaErrorNotSupported;
    return launch_stream_probe(p, pl, mode, st);
  }
  return launch_stream<T>(p, pl, sbits, st);
}

template cudaError_t launch_all<half>(Params &p, const Plan &pl, int sbits, void *ws_gather, cudaStream_t st);
template cudaError_t launch_all<__nv_bfloat16>(Params &p, const Plan &pl, int sbits, void *ws_gather, cudaStream_t st);

}  // namespace w4p
