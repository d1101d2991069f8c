/*
 * Scalar reference kernel: the semantics every SIMD path is tested against. Plain C, any CPU.
 * One output row at a time, natural K order inside each activation block; both nibble planes of an
 * 8-bit layer are read together so that every code is whole (q = lo + 16*hi) before it is used.
 */
#include "w4p_cpu_internal.h"

#include <string.h>

/* code of column i for k = 8c + j (j = 0..7) of one block, both planes */
static inline int code_at(const uint32_t *w0, const uint32_t *w1, int c, int i, int j) {
    const int sh = 8 * (j & 3) + 4 * (j >> 2);
    int q = (int)((w0[c * W4P_TILE + i] >> sh) & 0xF);
    if (w1) q += 16 * (int)((w1[c * W4P_TILE + i] >> sh) & 0xF);
    return q;
}

void w4p_tile_scalar(const w4p_job *J, int tile, int64_t m0, int64_t m1) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    const int minima = L->zero_mode == W4P_ZERO_FLOAT;
    float s[W4P_TILE], zm[W4P_TILE], yv[W4P_TILE];
    for (int64_t m = m0; m < m1; m++) {
        memset(yv, 0, sizeof yv);
        for (int b = 0; b < nblk; b++) {
            w4p_block_params(L, tile, b, s, zm);
            const uint32_t *w0 = w4p_tile_words(L, tile, 0) + (size_t)b * cpb * W4P_TILE;
            const uint32_t *w1 = L->planes == 2 ? w4p_tile_words(L, tile, 1) + (size_t)b * cpb * W4P_TILE : NULL;
            if (J->precision == W4P_PREC_FAST) {
                /* integer dot of whole codes with the int8 activations: exact */
                const int8_t *a = J->xq + m * kp + (size_t)b * ab;
                const float xs = J->xs[m * nblk + b];
                const int32_t as = J->xsum[m * nblk + b];
                for (int i = 0; i < W4P_TILE; i++) {
                    int32_t acc = 0;
                    for (int c = 0; c < cpb; c++)
                        for (int j = 0; j < 8; j++) acc += code_at(w0, w1, c, i, j) * a[8 * c + j];
                    float t;
                    if (minima) {
                        /* s*acc + m*as: both products exact in double, one rounding, no cancellation */
                        t = (float)((double)s[i] * acc + (double)zm[i] * as);
                    } else {
                        /* zero point subtracted in the integer domain: |acc - z*as| < 2^24, exact */
                        t = s[i] * (float)(acc - (int32_t)zm[i] * as);
                    }
                    yv[i] += xs * t;
                }
            } else {
                const float *x = J->xf + m * kp + (size_t)b * ab;
                for (int i = 0; i < W4P_TILE; i++) {
                    float acc = 0.0f;
                    for (int c = 0; c < cpb; c++)
                        for (int j = 0; j < 8; j++) {
                            const int q = code_at(w0, w1, c, i, j);
                            /* int zeros: q - z is an exact small integer; minima: the dequantized
                               weight s*q + m rounded once (q*s is exact in double) */
                            const float wq = minima ? (float)((double)s[i] * q + zm[i]) : (float)q - zm[i];
                            acc += wq * x[8 * c + j];
                        }
                    yv[i] += minima ? acc : s[i] * acc;
                }
            }
        }
        w4p_store_row(J, m, tile, yv);
    }
}
