/*
 * One decode step of a llama-family model in one native call (batch 1, float32; see w4pack.h).
 *
 * Why: at batch 1 on a small model each projection takes tens of microseconds, and the glue around them
 * (RMSNorm, rotary embedding, attention over the cache, SiLU, residual adds) is a few dozen tiny tensor
 * operations per layer. Run from Python as torch operations, that glue costs as much as the GEMMs; here it is
 * a few loops over a few thousand floats, and the GEMMs are called directly (w4p_cpu_gemm: the same kernels,
 * ISA dispatch and thread pool as every other call).
 *
 * The arithmetic follows transformers' llama modules operation by operation (no fused multiply-adds where
 * transformers rounds a product before adding): rmsnorm = w * (h * 1/sqrt(mean(h^2) + eps)), rotary =
 * q*cos + rotate_half(q)*sin, softmax with the maximum subtracted, silu(x) = x / (1 + exp(-x)). Sums
 * (the mean of squares in double, the attention dot products in 16 float lanes) differ from torch's own
 * reductions by float rounding only.
 */
#pragma GCC optimize("fp-contract=off")
#include "w4p_cpu_internal.h"

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

/* a . b over n floats in 16 independent lanes (the compiler vectorizes them), then the lanes pairwise */
static float dot(const float *a, const float *b, int n) {
    float lane[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] += a[i + l] * b[i + l];
    for (; i < n; i++) lane[i & 15] += a[i] * b[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

static int gemm(const w4p_cpu_layer *L, const float *x, float *y, const void *bias, int bias_dtype,
                const w4p_llama_dims *D) {
    return w4p_cpu_gemm(L, x, W4P_DT_F32, 1, L->k, y, W4P_DT_F32, L->n, bias, bias_dtype, D->precision, D->isa,
                        D->threads);
}

static int check(const w4p_llama_dims *D, const w4p_llama_layer *ly, int i) {
    const int qn = D->n_heads * D->head_dim, kvn = D->n_kv * D->head_dim;
    if (!ly->qkv || !ly->o || !ly->gate_up || !ly->down || !ly->ln1 || !ly->ln2 || !ly->k_cache || !ly->v_cache) {
        w4p_set_error("layer %d: a null pointer", i);
        return W4P_EINVAL;
    }
    if (ly->qkv->k != D->hidden || ly->qkv->n != qn + 2 * kvn || ly->o->k != qn || ly->o->n != D->hidden ||
        ly->gate_up->k != D->hidden || ly->gate_up->n != 2 * D->inter || ly->down->k != D->inter ||
        ly->down->n != D->hidden) {
        w4p_set_error("layer %d: projection shapes qkv %dx%d, o %dx%d, gate_up %dx%d, down %dx%d do not match "
                      "hidden %d, heads %d/%d x %d, intermediate %d", i, ly->qkv->n, ly->qkv->k, ly->o->n,
                      ly->o->k, ly->gate_up->n, ly->gate_up->k, ly->down->n, ly->down->k, D->hidden,
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
    const size_t floats = (size_t)hid + (size_t)(qn + 2 * kvn) + (size_t)qn + (size_t)t + 2 * (size_t)inter +
                          (size_t)inter + (size_t)hid + (size_t)d;
    float *buf = malloc(sizeof(float) * floats);
    if (!buf) { w4p_set_error("out of memory"); return W4P_ENOMEM; }
    float *x = buf, *qkv = x + hid, *att = qkv + qn + 2 * kvn, *sc = att + qn, *gu = sc + t, *act = gu + 2 * inter,
          *y = act + inter, *tmp = y + hid;
    int rc = W4P_OK;
    for (int li = 0; li < n_layers && rc == W4P_OK; li++) {
        const w4p_llama_layer *L = layers + li;
        rmsnorm(h, L->ln1, L->eps1, hid, x);
        if ((rc = gemm(L->qkv, x, qkv, L->qkv_bias, L->qkv_bias_dtype, D))) break;
        float *q = qkv, *k = qkv + qn, *v = qkv + qn + kvn;
        rope(q, nh, d, cos, sin, tmp);
        rope(k, nkv, d, cos, sin, tmp);
        for (int j = 0; j < nkv; j++) {
            memcpy(L->k_cache + ((size_t)j * D->max_len + pos) * d, k + (size_t)j * d, sizeof(float) * (size_t)d);
            memcpy(L->v_cache + ((size_t)j * D->max_len + pos) * d, v + (size_t)j * d, sizeof(float) * (size_t)d);
        }
        for (int hd = 0; hd < nh; hd++) {
            const int j = hd / group;
            const float *qh = q + (size_t)hd * d;
            const float *kc = L->k_cache + (size_t)j * D->max_len * d;
            const float *vc = L->v_cache + (size_t)j * D->max_len * d;
            float mx = -INFINITY;
            for (int p = 0; p < t; p++) {
                sc[p] = dot(qh, kc + (size_t)p * d, d) * D->scaling;
                if (sc[p] > mx) mx = sc[p];
            }
            float total = 0.0f;
            for (int p = 0; p < t; p++) {
                sc[p] = expf(sc[p] - mx);
                total += sc[p];
            }
            float *out = att + (size_t)hd * d;
            for (int i = 0; i < d; i++) out[i] = 0.0f;
            for (int p = 0; p < t; p++) {
                const float w = sc[p] / total;
                const float *vr = vc + (size_t)p * d;
                for (int i = 0; i < d; i++) out[i] += w * vr[i];
            }
        }
        if ((rc = gemm(L->o, att, y, L->o_bias, L->o_bias_dtype, D))) break;
        for (int i = 0; i < hid; i++) h[i] = h[i] + y[i];
        rmsnorm(h, L->ln2, L->eps2, hid, x);
        if ((rc = gemm(L->gate_up, x, gu, L->gate_up_bias, L->gate_up_bias_dtype, D))) break;
        for (int i = 0; i < inter; i++) {
            const float g = gu[i];
            act[i] = (g / (1.0f + expf(-g))) * gu[inter + i];
        }
        if ((rc = gemm(L->down, act, y, L->down_bias, L->down_bias_dtype, D))) break;
        for (int i = 0; i < hid; i++) h[i] = h[i] + y[i];
    }
    free(buf);
    return rc;
}
