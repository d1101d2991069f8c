// The planner's thresholds, one row each: the value, why, and the measurement that set it (H200 unless noted;
// "journal" is docs/journal/2026-cuda.md, whose section numbers are those of the CUDA.md it was cut from).
// AUTO_RULES below summarizes what make_plan's steps (AUTO_STEPS, planner.cpp) take for "auto"; tests/test_cuda_planner.py checks
// every row against the planner and docs/CUDA.md prints it.
#pragma once
#include <stdint.h>

namespace w4p {

// Size classes by weights (N x K, padded)
constexpr int64_t SIZE_M = (int64_t)1 << 24;   // 4096x4096: wgmma_ws past M = 32 where one wave holds it (journal 4)
constexpr int64_t SIZE_L = (int64_t)1 << 25;   // the 7B MLP shapes: bulk to M = 8, wgmma_ws to M = 128 (journal 4)
constexpr int64_t SIZE_XL = (int64_t)1 << 26;  // the 70B shapes: bulk's 16-tile units, wgmma_ws to M = 256 (journal 4)

// M thresholds
constexpr int RING_MAX_M = 8;       // ring: M <= 8 before sm_90, where its warps' runs are long (journal 4, 7)
constexpr int RING_LMIN = 4;        // ring: at least 4 units per warp, fewer partial sums on small layers (journal 7)
constexpr int RING_MIN_UNITS = 12;  // ring over stream only where each resident warp gets 12 units (journal 4)
constexpr int BULK_MAX_M = 16;      // bulk: two n8 blocks of tokens at most (kernel limit)
constexpr int BULK_AUTO_M = 4;      // bulk: auto to M = 4 everywhere, to 8 on L+ and one-stripe layers (journal 4)
constexpr int WS_AUTO_MIN_M = 8;    // wgmma_ws from M = 9 (M = 8 on L+ without bulk): ahead of stream (journal 4)
constexpr int WG_AUTO_MAX_M = 256;  // wgmma kernels to M = 256 on XL; past it only where the waves fill (journal 4)
constexpr int WIDE_AUTO_MAX_M = 512;  // wgmma_ws where one wave of blocks holds the grid, to M = 512 (journal 4)
constexpr int SS_AUTO_MIN_M = 65;     // wgmma_ss in wgmma_ws's range from M = 65 (journal 4, wgmma_ss; 7 section 8)
constexpr int SS_AUTO_DENSE_M = 160;  // wgmma_ss in the dense path's range from M = 160 (journal 4, wgmma_ss)
constexpr double GEMV_SMS = 0.24;   // gemv at M = 1 from this many stripes per SM (32 on 132 SMs; journal 20)
constexpr double GEMV_FULL = 0.6;   // and on L+ where its rounds of blocks are this full (journal 20)
constexpr double GEMV_TOK_SMS = 0.85;  // gemv at M = 3-8 from this many stripes per SM (M = 2: GEMV_SMS; journal 9, 21)
constexpr double GEMV_TOK_FULL = 0.7;  // and rounds this full on L+ (journal 9, 18)

// The auto choice, 4-bit, group size 128 (other group sizes: the same or a kernel that takes them). Sizes: S
// under 2^24 weights, M, L, XL as above. Kernels: the ones the planner may take in the row, by the row's
// condition; "dense" is the plan "tiled" (the Python side runs dequantize + cuBLAS there from M = 33).
struct AutoRule {
  int cc_lo, cc_hi;   // compute capability range (major * 10 + minor)
  int m_lo, m_hi;     // M range
  const char *sizes;  // size classes
  const char *kernels;
  const char *why;    // the condition, one line
  const char *bench;  // the measurement that set it
};
constexpr AutoRule AUTO_RULES[] = {
    {90, 90, 1, 1, "S M L XL", "gemv bulk", "gemv from 0.24 stripes per SM and, on L and XL, where its rounds are 60% full",
     "journal 4 (gemv), 9, 20"},
    {90, 90, 2, 2, "S M L XL", "gemv bulk", "gemv from 0.24 stripes per SM, on L and XL rounds 70% full, and where the "
     "staged rows leave its blocks per SM; else the copy engine's weight stream, stream-K over 2 blocks per SM",
     "journal 4 (bulk), 7, 17, 18, 21"},
    {90, 90, 3, 4, "S M L XL", "gemv bulk", "gemv where every SM gets a block of stripes, on L and XL rounds 70% full, "
     "and the staged rows leave its blocks per SM; else bulk as at M = 2", "journal 4 (bulk), 7, 17, 18"},
    {90, 90, 5, 8, "L", "gemv bulk", "gemv as at M = 3-4; else bulk's balanced units", "journal 4 (bulk units), 17"},
    {90, 90, 5, 8, "XL", "gemv bulk", "gemv as at M = 3-4; else bulk's 16-tile units", "journal 4 (bulk units), 18"},
    {90, 90, 5, 8, "S M", "gemv bulk stream", "gemv as at M = 3-4; else bulk where every block owns a whole stripe "
     "(one-stripe units)", "journal 4 (one-stripe units), 17"},
    {90, 90, 9, 32, "S M L XL", "wgmma_ws", "split K to fill the SMs, 16+ K tiles a split, 2 in a cluster",
     "journal 4 (wgmma_ws splits)"},
    {90, 90, 33, 64, "S", "dense", "dequantize + cuBLAS", "journal 4"},
    {90, 90, 33, 64, "M L XL", "wgmma_ws", "its blocks fit one wave", "journal 4 (wgmma_ws)"},
    {90, 90, 65, 128, "S", "dense", "dequantize + cuBLAS", "journal 4"},
    {90, 90, 65, 128, "M L XL", "wgmma_ws wgmma_ss", "wgmma_ws 256/192-row blocks by the wave model; wgmma_ss "
     "where its 256x128 blocks fill half the SMs unsplit", "journal 4 (row blocks, wgmma_ss), 7"},
    {90, 90, 129, 512, "S", "dense", "dequantize + cuBLAS", "journal 4"},
    {90, 90, 129, 512, "M L XL", "wgmma_ws wgmma_ss dense", "the grid that fills its waves best by the wave model; "
     "dense where none does", "journal 4 (wave model, 256-token tile), 7"},
    {90, 90, 513, 1024, "S", "dense", "dequantize + cuBLAS", "journal 4"},
    {90, 90, 513, 1024, "M L XL", "wgmma_ws dense", "wgmma_ws 192/256-row blocks or 256-token tile where the wave "
     "model ranks them ahead", "journal 4 (row blocks, 256-token tile)"},
    {90, 90, 1025, 1 << 30, "S M L XL", "dense", "dequantize + cuBLAS", "journal 4"},
    {80, 89, 1, 8, "L XL", "ring stream", "ring where each resident warp gets 12+ units", "journal 4 (ring)"},
    {80, 89, 1, 8, "S M", "stream", "split-K stream kernel, about one wave of blocks", "journal 4 (stream)"},
    {80, 89, 9, 32, "S M L XL", "stream", "split-K stream kernel, two blocks per SM", "journal 4 (stream)"},
    {80, 89, 33, 1 << 30, "S M L XL", "dense", "dequantize + cuBLAS", "journal 4"},
};

}  // namespace w4p
