/*
 * One decode step of a llama-family model in one native call (batch 1, float32; see w4pack.h).
 *
 * Why: at batch 1 on a small model each projection takes tens of microseconds, and the glue around them
 * (RMSNorm, rotary embedding, attention over the cache, SiLU, residual adds) is a few dozen tiny tensor
 * operations per layer. Run from Python as torch operations, that glue costs as much as the GEMMs; here it is
 * a few loops over a few thousand floats, and the GEMMs are called directly (w4p_cpu_gemm: the same kernels,
 * ISA dispatch and thread pool as every other call).
 *
 * The arithmetic follows transformers' llama (and qwen3: per-head q/k norms) modules operation by operation
 * (no fused multiply-adds where transformers rounds a product before adding):
 * rmsnorm = w * (h * 1/sqrt(mean(h^2) + eps)), rotary = q*cos + rotate_half(q)*sin, softmax with the maximum
 * subtracted, silu(x) = x / (1 + exp(-x)). Sums (the mean of squares in double, the attention dot products in
 * 16 float lanes) differ from torch's own reductions by float rounding only.
 */
#pragma GCC optimize("fp-contract=off")
#include "w4p_cpu_internal.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void rmsnorm(const float *h, const float *w, float eps, int n, float *out) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)h[i] * (double)h[i];
    float var = (float)(ss / n);
    float r = 1.0f / sqrtf(var + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (h[i] * r);
}

/* x[heads][d] in place: x*cos + rotate_half(x)*sin, rotate_half(x) = [-x[half:], x[:half]] */
static void rope(float *x, int heads, int d, const float *cos, const float *sin, float *tmp) {
    const int half = d / 2;
    for (int hd = 0; hd < heads; hd++) {
        float *v = x + (size_t)hd * d;
        for (int i = 0; i < d; i++) {
            float rot = i < half ? -v[i + half] : v[i - half];
            float a = v[i] * cos[i];
            float b = rot * sin[i];
            tmp[i] = a + b;
        }
        memcpy(v, tmp, sizeof(float) * (size_t)d);
    }
}

/* Vector clones of the loops (the same arithmetic in every clone: the lanes are explicit, no reassociation) */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define W4P_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define W4P_CLONES
#endif

/* a . b over n floats in 16 independent lanes (the compiler vectorizes them), then the lanes pairwise */
static inline float dot(const float *a, const float *b, int n) {
    float lane[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] += a[i + l] * b[i + l];
    for (; i < n; i++) lane[i & 15] += a[i] * b[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* out = silu(g) * u, silu(x) = x / (1 + exp(-x)) */
static void silu_mul(const float *g, const float *u, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

/* The query heads q[g][d] (g < group) that share one KV head, over positions 0..t-1 of its cache:
 * out[g] = softmax(q[g] . K * scaling) . V. sc: scratch of group * t floats. Each K and V row is read once
 * for the whole group. */
W4P_CLONES
static void attend(const float *q, int group, const float *kc, const float *vc, int t, int d, float scaling,
                   float *sc, float *out) {
    for (int p = 0; p < t; p++) {
        const float *kr = kc + (size_t)p * d;
        for (int g = 0; g < group; g++) sc[(size_t)g * t + p] = dot(q + (size_t)g * d, kr, d) * scaling;
    }
    for (int g = 0; g < group; g++) {
        float *s = sc + (size_t)g * t;
        float mx = -INFINITY, total = 0.0f;
        for (int p = 0; p < t; p++) mx = s[p] > mx ? s[p] : mx;
        for (int p = 0; p < t; p++) {
            s[p] = expf(s[p] - mx);
            total += s[p];
        }
        for (int p = 0; p < t; p++) s[p] = s[p] / total;
        for (int i = 0; i < d; i++) out[(size_t)g * d + i] = 0.0f;
    }
    for (int p = 0; p < t; p++) {
        const float *vr = vc + (size_t)p * d;
        for (int g = 0; g < group; g++) {
            const float w = sc[(size_t)g * t + p];
            float *o = out + (size_t)g * d;
            for (int i = 0; i < d; i++) o[i] += w * vr[i];
        }
    }
}

#define W4P_PARTS 3

/* rows and input width of a projection made of up to W4P_PARTS layers (0 rows when malformed) */
static int proj_shape(const w4p_cpu_layer *const *parts, int *k) {
    int n = 0;
    *k = parts[0] ? parts[0]->k : -1;
    for (int j = 0; j < W4P_PARTS && parts[j]; j++) {
        if (parts[j]->k != *k) return 0;
        n += parts[j]->n;
    }
    return n;
}

static int gemm(const w4p_cpu_layer *const *parts, const void *const *bias, const int *bias_dtype, const float *x,
                float *y, const w4p_llama_dims *D) {
    int col = 0;
    for (int j = 0; j < W4P_PARTS && parts[j]; j++) {
        const w4p_cpu_layer *L = parts[j];
        int rc = w4p_cpu_gemm(L, x, W4P_DT_F32, 1, L->k, y + col, W4P_DT_F32, L->n, bias[j], bias_dtype[j],
                              D->precision, D->isa, D->threads);
        if (rc) return rc;
        col += L->n;
    }
    return W4P_OK;
}

static int check(const w4p_llama_dims *D, const w4p_llama_layer *ly, int i) {
    const int qn = D->n_heads * D->head_dim, kvn = D->n_kv * D->head_dim;
    if (!ly->ln1 || !ly->ln2 || !ly->k_cache || !ly->v_cache) {
        w4p_set_error("layer %d: a null pointer", i);
        return W4P_EINVAL;
    }
    int kq, ko, kg, kd;
    const int nq = proj_shape(ly->qkv, &kq), no = proj_shape(ly->o, &ko), ng = proj_shape(ly->gate_up, &kg),
              nd = proj_shape(ly->down, &kd);
    if (kq != D->hidden || nq != qn + 2 * kvn || ko != qn || no != D->hidden || kg != D->hidden ||
        ng != 2 * D->inter || kd != D->inter || nd != D->hidden) {
        w4p_set_error("layer %d: projection shapes qkv %dx%d, o %dx%d, gate_up %dx%d, down %dx%d do not match "
                      "hidden %d, heads %d/%d x %d, intermediate %d", i, nq, kq, no, ko, ng, kg, nd, kd, D->hidden,
                      D->n_heads, D->n_kv, D->head_dim, D->inter);
        return W4P_EINVAL;
    }
    return W4P_OK;
}

int w4p_llama_decode(const w4p_llama_dims *D, const w4p_llama_layer *layers, int n_layers, float *h,
                     int pos, const float *cos, const float *sin) {
    if (!D || !layers || !h || !cos || !sin) { w4p_set_error("null argument"); return W4P_EINVAL; }
    if (D->hidden < 1 || D->n_heads < 1 || D->n_kv < 1 || D->n_heads % D->n_kv || D->head_dim < 2 ||
        D->head_dim % 2 || D->inter < 1 || D->max_len < 1 || n_layers < 0) {
        w4p_set_error("bad dimensions: hidden %d, heads %d, kv heads %d, head_dim %d, intermediate %d, "
                      "max_len %d, layers %d", D->hidden, D->n_heads, D->n_kv, D->head_dim, D->inter,
                      D->max_len, n_layers);
        return W4P_EINVAL;
    }
    /* the widths below are ints (and the C API takes any int): a product past INT_MAX would wrap, pass the
       shape check against a layer of the wrapped width and then index q/k/v far past their buffers */
    if ((int64_t)(D->n_heads + 2 * (int64_t)D->n_kv) * D->head_dim > INT_MAX || 2 * (int64_t)D->inter > INT_MAX) {
        w4p_set_error("dimensions too large: %d heads + 2 x %d kv heads of %d, intermediate %d", D->n_heads,
                      D->n_kv, D->head_dim, D->inter);
        return W4P_EINVAL;
    }
    if (pos < 0 || pos >= D->max_len) {
        w4p_set_error("position %d is outside the cache (%d positions)", pos, D->max_len);
        return W4P_EINVAL;
    }
    if (D->threads < 1) { w4p_set_error("threads must be >= 1, got %d", D->threads); return W4P_EINVAL; }
    for (int i = 0; i < n_layers; i++) {
        int rc = check(D, layers + i, i);
        if (rc) return rc;
    }
    const int hid = D->hidden, d = D->head_dim, nh = D->n_heads, nkv = D->n_kv, inter = D->inter;
    const int qn = nh * d, kvn = nkv * d, group = nh / nkv, t = pos + 1;
    const size_t floats = (size_t)hid + (size_t)(qn + 2 * kvn) + (size_t)qn + (size_t)group * t + 2 * (size_t)inter +
                          (size_t)inter + (size_t)hid + (size_t)d;
    float *buf = malloc(sizeof(float) * floats);
    if (!buf) { w4p_set_error("out of memory"); return W4P_ENOMEM; }
    float *x = buf, *qkv = x + hid, *att = qkv + qn + 2 * kvn, *sc = att + qn, *gu = sc + (size_t)group * t, *act = gu + 2 * inter,
          *y = act + inter, *tmp = y + hid;
    int rc = W4P_OK;
    for (int li = 0; li < n_layers && rc == W4P_OK; li++) {
        const w4p_llama_layer *L = layers + li;
        rmsnorm(h, L->ln1, L->eps1, hid, x);
        if ((rc = gemm(L->qkv, L->qkv_bias, L->qkv_bias_dtype, x, qkv, D))) break;
        float *q = qkv, *k = qkv + qn, *v = qkv + qn + kvn;
        if (L->q_norm) /* rmsnorm reads every value before it writes it: in place is safe */
            for (int j = 0; j < nh; j++) rmsnorm(q + (size_t)j * d, L->q_norm, L->q_eps, d, q + (size_t)j * d);
        if (L->k_norm)
            for (int j = 0; j < nkv; j++) rmsnorm(k + (size_t)j * d, L->k_norm, L->k_eps, d, k + (size_t)j * d);
        rope(q, nh, d, cos, sin, tmp);
        rope(k, nkv, d, cos, sin, tmp);
        for (int j = 0; j < nkv; j++) {
            memcpy(L->k_cache + ((size_t)j * D->max_len + pos) * d, k + (size_t)j * d, sizeof(float) * (size_t)d);
            memcpy(L->v_cache + ((size_t)j * D->max_len + pos) * d, v + (size_t)j * d, sizeof(float) * (size_t)d);
        }
        for (int j = 0; j < nkv; j++)
            attend(q + (size_t)j * group * d, group, L->k_cache + (size_t)j * D->max_len * d,
                   L->v_cache + (size_t)j * D->max_len * d, t, d, D->scaling, sc, att + (size_t)j * group * d);
        if ((rc = gemm(L->o, L->o_bias, L->o_bias_dtype, att, y, D))) break;
        for (int i = 0; i < hid; i++) h[i] = h[i] + y[i];
        rmsnorm(h, L->ln2, L->eps2, hid, x);
        if ((rc = gemm(L->gate_up, L->gate_up_bias, L->gate_up_bias_dtype, x, gu, D))) break;
        silu_mul(gu, gu + inter, inter, act);
        if ((rc = gemm(L->down, L->down_bias, L->down_bias_dtype, act, y, D))) break;
        for (int i = 0; i < hid; i++) h[i] = h[i] + y[i];
    }
    if (rc == W4P_OK && D->final_norm) {
        rmsnorm(h, D->final_norm, D->final_eps, hid, x);
        memcpy(h, x, sizeof(float) * (size_t)hid);
    }
    free(buf);
    return rc;
}
