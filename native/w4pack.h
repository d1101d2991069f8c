/*
 * w4pack native ABI: the one public header shared by the C (CPU) and CUDA kernels and by the cffi cdef.
 *
 * Conventions
 *   - Every entry point returns an int status: W4P_OK (0) or a negative W4P_E* code; the message of the
 *     last error on the calling thread is available from w4p_last_error(). Nothing aborts the process.
 *   - Weights are in layout w4pack-tiles v1 (docs/LAYOUT.md): qweight int32 [Np/16][Kp/64 * 32 * wpl],
 *     scales/zeros/mins [Gp][Np], perm int32 [K] (optional).
 *   - This header is parsed by cffi: plain C declarations only, no macros beyond #define constants.
 */
#ifndef W4PACK_H
#define W4PACK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define W4P_ABI_VERSION 1

#define W4P_OK 0
#define W4P_EINVAL -1
#define W4P_ENOMEM -2
#define W4P_EUNSUPPORTED -3
#define W4P_ENODEVICE -4
#define W4P_ECUDA -5

/* ---- common ------------------------------------------------------------------------------------ */
int w4p_abi_version(void);
const char *w4p_last_error(void);

/* ---- CPU ---------------------------------------------------------------------------------------- */
/* Bit set of the instruction-set paths this CPU can run (W4P_ISA_*). */
#define W4P_ISA_SCALAR 1
#define W4P_ISA_AVX2 2
#define W4P_ISA_AVX512 4
#define W4P_ISA_AVX512VNNI 8
#define W4P_ISA_NEON 16
#define W4P_ISA_AMX 32 /* AVX-512 VNNI, plus AMX bf16 tiles for exact GEMMs of many rows */
int w4p_cpu_isa_available(void);
/* The path the dispatcher picks (honours W4PACK_ISA=scalar|avx2|avx512|amx|neon). */
int w4p_cpu_isa_selected(void);
const char *w4p_cpu_isa_name(int isa);

/* Element types of activations, outputs, scales and biases. bf16 travels as raw uint16 bits. */
#define W4P_DT_F16 1
#define W4P_DT_BF16 2
#define W4P_DT_F32 3
#define W4P_ZERO_NONE 0
#define W4P_ZERO_INT 1
#define W4P_ZERO_FLOAT 2
/* exact: weights dequantized to fp32, fp32 accumulation; fast: int8 activations per block, integer dots */
#define W4P_PREC_EXACT 0
#define W4P_PREC_FAST 1

/* A packed layer in layout v1, as stored in the checkpoint (pointers are only read during create). */
typedef struct {
    int32_t n, k;            /* true shape [N, K] */
    int32_t np, kp;          /* padded shape (N to 16, K to 64) */
    int32_t bits;            /* 2, 3, 4 (storage_bits 4), 5, 6 or 8 (storage_bits 8) */
    int32_t storage_bits;    /* 4 or 8 */
    int32_t group_size;      /* > 0 (multiple of 16) or -1 (per channel) */
    int32_t padded_groups;   /* Gp: rows of scales / zeros / mins */
    int32_t zero_mode;       /* W4P_ZERO_* */
    int32_t scale_dtype;     /* W4P_DT_*: dtype of scales and mins */
    const int32_t *qweight;  /* [np/16][kp/64 * 32 * (storage_bits == 4 ? 4 : 8)] */
    const void *scales;      /* [Gp][np] */
    const void *zeros;       /* [Gp][np] uint8 (4-bit storage) or uint16 (8-bit); NULL unless zero_mode int */
    const void *mins;        /* [Gp][np] scale dtype; NULL unless zero_mode float */
    const int32_t *perm;     /* [k] act-order permutation, or NULL */
} w4p_packed_desc;

/* A layer repacked once into the CPU tile layout (2 MiB pages where possible); opaque. */
typedef struct w4p_cpu_layer w4p_cpu_layer;

int w4p_cpu_layer_create(const w4p_packed_desc *desc, w4p_cpu_layer **out);
void w4p_cpu_layer_free(w4p_cpu_layer *layer);
/* Bytes held by the repacked weights and parameters. */
size_t w4p_cpu_layer_bytes(const w4p_cpu_layer *layer);
/* The codes as the CPU layout holds them, [np][kp] in packed (permuted) K order: tests of the repack. */
int w4p_cpu_layer_codes(const w4p_cpu_layer *layer, uint8_t *codes);

/* y[m, :n] = x[m, :k] . W^T (+ bias) for m < M.  x: [M][ldx] of x_dtype; y: [M][ldy] of y_dtype;
   bias: [n] of bias_dtype or NULL. isa: 0 = the dispatcher's choice, else one W4P_ISA_* path (must be
   available). threads: the most threads to use (>= 1). */
int w4p_cpu_gemm(const w4p_cpu_layer *layer, const void *x, int x_dtype, int64_t m, int64_t ldx,
                 void *y, int y_dtype, int64_t ldy, const void *bias, int bias_dtype,
                 int precision, int isa, int threads);

/* Conversion (cpu_pack.c). Canonical codes [n][k] (row stride ldc bytes, values < 2**storage_bits)
   -> layout v1 qweight words [np/16][kp/64 * 32 * (storage_bits == 4 ? 4 : 8)], with packed column j
   taken from original column perm[j] (perm: [k] or NULL) and zero padding; the numpy _interleave in
   w4pack/layout.py is the spec. *max_seen receives the largest code (the caller checks the bit range
   with it; nothing is refused here). threads: the most threads to use (>= 1). */
int w4p_pack_layout_v1(const uint8_t *codes, int64_t ldc, int32_t n, int32_t k, const int32_t *perm,
                       int32_t storage_bits, int32_t *out, int32_t *max_seen, int threads);
/* GPTQ qweight [rows][ldq] int32 (bits = 4 or 8: codes along K, LSB first) -> codes [n][ldc] uint8,
   k = rows * 32 / bits columns written per row. */
int w4p_gptq_unpack_codes(const int32_t *qweight, int64_t ldq, int32_t rows, int32_t n, int32_t bits,
                          uint8_t *codes, int64_t ldc, int threads);
/* Both in one pass for 4-bit GPTQ: qweight [k/8][ldq] -> layout v1 words (as w4p_pack_layout_v1 of the
   unpacked codes, storage_bits 4), without materializing the codes. */
int w4p_gptq_pack_layout_v1(const int32_t *qweight, int64_t ldq, int32_t n, int32_t k, const int32_t *perm,
                            int32_t *out, int threads);

/* ---- one decode step of a llama-family model (cpu_decode.c) ---------------------------------------
   For each layer, at one position `pos` (batch 1, float32 hidden state h[hidden], updated in place):
     x = rmsnorm(h) * ln1;  [q|k|v] = qkv(x);  where q_norm / k_norm are given (qwen3), each query / key head
     = rmsnorm(head) * q_norm / k_norm over head_dim;  rotary on q and k (cos/sin: the rows of position pos,
     head_dim values each, rotate-half convention);  k, v -> the cache at pos;
     a = softmax(q . K[0..pos] * scaling) . V[0..pos] per head (head h reads KV head h / (n_heads / n_kv));
     h += o(a);  x = rmsnorm(h) * ln2;  [g|u] = gate_up(x);  h += down(silu(g) * u).
   Each projection is one to three packed layers (q/k/v and gate/up stacked along N where they can be) run by
   w4p_cpu_gemm. */
typedef struct {
    /* each projection: up to 3 packed layers writing consecutive output columns (NULL after the last) */
    const w4p_cpu_layer *qkv[3], *o[3], *gate_up[3], *down[3];
    const void *qkv_bias[3], *o_bias[3], *gate_up_bias[3], *down_bias[3]; /* [n] or NULL */
    int qkv_bias_dtype[3], o_bias_dtype[3], gate_up_bias_dtype[3], down_bias_dtype[3];
    const float *ln1, *ln2;   /* RMSNorm weights [hidden] */
    float eps1, eps2;
    float *k_cache, *v_cache; /* [n_kv][max_len][head_dim] */
    const float *q_norm, *k_norm; /* per-head RMSNorm weights [head_dim] before the rotary, or NULL (none) */
    float q_eps, k_eps;
} w4p_llama_layer;

typedef struct {
    int hidden, n_heads, n_kv, head_dim, inter, max_len;
    float scaling;
    int precision, isa, threads;
    const float *final_norm; /* [hidden] or NULL: after the last layer h = rmsnorm(h) * final_norm */
    float final_eps;
} w4p_llama_dims;

int w4p_llama_decode(const w4p_llama_dims *dims, const w4p_llama_layer *layers, int n_layers, float *h,
                     int pos, const float *cos, const float *sin);

/* Read `bytes` of buf as fast as the CPU can (benchmark of the memory read bandwidth); returns a checksum. */
uint64_t w4p_cpu_read_stream(const void *buf, size_t bytes);

/* W4P_CUDA_BEGIN ---- CUDA entry points (libw4p_cuda.so, loaded with ffi.dlopen) ------------------ */
/* All device pointers; `stream` is a cudaStream_t (NULL = legacy default stream). Works under graph
   capture. Errors: negative W4P_E* code, message from w4p_cuda_last_error() (thread-local). */
#define W4P_CUDA_KERNEL_AUTO 0
#define W4P_CUDA_KERNEL_STREAM 1
#define W4P_CUDA_KERNEL_TILED 2
/* RING (M <= 8): stream-K over warps, each warp with its own cp.async ring in shared memory */
#define W4P_CUDA_KERNEL_RING 3
/* BULK (M <= 16, sm_90+): stream-K over one block per SM, weights through the bulk copy engine */
#define W4P_CUDA_KERNEL_BULK 4
/* WGMMA (sm_90a, compute capability 9.0, 4-bit): weights as wgmma's register operand, 64 rows x 64 or 128
   tokens per warpgroup; splits forces the split-K count */
#define W4P_CUDA_KERNEL_WGMMA 5
/* WGMMA_WS (sm_90a, 4-bit; auto's choice on compute capability 9.0 from M = 16): the wgmma kernel fed by a
   TMA producer warp through mbarriers; splits forces the split-K count */
#define W4P_CUDA_KERNEL_WGMMA_WS 6
/* WGMMA_SS (sm_90a, compute capability 9.0, 4-bit, group sizes that are multiples of 64 or per channel): the
   tokens as wgmma's A operand and the weights, dequantized into shared memory, as its B operand (256 rows per
   block); splits forces the split-K count */
#define W4P_CUDA_KERNEL_WGMMA_SS 7
/* GEMV (M = 1 to 8, 4-bit, group sizes that are multiples of 32 or per channel, sm_80+; auto's choice on compute
   capability 9.0 at M = 1, and at M = 2-8 where its staged rows fit as many blocks per SM as at M = 1):
   blocks own whole 16-row stripes, weights through plain 16-byte loads, one token per MMA column */
#define W4P_CUDA_KERNEL_GEMV 8
/* probes (diagnostics for tools/bench_gpu.py; the output is not computed): copies only */
#define W4P_CUDA_PROBE_LOAD 10
#define W4P_CUDA_PROBE_DEQUANT 11
#define W4P_CUDA_PROBE_BULK 12
#define W4P_CUDA_PROBE_WS 13
#define W4P_CUDA_PROBE_SS 14
int w4p_cuda_abi_version(void);
const char *w4p_cuda_last_error(void);
/* Number of CUDA devices; W4P_ENODEVICE ("no CUDA device: ...") when there is none or no driver. */
int w4p_cuda_device_count(int *count);
/* The plan w4p_cuda_gemm would use (kernel 0 = auto, splits 0 = auto) and the workspace it needs.
   x_aligned: 1 if x is 16-byte aligned with ldx % 8 == 0. */
int w4p_cuda_plan(int device, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                  int x_aligned, int kernel, int splits, int *kernel_out, int *splits_out,
                  size_t *workspace_bytes);
/* The same plan for a described device (multiprocessors, compute capability major * 10 + minor, shared memory
   per SM / per block (opt-in) / reserved per block, in bytes): capacity planning and tests without that GPU. */
int w4p_cuda_plan_for(int sms, int cc, int smem_sm, int smem_block, int smem_reserved, int64_t m, int n, int k,
                      int storage_bits, int group_size, int act_order, int x_aligned, int kernel, int splits,
                      int *kernel_out, int *splits_out, size_t *workspace_bytes);
/* The same plans as one line of text for logs and tests (kernel name, then its choices: for the bulk kernel
   "bulk unit=16 granule=1 stages=2 stripes=4 blocks=264 ..."; fields may be added), NUL-terminated, cut to len bytes. */
int w4p_cuda_plan_describe(int device, int64_t m, int n, int k, int storage_bits, int group_size, int act_order,
                           int x_aligned, int kernel, int splits, char *buf, size_t len);
int w4p_cuda_plan_describe_for(int sms, int cc, int smem_sm, int smem_block, int smem_reserved, int64_t m, int n,
                               int k, int storage_bits, int group_size, int act_order, int x_aligned, int kernel,
                               int splits, char *buf, size_t len);
/* y[m, :n] = x[m, :k] . W^T (+ bias) for m < M, W in layout w4pack-tiles v1 (padded shape from n, k).
   dtype W4P_DT_F16 or W4P_DT_BF16 for x, y, scales, zeros, mins and bias alike. zeros: [Gp][np] in
   dtype holding the integer zero points (zero_mode int); mins: [Gp][np] (zero_mode float); perm: [k]
   act-order permutation or NULL; bias [n] or NULL. workspace: zero-filled before its first use, reused
   across calls on one stream (the kernels leave its counters at zero); too small a workspace makes the
   call choose fewer splits or fail with W4P_EINVAL. Deterministic: the same inputs and plan give
   bit-identical outputs. */
int w4p_cuda_gemm(int device, void *stream, int dtype, int64_t m, int n, int k,
                  const void *x, int64_t ldx, void *y, int64_t ldy,
                  const int32_t *qweight, int storage_bits, int group_size, int zero_mode,
                  const void *scales, const void *zeros, const void *mins, const int32_t *perm,
                  const void *bias, void *workspace, size_t workspace_bytes, int kernel, int splits);
/* One row (M = 1) through the gemv kernel with what precedes the GEMM in a decoder layer applied to x while the
   kernel stages it (prologue), so a decode step needs no kernel of its own for it:
     W4P_ROW_PLAIN    y = x . W^T (+ bias);
     W4P_ROW_RMSNORM  y = RMSNorm(x) . W^T (+ bias), the norm as transformers' RMSNorm computes it:
                      x / sqrt(mean(x^2) + norm_eps) in fp32, rounded to dtype, times norm_weight [k], rounded;
     W4P_ROW_SWIGLU   x holds 2k values [gate | up]; y = (silu(gate) * up) . W^T (+ bias), silu in fp32 rounded
                      to dtype, times up, rounded (transformers' act_fn(gate) * up).
   norm_weight and norm_eps are read for W4P_ROW_RMSNORM only; another prologue value is W4P_EINVAL.
   bias [n] or NULL, added to the fp32 sum before its one rounding (a layer's own bias). With W4P_ROW_RESIDUAL
   or'd into prologue, bias is a decoder layer's residual stream instead, added as the unfolded layer adds it:
   y = round(round(f(x) . W^T) + bias), the add rounding as an unfolded residual add does. The other arguments
   as w4p_cuda_gemm's; x and y are contiguous rows, y not overlapping x. W4P_EUNSUPPORTED where the gemv kernel
   does not run the layer (8-bit storage, a group size it does not take, compute capability below 8.0, a row
   too long for its shared memory): w4p_cuda_plan with kernel W4P_CUDA_KERNEL_GEMV and m = 1 says so up
   front. */
#define W4P_ROW_PLAIN 0
#define W4P_ROW_RMSNORM 1
#define W4P_ROW_SWIGLU 2
#define W4P_ROW_RESIDUAL 8
int w4p_cuda_gemm_row(int device, void *stream, int dtype, int n, int k, const void *x, void *y,
                      const int32_t *qweight, int storage_bits, int group_size, int zero_mode, const void *scales,
                      const void *zeros, const void *mins, const int32_t *perm, const void *bias, int prologue,
                      const void *norm_weight, float norm_eps, void *workspace, size_t workspace_bytes);
/* W[n][k] (row stride ldw, original column order: act-order undone) = the layer's weights in dtype, one
   rounding from fp32. For dense GEMMs at large M and for checks. */
int w4p_cuda_dequantize(int device, void *stream, int dtype, int n, int k, const int32_t *qweight,
                        int storage_bits, int group_size, int zero_mode, const void *scales,
                        const void *zeros, const void *mins, const int32_t *perm, void *w, int64_t ldw);
/* One query token's attention over a layer's KV cache, in one launch (a batch-1 decode step's attention):
     q, k = the token's queries and key, rotated by rows `pos` of cos/sin: x * cos + rotate_half(x) * sin in fp32,
            rounded to dtype once (transformers rounds in dtype after each operation); cos/sin NULL: as they are;
     k_cache[h][pos] = k, v_cache[h][pos] = v (stored);
     out[q] = softmax(q . k_cache[q / G][0 .. pos] * scaling) . v_cache[q / G][0 .. pos], G = heads / kv_heads,
            scores, softmax and sums in fp32, rounded to dtype once.
   qkv: [heads + 2 * kv_heads][head_dim] (queries, keys, values); cos/sin: [max_len][head_dim]; pos: one int64
   in device memory, so one captured graph serves every position (pos outside [0, max_len): out is NaN, nothing
   stored); k_cache/v_cache: [kv_heads][max_len][head_dim]; out: [heads][head_dim]; all dtype W4P_DT_F16 or
   W4P_DT_BF16, contiguous, 16-byte aligned. head_dim 64, 128 or 256; G at most 8 (else W4P_EUNSUPPORTED).
   splits (1 to 64): blocks per kv head at most, sharing the keys in chunks of 32 or more, combined by the last
   to finish;
   workspace: w4p_cuda_decode_attention_workspace bytes, zero-filled before its first use and left with its
   counters at zero; calls in flight at once need a workspace each. */
size_t w4p_cuda_decode_attention_workspace(int heads, int kv_heads, int head_dim, int splits);
int w4p_cuda_decode_attention(int device, void *stream, int dtype, int heads, int kv_heads, int head_dim,
                              const void *qkv, const void *cos, const void *sin, const int64_t *pos, void *k_cache,
                              void *v_cache, int64_t max_len, float scaling, void *out, int splits, void *workspace,
                              size_t workspace_bytes);
/* W4P_CUDA_END */

#ifdef __cplusplus
}
#endif
#endif /* W4PACK_H */
