/*
 * The AMX path (x86-64, AMX-TILE + AMX-BF16, with AVX-512 BF16/VBMI): exact-precision GEMM for work items
 * of several activation rows (w4p_amx_min_rows), on bf16 tile matrix multiplies; everything else is the AVX-512 VNNI path.
 *
 * Exact needs the products of the true weights with the fp32 activations, accumulated in fp32 (cpu_gemm.c).
 * Both operands are made exact in bf16:
 *   - weights: q - z is a small integer (|q - z| <= 16 for codes of at most 4 bits with 0 <= z <= 16, <= 256
 *     for 8-bit storage), and every integer of magnitude <= 256 is a bf16; float minima are rewritten with an integer zero point and a
 *     small remainder (virtual_zero);
 *   - activations: each fp32 row is split into bf16 pieces x = x1 + x2 + x3 (x1 = bf16(x), x2 = bf16(x - x1),
 *     x3 = x - x1 - x2): three pieces hold the 24-bit significand exactly, two suffice for fp16 inputs (11 bits)
 *     and one for bf16 inputs. cpu_gemm.c prepares the pieces once per call (w4p_bf16_pieces_avx512).
 * A product of two bf16 values has at most 16 significant bits, so it is exact in fp32, and the tile unit
 * accumulates them in fp32: per activation block, C = sum over pieces and k of (q - z)*x_p, then y += s*C as
 * in the other paths. The result is an fp32 dot product of the true weights with the true activations, in
 * another order of summation (it is not bit-identical to the VNNI path, but within the same bound). The tile
 * unit treats bf16 subnormals as zero: pieces below 2^-126 in magnitude (activations below about 2^-110) are
 * dropped.
 *
 * Tiles (palette 1, every tile 16 rows x 64 bytes): tmm0..3 = C for the four 16-column quarters of the
 * 64-column tile, tmm4..6 = the activation pieces (16 rows x 32 k), tmm7 = one weight tile (16 pairs of k x 16
 * columns, the VNNI-pair order of TDPBF16PS). Per activation block the weights of the 64 columns are decoded
 * once into bf16 tiles in L1 (16 KiB for a block of 128) and read by every group of 16 rows of the work item.
 * Decoding a tile row (two k of 16 columns) is one masked byte permute of the CPU layout's nibble bytes
 * (cpu_repack.c: `w & 0x0f0f0f0f` holds k 0..3 of a column, `(w >> 4) & 0x0f0f0f0f` k 4..7), one add of the
 * per-column offset 16 - z and one 16-bit table lookup giving bf16(q - z); 8-bit storage first joins the two
 * nibble planes into whole bytes and converts q - z through fp32.
 *
 * Linux gives a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM); cpu_dispatch.c asks
 * once and offers this path only when granted.
 */
#include "w4p_cpu_internal.h"
#include "w4p_avx512_fast.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#define TAMX __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma,f16c,avx2")))
#define INL inline __attribute__((always_inline))

/* The tile configuration of palette 1 (64 bytes, the layout LDTILECFG reads). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

#define KSTEP 32 /* k per bf16 tile */
/* Software prefetch distance in a tile's word stream (bytes), as the VNNI kernel's: at few rows the decoding is
 * bound by memory, and the hardware prefetcher alone left about half the read bandwidth unused */
#define W4P_AMX_PREFETCH 3072
#define MAX_KSTEPS (128 / KSTEP)

/* This thread's tiles: tmm0..3 accumulators (16 x 64 bytes), tmm4..6 activations (16 rows of a_bytes), tmm7
 * weights (b_rows x 64 bytes). Set per work item; the pool's threads each hold their own configuration. */
static INL TAMX void configure_tiles(int a_bytes, int b_rows) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = (uint16_t)(t >= 4 && t < 7 ? a_bytes : 64);
        cfg.rows[t] = (uint8_t)(t == 7 ? b_rows : 16);
    }
    _tile_loadconfig(&cfg);
}

/* Whether the AMX kernel computes this layer: codes of at most 4 bits in one plane, integer zero points (zero
 * modes none / int, checked per block by the kernel) and activation blocks of whole bf16 tiles. */
int w4p_amx_layer_ok(const struct w4p_cpu_layer *L) {
    return L->ab % KSTEP == 0 && L->ab <= 128;
}

/* Per activation block of `ab` values, the sum of the row's values (float minima: y += r*sum). Summed in double:
   its error then comes from the one rounding to fp32. */
TAMX void w4p_block_sums_avx512(const float *x, int nblk, int ab, float *out) {
    for (int b = 0; b < nblk; b++) {
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (int i = 0; i < ab; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + (size_t)b * ab + i);
            a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
            a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
        }
        out[b] = (float)_mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    }
}

/* Split n fp32 values (n a multiple of 16) into `pieces` bf16 rows dst[p*stride + i] whose sum is x exactly. */
TAMX void w4p_bf16_pieces_avx512(const float *x, int n, int pieces, uint16_t *dst, size_t stride) {
    for (int i = 0; i < n; i += 16) {
        __m512 r = _mm512_loadu_ps(x + i);
        const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(r), _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ);
        for (int p = 0; p < pieces; p++) {
            __m256i h = (__m256i)_mm512_cvtneps_pbh(r);
            if (p) h = _mm256_maskz_mov_epi16(finite, h); /* inf and NaN live in the first piece alone */
            _mm256_storeu_si256((__m256i *)(dst + (size_t)p * stride + i), h);
            const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            r = _mm512_sub_ps(r, back);
        }
    }
}

/* The largest zero point the kernel takes: q - z must stay a bf16 integer (|q - z| <= 256) and, for 4-bit
 * storage, an index of the 32-entry table (q + 16 - z in [0, 31]). */
static INL int zero_max(const struct w4p_cpu_layer *L) { return L->planes == 2 ? 256 : 16; }

/* Per column of one 16-column quarter, as the 32 16-bit lanes of a tile row (two k per column): 16 - z for
 * 4-bit storage (added before the table lookup), z for 8-bit storage (subtracted); 0 when some z is not an
 * integer in [0, zmax] (the kernel then leaves the work item to VNNI). */
static INL TAMX int zero_offsets(const __m512 z, const int zmax, __m512i *off) {
    const __m512 zr = _mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 ok = _mm512_cmp_ps_mask(zr, z, _CMP_EQ_OQ) &
                         _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(z, _mm512_set1_ps((float)zmax), _CMP_LE_OQ);
    if (ok != 0xFFFF) return 0;
    const __m512i zi = _mm512_cvtps_epi32(zr);
    const __m512i o = zmax == 16 ? _mm512_sub_epi32(_mm512_set1_epi32(16), zi) : zi;
    *off = _mm512_or_si512(o, _mm512_slli_epi32(o, 16));
    return 1;
}

/* Scales and zero points (or minima) of (tile, block) as four vectors of 16 floats each. */
static INL TAMX void block_params(const struct w4p_cpu_layer *L, int tile, int blk, __m512 s[4], __m512 z[4]) {
    const uint8_t *p = w4p_tile_params(L, tile, w4p_block_group(L, blk));
    for (int q = 0; q < 4; q++) {
        if (L->pkind == W4P_PK_F16U8) {
            s[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * q)));
            z[q] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 128 + 16 * q))));
        } else if (L->pkind == W4P_PK_F16F16) {
            s[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * q)));
            z[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * q)));
        } else {
            s[q] = _mm512_loadu_ps((const float *)p + 16 * q);
            z[q] = _mm512_loadu_ps((const float *)p + 64 + 16 * q);
        }
    }
}

/* Float minima w = s*q + m as w = s*(q - z) + r: z = round(-m/s) clamped to [0, zmax] (a zero in the middle of
 * the code range puts it there; NaN from s = 0 gives 0) and r = fma(s, z, m), so q - z is a small integer as
 * for int zeros and y += s*sum((q - z)*x) + r*sum(x). Unclamped, |r| <= |s|/2 and r is exact (Sterbenz: s*z is
 * within a factor two of -m); clamped, s*(q - z) and r have the same sign. Either way neither term is much
 * larger than the weights, so nothing cancels into noise (the reason exact forms each weight on the other
 * paths), and a weight that is exactly zero under a large scale gives q = z and r = 0. */
static INL TAMX void virtual_zero(__m512 s, const int zmax, __m512 *zm, __m512 *r) {
    __m512 t = _mm512_div_ps(*zm, s);
    t = _mm512_roundscale_ps(_mm512_sub_ps(_mm512_setzero_ps(), t), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 z = _mm512_min_ps(_mm512_max_ps(t, _mm512_setzero_ps()), _mm512_set1_ps((float)zmax));
    *r = _mm512_fmadd_ps(s, z, *zm);
    *zm = z;
}

/* bf16(i - 16) for i = 0 .. 31 */
static INL TAMX __m512i value_table(void) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = w4p_float_to_bf16((float)(i - 16));
    return _mm512_loadu_si512((const void *)t);
}

/* The code bytes of chunk c of the tile (k 8c .. 8c+7), column quarter q: lo = k 0..3, hi = k 4..7 of each column, one byte
 * per code (the layout's `w & 0x0f0f0f0f` and `(w >> 4) & 0x0f0f0f0f`; 8-bit storage ORs in plane 1's high
 * nibbles, giving whole codes). The word stream is prefetched ahead, as on VNNI. */
static INL TAMX void code_bytes(const struct w4p_cpu_layer *L, int tile, int c, int q, __m512i *lo, __m512i *hi) {
    const __m512i nib = _mm512_set1_epi32(0x0f0f0f0f);
    const int two = L->planes == 2;
    const size_t at = (size_t)c * W4P_TILE + 16 * q;
    const uint32_t *p0 = w4p_tile_words(L, tile, 0) + at, *p1 = w4p_tile_words(L, tile, two) + at;
    _mm_prefetch((const char *)p0 + W4P_AMX_PREFETCH, _MM_HINT_T0);
    if (two) _mm_prefetch((const char *)p1 + W4P_AMX_PREFETCH, _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512((const void *)p0);
    *lo = _mm512_and_si512(w, nib);
    *hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), nib);
    if (two) { /* plane 1 holds the high nibbles of the same k */
        const __m512i v = _mm512_loadu_si512((const void *)p1);
        *lo = _mm512_or_si512(*lo, _mm512_slli_epi32(_mm512_and_si512(v, nib), 4));
        *hi = _mm512_or_si512(*hi, _mm512_andnot_si512(nib, v));
    }
}

/* Weight tiles of block b: bt[ks][q] = the 16 x 32 bf16 tile of k-step ks and column quarter q. */
static INL TAMX void decode_block(const struct w4p_cpu_layer *L, int tile, int b, const __m512i off[4],
                                  const __m512i table, uint16_t (*bt)[4][16 * 32]) {
    /* byte permutes of one nibble vector (16 columns x 4 k): rows (k0, k1) and (k2, k3) of a column */
    const __m512i i01 = _mm512_set1_epi32(0x00010000), i23 = _mm512_set1_epi32(0x00030002);
    const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(0x00040004));
    const __m512i idx01 = _mm512_add_epi8(i01, col), idx23 = _mm512_add_epi8(i23, col);
    const __mmask64 even = 0x5555555555555555ull;
    const int cpb = L->ab / 8, two = L->planes == 2;
    for (int c = 0; c < cpb; c++) {
        const int ks = c / 4, r0 = 4 * (c % 4);
        for (int q = 0; q < 4; q++) {
            __m512i lo, hi;
            code_bytes(L, tile, b * cpb + c, q, &lo, &hi);
            uint16_t *dst = bt[ks][q] + (size_t)r0 * 32;
            const __m512i rows[4] = {_mm512_maskz_permutexvar_epi8(even, idx01, lo),
                                     _mm512_maskz_permutexvar_epi8(even, idx23, lo),
                                     _mm512_maskz_permutexvar_epi8(even, idx01, hi),
                                     _mm512_maskz_permutexvar_epi8(even, idx23, hi)};
            for (int r = 0; r < 4; r++) {
                __m512i v;
                if (two) { /* q - z in [-256, 255]: through fp32, exact */
                    const __m512i d = _mm512_sub_epi16(rows[r], off[q]);
                    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(d)));
                    const __m512 e = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(d, 1)));
                    v = (__m512i)_mm512_cvtne2ps_pbh(e, a);
                } else {
                    v = _mm512_permutexvar_epi16(_mm512_add_epi16(rows[r], off[q]), table);
                }
                _mm512_store_si512((void *)(dst + 32 * r), v);
            }
        }
    }
}

/* the four accumulator tiles (tmm0..3: the 16-column quarters of the 64-column tile), zeroed / stored to cb */
#define W4P_AMX_ZERO_C()                                                                                           \
    do {                                                                                                           \
        _tile_zero(0);                                                                                             \
        _tile_zero(1);                                                                                             \
        _tile_zero(2);                                                                                             \
        _tile_zero(3);                                                                                             \
    } while (0)
#define W4P_AMX_STORE_C(cb)                                                                                        \
    do {                                                                                                           \
        _tile_stored(0, (cb)[0], 64);                                                                              \
        _tile_stored(1, (cb)[1], 64);                                                                              \
        _tile_stored(2, (cb)[2], 64);                                                                              \
        _tile_stored(3, (cb)[3], 64);                                                                              \
    } while (0)

/* C[q] += sum over pieces of A_p x B(ks, q), for one group of 16 rows */
#define W4P_AMX_STEP(Q)                                                                                            \
    do {                                                                                                           \
        _tile_loadd(7, bt[ks][Q], 64);                                                                             \
        _tile_dpbf16ps(Q, 4, 7);                                                                                   \
        if (P > 1) _tile_dpbf16ps(Q, 5, 7);                                                                        \
        if (P > 2) _tile_dpbf16ps(Q, 6, 7);                                                                        \
    } while (0)

static INL TAMX void row_group(const w4p_job *J, int b, int64_t m, int nks, const int P,
                               uint16_t (*bt)[4][16 * 32], float (*cb)[16][16]) {
    const struct w4p_cpu_layer *L = J->L;
    const size_t stride = w4p_amx_row(P, L->kp) * 2; /* bytes from one row's piece to the next row's */
    const uint16_t *a = J->xb + (size_t)m * w4p_amx_row(P, L->kp) + (size_t)b * L->ab;
    W4P_AMX_ZERO_C();
    for (int ks = 0; ks < nks; ks++) {
        _tile_loadd(4, a + KSTEP * ks, stride);
        if (P > 1) _tile_loadd(5, a + L->kp + KSTEP * ks, stride);
        if (P > 2) _tile_loadd(6, a + 2 * (size_t)L->kp + KSTEP * ks, stride);
        W4P_AMX_STEP(0);
        W4P_AMX_STEP(1);
        W4P_AMX_STEP(2);
        W4P_AMX_STEP(3);
    }
    W4P_AMX_STORE_C(cb);
}

static INL TAMX void tile_pieces(const w4p_job *J, int tile, int64_t m0, int64_t m1, const int P) {
    const struct w4p_cpu_layer *L = J->L;
    float y[W4P_MCHUNK][W4P_TILE] __attribute__((aligned(64)));
    uint16_t bt[MAX_KSTEPS][4][16 * 32] __attribute__((aligned(64)));
    float cb[4][16][16] __attribute__((aligned(64)));
    __m512 s[4], z[4], r[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512i off[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    const int minima = L->zero_mode == W4P_ZERO_FLOAT, zmax = zero_max(L);
    /* every block's zero points must be integers in [0, zmax]; else VNNI computes the whole item */
    for (int b = 0; b < L->nblk && !minima; b++) {
        block_params(L, tile, b, s, z);
        for (int q = 0; q < 4; q++)
            if (!zero_offsets(z[q], zmax, &off[q])) {
                w4p_tile_avx512vnni(J, tile, m0, m1);
                return;
            }
    }
    const int64_t rows = m1 - m0;
    memset(y, 0, sizeof(float) * W4P_TILE * (size_t)rows);
    configure_tiles(64, 16);
    const __m512i table = value_table();
    const int nks = L->ab / KSTEP;
    for (int b = 0; b < L->nblk; b++) {
        block_params(L, tile, b, s, z);
        for (int q = 0; q < 4; q++) {
            if (minima) virtual_zero(s[q], zmax, &z[q], &r[q]);
            zero_offsets(z[q], zmax, &off[q]);
        }
        decode_block(L, tile, b, off, table, bt);
        for (int64_t m = m0; m < m1; m += 16) {
            /* rows past m1 are the next item's or the zero padding of the pieces buffer: computed, not kept */
            row_group(J, b, m, nks, P, bt, cb);
            const int n = m1 - m < 16 ? (int)(m1 - m) : 16;
            for (int i = 0; i < n; i++) {
                const __m512 sx = minima ? _mm512_set1_ps(J->xsumf[(m + i) * L->nblk + b]) : _mm512_setzero_ps();
                for (int q = 0; q < 4; q++) {
                    float *yr = &y[m - m0 + i][16 * q];
                    __m512 v = _mm512_fmadd_ps(s[q], _mm512_load_ps(cb[q][i]), _mm512_load_ps(yr));
                    if (minima) v = _mm512_fmadd_ps(r[q], sx, v);
                    _mm512_store_ps(yr, v);
                }
            }
        }
    }
    _tile_release();
    for (int64_t m = m0; m < m1; m++) w4p_store_row(J, m, tile, y[m - m0]);
}

/* ---- fast: int8 activations times unsigned codes (TDPBSUD), exact int32 sums ------------------------------- */

/* Code tiles of block b: ct[ks][q] = k-step ks (64 k, or the whole block when it is shorter) of column quarter q,
 * row r holding for each of the 16 columns the codes of k = 4r .. 4r+3 (TDPBSUD's B order): exactly the layout's
 * `w & 0x0f0f0f0f` (even rows) and `(w >> 4) & 0x0f0f0f0f` (odd rows); 8-bit storage joins the planes. */
static INL TAMX void decode_codes(const struct w4p_cpu_layer *L, int tile, int b, uint8_t (*ct)[4][16 * 64]) {
    const int cpb = L->ab / 8;
    for (int c = 0; c < cpb; c++) {
        const int ks = c / 8, row = 2 * (c % 8);
        for (int q = 0; q < 4; q++) {
            __m512i lo, hi;
            code_bytes(L, tile, b * cpb + c, q, &lo, &hi);
            _mm512_store_si512((void *)(ct[ks][q] + 64 * row), lo);
            _mm512_store_si512((void *)(ct[ks][q] + 64 * (row + 1)), hi);
        }
    }
}

#define W4P_AMX_FAST_STEP(Q)                                                                                       \
    do {                                                                                                           \
        _tile_loadd(7, ct[ks][Q], 64);                                                                             \
        _tile_dpbsud(Q, 4, 7);                                                                                     \
    } while (0)

/* The fast path's per-block arithmetic is the VNNI kernel's (w4p_fast_term) on the same exact integer sums: the
 * two kernels give the same bits. */
static INL TAMX void tile_fast(const w4p_job *J, int tile, int64_t m0, int64_t m1) {
    const struct w4p_cpu_layer *L = J->L;
    float y[W4P_MCHUNK][W4P_TILE] __attribute__((aligned(64)));
    uint8_t ct[2][4][16 * 64] __attribute__((aligned(64)));
    int32_t cb[4][16][16] __attribute__((aligned(64)));
    const int kst = L->ab < 64 ? L->ab : 64, nks = L->ab / kst, nblk = L->nblk;
    const int minima = L->zero_mode == W4P_ZERO_FLOAT;
    memset(y, 0, sizeof(float) * W4P_TILE * (size_t)(m1 - m0));
    configure_tiles(kst, kst / 4); /* activations: 16 rows of kst int8; codes: kst/4 rows of 16 columns x 4 k */
    for (int b = 0; b < nblk; b++) {
        __m512 s[4], zm[4];
        block_params(L, tile, b, s, zm);
        decode_codes(L, tile, b, ct);
        for (int64_t m = m0; m < m1; m += 16) {
            const int8_t *a = J->xq + m * L->kp + (size_t)b * L->ab;
            W4P_AMX_ZERO_C();
            for (int ks = 0; ks < nks; ks++) {
                _tile_loadd(4, a + kst * ks, L->kp);
                W4P_AMX_FAST_STEP(0);
                W4P_AMX_FAST_STEP(1);
                W4P_AMX_FAST_STEP(2);
                W4P_AMX_FAST_STEP(3);
            }
            W4P_AMX_STORE_C(cb);
            const int n = m1 - m < 16 ? (int)(m1 - m) : 16;
            for (int i = 0; i < n; i++) {
                const __m512 xs = _mm512_set1_ps(J->xs[(m + i) * nblk + b]);
                const __m512 as = _mm512_set1_ps((float)J->xsum[(m + i) * nblk + b]);
                for (int q = 0; q < 4; q++) {
                    const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)cb[q][i]));
                    const __m512 t = w4p_fast_term(s[q], zm[q], d, as, minima);
                    float *yr = &y[m - m0 + i][16 * q];
                    _mm512_store_ps(yr, _mm512_fmadd_ps(t, xs, _mm512_load_ps(yr)));
                }
            }
        }
    }
    _tile_release();
    for (int64_t m = m0; m < m1; m++) w4p_store_row(J, m, tile, y[m - m0]);
}

TAMX void w4p_tile_amx(const w4p_job *J, int tile, int64_t m0, int64_t m1) {
    if (J->precision == W4P_PREC_FAST) {
        if (m1 - m0 >= w4p_amx_min_rows(W4P_PREC_FAST, 0)) tile_fast(J, tile, m0, m1);
        else w4p_tile_avx512vnni(J, tile, m0, m1);
        return;
    }
    if (!J->xb || m1 - m0 < w4p_amx_min_rows(W4P_PREC_EXACT, J->pieces)) {
        w4p_tile_avx512vnni(J, tile, m0, m1);
        return;
    }
    switch (J->pieces) {
    case 1: tile_pieces(J, tile, m0, m1, 1); break;
    case 2: tile_pieces(J, tile, m0, m1, 2); break;
    default: tile_pieces(J, tile, m0, m1, 3); break;
    }
}

#endif
