// Read-order probes for tools/read_order.py: how fast a buffer of a layer's size can be read on this GPU, and how
// the order in which the grid requests a packed layer's 512-byte tiles changes that. Loads only: every thread
// XOR-sums its words (the result is written only if it equals a value it never takes, so nothing is optimized out).
// Not part of the library: built on demand by the script.
#include <cstdint>
#include <cuda_runtime.h>

namespace {
__device__ __forceinline__ uint4 ld16(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned fold(const uint4 &v) { return v.x + v.y + v.z + v.w; }

// the plain read: consecutive threads on consecutive 16 bytes, the grid striding over the buffer, U loads in
// flight per thread
template <int U>
__global__ void plain_read(const uint4 *__restrict__ p, long n16, unsigned *out) {
  const long stride = (long)blockDim.x * gridDim.x;
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld16(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
  }
  for (; i < n16; i += stride) acc ^= fold(ld16(p + i));
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// A packed layer's tiles (T of them, KT per 16-row stripe), one 16-byte load per lane and tile, blocks of 8 warps.
// ORDER 0: units of U consecutive tiles dealt to the warps in turn; 1: single tiles dealt in turn, U in flight;
// 2: whole stripes per block, 8 warps taking U consecutive tiles of each 8U-tile step; 3: one contiguous range of
// tiles per warp, U in flight (the stream-K order)
template <int U, int ORDER>
__global__ void __launch_bounds__(256) tile_read(const uint4 *__restrict__ q, int T, int KT, unsigned *out) {
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
  const int W = gridDim.x * 8, w = blockIdx.x * 8 + wi;
  unsigned acc = 0;
  if (ORDER == 0) {
    for (int v = w; v < T / U; v += W) {
      uint4 b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) b[u] = ld16(q + ((long)v * U + u) * 32 + lane);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(b[u]);
    }
  } else if (ORDER == 1) {
    for (long t = w; t < T; t += (long)U * W) {
      uint4 b[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        b[u] = t + (long)u * W < T ? ld16(q + (t + (long)u * W) * 32 + lane) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(b[u]);
    }
  } else if (ORDER == 2) {
    for (int s = blockIdx.x; s < T / KT; s += gridDim.x)
      for (int t0 = wi * U; t0 < KT; t0 += 8 * U) {
        uint4 b[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          b[u] = t0 + u < KT ? ld16(q + ((long)s * KT + t0 + u) * 32 + lane) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= fold(b[u]);
      }
  } else {
    const long tb = (long)w * T / W, te = (long)(w + 1) * T / W;
    for (long t = tb; t < te; t += U) {
      uint4 b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) b[u] = t + u < te ? ld16(q + (t + u) * 32 + lane) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(b[u]);
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
}  // namespace

// variant: 0-2 the plain read with 2 / 4 / 8 loads in flight (n = bytes / 16, kt unused); 10 + 4 * order + i the
// tile orders with i = 0 / 1 / 2 for U = 2 / 4 / 8 (n = tiles, kt = tiles per stripe). Returns a cudaError_t.
extern "C" int ro_launch(int variant, const void *buf, long n, int kt, void *out, int grid, int threads,
                         void *stream) {
  cudaStream_t st = (cudaStream_t)stream;
  const uint4 *p = (const uint4 *)buf;
  unsigned *outp = (unsigned *)out;
  switch (variant) {
    case 0: plain_read<2><<<grid, threads, 0, st>>>(p, n, outp); break;
    case 1: plain_read<4><<<grid, threads, 0, st>>>(p, n, outp); break;
    case 2: plain_read<8><<<grid, threads, 0, st>>>(p, n, outp); break;
#define RO_ORDER(ORD)                                                                        \
  case 10 + 4 * ORD: tile_read<2, ORD><<<grid, 256, 0, st>>>(p, (int)n, kt, outp); break; \
  case 11 + 4 * ORD: tile_read<4, ORD><<<grid, 256, 0, st>>>(p, (int)n, kt, outp); break; \
  case 12 + 4 * ORD: tile_read<8, ORD><<<grid, 256, 0, st>>>(p, (int)n, kt, outp); break;
    RO_ORDER(0)
    RO_ORDER(1)
    RO_ORDER(2)
    RO_ORDER(3)
#undef RO_ORDER
    default: return (int)cudaErrorInvalidValue;
  }
  return (int)cudaGetLastError();
}
