// The device's description for the planner (multiprocessors, compute capability, shared memory, the TMA
// encoder), queried once per device.
#include <cuda_runtime.h>
#include <mutex>
#include "../w4pack.h"
#include "error.h"
#include "launch.h"
#include "planner.h"

namespace w4p {

DevInfo g_dev[64];
std::mutex g_mu;

int dev_info(int device, DevInfo *out) {
  if (device < 0 || device >= 64) return fail(W4P_EINVAL, "device index %d out of range", device);
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_dev[device].init) {
    int sms = 0;
    cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaDeviceGetAttribute(device %d): %s", device, cudaGetErrorString(e));
    }
    int a = 0, b = 0, c = 0;
    if (cudaDeviceGetAttribute(&a, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&b, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&c, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaDeviceGetAttribute(device %d): shared memory limits unavailable", device);
    }
    int ccmaj = 0, ccmin = 0;
    if (cudaDeviceGetAttribute(&ccmaj, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&ccmin, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaDeviceGetAttribute(device %d): compute capability unavailable", device);
    }
    g_dev[device].cc = ccmaj * 10 + ccmin;
    g_dev[device].sms = sms;
    g_dev[device].tma = tma_encoder_available();
    g_dev[device].smem_sm = a;
    g_dev[device].smem_block = b;
    g_dev[device].smem_reserved = c;
    g_dev[device].init = true;
  }
  *out = g_dev[device];
  return W4P_OK;
}

}  // namespace w4p
