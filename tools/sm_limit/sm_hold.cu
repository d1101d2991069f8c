// Holds whole SMs for tools/sm_limit.py: one block per SM, with all of the SM's shared memory, so no other
// kernel's block can run there until the host releases it. The host and the blocks talk through pinned, mapped
// host memory (flags[0]: release; flags[1 + b]: block b has started), never through a CUDA call, so the kernel
// can run while other streams' work is timed. A block leaves on its own after 10 s whatever the host does.
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

namespace {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(1024, 1) hold(volatile int *flags) {
  extern __shared__ unsigned char pad[];
  if (threadIdx.x == 0) {
    pad[0] = 0;  // (the shared memory is asked for, not used)
    flags[1 + blockIdx.x] = 1;
    __threadfence_system();
    const uint64_t end = now_ns() + 10000000000ull;
    while (flags[0] == 0 && now_ns() < end) __nanosleep(4000);
  }
  __syncthreads();
}

int *h_flags = nullptr, *d_flags = nullptr, cap = 0;

}  // namespace

// Launches `blocks` holding blocks on `stream`; 0 or a cudaError_t.
extern "C" int smh_hold(int blocks, uint64_t stream) {
  cudaError_t e;
  if (blocks + 1 > cap) {  // (allocated once, for more SMs than a GPU has: a later call frees nothing)
    if (h_flags || blocks + 1 > 4096) return cudaErrorInvalidValue;
    if ((e = cudaHostAlloc((void **)&h_flags, 4096 * sizeof(int), cudaHostAllocMapped)) != cudaSuccess) return e;
    if ((e = cudaHostGetDevicePointer((void **)&d_flags, h_flags, 0)) != cudaSuccess) return e;
    cap = 4096;
  }
  memset(h_flags, 0, (blocks + 1) * sizeof(int));
  int dev = 0, smem = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess) return e;
  if ((e = cudaFuncSetAttribute(hold, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess) return e;
  hold<<<blocks, 1024, smem, (cudaStream_t)stream>>>(d_flags);
  return cudaGetLastError();
}

// How many of the `blocks` have started.
extern "C" int smh_started(int blocks) {
  int n = 0;
  for (int b = 0; b < blocks; ++b) n += ((volatile int *)h_flags)[1 + b] != 0;
  return n;
}

extern "C" void smh_release() { ((volatile int *)h_flags)[0] = 1; }
