// Host helpers of the kernel launchers: occupancy diagnostics, launches with clusters and programmatic
// dependent launch, and the cluster-or-workspace choice of the split wgmma kernels.
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include "launch.h"
#include "switches.h"

namespace w4p {
namespace {

// W4P_CUDA_DEBUG=1: print each kernel configuration's resident blocks per SM once (stderr), for tuning
template <typename F> void debug_occupancy(F fn, const char *what, int threads, size_t smem) {
  if (!debug_env()) return;
  static std::mutex mu;
  static std::set<std::pair<const void *, size_t>> seen;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (!seen.insert({(const void *)fn, smem}).second) return;
  }
  int nb = 0;
  cudaFuncAttributes fa;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, threads, smem) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, fn) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  fprintf(stderr, "w4p_cuda: %s: %d threads, %zu B dynamic smem, %d registers: %d blocks per SM\n", what, threads, smem,
          fa.numRegs, nb);
}

// A launch's configuration: clusters of cz blocks along z where cz > 1, programmatic dependent launch where pdl
// (the kernel then calls pdl_start before it touches global memory). at holds two attributes.
cudaLaunchConfig_t launch_config(cudaLaunchAttribute *at, dim3 grid, int threads, size_t smem, cudaStream_t st,
                                 int cz, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  unsigned n = 0;
  if (cz > 1) {
    at[n].id = cudaLaunchAttributeClusterDimension;
    at[n].val.clusterDim.x = 1;
    at[n].val.clusterDim.y = 1;
    at[n].val.clusterDim.z = (unsigned)cz;
    ++n;
  }
  if (pdl) {
    at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = n ? at : nullptr;
  cfg.numAttrs = n;
  return cfg;
}

// fn<<<grid, threads, smem, st>>>(p, rest...) with the attributes of launch_config
template <typename... Args, typename... Rest>
cudaError_t launch_ex(void (*fn)(Args...), dim3 grid, int threads, size_t smem, cudaStream_t st, int cz,
                      const Params &p, Rest &&...rest) {
  if (cz <= 1 && !p.pdl) {
    fn<<<grid, threads, smem, st>>>(p, std::forward<Rest>(rest)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute at[2];
  const cudaLaunchConfig_t cfg = launch_config(at, grid, threads, smem, st, cz, p.pdl != 0);
  return cudaLaunchKernelEx(&cfg, fn, p, std::forward<Rest>(rest)...);
}

// Whether clusters of cz blocks take no more waves than the plain launch. A cluster's blocks must share one GPC,
// so fewer of them may be resident than plain blocks (cudaOccupancyMaxActiveClusters); measured on an H200,
// such a launch ran up to 2x slower (docs/journal/2026-cuda.md). Cached per kernel, shared memory, cluster size and device.
template <typename... Args>
bool cluster_fits(void (*fn)(Args...), dim3 grid, int threads, size_t smem, int cz) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return cudaGetLastError(), false;
  static std::mutex mu;
  static std::map<std::tuple<const void *, size_t, int, int>, std::pair<int, int>> cache;
  const auto key = std::make_tuple((const void *)fn, smem, cz, dev);
  std::pair<int, int> got{0, 0};  // (clusters resident, plain blocks resident)
  bool hit;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(key);
    hit = it != cache.end();
    if (hit) got = it->second;
  }
  if (!hit) {
    int nb = 0, sms = 0, nc = 0;
    cudaLaunchAttribute at[2];
    const cudaLaunchConfig_t cfg = launch_config(at, grid, threads, smem, nullptr, cz, false);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, threads, smem) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&nc, fn, &cfg) != cudaSuccess) {
      cudaGetLastError();
      nc = 0;
    }
    got = {nc, nb * sms};
    if (debug_env())
      fprintf(stderr, "w4p_cuda: clusters of %d, %zu B dynamic smem: %d clusters resident (plain: %d blocks)\n", cz,
              smem, nc, nb * sms);
    std::lock_guard<std::mutex> lk(mu);
    cache[key] = got;
  }
  if (got.first <= 0 || got.second <= 0) return false;
  const int64_t blocks = (int64_t)grid.x * grid.y * grid.z;
  return ceil_div(blocks / cz, got.first) <= ceil_div(blocks, got.second);
}

// The wgmma_ws / wgmma_ss launch: with a cluster plan (pl.cl), the splits of each tile (blocks along z) as one
// cluster where the device holds the clusters in as few waves as the plain blocks; else plain blocks that sum
// through the workspace (which the plan always sizes for the splits)
template <typename... Args, typename... Rest>
cudaError_t launch_splits(void (*fn)(Args...), int threads, const Plan &pl, cudaStream_t st, Params p,
                          Rest &&...rest) {
  const dim3 grid((unsigned)pl.TB, (unsigned)(pl.tiles / pl.TB), (unsigned)pl.S);
  p.cl = pl.cl && cluster_fits(fn, grid, threads, pl.smem, pl.S) ? 1 : 0;
  return launch_ex(fn, grid, threads, pl.smem, st, p.cl ? pl.S : 1, p, std::forward<Rest>(rest)...);
}

}  // namespace
}  // namespace w4p
