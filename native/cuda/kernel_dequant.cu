// Dense dequantization and the activation gather.
#include "epilogue.cuh"
#include "launch.cuh"

namespace w4p {
namespace {

// Dequantization to a dense [N][ldw] matrix in the original K order (act-order undone), for the large-M
// path (dense GEMM by the caller's BLAS) and for checks. One warp per 16x64 tile: fp32 math, one rounding,
// staged through shared memory so the rows go out as 16-byte stores.
template <typename T, int SB>
__global__ void __launch_bounds__(256) dequant_kernel(const Params p, T *w, int64_t ldw) {
  constexpr int V = SB / 4;
  __shared__ __align__(16) T tile[8][16][64 + 8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tid4 = lane & 3;
  const int64_t id = (int64_t)blockIdx.x * 8 + warp;
  const int64_t ntiles = (int64_t)(p.Np >> 4) * p.KT;
  if (id >= ntiles) return;
  const int stripe = (int)(id / p.KT), kt = (int)(id % p.KT);
  const uint4 *src = reinterpret_cast<const uint4 *>(p.qw) + (size_t)id * (32 * V) + lane * V;
  uint32_t wd[4 * V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const uint4 q = ld_stream(src + v);
    wd[4 * v] = q.x;
    wd[4 * v + 1] = q.y;
    wd[4 * v + 2] = q.z;
    wd[4 * v + 3] = q.w;
  }
  const T *sc = (const T *)p.scales;
  const T *zp = (const T *)(p.zm == 1 ? p.zeros : p.mins);
  const float zdef = (float)(1 << (SB == 4 ? 3 : 7));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int g = group_of(kt * 64 + j * 16, p.gmul);
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int row = stripe * 16 + gid + rh * 8;
      const size_t off = (size_t)g * p.Np + row;
      const float s = to_f(sc[off]);
      const float z = p.zm == 0 ? zdef : to_f(zp[off]);
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const int i = kh * 2 + rh;  // register pair a_i
        float q0, q1;
        if (SB == 4) {
          q0 = (float)((wd[j] >> (4 * i)) & 15u);
          q1 = (float)((wd[j] >> (4 * i + 16)) & 15u);
        } else {
          const uint32_t x = wd[2 * j + (i >> 1)];
          q0 = (float)((x >> (16 * (i & 1))) & 255u);
          q1 = (float)((x >> (16 * (i & 1) + 8)) & 255u);
        }
        const float v0 = p.zm == 2 ? fmaf(s, q0, z) : s * (q0 - z);
        const float v1 = p.zm == 2 ? fmaf(s, q1, z) : s * (q1 - z);
        T *d = &tile[warp][gid + rh * 8][j * 16 + kh * 8 + tid4 * 2];
        d[0] = from_f<T>(v0);
        d[1] = from_f<T>(v1);
      }
    }
  }
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int idx = lane + 32 * q;
    const int r = idx >> 3, c = idx & 7;
    const int grow = stripe * 16 + r;
    const int gk = kt * 64 + c * 8;
    if (grow >= p.N || gk >= p.K) continue;
    const T *sv = &tile[warp][r][c * 8];
    T *drow = w + (int64_t)grow * ldw;
    if (!p.perm && gk + 8 <= p.K && p.xvec) {
      *reinterpret_cast<uint4 *>(drow + gk) = *reinterpret_cast<const uint4 *>(sv);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (gk + e < p.K) drow[p.perm ? p.perm[gk + e] : gk + e] = sv[e];
    }
  }
}

// Activation gather for the tiled kernel: xg[m][k] = x[m][perm[k]] (or x[m][k]) for k < K, 0 up to Kp.
template <typename T>
__global__ void gather_kernel(const T *x, int64_t ldx, T *xg, int64_t M, int K, int Kp, const int32_t *perm) {
  const int64_t total = M * Kp;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t m = i / Kp;
    const int k = (int)(i - m * Kp);
    T v = from_f<T>(0.f);
    if (k < K) v = x[m * ldx + (perm ? perm[k] : k)];
    xg[i] = v;
  }
}

}  // namespace

template <typename T> cudaError_t launch_gather(const Params &p, T *xg, cudaStream_t st) {
  const int64_t total = p.M * (int64_t)p.Kp;
  int blocks = (int)((total + 255) / 256);
  if (blocks > 65535 * 8) blocks = 65535 * 8;
  gather_kernel<T><<<blocks, 256, 0, st>>>((const T *)p.x, p.ldx, xg, p.M, p.K, p.Kp, p.perm);
  return cudaGetLastError();
}
template <typename T> void launch_dequant(const Params &p, int sbits, T *w, int64_t ldw, unsigned blocks,
                                          cudaStream_t st) {
  if (sbits == 4) dequant_kernel<T, 4><<<blocks, 256, 0, st>>>(p, w, ldw);
  else dequant_kernel<T, 8><<<blocks, 256, 0, st>>>(p, w, ldw);
}

template cudaError_t launch_gather<half>(const Params &p, half *xg, cudaStream_t st);
template cudaError_t launch_gather<__nv_bfloat16>(const Params &p, __nv_bfloat16 *xg, cudaStream_t st);
template void launch_dequant<half>(const Params &p, int sbits, half *w, int64_t ldw, unsigned blocks, cudaStream_t st);
template void launch_dequant<__nv_bfloat16>(const Params &p, int sbits, __nv_bfloat16 *w, int64_t ldw, unsigned blocks, cudaStream_t st);

}  // namespace w4p
