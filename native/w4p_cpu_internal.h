/*
 * Private declarations shared by the CPU files (not part of the ABI; not parsed by cffi).
 *
 * CPU tile layout (built once at load by cpu_repack.c, never written to disk):
 *   - columns (output features n) in tiles of 64; rows of K in chunks of 8 ("k8 chunks");
 *   - qw[tile][plane][kp/8][64] uint32: word (c, i) holds the eight 4-bit codes of column tile*64+i for
 *     k = 8c .. 8c+7 (K in packed order, i.e. after the act-order permutation): byte b's low nibble is
 *     k = 8c+b, its high nibble k = 8c+b+4. So `w & 0x0f0f0f0f` gives the codes of k 0..3 and
 *     `(w >> 4) & 0x0f0f0f0f` those of k 4..7, one per byte: exactly the u8 operand of vpdpbusd/sdot.
 *   - 8-bit layers are two such nibble planes (plane 0 low nibbles, plane 1 high nibbles; q = lo + 16 hi).
 *   - params[tile][gp]: kind F16U8: 64 fp16 scales then 64 u8 zero points (192 bytes; fp16 scales with
 *     4-bit int zeros, or no zeros); kind F16F16: 64 fp16 scales then 64 fp16 minima (256 bytes; zero mode
 *     float with fp16 scales, e.g. GGUF Q4_1: half the bytes of F32, which a memory-bound GEMV reads);
 *     kind F32: 64 fp32 scales s then 64 fp32 values (512 bytes): the zero point z as a float (zero modes
 *     none / int, w = s*(q - z)) or the minimum m (zero mode float, w = s*q + m). z is kept rather than
 *     o = -s*z because the kernels subtract it from the integer code before any rounding (see cpu_gemm.c).
 *   - K is cut into activation blocks of `ab` columns (a divisor of the group size and of kp); the fast
 *     path quantizes activations per block (int8, scale, integer sum) and applies the scale per block.
 */
#ifndef W4P_CPU_INTERNAL_H
#define W4P_CPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "w4pack.h"

#define W4P_TILE 64
#define W4P_PK_F16U8 0
#define W4P_PK_F32 1
#define W4P_PK_F16F16 2
#define W4P_RMAX 4 /* activation rows per register tile */
#define W4P_MCHUNK 64 /* activation rows per work item: a tile's weights stay in cache across them */

void w4p_set_error(const char *fmt, ...);

struct w4p_cpu_layer {
    int n, k, np, kp;
    int bits, storage_bits, planes;
    int group_size; /* > 0, or kp when the source was per-channel */
    int gp;         /* parameter groups stored */
    int zero_mode;
    int nt;         /* 64-column tiles */
    int ab;         /* activation block (columns of K) */
    int nblk;       /* kp / ab */
    int pkind;      /* W4P_PK_* */
    int32_t *perm;  /* [k] or NULL */
    uint32_t *qw;   /* [nt][planes][kp/8][64] */
    uint8_t *params;
    size_t qw_bytes, param_bytes, param_stride; /* param_stride: bytes per (tile, group) */
    int qw_huge, params_huge;
};

/* One GEMM call, as seen by the per-ISA tile kernels. */
typedef struct {
    const struct w4p_cpu_layer *L;
    int64_t m;
    int precision;
    /* fast: int8 activations [m][kp], per-block scale [m][nblk], integer sum [m][nblk] */
    const int8_t *xq;
    const float *xs;
    const int32_t *xsum;
    /* exact: fp32 activations [m][kp] */
    const float *xf;
    /* output */
    void *y;
    int y_dtype;
    int64_t ldy;
    const float *bias; /* [nt*64] fp32 or NULL */
    /* exact on the AMX path: the activations as `pieces` bf16 rows summing to them exactly,
       rows of w4p_amx_row(pieces, kp) values, ceil16(m) of them (rows past m are zero), or NULL where the AMX kernel does not run */
    const uint16_t *xb;
    int pieces;
    const float *xsumf; /* AMX, float minima: per row and activation block, the sum of the activations [m][nblk] */
    /* fast on the AMX path: xq has ceil16(m) rows, zero past m (the int8 tiles are loaded 16 rows at a time) */
} w4p_job;

/* A tile kernel computes output columns tile*64 .. tile*64+63 for activation rows m0 .. m1-1. */
typedef void (*w4p_tile_fn)(const w4p_job *job, int tile, int64_t m0, int64_t m1);

void w4p_tile_scalar(const w4p_job *job, int tile, int64_t m0, int64_t m1);
#if defined(__x86_64__) || defined(__i386__)
void w4p_tile_avx2(const w4p_job *job, int tile, int64_t m0, int64_t m1);
void w4p_tile_avx512(const w4p_job *job, int tile, int64_t m0, int64_t m1);
void w4p_tile_avx512vnni(const w4p_job *job, int tile, int64_t m0, int64_t m1);
#endif
#if defined(__x86_64__)
/* AMX (cpu_amx.c): work items of at least w4p_amx_min_rows rows (exact on layers w4p_amx_layer_ok accepts, fast
   on every layer); every other item goes to w4p_tile_avx512vnni. A tile multiply costs the same for 1 row as for
   16, and with weights read from memory VNNI stays ahead below 8 rows, below 16 for fast and for exact with fp32
   activations (three bf16 pieces) (docs/journal/2026-cpu-decode.md) */
static inline int64_t w4p_amx_min_rows(int precision, int pieces) {
    return precision == W4P_PREC_FAST || pieces > 2 ? 16 : 8;
}
void w4p_tile_amx(const w4p_job *job, int tile, int64_t m0, int64_t m1);
int w4p_amx_layer_ok(const struct w4p_cpu_layer *L);
void w4p_bf16_pieces_avx512(const float *x, int n, int pieces, uint16_t *dst, size_t stride);
void w4p_block_sums_avx512(const float *x, int nblk, int ab, float *out);
/* bf16 values from one activation row's pieces to the next row's: one cache line more than the pieces, so the
   16 rows of a tile load do not all fall into the same L1 sets when pieces * kp is a multiple of 4 KiB */
static inline size_t w4p_amx_row(int pieces, int kp) { return (size_t)pieces * (size_t)kp + 32; }
#endif
#if defined(__aarch64__)
void w4p_tile_neon(const w4p_job *job, int tile, int64_t m0, int64_t m1);
#endif

/* activation preparation: dtype -> fp32 (n values), and one block of n (multiple of 16) to int8 */
typedef void (*w4p_cvt_fn)(const void *src, int dtype, float *dst, int n);
typedef void (*w4p_quant_fn)(const float *x, int n, int8_t *q, float *scale, int32_t *sum);
void w4p_cvt_generic(const void *src, int dtype, float *dst, int n);
void w4p_quant_generic(const float *x, int n, int8_t *q, float *scale, int32_t *sum);
#if defined(__x86_64__) || defined(__i386__)
void w4p_cvt_avx512(const void *src, int dtype, float *dst, int n);
void w4p_quant_avx512(const float *x, int n, int8_t *q, float *scale, int32_t *sum);
void w4p_cvt_avx2(const void *src, int dtype, float *dst, int n);
void w4p_quant_avx2(const float *x, int n, int8_t *q, float *scale, int32_t *sum);
#endif

/* helpers (cpu_gemm.c) */
float w4p_half_to_float(uint16_t h);
uint16_t w4p_float_to_half(float f);
uint16_t w4p_float_to_bf16(float f);
/* Element i of an fp16 / bf16 / fp32 array as fp32 (exact widening). */
static inline float w4p_load_float(const void *base, int dtype, int64_t i) {
    if (dtype == W4P_DT_F16) return w4p_half_to_float(((const uint16_t *)base)[i]);
    if (dtype == W4P_DT_BF16) {
        union { uint32_t u; float f; } v = {(uint32_t)((const uint16_t *)base)[i] << 16};
        return v.f;
    }
    return ((const float *)base)[i];
}
/* Parameters of (tile, block) as fp32 vectors of 64: the scale s, and zm = the zero point z (zero modes
 * none / int: w = s*(q - z)) or the minimum m (zero mode float: w = s*q + m). */
void w4p_block_params(const struct w4p_cpu_layer *L, int tile, int blk, float *s, float *zm);
/* Add bias, convert and store one row of 64 fp32 results (only columns < n). */
void w4p_store_row(const w4p_job *job, int64_t m, int tile, const float *v);

static inline int w4p_block_group(const struct w4p_cpu_layer *L, int blk) {
    return (int)(((int64_t)blk * L->ab) / L->group_size);
}
static inline const uint32_t *w4p_tile_words(const struct w4p_cpu_layer *L, int tile, int plane) {
    return L->qw + ((size_t)tile * L->planes + plane) * (size_t)(L->kp / 8) * W4P_TILE;
}
static inline const uint8_t *w4p_tile_params(const struct w4p_cpu_layer *L, int tile, int group) {
    return L->params + ((size_t)tile * L->gp + group) * L->param_stride;
}

/* thread pool (cpu_threads.c): run fn(ctx, i) for i in [0, n) on up to `threads` threads. */
typedef void (*w4p_task_fn)(void *ctx, int64_t index);
void w4p_parallel_for(int64_t n, int threads, w4p_task_fn fn, void *ctx);

#endif
