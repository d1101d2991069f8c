// What the three wgmma kernels share (sm_90a): the wgmma instructions, shared-memory descriptors, the
// staged y store and the stream-K epilogue, TMA copies and the last token tile's tensor maps.
#pragma once
#include "epilogue.cuh"

namespace w4p {

__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  // K-major, 128-byte swizzle: start >> 4, LBO unused (1), SBO = 1024 B between 8-row groups, mode 1
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// wgmma.mma_async m64nNk16 with fp32 accumulators d[N / 2]; the fp16 and bf16 forms differ only in the
// type's PTX name. The bodies are empty outside sm_90a (the planner launches these kernels on 9.0 only).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define W4P_SM90A(...) __VA_ARGS__
#else
#define W4P_SM90A(...)
#endif
#define W4P_WG_ACC8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define W4P_WG_ACC16 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define W4P_WG_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define W4P_WG_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define W4P_WG_ACC32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), \
  "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), \
  "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
  "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define W4P_WG_ACC64_OF(v) "+f"(v[0]), "+f"(v[1]), "+f"(v[2]), "+f"(v[3]), "+f"(v[4]), "+f"(v[5]), "+f"(v[6]), "+f"(v[7]), "+f"(v[8]), \
  "+f"(v[9]), "+f"(v[10]), "+f"(v[11]), "+f"(v[12]), "+f"(v[13]), "+f"(v[14]), "+f"(v[15]), "+f"(v[16]), \
  "+f"(v[17]), "+f"(v[18]), "+f"(v[19]), "+f"(v[20]), "+f"(v[21]), "+f"(v[22]), "+f"(v[23]), "+f"(v[24]), \
  "+f"(v[25]), "+f"(v[26]), "+f"(v[27]), "+f"(v[28]), "+f"(v[29]), "+f"(v[30]), "+f"(v[31]), "+f"(v[32]), \
  "+f"(v[33]), "+f"(v[34]), "+f"(v[35]), "+f"(v[36]), "+f"(v[37]), "+f"(v[38]), "+f"(v[39]), "+f"(v[40]), \
  "+f"(v[41]), "+f"(v[42]), "+f"(v[43]), "+f"(v[44]), "+f"(v[45]), "+f"(v[46]), "+f"(v[47]), "+f"(v[48]), \
  "+f"(v[49]), "+f"(v[50]), "+f"(v[51]), "+f"(v[52]), "+f"(v[53]), "+f"(v[54]), "+f"(v[55]), "+f"(v[56]), \
  "+f"(v[57]), "+f"(v[58]), "+f"(v[59]), "+f"(v[60]), "+f"(v[61]), "+f"(v[62]), "+f"(v[63])
#define W4P_WG_ACC64 W4P_WG_ACC64_OF(d)
// m64n256: the second half through e = d + 64
#define W4P_WG_ACC128 W4P_WG_ACC64_OF(d), W4P_WG_ACC64_OF(e)
#define W4P_WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define W4P_WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define W4P_WG_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, " \
  "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, " \
  "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// A from registers (%ia: the four A registers, scale-d and the B descriptor follow the accumulators)
#define W4P_WGOP_RS(T, TY, N, DREGS, ACC, AREGS, SC, DESC)                                                       \
  template <> struct WgOp<T, N> {                                                                                \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc,         \
                                               int scale_d) {                                                    \
      float *const e = d + (N > 128 ? 64 : 0); /* the second 64 accumulators of m64n256 */                       \
      (void)e;                                                                                                   \
      W4P_SM90A(asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " SC ", 0;\n"                                   \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", " AREGS    \
                             ", " DESC ", p, 1, 1, 0;\n}\n"                                                      \
                             : ACC                                                                               \
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(desc));)            \
    }                                                                                                            \
  };
// A from shared memory as well (both operands K-major, 128-byte swizzle)
#define W4P_WGOP_SS(T, TY, N, DREGS, ACC, DA, DB, SC)                                                            \
  template <> struct WgOpSS<T, N> {                                                                              \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {       \
      float *const e = d + (N > 128 ? 64 : 0); /* the second 64 accumulators of m64n256 */                       \
      (void)e;                                                                                                   \
      W4P_SM90A(asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " SC ", 0;\n"                                   \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", " DA ", " \
                             DB ", p, 1, 1, 0, 0;\n}\n"                                                          \
                             : ACC                                                                               \
                             : "l"(da), "l"(db), "r"(scale_d));)                                                 \
    }                                                                                                            \
  };
// A warpgroup's wgmma D fragment out (both wgmma kernels): acc[4 i + c] is row (c < 2 ? r_lo : r_lo + 8),
// token tok0 + 8 i + 2 (lane & 3) + (c & 1). One split: y (+ bias).
template <typename T, int BN>
__device__ __forceinline__ void wg_store_y(const Params &p, const float (&acc)[BN / 2], int r_lo, int64_t tok0,
                                           int lane) {
  const int r_hi = r_lo + 8;
  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  const float b_lo = (bias && r_lo < p.N) ? to_f(bias[r_lo]) : 0.f;
  const float b_hi = (bias && r_hi < p.N) ? to_f(bias[r_hi]) : 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = c < 2 ? r_lo : r_hi;
      const int64_t tok = tok0 + 8 * i + 2 * (lane & 3) + (c & 1);
      if (row < p.N && tok < p.M) y[tok * p.ldy + row] = from_f<T>(acc[4 * i + c] + (c < 2 ? b_lo : b_hi));
    }
}
// Several splits: this split's fp32 partials, which split_reduce then adds in split order.
template <int BN>
__device__ __forceinline__ void wg_store_part(const Params &p, const float (&acc)[BN / 2], int r_lo, int64_t tok0,
                                              int lane) {
  const int r_hi = r_lo + 8;
  float *part = p.part + (size_t)blockIdx.z * p.M * p.Np;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = c < 2 ? r_lo : r_hi;
      const int64_t tok = tok0 + 8 * i + 2 * (lane & 3) + (c & 1);
      if (tok < p.M && row < p.Np) __stcg(part + tok * p.Np + row, acc[4 * i + c]);
    }
}

__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3) : "memory");
}
template <typename T> __device__ __forceinline__ uint32_t pack_t2(float a, float b) {
  typename Tr<T, 4>::T2 v;
  v.x = from_f<T>(a);
  v.y = from_f<T>(b);
  return *reinterpret_cast<uint32_t *>(&v);
}
// One part of a wgmma_ws output tile into y through shared memory: the NW warps of the part (index wl within it)
// each hold 16 weight rows, rbase + 16 wl + {gid, gid + 8}, x BN tokens from tok0 (the m64nN D fragment). Each
// 8 x 8 block of the fragment (+ bias, rounded once to T) is stored transposed (stmatrix .trans), so that a
// token's 8 rows become one 16-byte run of the staging tile [BN][16 NW (+ 8)]; then the part's threads write it
// out token row by token row, 16 bytes a thread. Before, the fragment went to y in 2-byte stores (four 16-byte
// runs per warp instruction): 3.8-5.5 us of a 256 x 128 block's 50, 1.9-2.2 staged (H200 trace of 4096x11008 at
// M = 256, docs/journal/2026-cuda.md section 7).
// The part's 32 NW threads synchronize on named barrier `bar` before and after staging, so the staging tile may be
// reused by the next part.
template <typename T, int BN, int NW>
__device__ __forceinline__ void ws_store_y(const Params &p, const float (&acc)[BN / 2], int rbase, int64_t tok0,
                                           uint32_t stg, const unsigned char *stg_g, int wl, int lane, int bar) {
  constexpr int R = 16 * NW, PITCH = ws_ypitch(R), CPR = R / 8;  // 16-byte chunks per token row
  const int r_lo = rbase + 16 * wl + (lane >> 2), r_hi = r_lo + 8;
  const T *bias = (const T *)p.bias;
  const float b_lo = (bias && r_lo < p.N) ? to_f(bias[r_lo]) : 0.f;
  const float b_hi = (bias && r_hi < p.N) ? to_f(bias[r_hi]) : 0.f;
  named_sync(bar, 32 * NW);  // the part's previous readers of the staging tile are done
  {
    const int q = lane >> 3;  // the lane's address: row (lane & 7) of matrix q: (i + q / 2, half q & 1)
    const uint32_t a0 = stg + (uint32_t)((8 * (q >> 1) + (lane & 7)) * PITCH + (16 * wl + 8 * (q & 1)) * 2);
#pragma unroll
    for (int i = 0; i < BN / 8; i += 2)
      stsm_x4_trans(a0 + (uint32_t)(8 * i * PITCH), pack_t2<T>(acc[4 * i] + b_lo, acc[4 * i + 1] + b_lo),
                    pack_t2<T>(acc[4 * i + 2] + b_hi, acc[4 * i + 3] + b_hi),
                    pack_t2<T>(acc[4 * i + 4] + b_lo, acc[4 * i + 5] + b_lo),
                    pack_t2<T>(acc[4 * i + 6] + b_hi, acc[4 * i + 7] + b_hi));
  }
  named_sync(bar, 32 * NW);
  T *y = (T *)p.y;
  const bool vec = (p.ldy & 7) == 0 && (reinterpret_cast<uintptr_t>(p.y) & 15) == 0;
  // a fixed trip count, the same for every lane: inside stream-K's segment loop a loop whose exit depends on the
  // lane made ptxas move the main loop's uniform arithmetic (wgmma descriptors) to per-thread registers
  static_assert(BN * CPR % (32 * NW) == 0, "whole rounds of the part's threads");
#pragma unroll
  for (int it = 0; it < BN * CPR / (32 * NW); ++it) {
    const int idx = it * 32 * NW + 32 * wl + lane;
    const int t = idx / CPR, c = idx - t * CPR;
    const int64_t tok = tok0 + t;
    const int row = rbase + 8 * c;
    if (tok < p.M && row < p.N) {
      const unsigned char *src = stg_g + t * PITCH + c * 16;
      T *dst = y + tok * p.ldy + row;
      if (vec && row + 8 <= p.N) {
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
      } else {
        const T *s = reinterpret_cast<const T *>(src);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (row + e < p.N) dst[e] = s[e];
      }
    }
  }
}

// A wgmma_ws block's whole output tile through ws_store_y. RS = 2: each consumer warpgroup stages its own 64-row
// parts in its own tile after the zero tile (`stg`), on its own barrier, so neither waits for the other. RS = 1:
// the 4 CW consumer warps (8, or 12 in 192-row blocks) share the stages (`stg`), free once all of them are past the
// main loop (the first barrier)
template <typename T, int BN, int RS, int CW = 2>
__device__ __forceinline__ void ws_store_tile(const Params &p, const float (&acc)[RS][BN / 2], int row0, int64_t tok0,
                                              uint32_t stg, const unsigned char *stg_g, int warp, int lane) {
  if constexpr (RS == 2) {
    const int w = warp >> 2;
    const int off = w * BN * ws_ypitch(64);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      ws_store_y<T, BN, 4>(p, acc[r], row0 + 128 * r + 64 * w, tok0, stg + (uint32_t)off, stg_g + off, warp & 3, lane,
                           2 + w);
  } else {
    ws_store_y<T, BN, 4 * CW>(p, acc[0], row0, tok0, stg, stg_g, warp, lane, 1);
  }
}

__device__ __forceinline__ unsigned sk_block() { return blockIdx.x; }
__device__ __forceinline__ unsigned sk_grid() { return gridDim.x; }
// Stream-K (wgmma_ws with p.sk tiles over a grid of resident blocks): the block whose share of the units
// (stages of tiles, tile by tile) holds unit u, for shares split as floor(b * U / G)
__device__ __forceinline__ int sk_owner(int64_t u, int64_t U, int G) { return (int)(((u + 1) * G - 1) / U); }
// Stream-K epilogue of one segment, run by each consumer warpgroup on its own (the producer has left): a
// warpgroup's rows of a tile (64 of each 128-row half) are summed apart from the other warpgroup's, so the two
// never wait for each other (they drift by up to a few stages). A whole tile goes to y. For a partial one the
// warpgroups holding its part w first take an arrival number (counters[2 tile + w]). All but the last store their
// accumulators in their block's workspace slot (0 for the block's first segment, 1 for its last; fragment order:
// for each 4-float group of a thread's accumulators, the 256 threads' groups side by side, 512 contiguous bytes
// per warp instruction; a warpgroup writes its own threads' groups) and count themselves stored
// (counters[SK_READY + 2 tile + w], at their next epilogue: sk_count_stored). The last waits for those, adds the
// slots to its own registers in block order, its own term in its place (bit-identical whoever arrives last), and
// writes y: its own partial never goes through memory. Every block's run holds at least one unit (the plan keeps G <= U), so the blocks of a tile are
// exactly those from the owner of its first unit to the owner of its last.
// A warpgroup counts its last partial store stored (pend: its part, or -1) only at its next segment's epilogue or
// at the run's end: the stores drain while it runs the next segment, and the block that sums that tile arrives
// much later (at the end of its own run). The fence orders each thread's stores before the count.
__device__ __forceinline__ void sk_count_stored(const Params &p, int &pend, int warp) {
  __threadfence();
  named_sync(2 + (warp >> 2), 128);  // (also: every thread of the warpgroup is past its previous epilogue)
  if ((threadIdx.x & 127) == 0 && pend >= 0) atomicAdd(&p.counters[SK_READY + pend], 1u);
  pend = -1;
}
template <typename T, int RB, int BN, int RS>
__device__ __forceinline__ void sk_epilogue(const Params &p, float (&acc)[RS][BN / 2], int tile, int kb, int ke,
                                            int row0, int64_t tok0, int warp, int lane, int64_t u_beg, int SPT,
                                            uint32_t stg, const unsigned char *stg_g, int &pend) {
  static_assert(RS == 2, "stream-K runs the 256-row blocks");
  sk_count_stored(p, pend, warp);
  if (kb == 0 && ke == p.KT) {
    ws_store_tile<T, BN, RS>(p, acc, row0, tok0, stg, stg_g, warp, lane);
    return;
  }
  constexpr int TILE = BN * RB, NG = RS * BN / 8;  // floats per slot; 4-float groups per thread
  static_assert(NG * 4 * 256 == TILE, "a slot holds the 256 consumer threads' accumulators");
  const int w = warp >> 2, bar = 2 + w, part = 2 * tile + w;
  const bool lead = (threadIdx.x & 127) == 0;
  const int G = (int)sk_grid(), me = (int)sk_block();
  const int64_t U = (int64_t)p.sk * SPT;
  const int c_lo = sk_owner((int64_t)tile * SPT, U, G), c_hi = sk_owner((int64_t)(tile + 1) * SPT - 1, U, G);
  auto slot = [&](int cb) {
    return reinterpret_cast<float4 *>(p.part + ((size_t)cb * 2 + ((int64_t)cb * U / G / SPT == tile ? 0 : 1)) * TILE) +
           threadIdx.x;
  };
  const bool last = named_any(bar, 128, lead && atomicAdd(&p.counters[part], 1u) == (unsigned)(c_hi - c_lo));
  // (a vote: its result is known to be the same in every lane, so the branch keeps the segment loop's control
  // flow uniform for ptxas)
  if (!__any_sync(0xffffffffu, last)) {
    float4 *mine = slot(me);
#pragma unroll
    for (int r = 0; r < RS; ++r)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        __stcg(mine + (r * (BN / 8) + i) * 256,
               make_float4(acc[r][4 * i], acc[r][4 * i + 1], acc[r][4 * i + 2], acc[r][4 * i + 3]));
    pend = part;  // counted stored at the next segment's epilogue or the run's end
    return;
  }
  if (lead)  // the others have arrived: they are storing or have stored
    while (atomicOr(&p.counters[SK_READY + part], 0u) < (unsigned)(c_hi - c_lo)) __nanosleep(64);
  named_sync(bar, 128);
  __threadfence();
  if (c_hi - c_lo == 1) {
    // two blocks (the usual case): the other's slot, 8 groups in flight at once (four L2 round trips; 4 in flight
    // before took eight). One addition: its order does not change the result
    const float4 *other = slot(me == c_lo ? c_hi : c_lo);
#pragma unroll
    for (int i0 = 0; i0 < NG; i0 += 8) {
      float4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __ldcg(other + (i0 + i) * 256);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float *a = &acc[(i0 + i) / (BN / 8)][4 * ((i0 + i) % (BN / 8))];
        a[0] += v[i].x;
        a[1] += v[i].y;
        a[2] += v[i].z;
        a[3] += v[i].w;
      }
    }
  } else {
    constexpr int CH = 4;  // groups per chunk: loads of 16 bytes in flight per thread and slot
#pragma unroll
    for (int r = 0; r < RS; ++r)
#pragma unroll
      for (int i0 = 0; i0 < BN / 8; i0 += CH) {
        float4 pre[CH];  // the sum of the slots before this block's, in block order
        for (int cb = c_lo; cb < me; ++cb) {
          const float4 *src = slot(cb) + (r * (BN / 8) + i0) * 256;
          float4 v[CH];
#pragma unroll
          for (int i = 0; i < CH; ++i) v[i] = __ldcg(src + i * 256);
#pragma unroll
          for (int i = 0; i < CH; ++i)
            pre[i] = cb == c_lo ? v[i] : make_float4(pre[i].x + v[i].x, pre[i].y + v[i].y, pre[i].z + v[i].z,
                                                     pre[i].w + v[i].w);
        }
        if (me > c_lo)
#pragma unroll
          for (int i = 0; i < CH; ++i) {
            float *a = &acc[r][4 * (i0 + i)];
            a[0] = pre[i].x + a[0];
            a[1] = pre[i].y + a[1];
            a[2] = pre[i].z + a[2];
            a[3] = pre[i].w + a[3];
          }
        for (int cb = me + 1; cb <= c_hi; ++cb) {
          const float4 *src = slot(cb) + (r * (BN / 8) + i0) * 256;
          float4 v[CH];
#pragma unroll
          for (int i = 0; i < CH; ++i) v[i] = __ldcg(src + i * 256);
#pragma unroll
          for (int i = 0; i < CH; ++i) {
            float *a = &acc[r][4 * (i0 + i)];
            a[0] += v[i].x;
            a[1] += v[i].y;
            a[2] += v[i].z;
            a[3] += v[i].w;
          }
        }
      }
  }
  ws_store_tile<T, BN, RS>(p, acc, row0, tok0, stg, stg_g, warp, lane);
  if (lead) {  // ready for the next call / graph replay
    p.counters[part] = 0u;
    p.counters[SK_READY + part] = 0u;
  }
}

template <typename T, int BN> struct WgOp;
W4P_WGOP_RS(half, "f16", 16, W4P_WG_D8, W4P_WG_ACC8, "{%8, %9, %10, %11}", "%12", "%13")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 16, W4P_WG_D8, W4P_WG_ACC8, "{%8, %9, %10, %11}", "%12", "%13")
W4P_WGOP_RS(half, "f16", 32, W4P_WG_D16, W4P_WG_ACC16, "{%16, %17, %18, %19}", "%20", "%21")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 32, W4P_WG_D16, W4P_WG_ACC16, "{%16, %17, %18, %19}", "%20", "%21")
W4P_WGOP_RS(half, "f16", 64, W4P_WG_D32, W4P_WG_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 64, W4P_WG_D32, W4P_WG_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
W4P_WGOP_RS(half, "f16", 128, W4P_WG_D64, W4P_WG_ACC64, "{%64, %65, %66, %67}", "%68", "%69")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 128, W4P_WG_D64, W4P_WG_ACC64, "{%64, %65, %66, %67}", "%68", "%69")
W4P_WGOP_RS(half, "f16", 256, W4P_WG_D128, W4P_WG_ACC128, "{%128, %129, %130, %131}", "%132", "%133")
W4P_WGOP_RS(__nv_bfloat16, "bf16", 256, W4P_WG_D128, W4P_WG_ACC128, "{%128, %129, %130, %131}", "%132", "%133")
template <typename T, int BN> struct WgOpSS;
W4P_WGOP_SS(half, "f16", 64, W4P_WG_D32, W4P_WG_ACC32, "%32", "%33", "%34")
W4P_WGOP_SS(__nv_bfloat16, "bf16", 64, W4P_WG_D32, W4P_WG_ACC32, "%32", "%33", "%34")
W4P_WGOP_SS(half, "f16", 128, W4P_WG_D64, W4P_WG_ACC64, "%64", "%65", "%66")
W4P_WGOP_SS(__nv_bfloat16, "bf16", 128, W4P_WG_D64, W4P_WG_ACC64, "%64", "%65", "%66")
W4P_WGOP_SS(half, "f16", 256, W4P_WG_D128, W4P_WG_ACC128, "%128", "%129", "%130")
W4P_WGOP_SS(__nv_bfloat16, "bf16", 256, W4P_WG_D128, W4P_WG_ACC128, "%128", "%129", "%130")

// The activation tensor maps of a last token tile that ends past M: 8 << b token rows for b = 0..4 (wgmma_ws's
// producer; only the one its tile uses is encoded). xtail_box: the map for a tile of `rows` token rows out of bn,
// -1 for the whole tile's.
constexpr int XTAIL_MAPS = 5;
struct XTails {
  CUtensorMap m[XTAIL_MAPS];
};
__host__ __device__ constexpr int xtail_box(int bn, int rows) {
  int b = 0;
  while (b < XTAIL_MAPS && (8 << b) < rows) ++b;
  return (8 << b) >= bn ? -1 : b;
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void *src, unsigned bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// The register split between the producer warpgroup and the consumers (setmaxnreg) of the blocks that have one
// (ws_pwg: RS = 2 and the 256-token tile): stream-K's producer loop needs 56 (it spilled at 40)
__host__ __device__ constexpr int ws_preg(bool sk) { return sk ? 56 : 40; }
__host__ __device__ constexpr int ws_creg(bool sk) { return sk ? 224 : 232; }

}  // namespace w4p
