// TMA descriptors, encoded on the host through the driver's cuTensorMapEncodeTiled (fetched at run time, so
// the library needs no libcuda at link time).
#include <mutex>
#include "launch.h"

namespace w4p {

// The activation tile's TMA descriptor: [M][kx] in T, row stride ldx, boxes of 64 columns x BN rows with the
// 128-byte swizzle, out-of-bounds elements read as zeros. The encoder comes from the driver at run time.
typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                  const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiledFn tma_encoder() {
  static EncodeTiledFn fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (EncodeTiledFn)f;
    else
      cudaGetLastError();
  });
  return fn;
}
bool tma_encoder_available() { return tma_encoder() != nullptr; }
cudaError_t encode_x_map(CUtensorMap *map, const void *x, bool bf16, int64_t m, int64_t kx, int64_t ldx, int bn) {
  const EncodeTiledFn fn = tma_encoder();
  if (!fn) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {(cuuint64_t)kx, (cuuint64_t)m};
  const cuuint64_t strides[1] = {(cuuint64_t)ldx * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)bn};
  const cuuint32_t estr[2] = {1, 1};
  const CUresult r = fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                        const_cast<void *>(x), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The codes of layout v1 as a 3-D tensor of 32-bit words [stripes][K tiles][128] for the wgmma_ws and wgmma_ss
// kernels: boxes of ks tiles x bs stripes, no swizzle (the smem copy keeps the global order), out-of-range parts
// of a box read as zeros.
cudaError_t encode_w_map(CUtensorMap *map, const void *qw, int KT, int nstripes, int ks, int bs) {
  const EncodeTiledFn fn = tma_encoder();
  if (!fn) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {128, (cuuint64_t)KT, (cuuint64_t)nstripes};
  const cuuint64_t strides[2] = {512, (cuuint64_t)KT * 512};
  const cuuint32_t box[3] = {128, (cuuint32_t)ks, (cuuint32_t)bs};
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, const_cast<void *>(qw), dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace w4p
