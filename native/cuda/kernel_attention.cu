// Decode attention: one query token of a llama-family layer against its KV cache, in one launch.
//
// Why: in a batch-1 decode step the attention is six small kernels a layer (rotary, two cache writes, two
// batched products, softmax), each a launch and a round trip to memory for a few hundred KB. Here one block per
// (kv head, split of the keys) rotates the new query and key, writes the new key and value into the cache, and
// runs an online softmax over its keys; the last block of a kv head to finish combines the splits. The position
// is read from device memory, so a captured graph serves every position and reads only the keys written so far.
#include <math.h>
#include "dequant.cuh"
#include "launch.h"

namespace w4p {
namespace {

constexpr int AT_THREADS = 128;   // four warps
constexpr int AT_WARPS = AT_THREADS / 32;
constexpr int AT_MAX_SPLITS = 64;  // blocks a kv head at most: the combine's lanes take two splits each

__device__ __forceinline__ float lo_f(uint32_t w, half) { return __half2float(__ushort_as_half((unsigned short)w)); }
__device__ __forceinline__ float hi_f(uint32_t w, half) {
  return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}
__device__ __forceinline__ float lo_f(uint32_t w, __nv_bfloat16) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w, __nv_bfloat16) { return __uint_as_float(w & 0xffff0000u); }

// a lane's EPL consecutive 16-bit elements of a row, as one 4-, 8- or 16-byte load
template <int EPL> struct Raw { uint32_t w[EPL / 2]; };

template <int EPL>
__device__ __forceinline__ Raw<EPL> load_raw(const void *row, int lane) {
  Raw<EPL> r;
  if constexpr (EPL == 2) {
    r.w[0] = reinterpret_cast<const uint32_t *>(row)[lane];
  } else if constexpr (EPL == 4) {
    const uint2 u = reinterpret_cast<const uint2 *>(row)[lane];
    r.w[0] = u.x, r.w[1] = u.y;
  } else {
    const uint4 u = reinterpret_cast<const uint4 *>(row)[lane];
    r.w[0] = u.x, r.w[1] = u.y, r.w[2] = u.z, r.w[3] = u.w;
  }
  return r;
}

template <typename T, int EPL>
__device__ __forceinline__ void widen(const Raw<EPL> &r, float (&v)[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL / 2; ++i) {
    v[2 * i] = lo_f(r.w[i], T());
    v[2 * i + 1] = hi_f(r.w[i], T());
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Each lane's V partial sums (V a power of two, at most 32) summed over the warp, transposed: every step halves
// the values a lane holds, keeping one half and adding the other half from the lane across, so V sums cost
// V - 1 + (5 - log2 V) shuffles instead of 5 V. Afterwards v[0] of lane L holds sum j = L / (32 / V).
template <int V>
__device__ __forceinline__ void warp_sums(float (&v)[V], int lane) {
  static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "a power of two up to 32");
#pragma unroll
  for (int step = 0; step < 5; ++step) {
    const int o = 16 >> step, n = V >> step;
    if (n >= 2) {
      // which half a lane keeps, chosen by bit masks: a select between two array elements would become a
      // select between their addresses and put the array in local memory
      const uint32_t up = 0u - (uint32_t)((lane & o) != 0);
#pragma unroll
      for (int j = 0; j < V / 2; ++j) {  // (a constant bound, so both loops unroll and v stays in registers)
        if (j >= n / 2) break;
        const uint32_t lo = __float_as_uint(v[j]), hi = __float_as_uint(v[j + n / 2]);
        const float keep = __uint_as_float((lo & ~up) | (hi & up)), send = __uint_as_float((hi & ~up) | (lo & up));
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    }
  }
}

// x[i] * cos[i] + rotate_half(x)[i] * sin[i] in fp32, rounded to T once (transformers' apply_rotary_pos_emb
// rounds each product and the sum in the model's dtype); xo is x[i + D/2] where i is in the lower half (low),
// else x[i - D/2]
template <typename T>
__device__ __forceinline__ T rotated(T xi, T xo, T c, T s, bool low) {
  const float other = low ? -to_f(xo) : to_f(xo);
  return from_f<T>(to_f(xi) * to_f(c) + other * to_f(s));
}

// The values one thread rotates (or copies, without tables): element i of a row of D, its partner and the
// position's cos and sin, loaded together so a thread's several elements cost one memory round trip.
template <typename T> struct RotIn {
  T x{}, xo{}, c{}, s{};
};
template <typename T, int D>
__device__ __forceinline__ RotIn<T> rot_load(const T *row, const T *cs, const T *sn, int i) {
  RotIn<T> r;
  r.x = row[i];
  if (cs) {
    r.xo = row[i < D / 2 ? i + D / 2 : i - D / 2];
    r.c = cs[i];
    r.s = sn[i];
  }
  return r;
}
template <typename T, int D>
__device__ __forceinline__ T rot_apply(const RotIn<T> &r, bool tables, int i) {
  return tables ? rotated(r.x, r.xo, r.c, r.s, i < D / 2) : r.x;
}

// grid (kv_heads, splits); G = heads / kv_heads query heads share a kv head (GM: G rounded up to a power of
// two). The keys written so far are divided into S <= splits chunks of at least one tile (a short context
// takes fewer blocks and, with one, no combine); split s owns keys [s * chunk, min((s + 1) * chunk, pos + 1)).
// A tile is KPW keys per warp, each warp's K and V rows in registers: the first tile's loaded before the
// prologue, each next tile's K rows as soon as this tile's scores are done with theirs and its V rows as soon as
// the values are, so a split's loads overlap its arithmetic instead of waiting a memory round trip a tile. The key at pos comes from this token's projections
// (shared memory), the others from the cache. ws: counters [kv_heads] (left at zero), then per (kv head,
// split, g): m, l and the unnormalized output [D], fp32.
template <typename T, int EPL, int GM>
__global__ void __launch_bounds__(AT_THREADS) decode_attention_kernel(const AttnParams a) {
  constexpr int D = EPL * 32;
  constexpr int KPW = EPL == 8 ? 8 : 16;  // (K and V rows in registers: 32 or 64 a lane)
  constexpr int TK = KPW * AT_WARPS;
  const int kvh = blockIdx.x, s = blockIdx.y;
  const int G = a.heads / a.kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t pos = *a.pos;
  const T *qkv = (const T *)a.qkv;
  T *out = (T *)a.out;
  if (pos < 0 || pos >= a.max_len) {  // nothing valid to attend: the output says so
    for (int i = tid; i < G * D; i += AT_THREADS) out[(size_t)kvh * G * D + i] = from_f<T>(nanf(""));
    return;
  }
  const int64_t keys = pos + 1;
  int64_t chunk = (keys + gridDim.y - 1) / gridDim.y;
  chunk = max((chunk + 15) / 16 * 16, (int64_t)TK);
  const int S = (int)((keys + chunk - 1) / chunk);  // the splits with keys; the grid's others have none
  if (s >= S) return;
  const int64_t j0 = (int64_t)s * chunk, j1 = min(keys, j0 + chunk);

  __shared__ __align__(16) float q_s[GM][D];
  __shared__ __align__(16) T kn_s[D], vn_s[D];
  __shared__ float p_s[GM][TK];
  __shared__ float m_s[GM], l_s[GM], alpha_s[GM];
  __shared__ __align__(16) float red_s[AT_WARPS][GM][D];
  __shared__ unsigned last_s;

  T *kc = (T *)a.k_cache + (size_t)kvh * a.max_len * D;
  T *vc = (T *)a.v_cache + (size_t)kvh * a.max_len * D;
  // (rows past the keys are scored and dropped; the first tile's are zeros, a later tile's the rows before)
  Raw<EPL> kr[KPW] = {}, vr[KPW] = {};
  auto load_rows = [&](Raw<EPL>(&r)[KPW], const T *c, int64_t t0) {  // this warp's rows of a tile, not pos's
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
      const int64_t j = t0 + warp * KPW + i;
      if (j < j1 && j != pos) r[i] = load_raw<EPL>(c + j * D, lane);
    }
  };
  load_rows(kr, kc, j0);
  load_rows(vr, vc, j0);

  const T *cs = a.cos ? (const T *)a.cos + pos * D : nullptr;
  const T *sn = a.sin ? (const T *)a.sin + pos * D : nullptr;
  const T *kx = qkv + (size_t)(a.heads + kvh) * D;
  const T *vx = qkv + (size_t)(a.heads + a.kv_heads + kvh) * D;
  {  // the queries and the new key rotated, the value copied: every load first, then every store
    constexpr int QN = (GM * D + AT_THREADS - 1) / AT_THREADS, KN = (D + AT_THREADS - 1) / AT_THREADS;
    RotIn<T> qi[QN], ki[KN];
    T vi[KN];
#pragma unroll
    for (int n = 0; n < QN; ++n) {
      const int i = tid + n * AT_THREADS;
      if (i < G * D) qi[n] = rot_load<T, D>(qkv + (size_t)(kvh * G + i / D) * D, cs, sn, i % D);
    }
#pragma unroll
    for (int n = 0; n < KN; ++n) {
      const int i = tid + n * AT_THREADS;
      if (i < D) {
        ki[n] = rot_load<T, D>(kx, cs, sn, i);
        vi[n] = vx[i];
      }
    }
#pragma unroll
    for (int n = 0; n < QN; ++n) {
      const int i = tid + n * AT_THREADS;
      if (i < G * D) q_s[i / D][i % D] = to_f(rot_apply<T, D>(qi[n], cs != nullptr, i % D));
    }
#pragma unroll
    for (int n = 0; n < KN; ++n) {
      const int i = tid + n * AT_THREADS;
      if (i < D) {
        kn_s[i] = rot_apply<T, D>(ki[n], cs != nullptr, i);
        vn_s[i] = vi[n];
      }
    }
  }
  if (tid < GM) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  __syncthreads();
  if (j0 <= pos && pos < j1) {  // the block that attends to the new key stores it
    for (int i = tid; i < D; i += AT_THREADS) {
      kc[pos * D + i] = kn_s[i];
      vc[pos * D + i] = vn_s[i];
    }
  }

  float q[GM][EPL];
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int e = 0; e < EPL; ++e) q[g][e] = g < G ? q_s[g][lane * EPL + e] : 0.f;
  float acc[GM][EPL];
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;

  for (int64_t t0 = j0; t0 < j1; t0 += TK) {
    const bool more = t0 + TK < j1;
    const int64_t w0 = t0 + warp * KPW;  // this warp's first key
    if (w0 <= pos && pos < w0 + KPW) {
#pragma unroll
      for (int i = 0; i < KPW; ++i) {  // (a constant index: the rows stay in registers)
        if (w0 + i == pos) {
          kr[i] = load_raw<EPL>(kn_s, lane);
          vr[i] = load_raw<EPL>(vn_s, lane);
        }
      }
    }
    // scores: each lane's partial products of RC rows with the GM heads, summed over the warp together
    constexpr int RC = KPW < 32 / GM ? KPW : 32 / GM, V = RC * GM, P = 32 / V;  // rows a chunk; lanes a sum
#pragma unroll
    for (int cc = 0; cc < KPW / RC; ++cc) {
      const int c = cc * RC;
      float sc[V];
#pragma unroll
      for (int i = 0; i < RC; ++i) {
        float k[EPL];
        widen<T, EPL>(kr[c + i], k);
#pragma unroll
        for (int g = 0; g < GM; ++g) {
          float v = 0.f;
#pragma unroll
          for (int e = 0; e < EPL; ++e) v = fmaf(q[g][e], k[e], v);
          sc[i * GM + g] = v;  // (zero past G: q is)
        }
      }
      warp_sums<V>(sc, lane);
      const int j = lane / P, i = c + j / GM, g = j % GM;
      if (lane % P == 0 && g < G) p_s[g][warp * KPW + i] = w0 + i < j1 ? sc[0] * a.scaling : -INFINITY;
    }
    if (more) load_rows(kr, kc, t0 + TK);  // the next tile's keys arrive while the softmax and values run
    __syncthreads();
    // the online softmax's update: warp w the query heads g = w, w + 4, ...
    for (int g = warp; g < G; g += AT_WARPS) {
      float mx = -INFINITY;
      for (int e = lane; e < TK; e += 32) mx = fmaxf(mx, p_s[g][e]);
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, warp_max(mx));  // finite: the tile has a key
      float sum = 0.f;
      for (int e = lane; e < TK; e += 32) {
        const float p = __expf(p_s[g][e] - m_new);
        p_s[g][e] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();  // every lane has read m_s[g] before lane 0 rewrites it
      if (lane == 0) {
        const float al = __expf(m_old - m_new);
        alpha_s[g] = al;
        l_s[g] = l_s[g] * al + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();
    // the values: this warp's rows, a lane EPL of the D dimensions
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      if (g < G) {
        const float al = alpha_s[g];
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] *= al;
      }
    }
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
      if (w0 + i < j1) {
        float v[EPL];
        widen<T, EPL>(vr[i], v);
#pragma unroll
        for (int g = 0; g < GM; ++g) {
          if (g < G) {
            const float p = p_s[g][warp * KPW + i];
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(p, v[e], acc[g][e]);
          }
        }
      }
    }
    if (more) load_rows(vr, vc, t0 + TK);  // and its values while its scores run
    __syncthreads();  // p_s is rewritten by the next tile
  }

  // the four warps' partial outputs summed
#pragma unroll
  for (int g = 0; g < GM; ++g)
    if (g < G)
#pragma unroll
      for (int e = 0; e < EPL; ++e) red_s[warp][g][lane * EPL + e] = acc[g][e];
  __syncthreads();
  if (S == 1) {
    for (int i = tid; i < G * D; i += AT_THREADS) {
      const int g = i / D, d = i % D;
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < AT_WARPS; ++w) o += red_s[w][g][d];
      out[(size_t)kvh * G * D + i] = from_f<T>(o / l_s[g]);
    }
    return;
  }
  unsigned *counter = (unsigned *)a.ws + kvh;
  float *part = (float *)((char *)a.ws + a.ws_counters) + ((size_t)kvh * S + s) * G * (D + 2);
  for (int i = tid; i < G * D; i += AT_THREADS) {
    const int g = i / D, d = i % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < AT_WARPS; ++w) o += red_s[w][g][d];
    part[g * (D + 2) + 2 + d] = o;
  }
  if (tid < G) {
    part[tid * (D + 2)] = m_s[tid];
    part[tid * (D + 2) + 1] = l_s[tid];
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last_s = atomicAdd(counter, 1u) == (unsigned)(S - 1);
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  // the last block of this kv head: out = sum_s acc_s w_s / sum_s l_s w_s, w_s = e^(m_s - M). A warp per query
  // head reads the splits' m and l at once (a lane AT_MAX_SPLITS / 32 of them) and leaves the weights in shared memory (red_s:
  // free once this block's part is written); then every output's sums over the splits run in split order, each
  // thread's outputs side by side and splits unrolled, so the partial outputs' loads overlap.
  const float *base = (const float *)((const char *)a.ws + a.ws_counters) + (size_t)kvh * S * G * (D + 2);
  static_assert(AT_MAX_SPLITS % 32 == 0 && AT_MAX_SPLITS <= AT_WARPS * D, "the weights fit red_s, whole lanes");
  float *w_s = &red_s[0][0][0];  // [GM][AT_MAX_SPLITS]: the splits' weights
  for (int g = warp; g < G; g += AT_WARPS) {
    constexpr int PL = AT_MAX_SPLITS / 32;  // splits a lane
    float m[PL], l[PL];
#pragma unroll
    for (int h = 0; h < PL; ++h) {
      const int t = lane + 32 * h;
      const float *pt = base + ((size_t)t * G + g) * (D + 2);
      m[h] = t < S ? __ldcg(pt) : -INFINITY;
      l[h] = t < S ? __ldcg(pt + 1) : 0.f;
    }
    float mx = m[0];
#pragma unroll
    for (int h = 1; h < PL; ++h) mx = fmaxf(mx, m[h]);
    const float M = warp_max(mx);  // finite: every split has a key
    float den = 0.f;
#pragma unroll
    for (int h = 0; h < PL; ++h) {
      const int t = lane + 32 * h;
      const float w = t < S ? __expf(m[h] - M) : 0.f;
      if (t < S) w_s[g * AT_MAX_SPLITS + t] = w;
      den = fmaf(l[h], w, den);
    }
    den = warp_sum(den);
    if (lane == 0) l_s[g] = den;  // (l_s: this block's own sums are in the workspace already)
  }
  __syncthreads();
  {
    constexpr int QN = (GM * D + AT_THREADS - 1) / AT_THREADS;
    float num[QN];
#pragma unroll
    for (int n = 0; n < QN; ++n) num[n] = 0.f;
    constexpr int UNROLL = QN >= 8 ? 2 : 4;  // (fewer splits at once where a thread has many outputs: no spills)
#pragma unroll UNROLL
    for (int t = 0; t < S; ++t) {
      const float *pt = base + (size_t)t * G * (D + 2) + 2;
#pragma unroll
      for (int n = 0; n < QN; ++n) {
        const int i = tid + n * AT_THREADS;
        if (i < G * D) num[n] = fmaf(__ldcg(pt + (i / D) * (D + 2) + i % D), w_s[(i / D) * AT_MAX_SPLITS + t], num[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < QN; ++n) {
      const int i = tid + n * AT_THREADS;
      if (i < G * D) out[(size_t)kvh * G * D + i] = from_f<T>(num[n] / l_s[i / D]);
    }
  }
  if (tid == 0) *counter = 0u;
}

}  // namespace

template <typename T>
cudaError_t launch_decode_attention(const AttnParams &a, cudaStream_t st) {
  const dim3 grid((unsigned)a.kv_heads, (unsigned)a.splits);
  const int G = a.heads / a.kv_heads;
  const int gm = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8;
  if (G > 8 || a.splits < 1 || a.splits > AT_MAX_SPLITS) return cudaErrorInvalidValue;
  switch (a.head_dim * 16 + gm) {
#define W4P_ATTN_CASE(D, GMV) \
    case D * 16 + GMV: decode_attention_kernel<T, D / 32, GMV><<<grid, AT_THREADS, 0, st>>>(a); break;
    W4P_ATTN_CASE(64, 1) W4P_ATTN_CASE(64, 2) W4P_ATTN_CASE(64, 4) W4P_ATTN_CASE(64, 8)
    W4P_ATTN_CASE(128, 1) W4P_ATTN_CASE(128, 2) W4P_ATTN_CASE(128, 4) W4P_ATTN_CASE(128, 8)
    W4P_ATTN_CASE(256, 1) W4P_ATTN_CASE(256, 2) W4P_ATTN_CASE(256, 4) W4P_ATTN_CASE(256, 8)
#undef W4P_ATTN_CASE
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template cudaError_t launch_decode_attention<half>(const AttnParams &, cudaStream_t);
template cudaError_t launch_decode_attention<__nv_bfloat16>(const AttnParams &, cudaStream_t);

}  // namespace w4p
