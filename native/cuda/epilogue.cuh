// The epilogue the kernels share: y (+ bias) for a quad of rows, and the deterministic split sums, through
// the workspace (last block to arrive sums in split order) or inside a thread block cluster.
#pragma once
#include "geometry.h"
#include "ptx.cuh"

namespace w4p {

// y for the rows row..row+3 of token tok (rows from N on dropped): the split sums v plus the bias
template <typename T>
__device__ __forceinline__ void store_quad(const Params &p, int64_t tok, int row, const float (&v)[4], bool pairs) {
  using T2 = typename Tr<T, 4>::T2;
  const T *bias = (const T *)p.bias;
  T *dst = (T *)p.y + tok * p.ldy + row;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 2 * h;
    const float v0 = v[2 * h] + ((bias && r < p.N) ? to_f(bias[r]) : 0.f);
    const float v1 = v[2 * h + 1] + ((bias && r + 1 < p.N) ? to_f(bias[r + 1]) : 0.f);
    if (pairs && r + 1 < p.N) {
      T2 o;
      o.x = from_f<T>(v0);
      o.y = from_f<T>(v1);
      *reinterpret_cast<T2 *>(dst + 2 * h) = o;
    } else {
      if (r < p.N) dst[2 * h] = from_f<T>(v0);
      if (r + 1 < p.N) dst[2 * h + 1] = from_f<T>(v1);
    }
  }
}
__device__ __forceinline__ bool y_pairs(const Params &p) {
  return (p.ldy & 1) == 0 && (reinterpret_cast<uintptr_t>(p.y) & 3) == 0;
}

// Split-K epilogue through the workspace: every block stores its fp32 partial tile; the last block to arrive
// sums the S partials in split order (bit-identical whoever arrives last) and writes y.
// The sum runs on quads of rows (16-byte loads; Np and row0 are multiples of 16, the workspace 256-byte
// aligned) with U quads per thread in flight and the split loop unrolled, so the last block waits for a few
// L2 round trips rather than one per output element (a 256 x 128 tile summed one element per thread and
// iteration is 114 dependent round trips for 288 threads). U = 4 gave the wgmma_ws kernels a 4-byte spill
// (their 2 blocks per SM cap them at 112 registers): 2 there, 4 where registers allow. NT: block_or_named_sync's.
template <typename T, int RB, int TBK, int SR_U = 2, int NT = 0>
__device__ __forceinline__ void split_reduce(const Params &p, int rb, int tb, int row0, int tok0) {
  __threadfence();
  block_or_named_sync(NT);
  const int tile = tb + p.TB * rb;
  bool last = false;
  if (threadIdx.x == 0) last = atomicAdd(&p.counters[tile], 1u) == (unsigned)(p.S - 1);
  if (!block_or_named_any(NT, last)) return;
  __threadfence();
  const bool pairs = y_pairs(p);
  const size_t plane = (size_t)p.M * p.Np;
  const int nq = min(RB, p.Np - row0) / 4;                        // row quads of the tile inside Np
  const int ntok = (int)(p.M - tok0 < TBK ? p.M - tok0 : TBK);
  const int total = nq * ntok, step = NT ? NT : (int)blockDim.x;
  for (int base = (int)threadIdx.x; base < total; base += SR_U * step) {
    const float *src[SR_U];
    float4 a[SR_U];
#pragma unroll
    for (int u = 0; u < SR_U; ++u) {
      const int idx = min(base + u * step, total - 1);  // past the end: a repeated load, never stored
      const int t = idx / nq, q = idx - t * nq;
      src[u] = p.part + (size_t)(tok0 + t) * p.Np + row0 + 4 * q;
      a[u] = __ldcg(reinterpret_cast<const float4 *>(src[u]));
    }
#pragma unroll 4
    for (int s = 1; s < p.S; ++s) {
#pragma unroll
      for (int u = 0; u < SR_U; ++u) {
        const float4 b = __ldcg(reinterpret_cast<const float4 *>(src[u] + s * plane));
        a[u].x += b.x;
        a[u].y += b.y;
        a[u].z += b.z;
        a[u].w += b.w;
      }
    }
#pragma unroll
    for (int u = 0; u < SR_U; ++u) {
      const int idx = base + u * step;
      if (idx >= total) break;
      const int t = idx / nq;
      const float v[4] = {a[u].x, a[u].y, a[u].z, a[u].w};
      store_quad<T>(p, tok0 + t, row0 + 4 * (idx - t * nq), v, pairs);
    }
  }
  if (threadIdx.x == 0) p.counters[tile] = 0u;  // ready for the next call / graph replay
}

// Split-K epilogue inside a thread block cluster (sm_90; the S <= 8 blocks of one output tile launched as one
// cluster, dims 1 x 1 x S): each block has put its fp32 partial tile at shared address `tile`, as [TBK tokens]
// [RB + 8] floats (8 floats of padding per token put a warp's 8 tokens in different banks). After a cluster
// barrier, block z sums its 1/S share of the tile over the S blocks' shared memory, in split order
// (bit-identical every call), and writes y; a second barrier keeps every block's tile until the others have
// read it. The partials never leave the SMs: no workspace, no counters. Measured on an H200 (docs/journal/2026-cuda.md):
// the workspace epilogue's partial stores and last-block sums cost wgmma_ss 27 of 37 us on 4096x4096 at M = 128
// with 8 splits.
template <typename T, int RB, int TBK, int NT = 0>  // NT: as split_reduce's (the others arrive on the barriers)
__device__ __forceinline__ void cluster_reduce(const Params &p, uint32_t tile, int row0, int64_t tok0) {
  constexpr int PITCH = RB + 8, QR = RB / 4, Q = TBK * QR;
  cluster_barrier();
  const int S = p.S, z = (int)blockIdx.z;
  const bool pairs = y_pairs(p);
  const int q1 = (z + 1) * Q / S;
  for (int idx = z * Q / S + (int)threadIdx.x; idx < q1; idx += NT ? NT : (int)blockDim.x) {
    const int t = idx / QR, q = idx - t * QR;
    const int64_t tok = tok0 + t;
    const int row = row0 + 4 * q;
    if (tok >= p.M || row >= p.N) continue;
    const uint32_t la = tile + (uint32_t)(t * PITCH + 4 * q) * 4u;
    float4 v[CLUSTER_MAX];
#pragma unroll
    for (int s = 0; s < CLUSTER_MAX; ++s)
      if (s < S) v[s] = ld_cluster_f4(la, (uint32_t)s);
    float a[4] = {v[0].x, v[0].y, v[0].z, v[0].w};
#pragma unroll
    for (int s = 1; s < CLUSTER_MAX; ++s)
      if (s < S) {
        a[0] += v[s].x;
        a[1] += v[s].y;
        a[2] += v[s].z;
        a[3] += v[s].w;
      }
    store_quad<T>(p, tok, row, a, pairs);
  }
  cluster_barrier();
}

// the worker whose range holds unit idx (ranges: [w * total / W, (w + 1) * total / W))
__device__ __forceinline__ int64_t ring_owner(int64_t idx, int64_t total, int64_t W) {
  return ((idx + 1) * W + total - 1) / total - 1;
}

// Stream-K over row stripes (the ring and bulk kernels): W workers take equal runs of the `total` units, a stripe
// group ("quad") being `per_quad` consecutive units. A worker whose run covers only part of a quad stores its fp32
// piece (M tokens x `rows` rows, token-major) in its slot 0 (the quad where its run starts) or 1 (the next);
// the last of the quad's workers to arrive (counters[q]) sums the pieces in worker order, so every call gives the
// same bits, adds the bias and writes y.
struct SkQuad {
  int64_t w_lo, w_hi;  // the first and last worker with units in this quad
  int sl_lo;           // slot of w_lo's piece (1 when its run starts in an earlier quad)
  __device__ __forceinline__ unsigned others() const { return (unsigned)(w_hi - w_lo); }
};
__device__ __forceinline__ SkQuad sk_quad(int q, int64_t per_quad, int64_t total, int64_t W) {
  SkQuad s;
  s.w_lo = ring_owner((int64_t)q * per_quad, total, W);
  s.w_hi = ring_owner((int64_t)(q + 1) * per_quad - 1, total, W);
  s.sl_lo = s.w_lo * total / W < (int64_t)q * per_quad ? 1 : 0;
  return s;
}
// worker w's piece in slot sl: the workspace holds two slots of nv floats per worker
__device__ __forceinline__ float *sk_piece(const Params &p, int64_t w, int sl, int nv) {
  return p.part + (size_t)(w * 2 + sl) * nv;
}
// The last arriver's sum of quad sq's pieces (nv = M x rows floats) for the rows row0.. of y: thread `tid` of
// `NT` takes elements tid, tid + NT, ..., U at a time (U loads of each piece in flight). Resets the counter.
template <typename T, int U, int NT>
__device__ __forceinline__ void sk_sum_pieces(const Params &p, const SkQuad &sq, int nv, int rows, int row0,
                                              int tid) {
  const T *bias = (const T *)p.bias;
  T *y = (T *)p.y;
  const float *base = p.part + (size_t)(sq.w_lo * 2) * nv;  // piece (w, slot) at base + ((w - w_lo) * 2 + slot) * nv
  const int npc = (int)(sq.w_hi - sq.w_lo) + 1;
  for (int e0 = tid; e0 < nv; e0 += U * NT) {
    float v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = (e0 + NT * u < nv) ? __ldcg(base + sq.sl_lo * nv + e0 + NT * u) : 0.f;
#pragma unroll 4
    for (int j = 1; j < npc; ++j) {
      const float *pj = base + (size_t)(j * 2) * nv;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (e0 + NT * u < nv) v[u] += __ldcg(pj + e0 + NT * u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = e0 + NT * u, tok = e / rows, row = row0 + e % rows;
      if (e < nv && row < p.N) {
        float o = v[u];
        if (bias) o += to_f(bias[row]);
        y[(int64_t)tok * p.ldy + row] = from_f<T>(o);
      }
    }
  }
}

}  // namespace w4p
