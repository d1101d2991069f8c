/*
 * AVX-512 (F/BW/VL) kernels, with AVX512-VNNI `vpdpbusd` where present.
 *
 * A 64-column tile is four zmm of 16 columns; up to four activation rows share each loaded weight
 * vector (register tile 4 rows x 64 columns).
 *   fast:  the 0..15 codes are unsigned bytes after one AND (low nibbles = k 0..3) or a shift + AND
 *          (high nibbles = k 4..7); four int8 activations are broadcast per 32-bit lane; vpdpbusd (or
 *          vpmaddubsw + vpmaddwd without VNNI) accumulates exact int32 dots.
 *   exact: vpermps on a 16-entry table turns each nibble into an fp32 code (the index uses only the low
 *          4 bits, so a shift suffices); the code minus the zero point (or s*q + m for float minima,
 *          one FMA) is formed once per weight vector and shared by the rows, then one fp32 FMA per row.
 *          8-bit layers read both nibble planes in the same pass (q = lo + 16*hi, exact).
 * vpdpbusd is emitted with inline asm so the same source serves both variants without requiring the
 * VNNI target on the shared code (the VNNI entry point is only called when the CPU has it).
 */
#if defined(__x86_64__) || defined(__i386__)
#include "w4p_cpu_internal.h"
#include "w4p_avx512_fast.h"

#include <immintrin.h>
#include <string.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")))
#define INL inline __attribute__((always_inline))
/* software prefetch of the weight stream (measured cold on the Zen 5 VM): the fast path does best
 * prefetching into L2 4 KiB ahead with one activation row and 2 KiB ahead from every row group with
 * several (M = 16: +14 %); the exact path (slower per byte) into L1 3 KiB ahead */
#define W4P_PREFETCH_FAST_M1 4096
#define W4P_PREFETCH_FAST 2048
#define W4P_PREFETCH_EXACT 3072

/* acc += w (u8) . a (four s8 at a4, broadcast to every lane) */
static INL T512 __m512i dot4r(__m512i acc, __m512i w, __m512i a, const int vnni) {
    if (vnni) {
        __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
        return acc;
    }
    __m512i p = _mm512_maddubs_epi16(w, a);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}

static INL T512 __m512i dot4(__m512i acc, __m512i w, const int8_t *a4, const int vnni) {
    if (vnni) {
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)a4));
        return acc;
    }
    int32_t v;
    memcpy(&v, a4, 4);
    __m512i p = _mm512_maddubs_epi16(w, _mm512_set1_epi32(v));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}

/* scale s and zm: the zero point z as a float (zero modes none / int) or the minimum (mode float) */
static INL T512 void load_params(const struct w4p_cpu_layer *L, int tile, int blk, __m512 s[4], __m512 zm[4]) {
    const uint8_t *p = w4p_tile_params(L, tile, w4p_block_group(L, blk));
    if (L->pkind == W4P_PK_F16U8) {
        for (int q = 0; q < 4; q++) {
            s[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * q)));
            zm[q] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 128 + 16 * q))));
        }
    } else if (L->pkind == W4P_PK_F16F16) {
        for (int q = 0; q < 4; q++) {
            s[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * q)));
            zm[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * q)));
        }
    } else {
        for (int q = 0; q < 4; q++) {
            s[q] = _mm512_loadu_ps((const float *)p + 16 * q);
            zm[q] = _mm512_loadu_ps((const float *)p + 64 + 16 * q);
        }
    }
}

static INL T512 void store_row(const w4p_job *J, int64_t m, int tile, float *v) {
    const int n0 = tile * W4P_TILE;
    if (n0 + W4P_TILE > J->L->n) {
        w4p_store_row(J, m, tile, v);
        return;
    }
    for (int q = 0; q < 4; q++) {
        __m512 x = _mm512_loadu_ps(v + 16 * q);
        if (J->bias) x = _mm512_add_ps(x, _mm512_loadu_ps(J->bias + n0 + 16 * q));
        if (J->y_dtype == W4P_DT_F32) {
            _mm512_storeu_ps((float *)J->y + m * J->ldy + n0 + 16 * q, x);
        } else if (J->y_dtype == W4P_DT_F16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)J->y + m * J->ldy + n0 + 16 * q),
                                _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            __m512i u = _mm512_castps_si512(x);
            __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
            r = _mm512_srli_epi32(r, 16);
            __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
            _mm256_storeu_si256((__m256i *)((uint16_t *)J->y + m * J->ldy + n0 + 16 * q), _mm512_cvtepi32_epi16(r));
        }
    }
}

/* One activation block (and plane) of the tile for rows m .. m+R-1, added into y[r][64]. */
static INL T512 void fast_block(const w4p_job *J, int tile, int b, int p, int64_t m, const int R, const int vnni,
                                const __m512 s[4], const __m512 zm[4], float (*y)[W4P_TILE],
                                float (*part)[W4P_TILE], const int pf) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int pfd = J->m == 1 ? W4P_PREFETCH_FAST_M1 : W4P_PREFETCH_FAST;
    const uint32_t *w = w4p_tile_words(L, tile, p) + (size_t)b * cpb * W4P_TILE;
    const int8_t *a[W4P_RMAX];
    for (int r = 0; r < R; r++) a[r] = J->xq + (m + r) * kp + (size_t)b * ab;
    /* with few rows, two accumulator sets (low / high nibbles) halve the dependency chains */
    const int D = R <= 2 ? 2 : 1;
    __m512i acc[W4P_RMAX][4], acc2[W4P_RMAX][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = acc2[r][q] = _mm512_setzero_si512();
    for (int c = 0; c < cpb; c++) {
        const uint32_t *wc = w + (size_t)c * W4P_TILE;
        if (pf)
            for (int q = 0; q < 4; q++) _mm_prefetch((const char *)(wc + 16 * q) + pfd, _MM_HINT_T1);
        if (R >= 3) { /* activations broadcast once per chunk into registers, reused by the 4 quarters */
            __m512i alo[W4P_RMAX], ahi[W4P_RMAX];
            for (int r = 0; r < R; r++) {
                int32_t v0, v1;
                memcpy(&v0, a[r] + 8 * c, 4);
                memcpy(&v1, a[r] + 8 * c + 4, 4);
                alo[r] = _mm512_set1_epi32(v0);
                ahi[r] = _mm512_set1_epi32(v1);
            }
            for (int q = 0; q < 4; q++) {
                __m512i wv = _mm512_loadu_si512((const void *)(wc + 16 * q));
                __m512i lo = _mm512_and_si512(wv, m4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi32(wv, 4), m4);
                for (int r = 0; r < R; r++) {
                    acc[r][q] = dot4r(acc[r][q], lo, alo[r], vnni);
                    acc[r][q] = dot4r(acc[r][q], hi, ahi[r], vnni);
                }
            }
            continue;
        }
        for (int q = 0; q < 4; q++) {
            __m512i wv = _mm512_loadu_si512((const void *)(wc + 16 * q));
            __m512i lo = _mm512_and_si512(wv, m4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi32(wv, 4), m4);
            for (int r = 0; r < R; r++) {
                acc[r][q] = dot4(acc[r][q], lo, a[r] + 8 * c, vnni);
                if (D == 2) acc2[r][q] = dot4(acc2[r][q], hi, a[r] + 8 * c + 4, vnni);
                else acc[r][q] = dot4(acc[r][q], hi, a[r] + 8 * c + 4, vnni);
            }
        }
    }
    if (D == 2)
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) acc[r][q] = _mm512_add_epi32(acc[r][q], acc2[r][q]);
    /* Integer sums are exact in fp32 (|sum q*a| <= 255*127*128 < 2^24). 8-bit layers: plane 0's sum waits
     * in `part` until plane 1 completes the whole codes; then w4p_fast_term (w4p_avx512_fast.h). */
    const int two = L->planes == 2, minima = L->zero_mode == W4P_ZERO_FLOAT;
    for (int r = 0; r < R; r++) {
        const __m512 xs = _mm512_set1_ps(J->xs[(m + r) * nblk + b]);
        const __m512 as = _mm512_set1_ps((float)J->xsum[(m + r) * nblk + b]);
        for (int q = 0; q < 4; q++) {
            __m512 d = _mm512_cvtepi32_ps(acc[r][q]);
            if (two && p == 0) {
                _mm512_store_ps(&part[r][16 * q], d);
                continue;
            }
            if (two) d = _mm512_fmadd_ps(d, _mm512_set1_ps(16.0f), _mm512_load_ps(&part[r][16 * q]));
            const __m512 t = w4p_fast_term(s[q], zm[q], d, as, minima);
            __m512 yv = _mm512_load_ps(&y[r][16 * q]);
            _mm512_store_ps(&y[r][16 * q], _mm512_fmadd_ps(t, xs, yv));
        }
    }
}

/* The end of an exact block: the two accumulator chains summed, then y += s * acc (integer zero points: acc
 * holds sum (q - z) x) or y += acc (float minima: acc already holds sum (s q + m) x). */
static INL T512 void exact_store(const int R, const int D, __m512 acc[][4], __m512 acc2[][4], const __m512 s[4],
                                 const int minima, float (*y)[W4P_TILE]) {
    if (D == 2)
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) acc[r][q] = _mm512_add_ps(acc[r][q], acc2[r][q]);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) {
            __m512 yv = _mm512_load_ps(&y[r][16 * q]);
            _mm512_store_ps(&y[r][16 * q], minima ? _mm512_add_ps(yv, acc[r][q]) : _mm512_fmadd_ps(s[q], acc[r][q], yv));
        }
}

/* One activation block of the tile (both planes of an 8-bit layer) for rows m .. m+R-1, added into
 * y[r][64]. Int zeros: acc = sum (q - z)*x, y += s*acc; the code minus the zero point is an exact small
 * integer, so a weight that is exactly zero contributes exactly zero however large s is (summing q*x and
 * subtracting z*sum(x) afterwards cancels catastrophically). Minima: each weight s*q + m is formed by one
 * FMA (rounded once, like an fp32 dequantization), y += sum w*x. */
static INL T512 void exact_block(const w4p_job *J, int tile, int b, int64_t m, const int R, const __m512 s[4],
                                 const __m512 zm[4], float (*y)[W4P_TILE], const int pf, const int minima,
                                 const int two, const int uz) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8;
    /* uz: one zero point for the whole tile (symmetric layers, zero mode none): the table holds q - z
       itself and the per-weight subtraction disappears */
    const __m512 lut = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     uz ? zm[0] : _mm512_setzero_ps());
    const __m512 c16 = _mm512_set1_ps(16.0f);
    const uint32_t *w = w4p_tile_words(L, tile, 0) + (size_t)b * cpb * W4P_TILE;
    const uint32_t *w1 = two ? w4p_tile_words(L, tile, 1) + (size_t)b * cpb * W4P_TILE : w;
    const float *x[W4P_RMAX];
    for (int r = 0; r < R; r++) x[r] = J->xf + (m + r) * kp + (size_t)b * ab;
    const int D = R <= 2 ? 2 : 1;
    __m512 acc[W4P_RMAX][4], acc2[W4P_RMAX][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = acc2[r][q] = _mm512_setzero_ps();
    for (int c = 0; c < cpb; c++) {
        const uint32_t *wc = w + (size_t)c * W4P_TILE;
        const uint32_t *wc1 = w1 + (size_t)c * W4P_TILE;
        if (pf)
            for (int q = 0; q < 4; q++) {
                _mm_prefetch((const char *)(wc + 16 * q) + W4P_PREFETCH_EXACT, _MM_HINT_T0);
                if (two) _mm_prefetch((const char *)(wc1 + 16 * q) + W4P_PREFETCH_EXACT, _MM_HINT_T0);
            }
        __m512i wv[4];
        for (int q = 0; q < 4; q++) wv[q] = _mm512_loadu_si512((const void *)(wc + 16 * q));
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const int koff = (t & 1) ? (t >> 1) + 4 : (t >> 1); /* nibble t is byte t/2, low or high half */
            for (int q = 0; q < 4; q++) {
                __m512i idx = t ? _mm512_srli_epi32(wv[q], 4 * t) : wv[q];
                __m512 qf = _mm512_permutexvar_ps(idx, lut);
                if (two) { /* high nibble plane, reloaded from L1 (registers are full) */
                    __m512i w1v = _mm512_loadu_si512((const void *)(wc1 + 16 * q));
                    __m512 hf = _mm512_permutexvar_ps(t ? _mm512_srli_epi32(w1v, 4 * t) : w1v, lut);
                    qf = _mm512_fmadd_ps(hf, c16, qf);
                }
                const __m512 wq = minima ? _mm512_fmadd_ps(s[q], qf, zm[q]) : (uz ? qf : _mm512_sub_ps(qf, zm[q]));
                for (int r = 0; r < R; r++) {
                    if (D == 2 && (t & 1)) acc2[r][q] = _mm512_fmadd_ps(wq, _mm512_set1_ps(x[r][8 * c + koff]), acc2[r][q]);
                    else acc[r][q] = _mm512_fmadd_ps(wq, _mm512_set1_ps(x[r][8 * c + koff]), acc[r][q]);
                }
            }
        }
    }
    exact_store(R, D, acc, acc2, s, minima, y);
}

/* exact_block for 4-bit codes with a zero point per column, without a table lookup or most shifts: a
 * nibble at bits 4p..4p+3 of a word (p <= 4), masked and OR-ed into the exponent of 2^(23-4p), is the
 * float 2^(23-4p) + q exactly (it lands in the mantissa's units place), so subtracting 2^(23-4p) + z
 * (per column, formed once per block) leaves q - z exactly. Nibbles 0..4 need no shift; one shift by 20
 * brings 5..7 to positions 0..2. Per 128 weights: 1 shift, 8 vpternlogd, 8 subtractions: cheaper than the
 * table lookup + subtraction for one row, dearer for several (exact_rows picks it for R == 1). */
static INL T512 void exact_block_zc(const w4p_job *J, int tile, int b, int64_t m, const int R, const __m512 s[4],
                                    const __m512 zm[4], float (*y)[W4P_TILE], const int pf) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8;
    __m512 zmag[5][4]; /* 2^(23-4p) + z */
    for (int p = 0; p < 5; p++)
        for (int q = 0; q < 4; q++) zmag[p][q] = _mm512_add_ps(zm[q], _mm512_set1_ps((float)(1 << (23 - 4 * p))));
    const uint32_t *w = w4p_tile_words(L, tile, 0) + (size_t)b * cpb * W4P_TILE;
    const float *x[W4P_RMAX];
    for (int r = 0; r < R; r++) x[r] = J->xf + (m + r) * kp + (size_t)b * ab;
    const int D = R <= 2 ? 2 : 1;
    __m512 acc[W4P_RMAX][4], acc2[W4P_RMAX][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = acc2[r][q] = _mm512_setzero_ps();
    for (int c = 0; c < cpb; c++) {
        const uint32_t *wc = w + (size_t)c * W4P_TILE;
        if (pf)
            for (int q = 0; q < 4; q++) _mm_prefetch((const char *)(wc + 16 * q) + W4P_PREFETCH_EXACT, _MM_HINT_T0);
        __m512i wv[4], wh[4];
        for (int q = 0; q < 4; q++) {
            wv[q] = _mm512_loadu_si512((const void *)(wc + 16 * q));
            wh[q] = _mm512_srli_epi32(wv[q], 20);
        }
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const int koff = (t & 1) ? (t >> 1) + 4 : (t >> 1);
            const int p = t < 5 ? t : t - 5; /* nibble position in wv (t < 5) or in wh */
            const __m512i mask = _mm512_set1_epi32(0xF << (4 * p));
            const __m512i expo = _mm512_set1_epi32((127 + 23 - 4 * p) << 23);
            for (int q = 0; q < 4; q++) {
                const __m512i bits = _mm512_ternarylogic_epi32(t < 5 ? wv[q] : wh[q], mask, expo, 0xEA); /* (a&b)|c */
                const __m512 wq = _mm512_sub_ps(_mm512_castsi512_ps(bits), zmag[p][q]);
                for (int r = 0; r < R; r++) {
                    if (D == 2 && (t & 1)) acc2[r][q] = _mm512_fmadd_ps(wq, _mm512_set1_ps(x[r][8 * c + koff]), acc2[r][q]);
                    else acc[r][q] = _mm512_fmadd_ps(wq, _mm512_set1_ps(x[r][8 * c + koff]), acc[r][q]);
                }
            }
        }
    }
    exact_store(R, D, acc, acc2, s, 0, y);
}

/* exact_block with the row count, zero kind and plane count as compile-time constants */
static INL T512 void exact_rows(const w4p_job *J, int tile, int b, int64_t m, const int R, const __m512 s[4],
                                const __m512 zm[4], float (*y)[W4P_TILE], const int pf, const int uz) {
    const int minima = J->L->zero_mode == W4P_ZERO_FLOAT, two = J->L->planes == 2;
    if (!minima && !two && uz) exact_block(J, tile, b, m, R, s, zm, y, pf, 0, 0, 1);
    else if (!minima && !two && R == 1) exact_block_zc(J, tile, b, m, R, s, zm, y, pf); /* measured: M = 1 only */
    else if (!minima && !two) exact_block(J, tile, b, m, R, s, zm, y, pf, 0, 0, 0);
    else if (!two) exact_block(J, tile, b, m, R, s, zm, y, pf, 1, 0, 0);
    else if (!minima) exact_block(J, tile, b, m, R, s, zm, y, pf, 0, 1, 0);
    else exact_block(J, tile, b, m, R, s, zm, y, pf, 1, 1, 0);
}

/* the same zero point in all 64 columns of the block (zero mode none always) */
static INL T512 int uniform_zero(const struct w4p_cpu_layer *L, const __m512 zm[4]) {
    if (L->zero_mode == W4P_ZERO_NONE) return 1;
    if (L->zero_mode != W4P_ZERO_INT) return 0;
    const __m512 z0 = _mm512_permutexvar_ps(_mm512_setzero_si512(), zm[0]);
    __mmask16 eq = 0xFFFF;
    for (int q = 0; q < 4; q++) eq &= _mm512_cmp_ps_mask(zm[q], z0, _CMP_EQ_OQ);
    return eq == 0xFFFF;
}

/* Exact with many rows: each slice of W4P_DQ_K values of K of a block is dequantized once into an
 * L1-resident fp32 buffer (16 KiB) and shared by every row of the work item, so the per-weight work
 * (shift, table lookup, zero point) is paid once per work item instead of once per row group. */
#define W4P_DQ_MIN_ROWS 8
#define W4P_DQ_K 64

/* w[k][64] for k = k0 .. k0+nk-1 of block b: q - z (int zeros) or s*q + m (minima), as in exact_block */
static INL T512 void dequant_slice(const struct w4p_cpu_layer *L, int tile, int b, int k0, int nk, const __m512 s[4],
                                   const __m512 zm[4], float (*w)[W4P_TILE], const int minima, const int two) {
    const int cpb = L->ab / 8;
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 c16 = _mm512_set1_ps(16.0f);
    const uint32_t *w0 = w4p_tile_words(L, tile, 0) + ((size_t)b * cpb + k0 / 8) * W4P_TILE;
    const uint32_t *w1 = two ? w4p_tile_words(L, tile, 1) + ((size_t)b * cpb + k0 / 8) * W4P_TILE : w0;
    for (int c = 0; c < nk / 8; c++) {
        const uint32_t *wc = w0 + (size_t)c * W4P_TILE, *wc1 = w1 + (size_t)c * W4P_TILE;
        for (int q = 0; q < 4; q++) {
            _mm_prefetch((const char *)(wc + 16 * q) + W4P_PREFETCH_EXACT, _MM_HINT_T0);
            if (two) _mm_prefetch((const char *)(wc1 + 16 * q) + W4P_PREFETCH_EXACT, _MM_HINT_T0);
            const __m512i wv = _mm512_loadu_si512((const void *)(wc + 16 * q));
            const __m512i hv = two ? _mm512_loadu_si512((const void *)(wc1 + 16 * q)) : wv;
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const int koff = (t & 1) ? (t >> 1) + 4 : (t >> 1);
                __m512 qf = _mm512_permutexvar_ps(t ? _mm512_srli_epi32(wv, 4 * t) : wv, lut);
                if (two) qf = _mm512_fmadd_ps(_mm512_permutexvar_ps(t ? _mm512_srli_epi32(hv, 4 * t) : hv, lut), c16, qf);
                _mm512_store_ps(&w[8 * c + koff][16 * q], minima ? _mm512_fmadd_ps(s[q], qf, zm[q]) : _mm512_sub_ps(qf, zm[q]));
            }
        }
    }
}

/* rows m .. m+R-1 times a dequantized slice (activations from column koff of the block), added into y */
static INL T512 void dq_rows(const w4p_job *J, int b, int koff, int nk, int64_t m, const int R, const __m512 s[4],
                             const float (*w)[W4P_TILE], float (*y)[W4P_TILE], const int minima) {
    const struct w4p_cpu_layer *L = J->L;
    const float *x[W4P_RMAX];
    for (int r = 0; r < R; r++) x[r] = J->xf + (m + r) * L->kp + (size_t)b * L->ab + koff;
    __m512 acc[W4P_RMAX][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int k = 0; k < nk; k++)
        for (int q = 0; q < 4; q++) {
            const __m512 wv = _mm512_load_ps(&w[k][16 * q]);
            for (int r = 0; r < R; r++) acc[r][q] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r][k]), acc[r][q]);
        }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) {
            __m512 yv = _mm512_load_ps(&y[r][16 * q]);
            _mm512_store_ps(&y[r][16 * q], minima ? _mm512_add_ps(yv, acc[r][q]) : _mm512_fmadd_ps(s[q], acc[r][q], yv));
        }
}

static INL T512 void exact_dequantized(const w4p_job *J, int tile, int64_t m0, int64_t m1, float (*y)[W4P_TILE],
                                       const int minima, const int two) {
    const struct w4p_cpu_layer *L = J->L;
    const int sl = L->ab < W4P_DQ_K ? L->ab : W4P_DQ_K;
    float w[W4P_DQ_K][W4P_TILE] __attribute__((aligned(64)));
    for (int b = 0; b < L->nblk; b++) {
        __m512 s[4], zm[4];
        load_params(L, tile, b, s, zm);
        for (int k0 = 0; k0 < L->ab; k0 += sl) {
            dequant_slice(L, tile, b, k0, sl, s, zm, w, minima, two);
            for (int64_t m = m0; m < m1;) {
                const int64_t rem = m1 - m;
                float (*yr)[W4P_TILE] = y + (m - m0);
                if (rem >= 4) { dq_rows(J, b, k0, sl, m, 4, s, (const float (*)[W4P_TILE])w, yr, minima); m += 4; }
                else if (rem == 3) { dq_rows(J, b, k0, sl, m, 3, s, (const float (*)[W4P_TILE])w, yr, minima); m += 3; }
                else if (rem == 2) { dq_rows(J, b, k0, sl, m, 2, s, (const float (*)[W4P_TILE])w, yr, minima); m += 2; }
                else { dq_rows(J, b, k0, sl, m, 1, s, (const float (*)[W4P_TILE])w, yr, minima); m += 1; }
            }
        }
    }
}

/* Blocks outer, row groups inner: a block's 4 KiB of weights is loaded from memory once and reused
 * from L1 by every group of up to four activation rows. */
static INL T512 void tile_impl(const w4p_job *J, int tile, int64_t m0, int64_t m1, const int vnni) {
    const struct w4p_cpu_layer *L = J->L;
    float y[W4P_MCHUNK][W4P_TILE] __attribute__((aligned(64)));
    float part[W4P_MCHUNK][W4P_TILE] __attribute__((aligned(64))); /* fast, 8-bit: plane 0's integer sums */
    const int64_t rows = m1 - m0;
    memset(y, 0, sizeof(float) * W4P_TILE * (size_t)rows);
    const int fast = J->precision == W4P_PREC_FAST;
    if (!fast && rows >= W4P_DQ_MIN_ROWS) {
        const int minima = L->zero_mode == W4P_ZERO_FLOAT, two = L->planes == 2;
        if (!minima && !two) exact_dequantized(J, tile, m0, m1, y, 0, 0);
        else if (!two) exact_dequantized(J, tile, m0, m1, y, 1, 0);
        else if (!minima) exact_dequantized(J, tile, m0, m1, y, 0, 1);
        else exact_dequantized(J, tile, m0, m1, y, 1, 1);
        for (int64_t m = m0; m < m1; m++) store_row(J, m, tile, y[m - m0]);
        return;
    }
    for (int b = 0; b < L->nblk; b++) {
        __m512 s[4], zm[4];
        load_params(L, tile, b, s, zm);
        const int uz = !fast && uniform_zero(L, zm);
        if (uz) zm[0] = _mm512_permutexvar_ps(_mm512_setzero_si512(), zm[0]);
        for (int p = 0; p < (fast ? L->planes : 1); p++) { /* exact reads both planes at once */
            for (int64_t m = m0; m < m1;) {
                const int64_t rem = m1 - m;
                const int pf = fast || m == m0; /* fast: every row group (measured), exact: the first */
                float (*yr)[W4P_TILE] = y + (m - m0);
                float (*pr)[W4P_TILE] = part + (m - m0);
                if (fast) {
                    if (rem >= 4) { fast_block(J, tile, b, p, m, 4, vnni, s, zm, yr, pr, pf); m += 4; }
                    else if (rem == 3) { fast_block(J, tile, b, p, m, 3, vnni, s, zm, yr, pr, pf); m += 3; }
                    else if (rem == 2) { fast_block(J, tile, b, p, m, 2, vnni, s, zm, yr, pr, pf); m += 2; }
                    else { fast_block(J, tile, b, p, m, 1, vnni, s, zm, yr, pr, pf); m += 1; }
                } else {
                    if (rem >= 4) { exact_rows(J, tile, b, m, 4, s, zm, yr, pf, uz); m += 4; }
                    else if (rem == 3) { exact_rows(J, tile, b, m, 3, s, zm, yr, pf, uz); m += 3; }
                    else if (rem == 2) { exact_rows(J, tile, b, m, 2, s, zm, yr, pf, uz); m += 2; }
                    else { exact_rows(J, tile, b, m, 1, s, zm, yr, pf, uz); m += 1; }
                }
            }
        }
    }
    for (int64_t m = m0; m < m1; m++) store_row(J, m, tile, y[m - m0]);
}

T512 void w4p_tile_avx512(const w4p_job *J, int tile, int64_t m0, int64_t m1) { tile_impl(J, tile, m0, m1, 0); }

T512 void w4p_tile_avx512vnni(const w4p_job *J, int tile, int64_t m0, int64_t m1) { tile_impl(J, tile, m0, m1, 1); }

#endif

#if defined(__x86_64__) || defined(__i386__)
/* Read stream for the bandwidth benchmark (the limit the GEMV rows are held against): one sequential
 * stream, 256 bytes a step into four accumulators, XOR-folded so nothing is optimised away. */
T512 uint64_t w4p_read_stream_avx512(const void *buf, size_t bytes) {
    const char *p = buf;
    const size_t q = bytes / 256 * 256;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < q; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void *)(p + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void *)(p + i + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t out[8];
    _mm512_storeu_si512((void *)out, a0);
    uint64_t h = 0;
    for (int j = 0; j < 8; j++) h ^= out[j];
    for (size_t i = q; i < bytes; i++) h ^= (uint64_t)(unsigned char)p[i];
    return h;
}
#endif

#if defined(__x86_64__) || defined(__i386__)
/* Activation preparation: dtype -> fp32 and per-block int8 quantization (same rounding as the C code). */
T512 void w4p_cvt_avx512(const void *src, int dtype, float *dst, int n) {
    int i = 0;
    if (dtype == W4P_DT_F16) {
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i))));
        for (; i < n; i++) dst[i] = w4p_half_to_float(((const uint16_t *)src)[i]);
    } else if (dtype == W4P_DT_BF16) {
        for (; i + 16 <= n; i += 16) {
            __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i)));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
        }
        for (; i < n; i++) {
            uint32_t u = (uint32_t)((const uint16_t *)src)[i] << 16;
            memcpy(dst + i, &u, 4);
        }
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

T512 void w4p_quant_avx512(const float *x, int n, int8_t *q, float *scale, int32_t *sum) {
    /* n is a multiple of 16 (activation blocks are) */
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    float m = _mm512_reduce_max_ps(amax);
    float inv = m > 0.0f ? 127.0f / m : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    __m512i s = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, nlim), lim);
        __m512i vi = _mm512_cvtps_epi32(v);
        s = _mm512_add_epi32(s, vi);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(vi));
    }
    *scale = m / 127.0f;
    *sum = _mm512_reduce_add_epi32(s);
}
#endif
