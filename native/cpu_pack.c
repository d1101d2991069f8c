/*
 * Conversion helpers: canonical codes -> layout v1 words, and GPTQ qweight -> canonical codes.
 *
 * Both are pure data movement that numpy does in several passes (gather for act-order, pad, a 8-axis
 * transpose, nibble merge); here each output word is built once from a 16-row stripe held in cache.
 * The numpy functions in w4pack/layout.py (_interleave) and w4pack/formats/_bitpack.py stay the
 * executable spec; tests/test_pack_native.py compares both bit for bit.
 *
 * Layout v1 word of lane l = gid*4 + tid, k16 slice j, 16x64 tile (nb, kb), 4-bit storage, with
 * r0 = 16nb + gid, r1 = r0 + 8 and c = 64kb + 16j + 2tid (see docs/LAYOUT.md):
 *   nibbles 0..7 = q[r0][c], q[r1][c], q[r0][c+8], q[r1][c+8], q[r0][c+1], q[r1][c+1], q[r0][c+9], q[r1][c+9]
 * 8-bit storage: the lane's 32 bytes are, per slice j, the eight fragment elements
 *   q[r0][c], q[r0][c+1], q[r1][c], q[r1][c+1], q[r0][c+8], q[r0][c+9], q[r1][c+8], q[r1][c+9].
 */
#include "w4p_cpu_internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if (defined(__x86_64__) || defined(__i386__)) && !defined(W4P_PACK_SCALAR)
#include <emmintrin.h>
#endif

typedef struct {
    const uint8_t *codes;
    int64_t ldc;
    int32_t n, k, np, kp;
    const int32_t *perm;
    int32_t sbits;
    int32_t *out;
    volatile int failed; /* a worker could not get its scratch buffer */
    _Atomic int max_seen; /* largest code of any stripe */
    const uint32_t *qw;   /* fused GPTQ path: 4-bit qweight [k/8][ldq] instead of codes */
    int64_t ldq;
} pack_ctx;

/* one growing scratch buffer per thread (pool workers live for the process) */
static __thread uint8_t *scratch;
static __thread size_t scratch_size;

static uint8_t *get_scratch(size_t bytes) {
    if (bytes > scratch_size) {
        uint8_t *p = realloc(scratch, bytes);
        if (!p) return NULL;
        scratch = p;
        scratch_size = bytes;
    }
    return scratch;
}

/* rows 16nb .. 16nb+15 in packed column order, zero padded to [16][kp] */
static void gather_stripe(const pack_ctx *c, int64_t nb, uint8_t *buf) {
    for (int r = 0; r < 16; r++) {
        int64_t row = nb * 16 + r;
        uint8_t *dst = buf + (size_t)r * c->kp;
        if (row >= c->n) {
            memset(dst, 0, c->kp);
            continue;
        }
        const uint8_t *src = c->codes + row * c->ldc;
        if (c->perm) {
            const int32_t *p = c->perm;
            for (int32_t i = 0; i < c->k; i++) dst[i] = src[p[i]];
        } else {
            memcpy(dst, src, c->k);
        }
        memset(dst + c->k, 0, c->kp - c->k);
    }
}

static inline uint64_t spread_nibbles(uint32_t w);
#define GPTQ_PREFETCH 16

/* Fused GPTQ path without act-order: no scratch at all. With R = 8kb + 2j, the lane word (g, tid, j) takes
   byte tid of four qweight words A = qw[R][r0], B = qw[R][r1], C = qw[R+1][r0], D = qw[R+1][r1] (byte tid
   of a word = codes 2tid, 2tid+1 of its eight): low nibbles a, b, c, d into nibbles 0..3, high into 4..7. */
static void gptq_direct_tile(const pack_ctx *c, int64_t nb, int64_t kt) {
    const int64_t kt_n = c->kp / 64, words = c->k / 8;
    uint32_t *out = (uint32_t *)c->out + nb * kt_n * 128;
    int32_t rows16 = c->n - (int32_t)nb * 16 < 16 ? c->n - (int32_t)nb * 16 : 16;
    /* byte k = 4g + tid of the lane words' four bytes, per slice j (bytewise, so the compiler vectorizes):
       P = lo(a) | lo(b) << 4, Q = lo(c) | lo(d) << 4, R = hi(a) | hi(b) << 4, S = hi(c) | hi(d) << 4 */
    uint8_t P[4][32], Q[4][32], R[4][32], S[4][32];
    uint8_t zero[128] = {0}, part[2][64];
    {
        for (int j = 0; j < 4; j++) {
            int64_t row = kt * 8 + j * 2;
            const uint8_t *lo = zero, *hi = zero;
            if (row < words) lo = (const uint8_t *)(c->qw + row * c->ldq + nb * 16);
            if (row + 1 < words) hi = (const uint8_t *)(c->qw + (row + 1) * c->ldq + nb * 16);
            if (row + GPTQ_PREFETCH + 1 < words) {
                __builtin_prefetch(lo + GPTQ_PREFETCH * c->ldq * 4);
                __builtin_prefetch(hi + GPTQ_PREFETCH * c->ldq * 4);
            }
            if (rows16 < 16) { /* last stripe: rows past n are zero */
                memset(part, 0, sizeof part);
                memcpy(part[0], lo, (size_t)rows16 * 4);
                memcpy(part[1], hi, (size_t)rows16 * 4);
                lo = part[0];
                hi = part[1];
            }
            /* a = lo word g (row r0), b = lo word g+8 (row r1), c = hi word g, d = hi word g+8 */
            for (int k = 0; k < 32; k++) {
                uint8_t a = lo[k], b = lo[32 + k], cc = hi[k], d = hi[32 + k];
                P[j][k] = (uint8_t)((a & 15) | (b << 4));
                Q[j][k] = (uint8_t)((cc & 15) | (d << 4));
                R[j][k] = (uint8_t)((a >> 4) | (b & 0xF0));
                S[j][k] = (uint8_t)((cc >> 4) | (d & 0xF0));
            }
        }
        uint32_t *o = out + kt * 128;
#if (defined(__x86_64__) || defined(__i386__)) && !defined(W4P_PACK_SCALAR)
        /* word (k, j) = bytes P, Q, R, S: interleave bytes, then 16-bit pairs, then a 4x4 transpose over j */
        __m128i W[4][8];
        for (int j = 0; j < 4; j++) {
            for (int h = 0; h < 2; h++) {
                __m128i p = _mm_loadu_si128((const __m128i *)(P[j] + 16 * h));
                __m128i q = _mm_loadu_si128((const __m128i *)(Q[j] + 16 * h));
                __m128i r = _mm_loadu_si128((const __m128i *)(R[j] + 16 * h));
                __m128i t = _mm_loadu_si128((const __m128i *)(S[j] + 16 * h));
                __m128i pq_lo = _mm_unpacklo_epi8(p, q), pq_hi = _mm_unpackhi_epi8(p, q);
                __m128i rs_lo = _mm_unpacklo_epi8(r, t), rs_hi = _mm_unpackhi_epi8(r, t);
                W[j][4 * h + 0] = _mm_unpacklo_epi16(pq_lo, rs_lo);
                W[j][4 * h + 1] = _mm_unpackhi_epi16(pq_lo, rs_lo);
                W[j][4 * h + 2] = _mm_unpacklo_epi16(pq_hi, rs_hi);
                W[j][4 * h + 3] = _mm_unpackhi_epi16(pq_hi, rs_hi);
            }
        }
        for (int m = 0; m < 8; m++) {
            __m128i t0 = _mm_unpacklo_epi32(W[0][m], W[1][m]), t1 = _mm_unpacklo_epi32(W[2][m], W[3][m]);
            __m128i t2 = _mm_unpackhi_epi32(W[0][m], W[1][m]), t3 = _mm_unpackhi_epi32(W[2][m], W[3][m]);
            _mm_storeu_si128((__m128i *)(o + m * 16 + 0), _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(o + m * 16 + 4), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(o + m * 16 + 8), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128((__m128i *)(o + m * 16 + 12), _mm_unpackhi_epi64(t2, t3));
        }
#else
        for (int k = 0; k < 32; k++)
            for (int j = 0; j < 4; j++)
                o[k * 4 + j] = (uint32_t)P[j][k] | (uint32_t)Q[j][k] << 8 | (uint32_t)R[j][k] << 16 |
                               (uint32_t)S[j][k] << 24;
#endif
    }
}

/* Work item of the direct path: 16 stripes side by side, so each qweight row is read as 1 KiB contiguous
   (16 cache lines of one page that the prefetchers see together) rather than 64 bytes per pass: 1.9x
   faster than one stripe per item on the 7B shapes (16 beat 4 and 8). */
#define DIRECT_STRIPES 16
static void pack_group_gptq_direct(void *vctx, int64_t grp) {
    const pack_ctx *c = vctx;
    int64_t nb0 = grp * DIRECT_STRIPES, nbn = c->np / 16;
    for (int64_t kt = 0; kt < c->kp / 64; kt++)
        for (int64_t nb = nb0; nb < nb0 + DIRECT_STRIPES && nb < nbn; nb++) gptq_direct_tile(c, nb, kt);
}

/* Fused GPTQ path with act-order, column-major so the permutation moves 8 bytes per K column, not 16:
   pairT[kk][g] = q[r0][kk] | q[r1][kk] << 4 for original columns kk (r0 = 16nb + g, r1 = r0 + 8), then
   pairC[j] = pairT[perm[j]] (zero past k), then each lane word takes 4 bytes of 4 columns of pairC. */
/* stripes per act-order work item: pass 1 reads 64 * 8 contiguous bytes per qweight row (4.7 -> 2.7 CPU s on
   the 7B; 16 is no faster and needs 1.4 MB of scratch for K = 11008) */
#define PERM_STRIPES 8
static void pack_group_gptq_perm(const pack_ctx *c, int64_t grp, uint8_t *scratch) {
    const int64_t kt_n = c->kp / 64, words = c->k / 8, nbn = c->np / 16;
    int64_t nb0 = grp * PERM_STRIPES;
    int ns = nbn - nb0 < PERM_STRIPES ? (int)(nbn - nb0) : PERM_STRIPES;
    uint8_t *pairC = scratch + (size_t)PERM_STRIPES * 8 * c->k;
    uint32_t part[16];
    /* pass 1, all stripes of the group per qweight row: one contiguous read of 64 * ns bytes */
    for (int64_t r = 0; r < words; r++) {
        if (r + GPTQ_PREFETCH < words) {
            const char *ahead = (const char *)(c->qw + (r + GPTQ_PREFETCH) * c->ldq + nb0 * 16);
            for (int s2 = 0; s2 < ns; s2++) __builtin_prefetch(ahead + 64 * s2);
        }
        for (int st = 0; st < ns; st++) {
            int64_t nb = nb0 + st;
            int32_t rows16 = c->n - (int32_t)nb * 16 < 16 ? c->n - (int32_t)nb * 16 : 16;
            const uint32_t *w = c->qw + r * c->ldq + nb * 16;
            if (rows16 < 16) {
                memset(part, 0, sizeof part);
                memcpy(part, w, (size_t)rows16 * 4);
                w = part;
            }
            /* pairT of stripe st: columns 8r .. 8r+7, 8 bytes each */
            uint8_t *dst = scratch + (size_t)st * 8 * c->k + (size_t)r * 64;
#if (defined(__x86_64__) || defined(__i386__)) && !defined(W4P_PACK_SCALAR)
            __m128i w0 = _mm_loadu_si128((const __m128i *)w), w1 = _mm_loadu_si128((const __m128i *)(w + 4));
            __m128i w2 = _mm_loadu_si128((const __m128i *)(w + 8)), w3 = _mm_loadu_si128((const __m128i *)(w + 12));
            const __m128i m = _mm_set1_epi32(15);
            for (int e = 0; e < 8; e++) {
                __m128i sh = _mm_cvtsi32_si128(4 * e);
                __m128i p0 = _mm_or_si128(_mm_and_si128(_mm_srl_epi32(w0, sh), m),
                                          _mm_slli_epi32(_mm_and_si128(_mm_srl_epi32(w2, sh), m), 4));
                __m128i p1 = _mm_or_si128(_mm_and_si128(_mm_srl_epi32(w1, sh), m),
                                          _mm_slli_epi32(_mm_and_si128(_mm_srl_epi32(w3, sh), m), 4));
                __m128i b = _mm_packus_epi16(_mm_packs_epi32(p0, p1), _mm_setzero_si128());
                _mm_storel_epi64((__m128i *)(dst + e * 8), b);
            }
#else
            for (int e = 0; e < 8; e++)
                for (int g = 0; g < 8; g++)
                    dst[e * 8 + g] = (uint8_t)(((w[g] >> (4 * e)) & 15) | ((w[g + 8] >> (4 * e)) & 15) << 4);
#endif
        }
    }
    /* pass 2 per stripe: permute the columns, then assemble the lane words */
    for (int st = 0; st < ns; st++) {
        const uint8_t *pairT = scratch + (size_t)st * 8 * c->k;
        for (int32_t j = 0; j < c->k; j++) memcpy(pairC + (size_t)j * 8, pairT + (size_t)c->perm[j] * 8, 8);
        memset(pairC + (size_t)c->k * 8, 0, (size_t)(c->kp - c->k) * 8);
        uint32_t *out = (uint32_t *)c->out + (nb0 + st) * kt_n * 128;
        for (int64_t t = 0; t < kt_n; t++) {
            uint32_t *o = out + t * 128;
            const uint8_t *base = pairC + (size_t)t * 64 * 8;
            for (int g = 0; g < 8; g++)
                for (int tid = 0; tid < 4; tid++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *q = base + (size_t)(j * 16 + tid * 2) * 8 + g;
                        o[(g * 4 + tid) * 4 + j] = (uint32_t)q[0] | (uint32_t)q[64] << 8 | (uint32_t)q[8] << 16 |
                                                   (uint32_t)q[72] << 24;
                    }
        }
    }
}

static void pack_group_perm_item(void *vctx, int64_t grp) {
    pack_ctx *c = vctx;
    uint8_t *scratch = get_scratch((size_t)PERM_STRIPES * 8 * c->k + (size_t)8 * c->kp);
    if (!scratch) {
        c->failed = 1;
        return;
    }
    pack_group_gptq_perm(c, grp, scratch);
}

static void pack_stripe(void *vctx, int64_t nb) {
    pack_ctx *c = vctx;
    const int32_t kp = c->kp;
    uint8_t *buf = get_scratch((size_t)24 * kp);
    if (!buf) {
        c->failed = 1;
        return;
    }
    gather_stripe(c, nb, buf);
    {
        uint8_t m = 0;
        for (size_t i = 0; i < (size_t)16 * kp; i++) m = buf[i] > m ? buf[i] : m;
        int prev = atomic_load_explicit(&c->max_seen, memory_order_relaxed);
        while (m > prev && !atomic_compare_exchange_weak(&c->max_seen, &prev, m)) {
        }
    }
    const int64_t kt = kp / 64;
    if (c->sbits == 4) {
        /* pair[gid][col] = q[r0][col] | q[r1][col] << 4: each word is then 4 bytes of one row of pair */
        uint8_t *pair = buf + (size_t)16 * kp;
        for (int g = 0; g < 8; g++) {
            const uint8_t *a = buf + (size_t)g * kp, *b = buf + (size_t)(g + 8) * kp;
            uint8_t *p = pair + (size_t)g * kp;
            for (int32_t i = 0; i < kp; i++) p[i] = (uint8_t)(a[i] | (b[i] << 4));
        }
        uint32_t *out = (uint32_t *)c->out + nb * kt * 128;
        for (int64_t t = 0; t < kt; t++) {
            uint32_t *o = out + t * 128;
            for (int g = 0; g < 8; g++) {
                const uint8_t *p = pair + (size_t)g * kp + t * 64;
                for (int tid = 0; tid < 4; tid++) {
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *q = p + j * 16 + tid * 2;
                        o[(g * 4 + tid) * 4 + j] = (uint32_t)q[0] | (uint32_t)q[8] << 8 |
                                                   (uint32_t)q[1] << 16 | (uint32_t)q[9] << 24;
                    }
                }
            }
        }
    } else {
        uint8_t *out = (uint8_t *)c->out + nb * kt * 32 * 32;
        for (int64_t t = 0; t < kt; t++) {
            uint8_t *o = out + t * 32 * 32;
            for (int g = 0; g < 8; g++) {
                const uint8_t *a = buf + (size_t)g * kp + t * 64, *b = buf + (size_t)(g + 8) * kp + t * 64;
                for (int tid = 0; tid < 4; tid++) {
                    uint8_t *lane = o + (g * 4 + tid) * 32;
                    for (int j = 0; j < 4; j++) {
                        int cc = j * 16 + tid * 2;
                        uint8_t *e = lane + j * 8;
                        e[0] = a[cc]; e[1] = a[cc + 1]; e[2] = b[cc]; e[3] = b[cc + 1];
                        e[4] = a[cc + 8]; e[5] = a[cc + 9]; e[6] = b[cc + 8]; e[7] = b[cc + 9];
                    }
                }
            }
        }
    }
}

/* perm (NULL: none) holds column indices 0..k-1; otherwise the error names the caller and the entry */
static int perm_ok(const char *fn, const int32_t *perm, int32_t k) {
    for (int32_t i = 0; perm && i < k; i++) {
        if (perm[i] < 0 || perm[i] >= k) {
            w4p_set_error("%s: perm[%d] = %d is outside 0..%d", fn, i, perm[i], k - 1);
            return 0;
        }
    }
    return 1;
}

int w4p_pack_layout_v1(const uint8_t *codes, int64_t ldc, int32_t n, int32_t k, const int32_t *perm,
                       int32_t storage_bits, int32_t *out, int32_t *max_seen, int threads) {
    if (!codes || !out || n < 1 || k < 1 || ldc < k || (storage_bits != 4 && storage_bits != 8)) {
        w4p_set_error("w4p_pack_layout_v1: bad arguments (n=%d k=%d ldc=%lld storage_bits=%d)", n, k,
                      (long long)ldc, storage_bits);
        return W4P_EINVAL;
    }
    if (!perm_ok("w4p_pack_layout_v1", perm, k)) return W4P_EINVAL;
    pack_ctx c = {codes, ldc, n, k, (n + 15) / 16 * 16, (k + 63) / 64 * 64, perm, storage_bits, out, 0, 0, NULL, 0};
    w4p_parallel_for(c.np / 16, threads < 1 ? 1 : threads, pack_stripe, &c);
    if (max_seen) *max_seen = atomic_load(&c.max_seen);
    if (c.failed) {
        w4p_set_error("w4p_pack_layout_v1: out of memory for a %d-column stripe", c.kp);
        return W4P_ENOMEM;
    }
    return W4P_OK;
}

/* ---- GPTQ qweight [k*bits/32][n] (stream along K, LSB first) -> codes [n][k] ------------------ */
typedef struct {
    const int32_t *qw;
    int64_t ldq;
    int32_t rows, n, bits;
    uint8_t *codes;
    int64_t ldc;
} unpack_ctx;

/* Work item: a block of UNPACK_COLS qweight columns (= output rows). For every 8 qweight rows, eight
   sequential input streams give, per column, eight words = one whole 64-byte line of its output row,
   written with non-temporal stores on x86: no read-for-ownership of lines that are fully overwritten,
   and no cache thrashing by output rows a power-of-two apart (measured 4x faster than storing 8 bytes
   at a time into 256 rows). */
#define UNPACK_COLS 256

/* the eight nibbles of a word, nibble i into byte i (little endian) */
static inline uint64_t spread_nibbles(uint32_t w) {
    uint64_t v = w;
    v = (v | v << 16) & 0x0000FFFF0000FFFFull;
    v = (v | v << 8) & 0x00FF00FF00FF00FFull;
    v = (v | v << 4) & 0x0F0F0F0F0F0F0F0Full;
    return v;
}

static inline void store_line(uint8_t *o, const uint64_t *line, int words) {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(W4P_PACK_SCALAR)
    if (words == 8 && ((uintptr_t)o & 15) == 0) {
        for (int j = 0; j < 8; j += 2)
            _mm_stream_si128((__m128i *)(o + j * 8), _mm_set_epi64x((long long)line[j + 1], (long long)line[j]));
        return;
    }
#endif
    memcpy(o, line, (size_t)words * 8);
}

static void unpack_block(void *vctx, int64_t blk) {
    const unpack_ctx *c = vctx;
    int32_t n0 = (int32_t)(blk * UNPACK_COLS);
    int32_t nc = c->n - n0 < UNPACK_COLS ? c->n - n0 : UNPACK_COLS;
    const uint32_t *qw = (const uint32_t *)c->qw;
    if (c->bits == 4) {
        for (int32_t r8 = 0; r8 < c->rows; r8 += 8) {
            int rr = c->rows - r8 < 8 ? c->rows - r8 : 8;
            const uint32_t *w = qw + (int64_t)r8 * c->ldq + n0;
            for (int32_t i = 0; i < nc; i++) {
                uint64_t line[8];
                for (int j = 0; j < rr; j++) line[j] = spread_nibbles(w[(int64_t)j * c->ldq + i]);
                store_line(c->codes + (int64_t)(n0 + i) * c->ldc + (int64_t)r8 * 8, line, rr);
            }
        }
    } else {
        for (int32_t r16 = 0; r16 < c->rows; r16 += 16) {
            int rr = c->rows - r16 < 16 ? c->rows - r16 : 16;
            const uint32_t *w = qw + (int64_t)r16 * c->ldq + n0;
            for (int32_t i = 0; i < nc; i++) {
                uint32_t words[16];
                for (int j = 0; j < rr; j++) words[j] = w[(int64_t)j * c->ldq + i];
                uint8_t *o = c->codes + (int64_t)(n0 + i) * c->ldc + (int64_t)r16 * 4;
                if (rr == 16) {
                    uint64_t line[8];
                    memcpy(line, words, 64);
                    store_line(o, line, 8);
                } else {
                    memcpy(o, words, (size_t)rr * 4);
                }
            }
        }
    }
#if (defined(__x86_64__) || defined(__i386__)) && !defined(W4P_PACK_SCALAR)
    _mm_sfence(); /* streaming stores are visible before the item counts as done */
#endif
}

int w4p_gptq_unpack_codes(const int32_t *qweight, int64_t ldq, int32_t rows, int32_t n, int32_t bits,
                          uint8_t *codes, int64_t ldc, int threads) {
    int32_t per = bits == 4 ? 8 : 4;
    if (!qweight || !codes || rows < 1 || n < 1 || ldq < n || (bits != 4 && bits != 8) ||
        ldc < (int64_t)rows * per) {
        w4p_set_error("w4p_gptq_unpack_codes: bad arguments (rows=%d n=%d bits=%d)", rows, n, bits);
        return W4P_EINVAL;
    }
    unpack_ctx c = {qweight, ldq, rows, n, bits, codes, ldc};
    w4p_parallel_for((n + UNPACK_COLS - 1) / UNPACK_COLS, threads < 1 ? 1 : threads, unpack_block, &c);
    return W4P_OK;
}

int w4p_gptq_pack_layout_v1(const int32_t *qweight, int64_t ldq, int32_t n, int32_t k, const int32_t *perm,
                            int32_t *out, int threads) {
    if (!qweight || !out || n < 1 || k < 8 || k % 8 || ldq < n) {
        w4p_set_error("w4p_gptq_pack_layout_v1: bad arguments (n=%d k=%d ldq=%lld)", n, k, (long long)ldq);
        return W4P_EINVAL;
    }
    if (!perm_ok("w4p_gptq_pack_layout_v1", perm, k)) return W4P_EINVAL;
    pack_ctx c = {NULL, 0, n, k, (n + 15) / 16 * 16, (k + 63) / 64 * 64, perm, 4, out, 0, 0,
                  (const uint32_t *)qweight, ldq};
    if (perm)
        w4p_parallel_for((c.np / 16 + PERM_STRIPES - 1) / PERM_STRIPES, threads < 1 ? 1 : threads,
                         pack_group_perm_item, &c);
    else
        w4p_parallel_for((c.np / 16 + DIRECT_STRIPES - 1) / DIRECT_STRIPES, threads < 1 ? 1 : threads,
                         pack_group_gptq_direct, &c);
    if (c.failed) {
        w4p_set_error("w4p_gptq_pack_layout_v1: out of memory for a %d-column stripe", c.kp);
        return W4P_ENOMEM;
    }
    return W4P_OK;
}
