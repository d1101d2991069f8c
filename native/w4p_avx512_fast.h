/*
 * The fast path's per-block term on AVX-512 (private, not parsed by cffi): the VNNI kernel (cpu_avx512.c) and the
 * AMX kernel (cpu_amx.c) form the same exact integer sums and both pass them through this one function, so the
 * two kernels give the same bits.
 */
#ifndef W4P_AVX512_FAST_H
#define W4P_AVX512_FAST_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* One activation block's contribution to 16 output columns before the activation scale: d = sum q*a (an exact
 * integer, |d| < 2^24), as = sum a. Int zeros: s*(d - z*as), where d - z*as is an integer below 2^24, so the FNMA
 * is exact and only the product with s rounds. Minima: s*d + m*as with the rounding error of s*d (one FMA) added
 * back, so the two terms cannot cancel into noise. */
static inline __attribute__((always_inline, target("avx512f,fma"))) __m512 w4p_fast_term(__m512 s, __m512 zm,
                                                                                        __m512 d, __m512 as,
                                                                                        const int minima) {
    if (minima) {
        const __m512 pr = _mm512_mul_ps(s, d);
        return _mm512_add_ps(_mm512_fmadd_ps(zm, as, pr), _mm512_fmsub_ps(s, d, pr));
    }
    return _mm512_mul_ps(s, _mm512_fnmadd_ps(zm, as, d));
}
#endif

#endif
