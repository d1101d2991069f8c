// Kernel shapes shared by the kernels and the planner: warps, tiles, stages and shared-memory bytes per
// block. Host and device code both read these, so the planner's sizes are the kernels' sizes. Plain C++
// (no CUDA header): the host compiler builds the planner from it.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define W4P_HD __host__ __device__
#define W4P_HDI __host__ __device__ __forceinline__
#else
#define W4P_HD
#define W4P_HDI inline
#endif

namespace w4p {

// cluster sums (epilogue.cuh)
constexpr int CLUSTER_MAX = 8;  // the portable cluster size

// stream kernel
constexpr int SW = 4;  // warps per stream block
W4P_HDI int stream_ngmax(int KC, int gs) { return gs > 0 ? (KC * 64) / gs + 2 : 1; }
W4P_HDI size_t stream_buf_bytes(int NI, int MI, int KC, int gs) {
  const size_t x = (size_t)NI * 8 * (KC * 64 + 8) * 2;
  const size_t prm = (size_t)stream_ngmax(KC, gs) * (SW * MI * 16) * 2;
  return (x + 2 * prm + 15) / 16 * 16;
}

// ring kernel
constexpr int RW = 2;          // warps per ring block (warps are independent; small blocks pack SMs finely)
constexpr int RING_MINB = 10;  // launch bound: registers for 10 blocks (20 warps) per SM
constexpr int RD = 4;          // ring slots per warp
constexpr int RQ = 4;          // stripes per unit
constexpr int RING_XP = 144;   // bytes per staged activation row (128 + 16: conflict-free ldmatrix)

// slot: RQ weight tiles | RQ x 128 B group parameters | M activation rows of 64 values
W4P_HDI int ring_slot_bytes(int sb, int m) { return RQ * (512 * (sb / 4) + 128) + m * RING_XP; }
W4P_HDI int ring_warp_bytes(int sb, int m) { return 16 + RD * ring_slot_bytes(sb, m); }

// bulk kernel
// CT, tiles per unit: 8 (512 columns of K), 12 or 16 for 4-bit layers (longer runs per copy, less work per
// chunk; measured faster on large layers and at M = 1: docs/journal/2026-cuda.md); 32 for units of one stripe
constexpr int BQ = 4;           // stripes per unit (QS), or one on small layers
constexpr int BCT1 = 32;        // tiles per unit of one stripe
constexpr int BNC = 8;          // consumer warps
constexpr int BNP = 2;          // producer warps (one measured too slow from M = 4: docs/journal/2026-cuda.md)
constexpr int BMAXS = 8;        // most stages
constexpr int BBPS = 2;         // blocks per SM (two producers and 16 consumer warps per SM: measured)
// smem pitch of an activation row (+16: conflict-free ldmatrix)
W4P_HD constexpr int bulk_xp(int ct) { return ct * 128 + 16; }
// groups a unit's parameters span: exactly CT * 64 / gs where units start on group boundaries, else two more
W4P_HDI int bulk_pgroups(int gs, int ct) {
  return gs > 0 ? (ct * 64) / gs + ((ct * 64) % gs == 0 ? 0 : 2) : 1;
}
// stage: weights | group parameters (per group: QS * 16 scales, QS * 16 zeros / minima) | activation rows
W4P_HDI int bulk_stage_bytes(int sb, int m, int gs, int ct, int qs = BQ) {
  return qs * ct * 512 * (sb / 4) + bulk_pgroups(gs, ct) * qs * 64 + m * bulk_xp(ct);
}
// fixed part: NS full + NS empty barriers, a zero row, two reduction buffers (NI n8 blocks each), a flag
// (warps that hand their sums to a stripe's first warp: BNC - QS)
W4P_HD constexpr int bulk_red_warps(int qs) { return qs >= BNC ? 0 : BNC - qs; }
// (the last 16 bytes held the split sums' "last block" flag, now a barrier reduction; kept, so plans stay as measured)
W4P_HD constexpr int bulk_fix(int ni, int qs = BQ) {
  return 2 * BMAXS * 8 + 16 + 2 * bulk_red_warps(qs) * 32 * ni * 4 * 4 + 16;
}
W4P_HDI int bulk_smem_bytes(int sb, int m, int gs, int ns, int ct, int qs = BQ) {
  return bulk_fix(m > 8 ? 2 : 1, qs) + ns * bulk_stage_bytes(sb, m, gs, ct, qs);
}

// gemv kernel
constexpr int GV_W = 16;  // warps per block
constexpr int GV_U = 2;   // tiles per warp and step
constexpr int GV_B = 2;   // blocks per SM asked of the compiler (one fewer for the heavier layer kinds)
// steps whose weights a warp holds in registers at once: the one it computes and GV_STAGES - 1 being loaded (2: a
// double buffer; 3: loads two steps ahead, a third more registers). A build option (W4P_CUDA_DEFINES=
// -DW4P_GV_STAGES=3) so both can be measured against each other on one machine.
#ifndef W4P_GV_STAGES
#define W4P_GV_STAGES 2
#endif
constexpr int GV_STAGES = W4P_GV_STAGES;
static_assert(GV_STAGES == 2 || GV_STAGES == 3, "the gemv kernel's loop names two or three register buffers");
// a ring of GV_RING steps per thread in shared memory instead of the register buffers (0: off): each thread
// copies its weights and group parameters there with cp.async, GV_RING - 1 steps ahead of the one it computes,
// so more bytes are in flight per SM than registers hold. A build option (W4P_CUDA_DEFINES=-DW4P_GV_RING=4).
#ifndef W4P_GV_RING
#define W4P_GV_RING 0
#endif
constexpr int GV_RING = W4P_GV_RING;
static_assert(GV_RING == 0 || (GV_RING >= 3 && GV_RING <= 6 && GV_STAGES == 2), "a ring of 3-6 steps, or none");
// how the gemv kernel loads a segment's group parameters (rows gid and gid + 8, the same 32-byte sector): 2 (the
// default) two loads a lane that allocate in L1, so the second finds the first's sector in flight or in L1 instead
// of asking L2 again; 0 the same two without L1 allocation, as the weights are loaded; 1 one load a lane (even lanes
// row gid, odd lanes gid + 8) and a shuffle with the neighbour lane. 0 and 1 are build options for A/Bs
// (W4P_CUDA_DEFINES=-DW4P_GV_PAR=0 or 1).
#ifndef W4P_GV_PAR
#define W4P_GV_PAR 2
#endif
constexpr int GV_PAR = W4P_GV_PAR;
static_assert(GV_PAR >= 0 && GV_PAR <= 2 && (GV_PAR != 1 || GV_RING == 0), "parameter loads 0-2; the ring copies both rows");
// diagnostics (0: off): levels that each take one more part away from the gemv kernel, so that their times
// against main's (`tools/gpu_ab.py`) say what each part costs the weight stream. 1: each chunk's arithmetic
// (activation loads, dequantization, MMAs) replaced by an XOR of its words into the sums; 2: also no group
// parameter loads; 3: also no stripe-end barrier and reduction (one warp stores its sums); 4: also three blocks per SM
// (the launch bound asks the registers for it; 1-3: the kernel's blocks per SM). The weight loads, staging and stores
// run as they do; the outputs are meaningless. A build option (W4P_CUDA_DEFINES=-DW4P_GV_PROBE=N).
#ifndef W4P_GV_PROBE
#define W4P_GV_PROBE 0
#endif
constexpr int GV_PROBE = W4P_GV_PROBE;
static_assert(GV_PROBE >= 0 && GV_PROBE <= 4, "probe levels 1-4, or none");
static_assert(GV_PROBE == 0 || GV_PAR != 1, "the probe reads both of a lane's parameter rows");
constexpr int GV_MAX_M = 8;  // tokens: the MMA's eight B columns, one token each (M = 1 leaves seven idle)
constexpr int GV_RED = 2 * GV_W * 16 * 4;  // the stripe sums' two buffers [2][GV_W][16] floats at M = 1
// the staged activation rows' pitch in 32-bit slots at M > 1: 16 bytes past a row so that lanes gid and gid + 1,
// which share a quarter-warp's 16-byte loads, read different banks (at M = 1 every lane reads the one row)
W4P_HD constexpr int gv_pitch(int kt) { return kt * 32 + 4; }
// the segment length in tiles a group size gives (0: half tiles, where groups end inside a tile)
W4P_HD constexpr int gv_ts(int gs) { return gs <= 0 || gs % (64 * GV_U) == 0 ? GV_U : gs % 64 == 0 ? 1 : 0; }
// the ring's bytes per block: per thread and step, GV_U 16-byte weight pieces and a 32-bit word per group
// parameter (two per segment, four with zero points or minima; zm: 0 none, else int zeros or float minima)
W4P_HD constexpr size_t gv_ring(int zm, int ts) {
  return GV_RING == 0 ? 0
                      : (size_t)GV_RING * GV_W * 32 *
                            (size_t)(16 * GV_U + 4 * (ts ? GV_U / ts : 2 * GV_U) * (zm == 0 ? 2 : 4));
}
// shared memory of an M-token call: the stripe sums [2][GV_W][16][m] and the m staged activation rows (and the
// ring, where it is built)
W4P_HD constexpr size_t gv_smem(int kt, int m = 1, size_t ring = 0) {
  return (m == 1 ? (size_t)GV_RED + (size_t)kt * 128 : ((size_t)GV_RED + (size_t)gv_pitch(kt) * 4) * m) + ring;
}

// wgmma kernel
constexpr int WG_BM = 128;       // weight rows per block (two warpgroups)
constexpr int WG_WB = 8 * 512;   // a stage's weight bytes
constexpr int WG_PB = 4 * 2 * WG_BM * 2;  // a stage's parameter bytes: up to 4 groups x (scale, zero) x 128 rows
W4P_HD constexpr int wg_stage_bytes(int bn) { return bn * 128 + WG_WB + WG_PB; }
// stages (one K tile each): BN 64 fits two blocks per SM; BN 128 holds 64 accumulators per thread and, with
// two tiles' fragments live (KP 2), one block per SM
// AS: the dequantized weights go through shared memory (two buffers per warpgroup) so that a warpgroup's
// wgmmas on tile kt run while it dequantizes tile kt + 1 (token tile 64, one K tile per step)
W4P_HD constexpr int wg_stages(int bn, int kp, bool as = false) { return as ? 5 : bn == 64 ? 6 : kp == 2 ? 8 : 4; }
constexpr int WG_AB = 2 * 2 * 64 * 128;  // AS: 2 warpgroups x 2 buffers x 64 rows x 128 bytes
W4P_HD constexpr int wg_smem_bytes(int bn, int kp, bool as = false) {
  return wg_stages(bn, kp, as) * wg_stage_bytes(bn) + (as ? WG_AB : 0) + 1024;
}

// wgmma_ws kernel (its epilogue's staging tile, stream-K's counters, its stages)
// The epilogue's staging tile (ws_store_y): one token row of R weight rows in the activation dtype, padded by 16
// bytes so that the 8 token rows of an stmatrix land in 8 different bank groups
W4P_HD constexpr int ws_ypitch(int r) { return (r + 8) * 2; }
constexpr int SK_READY = 8192;  // the second half of the counters (MAX_COUNTERS): slots stored per tile part
constexpr int WS_IL_BN = 32;  // up to this token tile each slice goes to the tensor cores as soon as it is ready
// how a wgmma_ws consumer waits before it rewrites a tile's A fragments (two tiles' registers, four-tile stages):
// 0 (the default) one wgmma group per two tiles, waited for in full; 1 one group per tile (per wgmma where each
// slice goes to the tensor cores as it is dequantized), so the wait is for tile u - 2's wgmmas only and tile u - 1's
// run on while tile u is dequantized (one row tile per warpgroup, RS = 1; the 256-row blocks keep 0). A build
// option for A/Bs (W4P_CUDA_DEFINES=-DW4P_WS_GRP=1).
#ifndef W4P_WS_GRP
#define W4P_WS_GRP 0
#endif
constexpr int WS_GRP = W4P_WS_GRP;
static_assert(WS_GRP == 0 || WS_GRP == 1, "wgmma groups per two tiles (0) or per tile (1)");
// RS: 16-row stripes per consumer warp, 1 (128-row blocks) or 2 (256-row blocks: each warpgroup runs two m64
// row tiles against the same activation tile, which halves the activations' L2 traffic per weight row)
// CW: consumer warpgroups, 2 or 3 (192-row blocks: RS = 1, the 128-token tile; more rows per block than 128 where
// 256-row blocks would leave a wave's SMs idle)
W4P_HD constexpr int ws_pb(int ks, int rs = 1, int cw = 2) {
  return rs * cw * (ks == 4 ? 1024 : ks * 1024);
}
W4P_HD constexpr int ws_stage_bytes(int bn, int ks, int rs = 1, int cw = 2) {
  return ks * (bn * 128 + 4 * cw * rs * 512) + ws_pb(ks, rs, cw);
}
W4P_HD constexpr int ws_stages(int bn, int ks, int rs = 1) {
  return rs == 2      ? 3
         : bn == 256 ? (ks == 1 ? 5 : 2)
         : ks == 4   ? (bn == 16 ? 4 : bn == 32 ? 3 : 2)
                     : (bn == 16 ? 6 : bn == 32 ? 4 : bn == 64 ? 3 : 4);
}
W4P_HD constexpr int ws_blocks_per_sm(int bn, int rs = 1) { return bn >= 128 || rs == 2 ? 1 : 2; }
// RS = 2 needs about 200 registers per consumer thread, past the 168 that 9 warps allow (three warps on a
// scheduler's 16K registers): a whole producer warpgroup (one active warp) gives its registers to the
// consumers (setmaxnreg 40 / 232)
// The 256-token tile (128 accumulators a thread, like RS = 2) does the same
W4P_HD constexpr bool ws_pwg(int bn, int rs) { return rs == 2 || bn == 256; }
W4P_HD constexpr int ws_threads(int rs, int cw = 2, int bn = 128) {
  return ws_pwg(bn, rs) ? 12 * 32 : (4 * cw + 1) * 32;
}
W4P_HD constexpr int ws_tile(int64_t m) { return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128; }
#ifndef W4P_WS_KS4_MAX_BN
#define W4P_WS_KS4_MAX_BN 64  // (the 128-token tile measured slower with four-tile stages: two stages only)
#endif
W4P_HD constexpr int ws_ks(int bn, int gs) {
  return bn <= W4P_WS_KS4_MAX_BN && (gs <= 0 || gs % 64 == 0) ? 4 : 2;
}
// + a zeroed activation tile: the B operand of the wgmmas past the K range in a stage's last tile; RS = 2: + a
// staging tile of 64 rows x bn tokens per consumer warpgroup (the stages stay busy there: stream-K's producer
// runs on into the next segment)
W4P_HD constexpr int ws_smem_bytes(int bn, int ks, int rs = 1, int cw = 2) {
  return 2048 + ws_stages(bn, ks, rs) * ws_stage_bytes(bn, ks, rs, cw) + bn * 128 + (rs == 2 ? 2 * bn * ws_ypitch(64) : 0);
}

// wgmma_ss kernel
constexpr int SS_BR = 256;  // weight rows per block
// K tiles per stage: 2 for the 64-token tile (the second tile's codes load while the first is dequantized);
// 1 for the 128-token tile, whose 128 accumulators leave no registers for a second tile's codes (ptxas caps a
// block of 9 warps at 168 registers per thread: it spilled)
W4P_HD constexpr int ss_ks(int tok) { return tok == 128 ? 1 : 2; }
W4P_HD constexpr int ss_nb(int tok) { return tok == 128 ? 3 : 2; }  // B buffers
W4P_HD constexpr int ss_stage_bytes(int tok) { return ss_ks(tok) * (tok * 128 + 16 * 512 + 2 * SS_BR * 2); }
W4P_HD constexpr int ss_stages(int tok) { return tok == 128 ? 4 : 3; }
W4P_HD constexpr int ss_smem_bytes(int tok) {
  return 1024 + 1024 + ss_nb(tok) * SS_BR * 128 + ss_stages(tok) * ss_stage_bytes(tok);  // align slack, barriers
}

// tiled kernel
constexpr int TBM = 128, TBN = 128, TST = 4, TXP = 72;  // TXP: smem pitch of a 64-wide activation row

template <int SB> struct TiledCfg {
  static constexpr int V = SB / 4;
  static constexpr int W_BYTES = 8 * 32 * V * 16;
  static constexpr int X_BYTES = TBN * TXP * 2;
  static constexpr int P_BYTES = 4 * TBM * 2;  // up to 4 groups per 64-wide step (group size >= 16)
  static constexpr int STAGE = W_BYTES + X_BYTES + 2 * P_BYTES;
  static constexpr int SMEM = STAGE * TST;
};

// the workspace: the tile counters of the split and stream-K sums, then the gathered activations and partials
constexpr size_t COUNTER_BYTES = 64 * 1024;  // 16384 tile counters at the start of the workspace
constexpr int MAX_COUNTERS = (int)(COUNTER_BYTES / 4);
static_assert(2 * SK_READY == MAX_COUNTERS, "stream-K's two counters per tile");

}  // namespace w4p
