/*
 * Test driver for native/cpu_pack.c (run by tests/test_pack_native.py): packs fixed pseudo-random GPTQ
 * layers (fused path with and without act-order, and the codes unpack) and writes every output to the
 * file named by argv[1]. Built twice, with and without -DW4P_PACK_SCALAR, so the portable code that
 * non-x86 hosts run is checked byte for byte against the SSE2 path the Python tests cover.
 */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdarg.h>
#include "w4pack.h"
void w4p_set_error(const char *fmt, ...) { va_list a; va_start(a, fmt); vfprintf(stderr, fmt, a); va_end(a); }
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "wb");
    int shapes[][2] = {{40, 384}, {24, 136}, {4096, 512}, {520, 1032}};
    uint64_t s = 88172645463325252ull;
    for (int t = 0; t < 4; t++) {
        int n = shapes[t][0], k = shapes[t][1], np = (n + 15) / 16 * 16, kp = (k + 63) / 64 * 64;
        int rows = k / 8;
        int32_t *qw = malloc((size_t)rows * n * 4), *perm = malloc(k * 4);
        for (size_t i = 0; i < (size_t)rows * n; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; qw[i] = (int32_t)s; }
        for (int i = 0; i < k; i++) perm[i] = i;
        for (int i = k - 1; i > 0; i--) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; int j = s % (i + 1); int x = perm[i]; perm[i] = perm[j]; perm[j] = x; }
        size_t nw = (size_t)np / 16 * kp / 64 * 128;
        int32_t *out = malloc(nw * 4);
        uint8_t *codes = malloc((size_t)n * k);
        for (int p = 0; p < 2; p++) {
            if (w4p_gptq_pack_layout_v1(qw, n, n, k, p ? perm : NULL, out, 2)) return 1;
            fwrite(out, 4, nw, f);
        }
        if (w4p_gptq_unpack_codes(qw, n, rows, n, 4, codes, k, 2)) return 1;
        fwrite(codes, 1, (size_t)n * k, f);
    }
    fclose(f);
    return 0;
}
