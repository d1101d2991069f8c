// The planner: which kernel, split and workspace a GEMM of M tokens on an N x K layer takes on a device.
// Host-only C++ (no CUDA header), so the host compiler builds it and its tests need no GPU and no nvcc
// (tests/test_cuda_planner.py builds it into a library of its own). The thresholds it applies are the table in
// planner_rules.h.
#pragma once
#include <stddef.h>
#include <stdint.h>
// the ABI functions keep default visibility; everything else in the library is hidden
#pragma GCC visibility push(default)
#include "../w4pack.h"
#pragma GCC visibility pop
#include "error.h"
#include "geometry.h"

namespace w4p {

struct DevInfo {
  int sms = 0;
  int cc = 0;  // compute capability, major * 10 + minor
  int smem_sm = 0, smem_block = 0, smem_reserved = 0;  // shared memory per SM, per block (opt-in), reserved
  bool tma = true;  // the driver gives the TMA descriptor encoder (the wgmma_ws kernel; described devices: yes)
  bool init = false;
  // a block of `bytes` dynamic shared memory fits (the system's reserved share counts against the opt-in limit)
  bool fits(size_t bytes) const { return bytes + (size_t)smem_reserved <= (size_t)smem_block; }
};

struct Plan {
  int kernel = 0;  // 1 stream, 2 tiled, 3 ring, 4 bulk, 10/11 probes (stream kernel variants)
  int64_t W = 0;   // ring: workers (warps)
  int ct = 8;      // bulk kernel: tiles per unit
  int qs = 4;      // bulk kernel: stripes per unit
  int kg = 8;      // bulk kernel: tiles per stream-K granule
  int S = 1, TB = 1, NI = 1, MI = 1, KC = 8;
  int tiles = 0;   // output tiles (counters)
  int bn = 0, kp = 1;  // wgmma kernel: token tile, K tiles per step
  int rs = 1;          // wgmma_ws: 16-row stripes per consumer warp (2: 256-row blocks)
  int cw = 2;          // wgmma_ws: consumer warpgroups (3: 192-row blocks)
  bool as = false;     // wgmma kernel: A through shared memory
  bool cl = false;     // wgmma_ws, wgmma_ss: the splits of a tile launched as one cluster (cluster_reduce)
  int sk = 0;          // wgmma_ws stream-K: its grid of resident blocks (0: a grid of tiles x splits)
  int sk_plain_S = 1;  // ... and the plain grid's split count, where the workspace cannot hold stream-K's slots
  bool gather = false;
  bool pdl = false;    // gemv: programmatic dependent launch (sm_90)
  size_t smem = 0;
  size_t ws_part = 0, ws_gather = 0, ws_total = 0;
};

inline int ceil_div(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

// kernel: 0 auto, 1 stream, 2 tiled, 10/11 probes. splits: 0 auto. ws_avail: bytes available (SIZE_MAX = plan only).
int make_plan(const DevInfo &di, int64_t m, int n, int k, int sbits, int gs, bool act_order, bool x_aligned,
              int kernel, int splits, size_t ws_avail, Plan *pl);
// the stream kernel takes the group size (a multiple of 32, or per channel): the fallback of an "auto" call whose
// plan gathers the activations into a workspace too small for them
bool stream_gathers(int gs);
// the ABI's plan and description on a device (real or described), arguments checked
int plan_on(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order, int x_aligned,
            int kernel, int splits, int *kernel_out, int *splits_out, size_t *workspace_bytes);
int describe_on(const DevInfo &di, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                int x_aligned, int kernel, int splits, char *buf, size_t len);
DevInfo described(int sms, int cc, int smem_sm, int smem_block, int smem_reserved);
bool bad_description(int sms, int cc, int smem_sm, int smem_block, int smem_reserved);
// the device's description (device.cu; not in the host-only planner library)
int dev_info(int device, DevInfo *out);

}  // namespace w4p
