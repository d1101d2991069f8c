/*
 * Cross-compiled test driver for the NEON kernels (run under qemu-user by tests/test_native_cpu.py).
 *
 * Reads one case written by the Python test: a packed v1 layer, activations and two float64
 * references (true result, and the fast path's exact semantics); runs the GEMM on the NEON path and
 * on the scalar path, both precisions, with 1 and 2 threads, and prints the relative errors.
 * Exit 0 when every error is within tolerance and both thread counts agree bit for bit.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "w4pack.h"

static void *read_n(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) { fprintf(stderr, "short read\n"); exit(2); }
    return p;
}

static double rel(const float *y, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) { double d = y[i] - ref[i]; num += d * d; den += ref[i] * ref[i]; }
    return sqrt(num / den);
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: neon_check CASE\n"); return 2; }
    FILE *f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 2; }
    int32_t h[14];
    if (fread(h, 4, 14, f) != 14 || h[0] != 0x57345043) { fprintf(stderr, "bad header\n"); return 2; }
    w4p_packed_desc d;
    memset(&d, 0, sizeof d);
    d.n = h[1], d.k = h[2], d.np = h[3], d.kp = h[4], d.bits = h[5], d.storage_bits = h[6];
    d.group_size = h[7], d.padded_groups = h[8], d.zero_mode = h[9], d.scale_dtype = h[10];
    int has_perm = h[11], m = h[12], x_dtype = h[13];
    size_t wpl = d.storage_bits == 4 ? 4 : 8, sz = d.scale_dtype == W4P_DT_F32 ? 4 : 2;
    size_t params = (size_t)d.padded_groups * d.np;
    d.qweight = read_n(f, 4 * (size_t)(d.np / 16) * (d.kp / 64) * 32 * wpl);
    d.scales = read_n(f, sz * params);
    if (d.zero_mode == W4P_ZERO_INT) d.zeros = read_n(f, (d.storage_bits == 4 ? 1 : 2) * params);
    if (d.zero_mode == W4P_ZERO_FLOAT) d.mins = read_n(f, sz * params);
    if (has_perm) d.perm = read_n(f, 4 * (size_t)d.k);
    void *x = read_n(f, (x_dtype == W4P_DT_F32 ? 4 : 2) * (size_t)m * d.k);
    double *ref = read_n(f, 8 * (size_t)m * d.n), *ref_fast = read_n(f, 8 * (size_t)m * d.n);
    fclose(f);
    w4p_cpu_layer *L;
    if (w4p_cpu_layer_create(&d, &L)) { fprintf(stderr, "create: %s\n", w4p_last_error()); return 1; }
    float *y = malloc(4 * (size_t)m * d.n), *y2 = malloc(4 * (size_t)m * d.n);
    int isas[2] = {W4P_ISA_NEON, W4P_ISA_SCALAR}, bad = 0;
    for (int i = 0; i < 2; i++)
        for (int prec = 0; prec < 2; prec++) {
            if (w4p_cpu_gemm(L, x, x_dtype, m, d.k, y, W4P_DT_F32, d.n, NULL, 0, prec, isas[i], 1) ||
                w4p_cpu_gemm(L, x, x_dtype, m, d.k, y2, W4P_DT_F32, d.n, NULL, 0, prec, isas[i], 2)) {
                fprintf(stderr, "gemm: %s\n", w4p_last_error());
                return 1;
            }
            double e = rel(y, prec ? ref_fast : ref, (size_t)m * d.n);
            int same = !memcmp(y, y2, 4 * (size_t)m * d.n);
            int ok = e < 2e-6 && same;
            bad |= !ok;
            printf("%s %s rel_err=%.3e threads_identical=%d %s\n", w4p_cpu_isa_name(isas[i]), prec ? "fast" : "exact",
                   e, same, ok ? "ok" : "FAIL");
        }
    w4p_cpu_layer_free(L);
    return bad;
}
