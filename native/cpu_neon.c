/*
 * NEON (aarch64) kernels; compiled only on aarch64.
 *
 * A 64-column tile is handled as four quarters of 16 columns (four int32x4 / float32x4 each), with up
 * to two activation rows sharing each loaded weight vector.
 *   fast:  the 0..15 codes are valid signed bytes, so `sdot` (dotprod, ARMv8.2) multiplies them with four
 *          broadcast int8 activations per lane; without dotprod, smull + two pairwise adds do the same.
 *          sdot is emitted with inline asm (plus an .arch directive) so the file needs no -march flag;
 *          it is only executed when HWCAP_ASIMDDP says the CPU has it.
 *   exact: nibble -> u32 (shift, AND) -> fp32, minus the zero point (or s*q + m for float minima, one
 *          FMA), formed once per weight vector and shared by the rows; then one FMA per row. 8-bit
 *          layers read both nibble planes in the same pass (q = lo + 16*hi, exact).
 */
#if defined(__aarch64__)
#include "w4p_cpu_internal.h"

#include <arm_neon.h>
#include <string.h>
#include <sys/auxv.h>

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif

#define INL inline __attribute__((always_inline))
#define RN 2

static int has_dotprod(void) {
    static int cached = -1;
    if (cached < 0) cached = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) ? 1 : 0;
    return cached;
}

/* acc += per 32-bit lane: sum of four u8 codes (0..15) x the four s8 activations at a4 */
static INL int32x4_t dot4(int32x4_t acc, uint8x16_t w, const int8_t *a4, const int dp) {
    int32_t v;
    memcpy(&v, a4, 4);
    int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(v));
    int8x16_t ws = vreinterpretq_s8_u8(w);
    if (dp) {
        __asm__(".arch armv8.2-a+dotprod\n\tsdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(ws), "w"(a));
        return acc;
    }
    int16x8_t plo = vmull_s8(vget_low_s8(ws), vget_low_s8(a));
    int16x8_t phi = vmull_high_s8(ws, a);
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(plo), vpaddlq_s16(phi)));
}

/* sv: scales; zv: zero points as floats (zero modes none / int) or minima (mode float) */
static INL void quarter(const float *sv, const float *zv, int qt, float32x4_t s[4], float32x4_t zm[4]) {
    for (int j = 0; j < 4; j++) {
        s[j] = vld1q_f32(sv + 16 * qt + 4 * j);
        zm[j] = vld1q_f32(zv + 16 * qt + 4 * j);
    }
}

static INL void fast_rows(const w4p_job *J, int tile, int64_t m0, const int R, const int dp, float y[][W4P_TILE]) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int two = L->planes == 2, minima = L->zero_mode == W4P_ZERO_FLOAT;
    float sv[W4P_TILE], zv[W4P_TILE];
    float32x4_t part[RN][4]; /* 8-bit layers: plane 0's integer sums, until plane 1 completes the codes */
    for (int r = 0; r < RN; r++)
        for (int j = 0; j < 4; j++) part[r][j] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nblk; b++) {
        w4p_block_params(L, tile, b, sv, zv);
        for (int qt = 0; qt < 4; qt++) {
            float32x4_t s[4], zm[4];
            quarter(sv, zv, qt, s, zm);
            for (int p = 0; p < L->planes; p++) {
                const uint32_t *w = w4p_tile_words(L, tile, p) + (size_t)b * cpb * W4P_TILE + 16 * qt;
                const int8_t *a[RN];
                for (int r = 0; r < R; r++) a[r] = J->xq + (m0 + r) * kp + (size_t)b * ab;
                int32x4_t acc[RN][4];
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < 4; j++) acc[r][j] = vdupq_n_s32(0);
                for (int c = 0; c < cpb; c++) {
                    const uint32_t *wc = w + (size_t)c * W4P_TILE;
                    for (int j = 0; j < 4; j++) {
                        uint8x16_t wv = vreinterpretq_u8_u32(vld1q_u32(wc + 4 * j));
                        uint8x16_t lo = vandq_u8(wv, m4);
                        uint8x16_t hi = vshrq_n_u8(wv, 4);
                        for (int r = 0; r < R; r++) {
                            acc[r][j] = dot4(acc[r][j], lo, a[r] + 8 * c, dp);
                            acc[r][j] = dot4(acc[r][j], hi, a[r] + 8 * c + 4, dp);
                        }
                    }
                }
                /* integer sums are exact in fp32 (< 2^24); int zeros: sum q*a - z*sum a is an exact
                   integer (one FMS), only s*(...) rounds; minima: s*acc + m*sum a with the rounding error
                   of s*acc added back (FMA), so the terms cannot cancel into noise */
                for (int r = 0; r < R; r++) {
                    const float xs = J->xs[(m0 + r) * nblk + b], as = (float)J->xsum[(m0 + r) * nblk + b];
                    for (int j = 0; j < 4; j++) {
                        float32x4_t d = vcvtq_f32_s32(acc[r][j]);
                        if (two && p == 0) {
                            part[r][j] = d;
                            continue;
                        }
                        if (two) d = vfmaq_n_f32(part[r][j], d, 16.0f);
                        float32x4_t t;
                        if (minima) {
                            const float32x4_t pr = vmulq_f32(s[j], d);
                            t = vaddq_f32(vfmaq_n_f32(pr, zm[j], as), vfmaq_f32(vnegq_f32(pr), s[j], d));
                        } else {
                            t = vmulq_f32(s[j], vfmsq_n_f32(d, zm[j], as));
                        }
                        float *yp = &y[r][16 * qt + 4 * j];
                        vst1q_f32(yp, vfmaq_n_f32(vld1q_f32(yp), t, xs));
                    }
                }
            }
        }
    }
}

/* Int zeros: acc = sum (q - z)*x, y += s*acc (q - z is an exact small integer, so a weight that is
 * exactly zero contributes exactly zero however large s is). Minima: acc = sum (s*q + m)*x, each weight
 * formed by one FMA, y += acc. */
static INL void exact_rows(const w4p_job *J, int tile, int64_t m0, const int R, float y[][W4P_TILE],
                           const int minima, const int two) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    const uint32x4_t m4 = vdupq_n_u32(0x0F);
    float sv[W4P_TILE], zv[W4P_TILE];
    for (int b = 0; b < nblk; b++) {
        w4p_block_params(L, tile, b, sv, zv);
        for (int qt = 0; qt < 4; qt++) {
            float32x4_t s[4], zm[4];
            quarter(sv, zv, qt, s, zm);
            const uint32_t *w = w4p_tile_words(L, tile, 0) + (size_t)b * cpb * W4P_TILE + 16 * qt;
            const uint32_t *w1 = two ? w4p_tile_words(L, tile, 1) + (size_t)b * cpb * W4P_TILE + 16 * qt : w;
            const float *x[RN];
            for (int r = 0; r < R; r++) x[r] = J->xf + (m0 + r) * kp + (size_t)b * ab;
            float32x4_t acc[RN][4];
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 4; j++) acc[r][j] = vdupq_n_f32(0.0f);
            for (int c = 0; c < cpb; c++) {
                const uint32_t *wc = w + (size_t)c * W4P_TILE;
                const uint32_t *wc1 = w1 + (size_t)c * W4P_TILE;
                for (int j = 0; j < 4; j++) {
                    uint32x4_t wv = vld1q_u32(wc + 4 * j);
                    uint32x4_t hv = two ? vld1q_u32(wc1 + 4 * j) : wv;
                    for (int t = 0; t < 8; t++) {
                        const int koff = (t & 1) ? (t >> 1) + 4 : (t >> 1);
                        uint32x4_t qi = vandq_u32(vshlq_u32(wv, vdupq_n_s32(-4 * t)), m4);
                        if (two) qi = vaddq_u32(qi, vshlq_n_u32(vandq_u32(vshlq_u32(hv, vdupq_n_s32(-4 * t)), m4), 4));
                        const float32x4_t qf = vcvtq_f32_u32(qi);
                        const float32x4_t wq = minima ? vfmaq_f32(zm[j], s[j], qf) : vsubq_f32(qf, zm[j]);
                        for (int r = 0; r < R; r++) acc[r][j] = vfmaq_n_f32(acc[r][j], wq, x[r][8 * c + koff]);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 4; j++) {
                    float *yp = &y[r][16 * qt + 4 * j];
                    const float32x4_t yv = vld1q_f32(yp);
                    vst1q_f32(yp, minima ? vaddq_f32(yv, acc[r][j]) : vfmaq_f32(yv, s[j], acc[r][j]));
                }
        }
    }
}

/* exact_rows with the zero kind and plane count as compile-time constants */
static INL void exact_any(const w4p_job *J, int tile, int64_t m0, const int R, float y[][W4P_TILE]) {
    const int minima = J->L->zero_mode == W4P_ZERO_FLOAT, two = J->L->planes == 2;
    if (!minima && !two) exact_rows(J, tile, m0, R, y, 0, 0);
    else if (!two) exact_rows(J, tile, m0, R, y, 1, 0);
    else if (!minima) exact_rows(J, tile, m0, R, y, 0, 1);
    else exact_rows(J, tile, m0, R, y, 1, 1);
}

void w4p_tile_neon(const w4p_job *J, int tile, int64_t m0, int64_t m1) {
    float y[RN][W4P_TILE];
    const int dp = has_dotprod();
    for (int64_t m = m0; m < m1;) {
        const int R = (m1 - m) >= 2 ? 2 : 1;
        memset(y, 0, sizeof y);
        if (J->precision == W4P_PREC_FAST) {
            if (R == 2) {
                if (dp) fast_rows(J, tile, m, 2, 1, y); else fast_rows(J, tile, m, 2, 0, y);
            } else {
                if (dp) fast_rows(J, tile, m, 1, 1, y); else fast_rows(J, tile, m, 1, 0, y);
            }
        } else {
            if (R == 2) exact_any(J, tile, m, 2, y); else exact_any(J, tile, m, 1, y);
        }
        for (int r = 0; r < R; r++) w4p_store_row(J, m + r, tile, y[r]);
        m += R;
    }
}

#endif
