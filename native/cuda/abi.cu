// The ABI's entry points that need a GPU (native/w4pack.h): device count, plan on a device, GEMM,
// dequantization and decode attention. The host-only ones are in abi_host.cpp.
#include <cuda_runtime.h>
#include <string.h>
#include "launch.h"

namespace w4p {
namespace {

// group_of's multiplier for group size gs on K columns; false where one multiply-high would not be exact
// (group sizes that are not powers of two, with K * gs >= 2^32: far beyond any real layer)
bool gmul_of(int gs, int kp, unsigned *gmul) {
  if (gs <= 0 || gs >= kp) {
    *gmul = 0;  // one group
    return true;
  }
  const uint64_t two32 = (uint64_t)1 << 32;
  *gmul = (unsigned)((two32 + (uint64_t)gs - 1) / (uint64_t)gs);
  return (gs & (gs - 1)) == 0 || (uint64_t)kp * (uint64_t)gs < two32;
}
// the calling thread's current device, or W4P_ENODEVICE with the reason
int use_device(int device) {
  const cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) return W4P_OK;
  cudaGetLastError();
  return fail(W4P_ENODEVICE, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
}
int set_gmul(Params *p, int gs, int k) {
  if (!gmul_of(gs, p->Kp, &p->gmul))
    return fail(W4P_EUNSUPPORTED, "group size %d with K = %d: K * group size must stay below 2^32", gs, k);
  return W4P_OK;
}

}  // namespace
}  // namespace w4p

using namespace w4p;

extern "C" {

int w4p_cuda_device_count(int *count) {
  if (!count) return fail(W4P_EINVAL, "count is NULL");
  *count = 0;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(W4P_ENODEVICE, "no CUDA device: %s", cudaGetErrorString(e));
  }
  if (n == 0) return fail(W4P_ENODEVICE, "no CUDA device: the driver reports none");
  *count = n;
  return W4P_OK;
}

int w4p_cuda_plan(int device, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                  int x_aligned, int kernel, int splits, int *kernel_out, int *splits_out, size_t *workspace_bytes) {
  DevInfo di;
  int rc = dev_info(device, &di);
  if (rc) return rc;
  return plan_on(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, kernel_out, splits_out,
                 workspace_bytes);
}

int w4p_cuda_plan_describe(int device, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                           int x_aligned, int kernel, int splits, char *buf, size_t len) {
  DevInfo di;
  int rc = dev_info(device, &di);
  if (rc) return rc;
  return describe_on(di, m, n, k, storage_bits, group_size, act_order, x_aligned, kernel, splits, buf, len);
}

static int gemm_impl(int device, void *stream, int dtype, int64_t m, int n, int k, const void *x, int64_t ldx,
                     void *y, int64_t ldy, const int32_t *qweight, int storage_bits, int group_size, int zero_mode,
                     const void *scales, const void *zeros, const void *mins, const int32_t *perm, const void *bias,
                     void *workspace, size_t workspace_bytes, int kernel, int splits, int prologue,
                     const void *norm_weight, float norm_eps) {
  if (m < 1 || n < 1 || k < 1) return fail(W4P_EINVAL, "bad shape m=%lld n=%d k=%d", (long long)m, n, k);
  if (dtype != W4P_DT_F16 && dtype != W4P_DT_BF16) return fail(W4P_EUNSUPPORTED, "dtype %d: fp16 or bf16 only", dtype);
  if (storage_bits != 4 && storage_bits != 8) return fail(W4P_EINVAL, "storage_bits must be 4 or 8, got %d", storage_bits);
  if (group_size != -1 && (group_size < 16 || group_size % 16))
    return fail(W4P_EINVAL, "group_size %d: must be -1 or a positive multiple of 16", group_size);
  if (zero_mode < 0 || zero_mode > 2) return fail(W4P_EINVAL, "zero_mode %d", zero_mode);
  if (!x || !y || !qweight || !scales) return fail(W4P_EINVAL, "x, y, qweight and scales are required");
  if (zero_mode == 1 && !zeros) return fail(W4P_EINVAL, "zero_mode int needs zeros");
  if (zero_mode == 2 && !mins) return fail(W4P_EINVAL, "zero_mode float needs mins");
  if (ldx < k || ldy < n) return fail(W4P_EINVAL, "ldx %lld < k %d or ldy %lld < n %d", (long long)ldx, k, (long long)ldy, n);
  if (((uintptr_t)qweight | (uintptr_t)scales | (uintptr_t)zeros | (uintptr_t)mins) & 15)
    return fail(W4P_EINVAL, "qweight, scales, zeros and mins must be 16-byte aligned");
  if (!workspace || workspace_bytes < COUNTER_BYTES)
    return fail(W4P_EINVAL, "workspace of at least %zu zero-filled bytes is required", COUNTER_BYTES);
  if ((uintptr_t)workspace & 255) return fail(W4P_EINVAL, "workspace must be 256-byte aligned");
  if (m > (int64_t)1 << 30) return fail(W4P_EINVAL, "m too large");

  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(W4P_ENODEVICE, "no CUDA device: %s", cudaGetErrorString(e));
  }
  if (cur != device) {
    e = cudaSetDevice(device);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return fail(W4P_ECUDA, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
    }
  }
  DevInfo di;
  int rc = dev_info(device, &di);
  if (rc) return rc;
  const bool x_aligned = (((uintptr_t)x & 15) == 0) && (ldx % 8 == 0);
  Plan pl;
  rc = make_plan(di, m, n, k, storage_bits, group_size, perm != nullptr, x_aligned, kernel, splits,
                 workspace_bytes, &pl);
  if (rc) return rc;
  if (pl.ws_total > workspace_bytes) {
    if (kernel == 0 && pl.gather && stream_gathers(group_size)) {
      // not enough room to gather the activations: the stream kernel gathers on the fly
      rc = make_plan(di, m, n, k, storage_bits, group_size, perm != nullptr, x_aligned, 1, splits, workspace_bytes, &pl);
      if (rc) return rc;
    }
    if (pl.ws_total > workspace_bytes)
      return fail(W4P_EINVAL, "workspace too small: %zu bytes, this call needs %zu", workspace_bytes, pl.ws_total);
  }

  Params p{};
  memset(&p, 0, sizeof p);
  p.x = x;
  p.y = y;
  p.qw = reinterpret_cast<const uint32_t *>(qweight);
  p.scales = scales;
  p.zeros = zeros;
  p.mins = mins;
  p.bias = bias;
  p.perm = perm;
  unsigned char *ws = (unsigned char *)workspace;
  p.counters = (unsigned *)ws;
  void *ws_gather = ws + COUNTER_BYTES;
  p.part = (float *)(ws + COUNTER_BYTES + pl.ws_gather);
  p.ldx = ldx;
  p.ldy = ldy;
  p.M = m;
  p.N = n;
  p.K = k;
  p.Np = ceil_div(n, 16) * 16;
  p.Kp = ceil_div(k, 64) * 64;
  p.KT = p.Kp / 64;
  p.gs = group_size;
  p.zm = zero_mode;
  if ((rc = set_gmul(&p, group_size, k)) != W4P_OK) return rc;
  p.S = pl.S;
  p.TB = pl.TB;
  p.KC = pl.KC;
  p.xvec = x_aligned ? 1 : 0;
  p.kx = k;
  p.W = pl.W;
  p.sink = 0x9E3779B9u;
  p.probe = kernel == W4P_CUDA_PROBE_BULK || kernel == W4P_CUDA_PROBE_WS || kernel == W4P_CUDA_PROBE_SS ? 1 : 0;
  p.kg = pl.kg;
  p.pro = prologue & ~W4P_ROW_RESIDUAL;
  p.radd = (prologue & W4P_ROW_RESIDUAL) != 0;
  p.nw = norm_weight;
  p.neps = norm_eps;

  cudaStream_t st = (cudaStream_t)stream;
  e = dtype == W4P_DT_F16 ? launch_all<half>(p, pl, storage_bits, ws_gather, st)
                          : launch_all<__nv_bfloat16>(p, pl, storage_bits, ws_gather, st);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(W4P_ECUDA, "kernel launch failed: %s", cudaGetErrorString(e));
  }
  return W4P_OK;
}

int w4p_cuda_gemm(int device, void *stream, int dtype, int64_t m, int n, int k, const void *x, int64_t ldx,
                  void *y, int64_t ldy, const int32_t *qweight, int storage_bits, int group_size, int zero_mode,
                  const void *scales, const void *zeros, const void *mins, const int32_t *perm, const void *bias,
                  void *workspace, size_t workspace_bytes, int kernel, int splits) {
  return gemm_impl(device, stream, dtype, m, n, k, x, ldx, y, ldy, qweight, storage_bits, group_size, zero_mode,
                   scales, zeros, mins, perm, bias, workspace, workspace_bytes, kernel, splits, W4P_ROW_PLAIN,
                   nullptr, 0.f);
}

int w4p_cuda_gemm_row(int device, void *stream, int dtype, int n, int k, const void *x, void *y,
                      const int32_t *qweight, int storage_bits, int group_size, int zero_mode, const void *scales,
                      const void *zeros, const void *mins, const int32_t *perm, const void *bias, int prologue,
                      const void *norm_weight, float norm_eps, void *workspace, size_t workspace_bytes) {
  const int f = prologue & ~W4P_ROW_RESIDUAL;  // what is applied to x
  if (f != W4P_ROW_PLAIN && f != W4P_ROW_RMSNORM && f != W4P_ROW_SWIGLU)
    return fail(W4P_EINVAL, "prologue %d: W4P_ROW_PLAIN, W4P_ROW_RMSNORM or W4P_ROW_SWIGLU (| W4P_ROW_RESIDUAL)",
                prologue);
  if ((prologue & W4P_ROW_RESIDUAL) && !bias) return fail(W4P_EINVAL, "W4P_ROW_RESIDUAL needs the residual as bias");
  if (f == W4P_ROW_RMSNORM && !norm_weight) return fail(W4P_EINVAL, "norm_weight is required");
  if (f == W4P_ROW_RMSNORM && !(norm_eps >= 0.f))
    return fail(W4P_EINVAL, "norm_eps must be a non-negative number");
  return gemm_impl(device, stream, dtype, 1, n, k, x, f == W4P_ROW_SWIGLU ? 2 * (int64_t)k : k, y, n,
                   qweight, storage_bits, group_size, zero_mode, scales, zeros, mins, perm, bias, workspace,
                   workspace_bytes, W4P_CUDA_KERNEL_GEMV, 0, prologue, norm_weight, norm_eps);
}

int w4p_cuda_dequantize(int device, void *stream, int dtype, int n, int k, const int32_t *qweight, int storage_bits,
                        int group_size, int zero_mode, const void *scales, const void *zeros, const void *mins,
                        const int32_t *perm, void *w, int64_t ldw) {
  if (n < 1 || k < 1) return fail(W4P_EINVAL, "bad shape n=%d k=%d", n, k);
  if (dtype != W4P_DT_F16 && dtype != W4P_DT_BF16) return fail(W4P_EUNSUPPORTED, "dtype %d: fp16 or bf16 only", dtype);
  if (storage_bits != 4 && storage_bits != 8) return fail(W4P_EINVAL, "storage_bits must be 4 or 8, got %d", storage_bits);
  if (group_size != -1 && (group_size < 16 || group_size % 16))
    return fail(W4P_EINVAL, "group_size %d: must be -1 or a positive multiple of 16", group_size);
  if (zero_mode < 0 || zero_mode > 2) return fail(W4P_EINVAL, "zero_mode %d", zero_mode);
  if (!qweight || !scales || !w) return fail(W4P_EINVAL, "qweight, scales and w are required");
  if ((zero_mode == 1 && !zeros) || (zero_mode == 2 && !mins)) return fail(W4P_EINVAL, "zeros/mins missing");
  if (ldw < k) return fail(W4P_EINVAL, "ldw %lld < k %d", (long long)ldw, k);
  if ((uintptr_t)qweight & 15) return fail(W4P_EINVAL, "qweight must be 16-byte aligned");
  if (const int rc = use_device(device)) return rc;
  Params p{};
  memset(&p, 0, sizeof p);
  p.qw = reinterpret_cast<const uint32_t *>(qweight);
  p.scales = scales;
  p.zeros = zeros;
  p.mins = mins;
  p.perm = perm;
  p.N = n;
  p.K = k;
  p.Np = ceil_div(n, 16) * 16;
  p.Kp = ceil_div(k, 64) * 64;
  p.KT = p.Kp / 64;
  p.gs = group_size;
  p.zm = zero_mode;
  if (const int rc = set_gmul(&p, group_size, k)) return rc;
  p.xvec = (((uintptr_t)w & 15) == 0 && ldw % 8 == 0) ? 1 : 0;
  const int64_t tiles = (int64_t)(p.Np / 16) * p.KT;
  const unsigned blocks = (unsigned)((tiles + 7) / 8);
  cudaStream_t st = (cudaStream_t)stream;
  if (dtype == W4P_DT_F16)
    launch_dequant<half>(p, storage_bits, (half *)w, ldw, blocks, st);
  else
    launch_dequant<__nv_bfloat16>(p, storage_bits, (__nv_bfloat16 *)w, ldw, blocks, st);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(W4P_ECUDA, "dequantize launch failed: %s", cudaGetErrorString(e));
  return W4P_OK;
}

int w4p_cuda_decode_attention(int device, void *stream, int dtype, int heads, int kv_heads, int head_dim,
                              const void *qkv, const void *cos, const void *sin, const int64_t *pos, void *k_cache,
                              void *v_cache, int64_t max_len, float scaling, void *out, int splits, void *workspace,
                              size_t workspace_bytes) {
  if (dtype != W4P_DT_F16 && dtype != W4P_DT_BF16) return fail(W4P_EUNSUPPORTED, "dtype %d: fp16 or bf16 only", dtype);
  if (heads < 1 || kv_heads < 1 || heads % kv_heads)
    return fail(W4P_EINVAL, "heads %d, kv_heads %d: heads must be a multiple of kv_heads", heads, kv_heads);
  if (heads / kv_heads > 8)
    return fail(W4P_EUNSUPPORTED, "%d query heads per kv head: the kernel takes at most 8", heads / kv_heads);
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    return fail(W4P_EUNSUPPORTED, "head_dim %d: 64, 128 or 256", head_dim);
  if (splits < 1 || splits > 64) return fail(W4P_EINVAL, "splits %d: 1 to 64", splits);
  if (max_len < 1) return fail(W4P_EINVAL, "max_len %lld", (long long)max_len);
  if (!qkv || !pos || !k_cache || !v_cache || !out) return fail(W4P_EINVAL, "qkv, pos, caches and out are required");
  if (!cos != !sin) return fail(W4P_EINVAL, "cos and sin: both or neither");
  const void *ptrs[] = {qkv, cos, sin, k_cache, v_cache, out};
  for (const void *p : ptrs)
    if ((uintptr_t)p & 15) return fail(W4P_EINVAL, "qkv, cos, sin, the caches and out must be 16-byte aligned");
  if (workspace_bytes < w4p_cuda_decode_attention_workspace(heads, kv_heads, head_dim, splits) ||
      (splits > 1 && !workspace))
    return fail(W4P_EINVAL, "workspace of %zu bytes: %zu needed", workspace_bytes,
                w4p_cuda_decode_attention_workspace(heads, kv_heads, head_dim, splits));
  if (const int rc = use_device(device)) return rc;
  AttnParams a{};
  a.qkv = qkv;
  a.cos = cos;
  a.sin = sin;
  a.pos = pos;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.out = out;
  a.ws = workspace;
  a.ws_counters = attn_counter_bytes(kv_heads);
  a.max_len = max_len;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = head_dim;
  a.splits = splits;
  a.scaling = scaling;
  cudaStream_t st = (cudaStream_t)stream;
  const cudaError_t e =
      dtype == W4P_DT_F16 ? launch_decode_attention<half>(a, st) : launch_decode_attention<__nv_bfloat16>(a, st);
  if (e != cudaSuccess) return fail(W4P_ECUDA, "decode attention launch failed: %s", cudaGetErrorString(e));
  return W4P_OK;
}

}  // extern "C"
