/*
 * AVX-512 (F/BW/VL) kernels, with AVX512-VNNI `vpdpbusd` where present.
 *
 * A 64-column tile is four zmm of 16 columns; up to four activation rows share each loaded weight
 * vector (register tile 4 rows x 64 columns).
 *   fast:  the 0..15 codes are unsigned bytes after one AND (low nibbles = k 0..3) or a shift + AND
 *          (high nibbles = k 4..7); four int8 activations are broadcast per 32-bit lane; vpdpbusd (or
 *          vpmaddubsw + vpmaddwd without VNNI) accumulates exact int32 dots.
 *   exact: vpermps on a 16-entry table turns each nibble into an fp32 code (the index uses only the low
 *          4 bits, so a shift suffices), then one fp32 FMA per row.
 * vpdpbusd is emitted with inline asm so the same source serves both variants without requiring the
 * VNNI target on the shared code (the VNNI entry point is only called when the CPU has it).
 */
#if defined(__x86_64__) || defined(__i386__)
#include "w4p_cpu_internal.h"

#include <immintrin.h>
#include <string.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")))
#define INL inline __attribute__((always_inline))

static INL T512 __m512i dot4(__m512i acc, __m512i w, __m512i a, const int vnni) {
    if (vnni) {
        __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
        return acc;
    }
    __m512i p = _mm512_maddubs_epi16(w, a);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}

static INL T512 void load_params(const struct w4p_cpu_layer *L, int tile, int blk, __m512 s[4], __m512 o[4]) {
    const uint8_t *p = w4p_tile_params(L, tile, w4p_block_group(L, blk));
    if (L->pkind == W4P_PK_F16U8) {
        for (int q = 0; q < 4; q++) {
            s[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * q)));
            __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 128 + 16 * q))));
            o[q] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(s[q], z));
        }
    } else {
        for (int q = 0; q < 4; q++) {
            s[q] = _mm512_loadu_ps((const float *)p + 16 * q);
            o[q] = _mm512_loadu_ps((const float *)p + 64 + 16 * q);
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

static INL T512 void fast_rows(const w4p_job *J, int tile, int64_t m0, const int R, const int vnni) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    float ybuf[W4P_RMAX][W4P_TILE] __attribute__((aligned(64)));
    memset(ybuf, 0, sizeof ybuf);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nblk; b++) {
        __m512 s[4], o[4];
        load_params(L, tile, b, s, o);
        for (int p = 0; p < L->planes; p++) {
            const uint32_t *w = w4p_tile_words(L, tile, p) + (size_t)b * cpb * W4P_TILE;
            const int8_t *a[W4P_RMAX];
            for (int r = 0; r < R; r++) a[r] = J->xq + (m0 + r) * kp + (size_t)b * ab;
            __m512i acc[W4P_RMAX][4];
            for (int r = 0; r < R; r++)
                for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_si512();
            for (int c = 0; c < cpb; c++) {
                __m512i alo[W4P_RMAX], ahi[W4P_RMAX];
                for (int r = 0; r < R; r++) {
                    int32_t lo, hi;
                    memcpy(&lo, a[r] + 8 * c, 4);
                    memcpy(&hi, a[r] + 8 * c + 4, 4);
                    alo[r] = _mm512_set1_epi32(lo);
                    ahi[r] = _mm512_set1_epi32(hi);
                }
                const uint32_t *wc = w + (size_t)c * W4P_TILE;
                for (int q = 0; q < 4; q++) {
                    __m512i wv = _mm512_loadu_si512((const void *)(wc + 16 * q));
                    __m512i lo = _mm512_and_si512(wv, m4);
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi32(wv, 4), m4);
                    for (int r = 0; r < R; r++) {
                        acc[r][q] = dot4(acc[r][q], lo, alo[r], vnni);
                        acc[r][q] = dot4(acc[r][q], hi, ahi[r], vnni);
                    }
                }
            }
            const __m512 mult = _mm512_set1_ps(p ? 16.0f : 1.0f);
            for (int r = 0; r < R; r++) {
                const __m512 xs = _mm512_set1_ps(J->xs[(m0 + r) * nblk + b]);
                const __m512 as = _mm512_set1_ps((float)J->xsum[(m0 + r) * nblk + b]);
                for (int q = 0; q < 4; q++) {
                    __m512 t = _mm512_mul_ps(p ? _mm512_mul_ps(s[q], mult) : s[q], _mm512_cvtepi32_ps(acc[r][q]));
                    if (p == 0) t = _mm512_fmadd_ps(o[q], as, t);
                    __m512 y = _mm512_load_ps(&ybuf[r][16 * q]);
                    _mm512_store_ps(&ybuf[r][16 * q], _mm512_fmadd_ps(t, xs, y));
                }
            }
        }
    }
    for (int r = 0; r < R; r++) store_row(J, m0 + r, tile, ybuf[r]);
}

static INL T512 void exact_rows(const w4p_job *J, int tile, int64_t m0, const int R) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    float ybuf[W4P_RMAX][W4P_TILE] __attribute__((aligned(64)));
    memset(ybuf, 0, sizeof ybuf);
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < nblk; b++) {
        __m512 s[4], o[4];
        load_params(L, tile, b, s, o);
        for (int p = 0; p < L->planes; p++) {
            const uint32_t *w = w4p_tile_words(L, tile, p) + (size_t)b * cpb * W4P_TILE;
            const float *x[W4P_RMAX];
            for (int r = 0; r < R; r++) x[r] = J->xf + (m0 + r) * kp + (size_t)b * ab;
            __m512 acc[W4P_RMAX][4];
            for (int r = 0; r < R; r++)
                for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
            for (int c = 0; c < cpb; c++) {
                const uint32_t *wc = w + (size_t)c * W4P_TILE;
                __m512i wv[4];
                for (int q = 0; q < 4; q++) wv[q] = _mm512_loadu_si512((const void *)(wc + 16 * q));
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    const int koff = (t & 1) ? (t >> 1) + 4 : (t >> 1); /* nibble t of byte t/2 */
                    __m512 xb[W4P_RMAX];
                    for (int r = 0; r < R; r++) xb[r] = _mm512_set1_ps(x[r][8 * c + koff]);
                    for (int q = 0; q < 4; q++) {
                        __m512i idx = t ? _mm512_srli_epi32(wv[q], 4 * t) : wv[q];
                        __m512 qf = _mm512_permutexvar_ps(idx, lut);
                        for (int r = 0; r < R; r++) acc[r][q] = _mm512_fmadd_ps(qf, xb[r], acc[r][q]);
                    }
                }
            }
            const __m512 mult = _mm512_set1_ps(p ? 16.0f : 1.0f);
            for (int r = 0; r < R; r++) {
                const __m512 xsum = _mm512_set1_ps(J->xfsum[(m0 + r) * nblk + b]);
                for (int q = 0; q < 4; q++) {
                    __m512 t = _mm512_mul_ps(p ? _mm512_mul_ps(s[q], mult) : s[q], acc[r][q]);
                    if (p == 0) t = _mm512_fmadd_ps(o[q], xsum, t);
                    __m512 y = _mm512_load_ps(&ybuf[r][16 * q]);
                    _mm512_store_ps(&ybuf[r][16 * q], _mm512_add_ps(y, t));
                }
            }
        }
    }
    for (int r = 0; r < R; r++) store_row(J, m0 + r, tile, ybuf[r]);
}

static INL T512 void tile_impl(const w4p_job *J, int tile, int64_t m0, int64_t m1, const int vnni) {
    for (int64_t m = m0; m < m1;) {
        int64_t rem = m1 - m;
        if (J->precision == W4P_PREC_FAST) {
            if (rem >= 4) { fast_rows(J, tile, m, 4, vnni); m += 4; }
            else if (rem == 3) { fast_rows(J, tile, m, 3, vnni); m += 3; }
            else if (rem == 2) { fast_rows(J, tile, m, 2, vnni); m += 2; }
            else { fast_rows(J, tile, m, 1, vnni); m += 1; }
        } else {
            if (rem >= 4) { exact_rows(J, tile, m, 4); m += 4; }
            else if (rem == 3) { exact_rows(J, tile, m, 3); m += 3; }
            else if (rem == 2) { exact_rows(J, tile, m, 2); m += 2; }
            else { exact_rows(J, tile, m, 1); m += 1; }
        }
    }
}

T512 void w4p_tile_avx512(const w4p_job *J, int tile, int64_t m0, int64_t m1) { tile_impl(J, tile, m0, m1, 0); }

T512 void w4p_tile_avx512vnni(const w4p_job *J, int tile, int64_t m0, int64_t m1) { tile_impl(J, tile, m0, m1, 1); }

#endif

#if defined(__x86_64__) || defined(__i386__)
/* Read stream for the bandwidth benchmark: four independent 512-bit XOR chains over the buffer. */
T512 uint64_t w4p_read_stream_avx512(const void *buf, size_t bytes) {
    const char *p = buf;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= bytes; i += 256) {
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
    for (; i < bytes; i++) h ^= (uint64_t)(unsigned char)p[i];
    return h;
}
#endif
