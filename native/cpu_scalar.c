/*
 * Scalar reference kernel: the semantics every SIMD path is tested against. Plain C, any CPU.
 * One output row at a time, natural K order inside each activation block.
 */
#include "w4p_cpu_internal.h"

#include <string.h>

void w4p_tile_scalar(const w4p_job *J, int tile, int64_t m0, int64_t m1) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    float s[W4P_TILE], o[W4P_TILE], yv[W4P_TILE];
    for (int64_t m = m0; m < m1; m++) {
        memset(yv, 0, sizeof yv);
        for (int b = 0; b < nblk; b++) {
            w4p_block_params(L, tile, b, s, o);
            for (int p = 0; p < L->planes; p++) {
                const uint32_t *w = w4p_tile_words(L, tile, p) + (size_t)b * cpb * W4P_TILE;
                const float mult = p ? 16.0f : 1.0f;
                if (J->precision == W4P_PREC_FAST) {
                    const int8_t *a = J->xq + m * kp + (size_t)b * ab;
                    int32_t acc[W4P_TILE] = {0};
                    for (int c = 0; c < cpb; c++)
                        for (int i = 0; i < W4P_TILE; i++) {
                            uint32_t word = w[c * W4P_TILE + i];
                            int32_t d = 0;
                            for (int j = 0; j < 4; j++)
                                d += (int32_t)((word >> (8 * j)) & 0xF) * a[8 * c + j] +
                                     (int32_t)((word >> (8 * j + 4)) & 0xF) * a[8 * c + 4 + j];
                            acc[i] += d;
                        }
                    const float xs = J->xs[m * nblk + b], as = (float)J->xsum[m * nblk + b];
                    for (int i = 0; i < W4P_TILE; i++) {
                        float t = s[i] * mult * (float)acc[i];
                        if (p == 0) t += o[i] * as;
                        yv[i] += xs * t;
                    }
                } else {
                    const float *x = J->xf + m * kp + (size_t)b * ab;
                    float acc[W4P_TILE] = {0};
                    for (int c = 0; c < cpb; c++)
                        for (int i = 0; i < W4P_TILE; i++) {
                            uint32_t word = w[c * W4P_TILE + i];
                            for (int j = 0; j < 4; j++) {
                                acc[i] += (float)((word >> (8 * j)) & 0xF) * x[8 * c + j];
                                acc[i] += (float)((word >> (8 * j + 4)) & 0xF) * x[8 * c + 4 + j];
                            }
                        }
                    const float xsum = J->xfsum[m * nblk + b];
                    for (int i = 0; i < W4P_TILE; i++) {
                        float t = s[i] * mult * acc[i];
                        if (p == 0) t += o[i] * xsum;
                        yv[i] += t;
                    }
                }
            }
        }
        w4p_store_row(J, m, tile, yv);
    }
}
