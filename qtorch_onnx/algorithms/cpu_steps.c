/* qtorch-onnx: fast finetune's written-out AdaRound and AdaQuant steps as fused CPU loops, and the loops of its
 * layer losses (reconstruction.py: QuadraticLayerLoss's depthwise Gram matrices and small layers' gradient,
 * DirectLayerLoss's residual pass and depthwise convolutions).
 *
 * The same functions as qtorch_onnx/algorithms/adaround.py (AdaRoundStep) and adaquant.py (AdaQuantStep), one
 * pass over the weight instead of about twenty torch operations (each a pass over the weight and a dispatch).
 * Built on first use by qtorch_onnx/algorithms/cpu_steps.py (cc -O3 -march=native -fno-math-errno
 * -fno-trapping-math), loaded with ctypes; no torch headers, no ONNX Runtime.
 *
 * Layout: float32, contiguous. A weight of n elements is `rows` rows of `inner` elements; row r uses the
 * quantization parameters of channel (r % channels) (per tensor: channels = 1). The step functions take a row
 * range [r0, r1) (the others a range of planes, samples or channels) so that the caller can split the work between
 * threads.
 *
 * AdaRound (Nagel et al. 2020, arXiv 2004.10568, eqs. 22-24; zeta = 1.1, gamma = -0.1):
 *   s = sigmoid(alpha);  hr = s (zeta - gamma) + gamma;  h = clamp(hr, 0, 1)
 *   wq = (clamp(floor + h + zp, qmin, qmax) - zp) * scale
 *   dL/dalpha = (dL/dwq scale [qmin <= floor + h + zp <= qmax]
 *                - 2 beta reg |2h - 1|^(beta - 1) sign(2h - 1)) (zeta - gamma) s (1 - s) [0 <= hr <= 1]
 * sigmoid, exp2 and log2 are our own polynomial approximations (relative error about 2e-7 for the sigmoid,
 * 2e-6 for |d|^p), so the values differ from torch's in the last bits: the step is an optimisation, and
 * export writes the hard rounding (alpha >= 0), which the quantizer computes, not this file.
 *
 * With Adam's moments the gradient functions also take Adam's step on the trained tensor in place (one pass over
 * the parameter, its gradient and moments instead of two; torch.optim.Adam's arithmetic, not its bits).
 *
 * AdaQuant (Hubara et al. 2021, arXiv 2006.10518), integer weight with the straight-through estimator:
 *   v = round_half_even(w / scale) + zp;  wq = (nan_to_num(clamp(v, qmin, qmax), qmin) - zp) * scale
 *   outside = 1 where v lies outside [qmin, qmax] (saturated), else 0 (NaN included, as the torch step)
 * bit for bit the quantizer's fused path (formats/integer.py, docs/numerics.md section 1): IEEE division,
 * rint in the default round-to-nearest-even mode, and no multiply followed by an add that the compiler could
 * contract into one rounding (GCC contracts by default: keep it so when editing these loops).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define ZETA 1.1f
#define GAMMA (-0.1f)

typedef union { uint32_t u; float f; } bits32;

/* x clamped to [lo, hi]; NaN gives lo (the comparison is false), as nan_to_num(clamp(x), lo) does */
static inline float clampf(float x, float lo, float hi) {
    x = x > lo ? x : lo;
    return x < hi ? x : hi;
}

/* 2^y for y in [-126, 126] (clamped): 2^k by the exponent bits for the nearest integer k, the degree-6 Taylor
 * polynomial of 2^f = e^(f ln 2) for the rest f in [-1/2, 1/2] (truncation error below 2e-7 relative) */
static inline float exp2_approx(float y) {
    y = clampf(y, -126.0f, 126.0f);
    float k = rintf(y);
    float f = y - k;
    /* Estrin's scheme (pairs, then powers of f): three multiply-add steps deep instead of Horner's six */
    float f2 = f * f, f4 = f2 * f2;
    float p01 = 1.0f + 6.9314718e-1f * f, p23 = 2.4022651e-1f + 5.5504109e-2f * f;
    float p45 = 9.6181291e-3f + 1.3333558e-3f * f;
    float p = p01 + f2 * p23 + f4 * (p45 + f2 * 1.5403530e-4f);
    bits32 b;
    b.u = (uint32_t)((int32_t)k + 127) << 23;
    return p * b.f;
}

/* log2(x) for a positive normal x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log2(m) = t p(t) with t = m - 1 and p
 * the degree-7 polynomial fitted to log2(1 + t) / t by least squares at 4000 Chebyshev nodes of
 * [sqrt(1/2) - 1, sqrt(2) - 1] (absolute error about 1e-7 in float32); no division */
static inline float log2_approx(float x) {
    bits32 b;
    b.f = x;
    int32_t e = (int32_t)(b.u >> 23) - 127;
    b.u = (b.u & 0x7fffffu) | 0x3f800000u; /* m in [1, 2) */
    float m = b.f;
    int big = m > 1.41421356f;
    m = big ? m * 0.5f : m;
    e += big;
    float t = m - 1.0f;
    /* Estrin's scheme: pairs, then powers of t (three multiply-add steps deep instead of Horner's eight) */
    float t2 = t * t, t4 = t2 * t2;
    float p01 = 1.442694821e+00f - 7.213575746e-01f * t, p23 = 4.809323190e-01f - 3.600646634e-01f * t;
    float p45 = 2.868851178e-01f - 2.504973469e-01f * t, p67 = 2.357155397e-01f - 1.430238252e-01f * t;
    float p = (p01 + t2 * p23) + t4 * (p45 + t2 * p67);
    return (float)e + t * p;
}

static inline float sigmoid_approx(float a) { return 1.0f / (1.0f + exp2_approx(-1.44269504089f * a)); }

/* ------------------------------------------------------------------------------------------------ AdaRound */
/* the soft-quantized weight of n elements; with keep, each element's sigmoid kept in sig too (the next gradient
 * pass reads it instead of computing it again: the same bits). keep is a constant in each caller below, so each gets
 * its own vector loop. */
static inline __attribute__((always_inline)) void adaround_values_body(int64_t n, const float *restrict alpha,
                                                                       const float *restrict fl, float scale,
                                                                       float zp, float lo, float hi,
                                                                       float *restrict out, float *restrict sig,
                                                                       const int keep) {
    for (int64_t i = 0; i < n; i++) {
        float s = sigmoid_approx(alpha[i]);
        if (keep)
            sig[i] = s;
        float h = clampf(s * (ZETA - GAMMA) + GAMMA, 0.0f, 1.0f);
        float v = clampf(fl[i] + h + zp, lo, hi);
        out[i] = (v - zp) * scale;
    }
}

__attribute__((noinline)) static void adaround_values_row(int64_t n, const float *alpha, const float *fl, float scale,
                                                         float zp, float lo, float hi, float *out) {
    adaround_values_body(n, alpha, fl, scale, zp, lo, hi, out, NULL, 0);
}

__attribute__((noinline)) static void adaround_values_row_sig(int64_t n, const float *alpha, const float *fl,
                                                             float scale, float zp, float lo, float hi, float *out,
                                                             float *sig) {
    adaround_values_body(n, alpha, fl, scale, zp, lo, hi, out, sig, 1);
}

/* the end of the row segment that starts at element q: the end of q's row, or limit if that comes first */
static inline int64_t segment_end(int64_t q, int64_t inner, int64_t limit) {
    int64_t end = (q / inner + 1) * inner;
    return end < limit ? end : limit;
}

/* the soft-quantized weight of elements [e0, e1), row segment by row segment (each its channel's parameters) */
static void adaround_values_range(int64_t e0, int64_t e1, int64_t channels, int64_t inner, const float *alpha,
                                  const float *fl, const float *scale, const float *zp, float lo, float hi,
                                  float *out, float *sig) {
    for (int64_t q = e0; q < e1;) {
        int64_t end = segment_end(q, inner, e1), c = (q / inner) % channels;
        if (sig != NULL)
            adaround_values_row_sig(end - q, alpha + q, fl + q, scale[c], zp ? zp[c] : 0.0f, lo, hi, out + q,
                                    sig + q);
        else
            adaround_values_row(end - q, alpha + q, fl + q, scale[c], zp ? zp[c] : 0.0f, lo, hi, out + q);
        q = end;
    }
}

void qt_adaround_values(int64_t r0, int64_t r1, int64_t channels, int64_t inner, const float *alpha,
                        const float *fl, const float *scale, const float *zp, float lo, float hi, float *out) {
    adaround_values_range(r0 * inner, r1 * inner, channels, inner, alpha, fl, scale, zp, lo, hi, out, NULL);
}

/* Adam's update of one element (Kingma and Ba 2015, Algorithm 1, with torch.optim.Adam's arithmetic: the first
 * moment by lerp, the bias corrections folded into step = lr / (1 - b1^t) and inv_c2 = 1 / sqrt(1 - b2^t)) */
typedef struct {
    float *m, *v;      /* the moments, laid out like the parameter */
    float b1, b2, eps; /* betas, epsilon */
    float step, inv_c2;
} adam_t;

static inline float adam_update(float p, float g, float *m, float *v, float b1, float b2, float eps, float step,
                                float inv_c2) {
    float mm = *m + (g - *m) * (1.0f - b1);
    float vv = *v * b2 + (1.0f - b2) * g * g;
    *m = mm;
    *v = vv;
    return p - step * mm / (sqrtf(vv) * inv_c2 + eps);
}

/* The gradient in chunks of ACH elements, in passes that each keep few values live (one loop computing the sigmoid,
 * the power and Adam's step spills registers: 1.13 -> 0.72 ms on 655k weights with the regulariser, AVX-512):
 *   A: per row segment, from alpha: t1 = dL/dwq scale (zeta - gamma) [inside], ds = s (1 - s) [0 <= hr <= 1],
 *      d = 2h - 1
 *   B: g = (t1 + coef |d|^p sign(d)) ds with the regulariser (coef = -2 beta reg (zeta - gamma), p = beta - 1),
 *      else t1 ds
 *   C: Adam's step on alpha (with the moments), then, with `next`, the soft-quantized weight of the new alpha
 *      (adaround_values_row: the same bits as the values call), else g into out */
#define ACH 256

/* pass A from alpha, or with use_sig from the sigmoids of alpha kept by the last values pass (adaround_values_row_sig),
 * read instead of computed; use_sig is a constant in each caller below, so each gets its own vector loop */
static inline __attribute__((always_inline)) void adaround_pass_a_body(
    int64_t n, const float *restrict alpha, const float *restrict sig, const float *restrict fl, float scale_dh,
    float zp, float lo, float hi, const float *restrict gwq, float *restrict t1, float *restrict ds,
    float *restrict dd, const int use_sig) {
    for (int64_t i = 0; i < n; i++) {
        float s = use_sig ? sig[i] : sigmoid_approx(alpha[i]);
        float hr = s * (ZETA - GAMMA) + GAMMA;
        float h = clampf(hr, 0.0f, 1.0f);
        float x = fl[i] + h + zp;
        float inside = (float)((x >= lo) & (x <= hi));
        float rect = (float)(hr == h);
        t1[i] = gwq[i] * scale_dh * inside;
        ds[i] = s * (1.0f - s) * rect;
        dd[i] = 2.0f * h - 1.0f;
    }
}

__attribute__((noinline)) static void adaround_pass_a(int64_t n, const float *alpha, const float *fl, float scale_dh,
                                                     float zp, float lo, float hi, const float *gwq, float *t1,
                                                     float *ds, float *dd) {
    adaround_pass_a_body(n, alpha, NULL, fl, scale_dh, zp, lo, hi, gwq, t1, ds, dd, 0);
}

__attribute__((noinline)) static void adaround_pass_a_sig(int64_t n, const float *sig, const float *fl,
                                                         float scale_dh, float zp, float lo, float hi,
                                                         const float *gwq, float *t1, float *ds, float *dd) {
    adaround_pass_a_body(n, NULL, sig, fl, scale_dh, zp, lo, hi, gwq, t1, ds, dd, 1);
}

__attribute__((noinline)) static void adaround_pass_b_reg(int64_t n, const float *restrict t1, const float *restrict ds,
                                                         const float *restrict dd, float p, float coef,
                                                         float *restrict g) {
    for (int64_t i = 0; i < n; i++) {
        float d = dd[i];
        float ad = fabsf(d);
        ad = ad > 1e-30f ? ad : 1e-30f; /* |d| = 0 gives 2^(p log2(1e-30)) = 0 for p >= 1 */
        float pw = exp2_approx(p * log2_approx(ad));
        g[i] = (t1[i] + coef * copysignf(pw, d)) * ds[i];
    }
}

__attribute__((noinline)) static void adaround_pass_b(int64_t n, const float *restrict t1, const float *restrict ds,
                                                     float *restrict g) {
    for (int64_t i = 0; i < n; i++)
        g[i] = t1[i] * ds[i];
}

__attribute__((noinline)) static void adam_pass(int64_t n, float *restrict p, const float *restrict g,
                                               float *restrict m, float *restrict v, float b1, float b2, float eps,
                                               float step, float inv_c2) {
    for (int64_t i = 0; i < n; i++)
        p[i] = adam_update(p[i], g[i], m + i, v + i, b1, b2, eps, step, inv_c2);
}

/* dL/dalpha (plus reg times the regulariser's gradient at beta when reg != 0) into out; or, with the moments m / v
 * (not NULL), Adam's step on alpha in place (lr_c1 = lr / (1 - b1^t), inv_c2 = 1 / sqrt(1 - b2^t)), the gradient
 * never stored, and with next (not NULL) the new alpha's soft-quantized weight into next. sig (not NULL, alpha's
 * size): with sig_valid, the sigmoids of the current alpha (kept by the last call's values pass), read instead of
 * computed; with next, the new alpha's sigmoids are written there. The same bits either way. */
void qt_adaround_grad(int64_t r0, int64_t r1, int64_t channels, int64_t inner, float *alpha, const float *fl,
                      const float *scale, const float *zp, float lo, float hi, const float *gwq, float beta,
                      float reg, float *out, float *m, float *v, float b1, float b2, float eps, float lr_c1,
                      float inv_c2, float *next, float *sig, int64_t sig_valid) {
    float t1[ACH] __attribute__((aligned(64))), ds[ACH] __attribute__((aligned(64)));
    float dd[ACH] __attribute__((aligned(64))), g[ACH] __attribute__((aligned(64)));
    float p = beta - 1.0f, coef = -2.0f * beta * reg * (ZETA - GAMMA);
    int64_t e1 = r1 * inner;
    for (int64_t c0 = r0 * inner; c0 < e1; c0 += ACH) {
        int64_t len = e1 - c0 < ACH ? e1 - c0 : ACH;
        for (int64_t q = c0; q < c0 + len;) { /* pass A by row segments: each row its channel's parameters */
            int64_t end = segment_end(q, inner, c0 + len), c = (q / inner) % channels;
            if (sig != NULL && sig_valid)
                adaround_pass_a_sig(end - q, sig + q, fl + q, scale[c] * (ZETA - GAMMA), zp ? zp[c] : 0.0f, lo, hi,
                                    gwq + q, t1 + (q - c0), ds + (q - c0), dd + (q - c0));
            else
                adaround_pass_a(end - q, alpha + q, fl + q, scale[c] * (ZETA - GAMMA), zp ? zp[c] : 0.0f, lo, hi,
                                gwq + q, t1 + (q - c0), ds + (q - c0), dd + (q - c0));
            q = end;
        }
        float *gg = m != NULL ? g : out + c0;
        if (reg != 0.0f)
            adaround_pass_b_reg(len, t1, ds, dd, p, coef, gg);
        else
            adaround_pass_b(len, t1, ds, gg);
        if (m == NULL)
            continue;
        adam_pass(len, alpha + c0, g, m + c0, v + c0, b1, b2, eps, lr_c1, inv_c2);
        if (next != NULL) /* (sig: this chunk's sigmoids were read above; the new alpha's replace them) */
            adaround_values_range(c0, c0 + len, channels, inner, alpha, fl, scale, zp, lo, hi, next, sig);
    }
}

/* ------------------------------------------------------------------------------------------------ AdaQuant */
__attribute__((noinline)) static void adaquant_values_row(int64_t n, const float *restrict w, float scale, float zp,
                                                         float lo, float hi, float *restrict out,
                                                         float *restrict outside) {
    for (int64_t i = 0; i < n; i++) {
        float v = rintf(w[i] / scale) + zp;
        float c = clampf(v, lo, hi);
        outside[i] = (float)((v < lo) | (v > hi)); /* NaN: 0, as torch.sign(NaN) gives in the torch step */
        out[i] = (c - zp) * scale;
    }
}

/* adaquant_values_row without the mask (the fused step recomputes it: adaquant_adam_seg) */
__attribute__((noinline)) static void adaquant_values_row_nomask(int64_t n, const float *restrict w, float scale,
                                                                float zp, float lo, float hi, float *restrict out) {
    for (int64_t i = 0; i < n; i++) {
        float v = rintf(w[i] / scale) + zp;
        out[i] = (clampf(v, lo, hi) - zp) * scale;
    }
}

/* the integer weight and saturation mask (outside NULL: not written) of elements [e0, e1), row segment by row
 * segment */
static void adaquant_values_range(int64_t e0, int64_t e1, int64_t channels, int64_t inner, const float *w,
                                  const float *scale, const float *zp, float lo, float hi, float *out,
                                  float *outside) {
    for (int64_t q = e0; q < e1;) {
        int64_t end = segment_end(q, inner, e1), c = (q / inner) % channels;
        if (outside != NULL)
            adaquant_values_row(end - q, w + q, scale[c], zp ? zp[c] : 0.0f, lo, hi, out + q, outside + q);
        else
            adaquant_values_row_nomask(end - q, w + q, scale[c], zp ? zp[c] : 0.0f, lo, hi, out + q);
        q = end;
    }
}

/* AdaQuant's straight-through gradient dL/dw = dL/dwq (1 - outside) and Adam's step on w in place */
__attribute__((noinline)) static void adaquant_adam_row(int64_t n, float *restrict w, const float *restrict gwq,
                                                       const float *restrict outside, float *restrict m,
                                                       float *restrict v, float b1, float b2, float eps, float step,
                                                       float inv_c2) {
    for (int64_t i = 0; i < n; i++)
        w[i] = adam_update(w[i], gwq[i] - gwq[i] * outside[i], m + i, v + i, b1, b2, eps, step, inv_c2);
}

/* adaquant_adam_row with the saturation mask of the weight before the step recomputed from it (the values call's
 * arithmetic: the same mask, so the same bits) instead of read from memory */
__attribute__((noinline)) static void adaquant_adam_seg(int64_t n, float *restrict w, const float *restrict gwq,
                                                       float *restrict m, float *restrict v, float b1, float b2,
                                                       float eps, float step, float inv_c2, float scale, float zp,
                                                       float lo, float hi) {
    for (int64_t i = 0; i < n; i++) {
        float q = rintf(w[i] / scale) + zp;
        float outside = (float)((q < lo) | (q > hi));
        w[i] = adam_update(w[i], gwq[i] - gwq[i] * outside, m + i, v + i, b1, b2, eps, step, inv_c2);
    }
}

/* ... over rows [r0, r1); with next (not NULL), in chunks of ACH elements, each followed by the new weight's values
 * (adaquant_values_row, per row segment: the values call's bits) while the chunk is in cache, and its mask into
 * next_outside when that is not NULL. With w0 (not NULL; next too): qt_kept_diff(next, w0, cap, at, d) in the same
 * pass, chunk by chunk (the same entries in the same order), its count into *count (one call over all rows: the log
 * is one sequence). outside NULL: the mask of the weight before the step is recomputed from it
 * (adaquant_adam_seg, row segment by row segment; the caller passes next_outside NULL then: nobody reads it) */
static int64_t kept_diff_range(int64_t q, int64_t m, const float *w, const float *w0, int64_t cap, int64_t *at,
                               float *d, int64_t k);
static void kept_diff_commit(int64_t k, int64_t cap, const int64_t *at, const float *w, float *w0);

void qt_adaquant_adam(int64_t r0, int64_t r1, int64_t channels, int64_t inner, float *w, const float *gwq,
                      const float *outside, float *m, float *v, float b1, float b2, float eps, float lr_c1,
                      float inv_c2, const float *scale, const float *zp, float lo, float hi, float *next,
                      float *next_outside, float *w0, int64_t cap, int64_t *at, float *d, int64_t *count) {
    int64_t e0 = r0 * inner, e1 = r1 * inner, k = 0;
    if (next == NULL && outside != NULL) {
        adaquant_adam_row(e1 - e0, w + e0, gwq + e0, outside + e0, m + e0, v + e0, b1, b2, eps, lr_c1, inv_c2);
        return;
    }
    for (int64_t c0 = e0; c0 < e1; c0 += ACH) {
        int64_t len = e1 - c0 < ACH ? e1 - c0 : ACH;
        if (outside != NULL)
            adaquant_adam_row(len, w + c0, gwq + c0, outside + c0, m + c0, v + c0, b1, b2, eps, lr_c1, inv_c2);
        else
            for (int64_t q = c0; q < c0 + len;) {
                int64_t end = segment_end(q, inner, c0 + len), c = (q / inner) % channels;
                adaquant_adam_seg(end - q, w + q, gwq + q, m + q, v + q, b1, b2, eps, lr_c1, inv_c2, scale[c],
                                  zp ? zp[c] : 0.0f, lo, hi);
                q = end;
            }
        if (next != NULL)
            adaquant_values_range(c0, c0 + len, channels, inner, w, scale, zp, lo, hi, next, next_outside);
        if (w0 != NULL) /* the chunk's next values against w0 while they are in cache: qt_kept_diff's scan */
            k = kept_diff_range(c0, c0 + len, next, w0, cap, at, d, k);
    }
    if (w0 != NULL) {
        kept_diff_commit(k, cap, at, next, w0);
        *count = k;
    }
}

/* qt_adaquant_adam with the weight gradient given as a sum of nb outer products, dL/dwq[r, i] = sum_b gy[b gs + r]
 * x[b inner + i] (a Linear layer's mini-batch: rows r of the [out, in] weight, inner = in), computed chunk by chunk
 * as fmaf(gy[b], x[b], ...) in b order from gy[0] x[0] (the rank-nb product's sums: MKL's for nb = 2 on the
 * reference CPU) instead of read from memory; the saturation mask recomputed from the weight (adaquant_adam_seg);
 * with next (not NULL) the updated weight's values (and mask into next_outside when not NULL) per chunk */
void qt_adaquant_adam_outer(int64_t r0, int64_t r1, int64_t channels, int64_t inner, float *w, const float *gy,
                            int64_t gs, const float *x, int64_t nb, float *m, float *v, float b1, float b2, float eps,
                            float lr_c1, float inv_c2, const float *scale, const float *zp, float lo, float hi,
                            float *next, float *next_outside) {
    float g[ACH];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t c = r % channels;
        const float s = scale[c], z = zp ? zp[c] : 0.0f;
        for (int64_t c0 = 0; c0 < inner; c0 += ACH) {
            const int64_t len = inner - c0 < ACH ? inner - c0 : ACH, e = r * inner + c0;
            const float g0 = gy[r];
            for (int64_t i = 0; i < len; i++)
                g[i] = g0 * x[c0 + i];
            for (int64_t b = 1; b < nb; b++) {
                const float gb = gy[b * gs + r];
                const float *xb = x + b * inner + c0;
                for (int64_t i = 0; i < len; i++)
                    g[i] = fmaf(gb, xb[i], g[i]);
            }
            adaquant_adam_seg(len, w + e, g, m + e, v + e, b1, b2, eps, lr_c1, inv_c2, s, z, lo, hi);
            if (next != NULL)
                adaquant_values_range(e, e + len, channels, inner, w, scale, zp, lo, hi, next, next_outside);
        }
    }
}

void qt_adaquant_values(int64_t r0, int64_t r1, int64_t channels, int64_t inner, const float *w, const float *scale,
                        const float *zp, float lo, float hi, float *out, float *outside) {
    adaquant_values_range(r0 * inner, r1 * inner, channels, inner, w, scale, zp, lo, hi, out, outside);
}

/* ------------------------------------------------------------------------- depthwise Gram matrices */
/* sum_q u[q] v[q] over n floats, in float64 */
__attribute__((noinline)) static double dot(int64_t n, const float *restrict u, const float *restrict v) {
    double acc[8] = {0.0}; /* independent lane sums: vector registers without reassociation */
    int64_t q = 0;
    for (; q + 8 <= n; q += 8)
        for (int t = 0; t < 8; t++)
            acc[t] += (double)u[q + t] * (double)v[q + t];
    double total = 0.0;
    for (int t = 0; t < 8; t++)
        total += acc[t];
    for (; q < n; q++)
        total += (double)u[q] * (double)v[q];
    return total;
}

/* sum_q u[q stride] v[q] over n floats, in float64 */
__attribute__((noinline)) static double strided_dot(int64_t n, const float *restrict u, int64_t stride,
                                                    const float *restrict v) {
    double total = 0.0;
    for (int64_t q = 0; q < n; q++)
        total += (double)u[q * stride] * (double)v[q];
    return total;
}

/* pre[c + sw] = col[c] + col[c - sw] + ... (the prefix sums along each stride-sw lattice of columns; pre[0, sw) = 0),
 * so that sum_{q < n} col[b + sw q] = pre[b + sw n] - pre[b]; a running sum in a register per lattice */
static void lattice_prefix(double *restrict pre, const double *restrict col, int64_t wp, int64_t sw) {
    for (int64_t c0 = 0; c0 < sw; c0++) {
        double run = 0.0;
        pre[c0] = 0.0;
        for (int64_t c = c0; c < wp; c += sw) {
            run += col[c];
            pre[c + sw] = run;
        }
    }
}

/* col[c] += sign * u[c] v[c] for c in [c0, c1), in float64 */
__attribute__((noinline)) static void col_madd(double *restrict col, const float *restrict u, const float *restrict v,
                                               int64_t c0, int64_t c1, double sign) {
    for (int64_t c = c0; c < c1; c++)
        col[c] += sign * ((double)u[c] * (double)v[c]);
}

/* The per-sample Gram matrices of a dilation-1 depthwise convolution (QuadraticLayerLoss,
 * algorithms/reconstruction.py) from its zero-padded input planes, without im2col. A plane is one sample and one
 * input channel (hp x wp floats); the kernel is kh x kw (k = kh kw weights, offset i = (a, b) = (i / kw, i % kw)),
 * the stride sh x sw, the output ho x wo, m outputs per input channel. Output position (y, x) reads the plane at
 * (sh y + a, sw x + b). For planes p in [p0, p1):
 *   h[p, i, j] = sum_pos x(pos + o_i) x(pos + o_j)      (k x k)
 *   g[p, o, i] = sum_pos r[p, o, pos] x(pos + o_i)      (m x k; r: [P, m, ho wo], skipped when NULL)
 *   s[p, i]    = sum_pos x(pos + o_i)                   (k; skipped when NULL)
 * the sums im2col's columns X (k x ho wo) give as h = X X^T, g = R X^T, s = X 1.
 * h[i, j] depends on the offset difference d = o_j - o_i and the window start o_i = (a, b): it is the sum of the
 * product plane x(q) x(q + d) over the strided ho x wo window at (a, b). For each of the (2 kh - 1)(2 kw - 1) / 2
 * + 1 differences (the others by symmetry): the product plane's column sums over the window's rows, V_a[c] =
 * sum_{y < ho} x(a + sh y, c) x(a + sh y + dy, c + dx) (vectorized along the rows; the window at a + sh adds one
 * row to the one at a and drops one), then one prefix sum of V_a along each stride-sw lattice of columns gives
 * every window's sum as a difference: about kh kw hp wp / (2 sh) multiply-adds per plane instead of k^2 ho wo, in
 * float64. `table`: the caller's scratch of sh (wp + 1) + wp + sw doubles, `spread`: of hp wp floats. */
void qt_depthwise_gram(int64_t p0, int64_t p1, int64_t hp, int64_t wp, int64_t kh, int64_t kw, int64_t sh,
                       int64_t sw, int64_t ho, int64_t wo, int64_t m, const float *xp, const float *r, float *h,
                       float *g, float *s, double *table, float *spread) {
    int64_t k = kh * kw, plane = hp * wp, l = ho * wo;
    double *cols = table, *pre = table + sh * (wp + 1); /* cols: V_a for a mod sh; pre: wp + sw */
    for (int64_t p = p0; p < p1; p++) {
        const float *x = xp + p * plane;
        float *hh = h + p * k * k;
        for (int64_t dy = 0; dy < kh; dy++)
            for (int64_t dx = -(kw - 1); dx < kw; dx++) {
                if (dy == 0 && dx < 0)
                    continue; /* the transpose of dx > 0 */
                /* products exist for columns c with 0 <= c + dx < wp */
                int64_t c0 = dx < 0 ? -dx : 0, c1 = dx > 0 ? wp - dx : wp;
                for (int64_t a = 0; a + dy < kh; a++) {
                    double *col = cols + (a % sh) * (wp + 1); /* the windows at a, a + sh, ... share one */
                    if (a < sh) { /* a fresh window */
                        for (int64_t c = 0; c < wp; c++)
                            col[c] = 0.0;
                        for (int64_t y = 0; y < ho; y++)
                            col_madd(col, x + (a + sh * y) * wp, x + (a + sh * y + dy) * wp + dx, c0, c1, 1.0);
                    } else { /* the window at a - sh, moved down one stride */
                        int64_t add = a - sh + sh * ho, drop = a - sh;
                        col_madd(col, x + add * wp, x + (add + dy) * wp + dx, c0, c1, 1.0);
                        col_madd(col, x + drop * wp, x + (drop + dy) * wp + dx, c0, c1, -1.0);
                    }
                    lattice_prefix(pre, col, wp, sw);
                    for (int64_t b = 0; b < kw; b++) {
                        if (b + dx < 0 || b + dx >= kw)
                            continue;
                        float v = (float)(pre[b + sw * wo] - pre[b]);
                        int64_t i = a * kw + b, j = (a + dy) * kw + b + dx;
                        hh[i * k + j] = v;
                        hh[j * k + i] = v;
                    }
                }
            }
        if (s != NULL)
            for (int64_t a = 0; a < kh; a++) {
                double *col = cols;
                for (int64_t c = 0; c < wp; c++)
                    col[c] = 0.0;
                for (int64_t y = 0; y < ho; y++)
                    for (int64_t c = 0; c < wp; c++)
                        col[c] += (double)x[(a + sh * y) * wp + c];
                lattice_prefix(pre, col, wp, sw);
                for (int64_t b = 0; b < kw; b++)
                    s[p * k + a * kw + b] = (float)(pre[b + sw * wo] - pre[b]);
            }
        if (r != NULL && sw == 1)
            for (int64_t o = 0; o < m; o++) {
                /* the residual spread onto the plane's rows (row stride sh wp, zeros past wo): each g[o, i] is then
                 * one contiguous dot product with the plane from offset o_i; the run stops after the last row's wo
                 * values, so every read stays inside the plane */
                const float *rr = r + (p * m + o) * l;
                int64_t run = (ho - 1) * sh * wp + wo;
                for (int64_t q = 0; q < run; q++)
                    spread[q] = 0.0f;
                for (int64_t y = 0; y < ho; y++)
                    for (int64_t xx = 0; xx < wo; xx++)
                        spread[y * sh * wp + xx] = rr[y * wo + xx];
                for (int64_t i = 0; i < k; i++)
                    g[(p * m + o) * k + i] = (float)dot(run, spread, x + (i / kw) * wp + i % kw);
            }
        else if (r != NULL)
            for (int64_t o = 0; o < m; o++) {
                const float *rr = r + (p * m + o) * l;
                for (int64_t i = 0; i < k; i++) {
                    int64_t a = i / kw, b = i % kw;
                    double acc = 0.0;
                    for (int64_t y = 0; y < ho; y++) {
                        const float *u = x + (a + sh * y) * wp + b, *v = rr + y * wo;
                        acc += sw == 1 ? dot(wo, u, v) : strided_dot(wo, u, sw, v);
                    }
                    g[(p * m + o) * k + i] = (float)acc;
                }
            }
    }
}

#define GB 16 /* channels per block of qt_depthwise_gram_blocked: the block's planes, interleaved, stay in L1 */
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
/* float64 vectors for the Gram matrices' sums: DN doubles, the widest register (one AVX-512 register; one 256-bit
 * one otherwise: GCC moved a 64-byte vector between memory and registers through the stack in 16-byte pieces on AVX2,
 * and sixteen accumulators of two registers each spilled). The sums per lane do not depend on DN. */
#ifdef __AVX512F__
#include <immintrin.h>
#define DN 8
typedef double vdn __attribute__((vector_size(DN * sizeof(double))));
static inline vdn loaddn(const float *p) { /* 8 floats widened to 8 doubles: one vcvtps2pd (GCC's generic
                                             * conversion splits it into 128-bit pieces) */
    return (vdn)_mm512_cvtps_pd(_mm256_loadu_ps(p));
}
#else
#define DN 4
typedef float vfn __attribute__((vector_size(DN * sizeof(float))));
typedef double vdn __attribute__((vector_size(DN * sizeof(double))));
static inline vdn loaddn(const float *p) { /* 4 floats widened to 4 doubles */
    vfn v;
    __builtin_memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vdn);
}
#endif

/* dst[pos GB + t] = src[t stride + pos] for pos < len and t < cn, 0 for cn <= t < GB: runs of len floats from cn (<= GB)
 * planes stride floats apart, into the channel-blocked layout. Long runs in 16 x 16 tiles (16 reads along each
 * plane, one 64-byte store per position); short ones (a small plane, or one row of it) element by element, where a
 * tile would be mostly padding (below INTERLEAVE_TILE_MIN floats: 512 ch 7x7 Gram matrices 10.6 -> 10.2 ms, 64 ch
 * 56x56 ones 13.3 -> 15.3 ms the other way round). The same values either way. */
#define INTERLEAVE_TILE_MIN 256
static void interleave(float *restrict dst, const float *restrict src, int64_t len, int64_t stride, int64_t cn) {
    if (len < INTERLEAVE_TILE_MIN) {
        for (int64_t t = 0; t < cn; t++) {
            const float *row = src + t * stride;
            for (int64_t q = 0; q < len; q++)
                dst[q * GB + t] = row[q];
        }
        for (int64_t t = cn; t < GB; t++)
            for (int64_t q = 0; q < len; q++)
                dst[q * GB + t] = 0.0f;
        return;
    }
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
        int64_t pn = len - p0 < 16 ? len - p0 : 16;
        float tile[16][GB];
        for (int64_t t = 0; t < GB; t++)
            for (int64_t q = 0; q < 16; q++)
                tile[q][t] = (t < cn && q < pn) ? src[t * stride + p0 + q] : 0.0f;
        __builtin_memcpy(dst + p0 * GB, tile, (size_t)(pn * GB) * sizeof(float));
    }
}

/* lattice_prefix on interleaved columns: pre[(c + sw) GB + t] = pre[c GB + t] + col[c GB + t] along each stride-sw
 * lattice of columns, pre[0, sw GB) = 0; each channel's running sums in its own lane */
static void blk_prefix(double *restrict pre, const double *restrict col, int64_t wp, int64_t sw) {
    for (int64_t j = 0; j < sw * GB; j++)
        pre[j] = 0.0;
    for (int64_t c = 0; c < wp; c++)
        for (int64_t t = 0; t < GB; t++)
            pre[(c + sw) * GB + t] = pre[c * GB + t] + col[c * GB + t];
}

/* The tiles of a channel-blocked plane's Gram matrices (qt_depthwise_gram_blocked): sums over the strided ho x wo
 * output positions of a left operand (a tap, or the residual) times nj (<= GT) taps of x, 8 channels side by side.
 * The products and their sums over GRAM_RUN positions (whole rows) in float32, each such partial sum then added in
 * float64: no float64 conversion per product. A partial sum of m <= GRAM_RUN + wo products is within m 2^-24 of the
 * exact one relative to the sum of the products' magnitudes; H is written in float32 (2^-24) anyway. */
#define GT 6         /* taps of x per pass over the plane: 2 GT accumulators with two left operands */
#define GRAM_RUN 48  /* positions (rounded up to whole rows) summed in float32 before a float64 addition */
#define GRAM_BAND (24 << 10) /* bytes of input rows per band of H's tiles */
#if defined(__FMA__) && (defined(__AVX2__) || defined(__AVX512F__))
static inline vf8 gram_fma(vf8 u, vf8 v, vf8 a) { return (vf8)_mm256_fmadd_ps((__m256)u, (__m256)v, (__m256)a); }
#else
static inline vf8 gram_fma(vf8 u, vf8 v, vf8 a) { return a + u * v; }
#endif
/* v kept in a register: GCC folded a load used by two multiply-adds into both as memory operands (two loads) */
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
#define GRAM_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define GRAM_IN_REGISTER(v) (void)0
#endif
static inline vf8 gram_ld(const float *p) {
    vf8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
typedef float vf4g __attribute__((vector_size(4 * sizeof(float))));
typedef double vd4g __attribute__((vector_size(4 * sizeof(double))));
/* tot[0..8) += (double)a[0..8) */
static inline void gram_flush(double *restrict tot, vf8 a) {
#if defined(__AVX2__) || defined(__AVX512F__)
    /* the halves converted in registers (GCC's generic form went through the stack in 8-byte pieces) */
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128((__m256)a)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps((__m256)a, 1));
    _mm256_storeu_pd(tot, _mm256_add_pd(_mm256_loadu_pd(tot), lo));
    _mm256_storeu_pd(tot + 4, _mm256_add_pd(_mm256_loadu_pd(tot + 4), hi));
#else
    vf4g lo = __builtin_shufflevector(a, a, 0, 1, 2, 3), hi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    vd4g t0, t1;
    __builtin_memcpy(&t0, tot, sizeof t0);
    __builtin_memcpy(&t1, tot + 4, sizeof t1);
    t0 += __builtin_convertvector(lo, vd4g);
    t1 += __builtin_convertvector(hi, vd4g);
    __builtin_memcpy(tot, &t0, sizeof t0);
    __builtin_memcpy(tot + 4, &t1, sizeof t1);
#endif
}
/* the offset of tap i (row i / kw, column i % kw of the kernel) in a channel-blocked plane of wp columns */
static inline int64_t gram_tap(int64_t i, int64_t kw, int64_t wp) { return ((i / kw) * wp + i % kw) * GB; }
/* One tile on one 8-channel half (x, u and tot offset by it): nu (1 or 2) left operands read at
 * u + y urow + xx ustep (the second du further on), each multiplied with the nj taps of x at oj[] (read at
 * x + sh y wp GB + xx sw GB + oj[jj]) over the output rows [y0, y1): tot[jj GB] += sum u0 x_j and, with nu = 2,
 * tot[ttot + jj GB] += sum u1 x_j; float32 over runs of `run` rows, each run added in float64 (gram_flush). The left
 * operands: two taps of x (H; each loaded tap of x then serves both, kept in a register: 12 multiply-adds for 8 loads
 * on AVX2's 16 registers) or one (H's last tap of an odd count), or the residual (G). nu and nj are constants per
 * instance (the accumulators in registers). */
static inline __attribute__((always_inline)) void gram_tile(const int nu, const int nj, const float *restrict x,
                                                            int64_t wp, int64_t sh, int64_t sw, int64_t y0, int64_t y1,
                                                            int64_t wo, int64_t run, const float *restrict u,
                                                            int64_t urow, int64_t ustep, int64_t du,
                                                            const int64_t *restrict oj, double *restrict tot,
                                                            int64_t ttot) {
    int64_t o[GT];
    _Pragma("GCC unroll 6") for (int jj = 0; jj < nj; jj++) o[jj] = oj[jj];
    const int64_t step = sw * GB;
    for (int64_t r0 = y0; r0 < y1; r0 += run) {
        int64_t r1 = r0 + run < y1 ? r0 + run : y1;
        vf8 a[GT], b[GT];
        _Pragma("GCC unroll 6") for (int jj = 0; jj < nj; jj++) a[jj] = b[jj] = (vf8){0};
        for (int64_t y = r0; y < r1; y++) {
            const float *p = x + sh * y * wp * GB, *q = u + y * urow;
            for (int64_t xx = 0; xx < wo; xx++, p += step, q += ustep) {
                const vf8 u0 = gram_ld(q), u1 = nu == 2 ? gram_ld(q + du) : (vf8){0};
                _Pragma("GCC unroll 6") for (int jj = 0; jj < nj; jj++) {
                    vf8 t = gram_ld(p + o[jj]);
                    if (nu == 2)
                        GRAM_IN_REGISTER(t);
                    a[jj] = gram_fma(u0, t, a[jj]);
                    if (nu == 2)
                        b[jj] = gram_fma(u1, t, b[jj]);
                }
            }
        }
        _Pragma("GCC unroll 6") for (int jj = 0; jj < nj; jj++) {
            gram_flush(tot + jj * GB, a[jj]);
            if (nu == 2)
                gram_flush(tot + ttot + jj * GB, b[jj]);
        }
    }
}
static inline __attribute__((always_inline)) void gram_tile_nu(const int nj, int64_t nu, const float *x, int64_t wp,
                                                               int64_t sh, int64_t sw, int64_t y0, int64_t y1,
                                                               int64_t wo, int64_t run, const float *u, int64_t urow,
                                                               int64_t ustep, int64_t du, const int64_t *oj,
                                                               double *tot, int64_t ttot) {
    if (nu == 2)
        gram_tile(2, nj, x, wp, sh, sw, y0, y1, wo, run, u, urow, ustep, du, oj, tot, ttot);
    else
        gram_tile(1, nj, x, wp, sh, sw, y0, y1, wo, run, u, urow, ustep, du, oj, tot, ttot);
}
/* gram_tile on both 8-channel halves of the block, with nu and nj constants in each branch */
__attribute__((noinline)) static void gram_tiles(int64_t nu, int64_t nj, const float *x, int64_t wp, int64_t sh,
                                                 int64_t sw, int64_t y0, int64_t y1, int64_t wo, int64_t run,
                                                 const float *u, int64_t urow, int64_t ustep, int64_t du,
                                                 const int64_t *oj, double *tot, int64_t ttot) {
    for (int64_t hf = 0; hf < GB; hf += 8) {
        const float *xh = x + hf, *uh = u + hf;
        double *th = tot + hf;
        switch (nj) {
        case 6: gram_tile_nu(6, nu, xh, wp, sh, sw, y0, y1, wo, run, uh, urow, ustep, du, oj, th, ttot); break;
        case 5: gram_tile_nu(5, nu, xh, wp, sh, sw, y0, y1, wo, run, uh, urow, ustep, du, oj, th, ttot); break;
        case 4: gram_tile_nu(4, nu, xh, wp, sh, sw, y0, y1, wo, run, uh, urow, ustep, du, oj, th, ttot); break;
        case 3: gram_tile_nu(3, nu, xh, wp, sh, sw, y0, y1, wo, run, uh, urow, ustep, du, oj, th, ttot); break;
        case 2: gram_tile_nu(2, nu, xh, wp, sh, sw, y0, y1, wo, run, uh, urow, ustep, du, oj, th, ttot); break;
        default: gram_tile_nu(1, nu, xh, wp, sh, sw, y0, y1, wo, run, uh, urow, ustep, du, oj, th, ttot); break;
        }
    }
}

/* qt_depthwise_gram for one output per channel (m = 1), GB channels at a time: the block's planes are interleaved
 * (each row: wp columns x GB channels, 16 floats per column; an incomplete last block zero-filled) in the caller's
 * scratch. h and g: every pair of taps (and the residual with every tap) as gram_tile products over the
 * output positions, float32 products summed in float32 over runs of GRAM_RUN positions (whole rows) and the runs in
 * float64 (table), in bands of output rows whose input rows stay in L1; within a few float32 roundings of the float64
 * sums (the tests: 1.5e-7 relative on 12,544 positive products), not qt_depthwise_gram's bits. s: qt_depthwise_gram's
 * sliding sums, its bits. Written plane-major as qt_depthwise_gram's. The tiles replaced sliding float64 sums of
 * products (about kh kw hp wp / 2 multiply-adds a plane instead of k^2 ho wo / 2, but each a float64 conversion,
 * multiply-add and store; one Zen 3 thread, 16 samples, H and G, alternated in one process): 256 ch 14x14 5x5 35.0 ->
 * 15.2 ms, 1152 ch 7x7 5x5 56.6 -> 23.7, 672 ch 14x14 5x5 86.9 -> 36.9, 240 ch 28x28 5x5 96.9 -> 46.1, 96 ch
 * 112x112 3x3 s2 115.5 -> 30.9, 144 ch 56x56 3x3 68.9 -> 27.9, 144 ch 56x56 5x5 s2 144.6 -> 34.5. Work items:
 * (sample, block) pairs [q0, q1) of n x ceil(C / GB). `table`: scratch of max(sh (wp + 1) + wp + sw, k (k + 1)) GB
 * doubles; `blk`: (hp wp + ho wo + k k) GB floats. */
void qt_depthwise_gram_blocked(int64_t q0, int64_t q1, int64_t nc, int64_t hp, int64_t wp, int64_t kh, int64_t kw,
                               int64_t sh, int64_t sw, int64_t ho, int64_t wo, const float *xp, const float *r,
                               float *h, float *g, float *s, double *table, float *blk) {
    int64_t k = kh * kw, plane = hp * wp, l = ho * wo, row = wp * GB, nb = (nc + GB - 1) / GB;
    int64_t run = (GRAM_RUN + wo - 1) / wo; /* output rows per float32 partial sum of H */
    int64_t band = (GRAM_BAND / (row * (int64_t)sizeof(float)) - kh) / sh + 1; /* output rows per band */
    band = band < run ? run : band / run * run;
    double *cols = table, *pre = table + sh * (wp + 1) * GB;
    float *x = blk, *rb = blk + plane * GB, *hh = rb + l * GB;
    for (int64_t q = q0; q < q1; q++) {
        int64_t n = q / nb, c0 = (q % nb) * GB, cn = nc - c0 < GB ? nc - c0 : GB;
        /* interleave the block's planes (and residuals): x[pos GB + t] = xp[n, c0 + t, pos] */
        interleave(x, xp + (n * nc + c0) * plane, plane, plane, cn);
        if (h != NULL) { /* H (NULL: not computed, fast finetune's lazily filled Gram matrices): in bands of output
                          * rows whose input rows fit GRAM_BAND bytes (the whole plane when it fits), every tile of
                          * the pairs i <= j over a band while it is in L1; float64 sums in table */
            for (int64_t i = 0; i < k; i++)
                for (int64_t q2 = (i * k + i) * GB; q2 < (i + 1) * k * GB; q2++)
                    table[q2] = 0.0;
            for (int64_t y0 = 0; y0 < ho; y0 += band) {
                int64_t y1 = y0 + band < ho ? y0 + band : ho;
                for (int64_t i = 0; i < k; i += 2) { /* taps i and i + 1 (the pair (i + 1, i) computed, not kept) */
                    int64_t oi = gram_tap(i, kw, wp), nu = i + 1 < k ? 2 : 1, oj[GT];
                    int64_t du = nu == 2 ? gram_tap(i + 1, kw, wp) - oi : 0;
                    for (int64_t j0 = i; j0 < k; j0 += GT) {
                        int64_t nj = k - j0 < GT ? k - j0 : GT;
                        for (int64_t jj = 0; jj < nj; jj++)
                            oj[jj] = gram_tap(j0 + jj, kw, wp);
                        gram_tiles(nu, nj, x, wp, sh, sw, y0, y1, wo, run, x + oi, sh * wp * GB, sw * GB, du, oj,
                                   table + (i * k + j0) * GB, k * GB);
                    }
                }
            }
            for (int64_t i = 0; i < k; i++)
                for (int64_t q2 = (i * k + i) * GB; q2 < (i + 1) * k * GB; q2++)
                    hh[q2] = (float)table[q2];
            for (int64_t t = 0; t < cn; t++) { /* h[n, c0 + t, i, j] = h[.., j, i] from the pairs i <= j */
                float *out = h + (n * nc + c0 + t) * k * k;
                for (int64_t i = 0; i < k; i++)
                    for (int64_t jj = i; jj < k; jj++) {
                        float v = hh[(i * k + jj) * GB + t];
                        out[i * k + jj] = v;
                        out[jj * k + i] = v;
                    }
            }
        }
        if (s != NULL)
            for (int64_t a = 0; a < kh; a++) {
                for (int64_t j = 0; j < row; j++)
                    cols[j] = 0.0;
                for (int64_t y = 0; y < ho; y++) {
                    const float *u = x + (a + sh * y) * row;
                    for (int64_t j = 0; j < row; j++)
                        cols[j] += (double)u[j];
                }
                blk_prefix(pre, cols, wp, sw);
                for (int64_t b = 0; b < kw; b++)
                    for (int64_t t = 0; t < cn; t++)
                        s[(n * nc + c0 + t) * k + a * kw + b] = (float)(pre[(b + sw * wo) * GB + t] - pre[b * GB + t]);
            }
        if (r != NULL) { /* g[n, c0 + t, i] = sum_pos r(pos) x(pos + o_i): H's tiles with the residual for the tap
                          * at oi, float64 sums in gt */
            double *gt = table + k * k * GB;
            interleave(rb, r + (n * nc + c0) * l, l, l, cn);
            for (int64_t q2 = 0; q2 < k * GB; q2++)
                gt[q2] = 0.0;
            for (int64_t y0 = 0; y0 < ho; y0 += band) {
                int64_t y1 = y0 + band < ho ? y0 + band : ho, oj[GT];
                for (int64_t j0 = 0; j0 < k; j0 += GT) {
                    int64_t nj = k - j0 < GT ? k - j0 : GT;
                    for (int64_t jj = 0; jj < nj; jj++)
                        oj[jj] = gram_tap(j0 + jj, kw, wp);
                    gram_tiles(1, nj, x, wp, sh, sw, y0, y1, wo, run, rb, wo * GB, GB, 0, oj, gt + j0 * GB, 0);
                }
            }
            for (int64_t t = 0; t < cn; t++)
                for (int64_t i = 0; i < k; i++)
                    g[(n * nc + c0 + t) * k + i] = (float)gt[i * GB + t];
        }
    }
}

/* --------------------------------------------------------------------------- direct layer loss */
/* The residual's gradient mask [lo < x < hi] + wlo [x == lo] + whi [x == hi]. BOUNDS 0 (wlo = whi = 0: an activation
 * with no gradient at its bounds, torch 2.14's clamp) takes [lo < x < hi] alone, which is that sum's value exactly:
 * both products are +0 and a 0 / 1 float plus +0 is itself. */
#define RESID_MASK(BOUNDS, x)                                                                                          \
    ((BOUNDS) ? (float)(((x) > lo) & ((x) < hi)) + wlo * (float)((x) == lo) + whi * (float)((x) == hi)                \
              : (float)(((x) > lo) & ((x) < hi)))

/* The residual loops' switches as constants: CASE(BOUNDS, SSE, GSUM) (a statement) with each of the three a literal
 * 0 / 1, chosen by the runtime values; with BOUNDS true where the activation has a gradient at a bound (wlo or whi
 * not 0). Each case is its own copy of the inlined loop; a switch passed as a literal 0 folds its branch away. */
#define RESID_DISPATCH(CASE, wlo, whi, sse, gsum)                                                                      \
    do {                                                                                                               \
        const int b_ = (wlo) != 0.0f || (whi) != 0.0f, s_ = (sse), g_ = (gsum);                                        \
        if (b_) {                                                                                                      \
            if (s_) { if (g_) CASE(1, 1, 1); else CASE(1, 1, 0); }                                                     \
            else { if (g_) CASE(1, 0, 1); else CASE(1, 0, 0); }                                                        \
        } else {                                                                                                       \
            if (s_) { if (g_) CASE(0, 1, 1); else CASE(0, 1, 0); }                                                     \
            else { if (g_) CASE(0, 0, 1); else CASE(0, 0, 0); }                                                        \
        }                                                                                                              \
    } while (0)

/* act_residual_row's loop with its switches as constants (inlined into one copy per case): BOUNDS as RESID_MASK's,
 * SSE 0: the sum of r^2 not taken (0 returned; a mini-batch whose loss nobody reads), the gradient the same. */
static inline __attribute__((always_inline)) double act_residual_body(int64_t n, float *restrict p,
                                                                      const float *restrict y, float lo, float hi,
                                                                      float wlo, float whi, float gscale,
                                                                      const int BOUNDS, const int SSE) {
    double acc[16] = {0.0};
    int64_t q = 0;
    for (; q + 16 <= n; q += 16)
        for (int t = 0; t < 16; t++) {
            float x = p[q + t];
            float a = x < lo ? lo : (x > hi ? hi : x);
            float r = a - y[q + t];
            if (SSE)
                acc[t] += (double)r * (double)r;
            float m = RESID_MASK(BOUNDS, x);
            p[q + t] = gscale * r * m;
        }
    double total = 0.0;
    for (int t = 0; SSE && t < 16; t++)
        total += acc[t];
    for (; q < n; q++) {
        float x = p[q];
        float a = x < lo ? lo : (x > hi ? hi : x);
        float r = a - y[q];
        if (SSE)
            total += (double)r * (double)r;
        float m = RESID_MASK(BOUNDS, x);
        p[q] = gscale * r * m;
    }
    return total;
}

/* One mini-batch row of fast finetune's direct layer loss (DirectLayerLoss, algorithms/reconstruction.py): the
 * pre-activation outputs p (n floats, overwritten) against the target y:
 *   a = clamp(p, lo, hi);  r = a - y;  returns sum r^2 (float64; 0 without want_sse)
 *   p := gscale r ([lo < p < hi] + wlo [p == lo] + whi [p == hi])
 * wlo / whi: the activation's own gradient at its bounds (torch 2.14's clamp passes none there). NaN passes the
 * clamp (torch.clamp keeps it), so r and the sum are NaN; its mask is 0. Identity: lo = -inf, hi = inf. The new p
 * is the torch expression (gscale r) m to the bit (the mask's terms are exact). 16 independent float64 lane sums:
 * vector registers without reassociation, the same sum on every machine. */
__attribute__((noinline)) static double act_residual_row(int64_t n, float *restrict p, const float *restrict y,
                                                        float lo, float hi, float wlo, float whi, float gscale,
                                                        int want_sse) {
    double total = 0.0;
#define ROW_CASE(B, S, G) total = act_residual_body(n, p, y, lo, hi, wlo, whi, gscale, B, S)
    RESID_DISPATCH(ROW_CASE, wlo, whi, want_sse, 0);
#undef ROW_CASE
    return total;
}

/* rows b in [b0, b1) of pre (each len floats) against the rows idx[b] of target; sse[b]: each row's sum (sse NULL:
 * not taken) */
void qt_act_residual(int64_t b0, int64_t b1, int64_t len, float *pre, const float *target, const int64_t *idx,
                     float lo, float hi, float wlo, float whi, float gscale, double *sse) {
    for (int64_t b = b0; b < b1; b++) {
        double v = act_residual_row(len, pre + b * len, target + idx[b] * len, lo, hi, wlo, whi, gscale, sse != NULL);
        if (sse != NULL)
            sse[b] = v;
    }
}

/* The sum of act_residual_row without its gradient: p is read only (a finished layer's outputs, kept for the layers
 * after it). The same 16 float64 lane sums in the same order, so the same value as act_residual_row's. */
__attribute__((noinline)) static double act_sse_row(int64_t n, const float *restrict p, const float *restrict y,
                                                   float lo, float hi) {
    double acc[16] = {0.0};
    int64_t q = 0;
    for (; q + 16 <= n; q += 16)
        for (int t = 0; t < 16; t++) {
            float x = p[q + t];
            float r = (x < lo ? lo : (x > hi ? hi : x)) - y[q + t];
            acc[t] += (double)r * (double)r;
        }
    double total = 0.0;
    for (int t = 0; t < 16; t++)
        total += acc[t];
    for (; q < n; q++) {
        float x = p[q];
        float r = (x < lo ? lo : (x > hi ? hi : x)) - y[q];
        total += (double)r * (double)r;
    }
    return total;
}

/* rows b in [b0, b1) of pre against the rows idx[b] of target, pre unchanged; sse[b]: each row's sum */
void qt_act_sse(int64_t b0, int64_t b1, int64_t len, const float *pre, const float *target, const int64_t *idx,
                float lo, float hi, double *sse) {
    for (int64_t b = b0; b < b1; b++)
        sse[b] = act_sse_row(len, pre + b * len, target + idx[b] * len, lo, hi);
}

/* qt_all_finite: 1 when none of the m floats of x is NaN or infinite (exponent bits all ones), else 0; 16 at a
 * time as integers (fast finetune's divergence check of the trained tensors) */
int64_t qt_all_finite(int64_t m, const float *x) {
    typedef uint32_t vu8 __attribute__((vector_size(8 * sizeof(uint32_t))));
    const vu8 expo = (vu8){0} + 0x7f800000u;
    vu8 bad = (vu8){0};
    int64_t q = 0;
    for (; q + 16 <= m; q += 16) {
        vu8 a0, a1;
        __builtin_memcpy(&a0, x + q, sizeof a0);
        __builtin_memcpy(&a1, x + q + 8, sizeof a1);
        bad |= (vu8)((a0 & expo) == expo) | (vu8)((a1 & expo) == expo);
    }
    uint32_t any = 0;
    for (int t = 0; t < 8; t++)
        any |= bad[t];
    for (; q < m; q++) {
        uint32_t u;
        __builtin_memcpy(&u, x + q, sizeof u);
        any |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return any == 0;
}

/* ------------------------------------------------------------------------ kept outputs (incremental) */
/* DirectLayerLoss(incremental=True): every sample's outputs before the bias, p0 ([n, o, p]: conv(x, w0) of a 1x1
 * convolution, w0 [o, c]), moved by a sparse change of the weight.
 * qt_kept_diff: the entries where w (m = o c floats) differs from w0, in order: their flat indices into at[] and
 * the differences w - w0 into d[] (at most cap of them), w0 set to w there. Returns how many differ; when that is
 * more than cap, nothing is written past cap and w0 is left as it was (the caller recomputes p0). */
/* kept_diff_range: qt_kept_diff's scan over entries [q, m), appending after the k entries found before (w0 is updated
 * by kept_diff_commit once the whole scan is done) */
static int64_t kept_diff_range(int64_t q, int64_t m, const float *w, const float *w0, int64_t cap, int64_t *at,
                               float *d, int64_t k) {
    /* 16 entries compared at a time (bitwise, as integers: a float32 weight that changed on its grid changes its
     * bits; -0.0 vs 0.0, and a NaN, are what the float test treats otherwise: their block goes to it below),
     * the branchy test only where some differ: a few in a thousand an iteration */
    typedef uint32_t vu8 __attribute__((vector_size(8 * sizeof(uint32_t))));
    for (; q + 16 <= m; q += 16) {
        vu8 a0, a1, b0, b1;
        __builtin_memcpy(&a0, w + q, sizeof a0);
        __builtin_memcpy(&a1, w + q + 8, sizeof a1);
        __builtin_memcpy(&b0, w0 + q, sizeof b0);
        __builtin_memcpy(&b1, w0 + q + 8, sizeof b1);
        const vu8 sign = (vu8){0} + 0x7fffffffu, inf = (vu8){0} + 0x7f800000u;
        /* NaN never equals itself: its lanes count as differing */
        vu8 any = (a0 ^ b0) | (a1 ^ b1) | (vu8)((a0 & sign) > inf) | (vu8)((a1 & sign) > inf);
        uint32_t anyv = 0;
        for (int t = 0; t < 8; t++)
            anyv |= any[t];
        if (anyv == 0)
            continue;
        for (int64_t t = q; t < q + 16; t++)
            if (w[t] != w0[t]) {
                if (k < cap) {
                    at[k] = t;
                    d[k] = w[t] - w0[t];
                }
                k++;
            }
    }
    for (; q < m; q++)
        if (w[q] != w0[q]) {
            if (k < cap) {
                at[k] = q;
                d[k] = w[q] - w0[q];
            }
            k++;
        }
    return k;
}

/* w0 takes w's values at the k entries found, when they are all in the log (k <= cap) */
static void kept_diff_commit(int64_t k, int64_t cap, const int64_t *at, const float *w, float *w0) {
    if (k <= cap)
        for (int64_t j = 0; j < k; j++)
            w0[at[j]] = w[at[j]];
}

int64_t qt_kept_diff(int64_t m, const float *w, float *w0, int64_t cap, int64_t *at, float *d) {
    int64_t k = kept_diff_range(0, m, w, w0, cap, at, d, 0);
    kept_diff_commit(k, cap, at, w, w0);
    return k;
}

/* qt_kept_replay: the kept outputs of the samples s = samples[b], b in [b0, b1), brought up to date with a log of
 * weight changes (flat indices at[j] = oi c + ci, differences d[j], in the order they happened): the entries
 * j = start[b] .. end - 1, in that order,  p0[s, oi, :] += d[j] x[s, ci, :]  (x: [n, c, p]). Each element gets the
 * same additions in the same order whenever it is replayed, so a sample brought up to date when it is read (lazily)
 * holds the bits it would hold had every change been applied to every sample at once; the lazy order touches one
 * sample's outputs (in cache) for a run of changes instead of every sample's for each.
 * runs (not NULL): the log's steps, runs[r] the first entry of step r (ascending; nruns of them, every start[b] one
 * of them), each step's entries in ascending at. Then a sample's backlog is applied by blocks of output rows that
 * stay in L1 / L2, every step's entries for the block in step order (a cursor per step): an element still gets its
 * additions in the same order, and a backlog of several steps reads the sample's outputs once instead of once per
 * step. */
static void kept_row_add(float *restrict dst, const float *restrict src, float dj, int64_t p) {
    for (int64_t q = 0; q < p; q++)
        dst[q] += dj * src[q];
}

#define KEPT_BLOCK_FLOATS 8192 /* output rows per block: 32 KB of them */

void qt_kept_replay(int64_t b0, int64_t b1, const int64_t *samples, const int64_t *start, int64_t end, int64_t o,
                    int64_t c, int64_t p, const int64_t *at, const float *d, const float *x, float *p0,
                    const int64_t *runs, int64_t nruns) {
    for (int64_t b = b0; b < b1; b++) {
        const int64_t s = samples[b];
        float *ps = p0 + s * o * p;
        const float *xs = x + s * c * p;
        int64_t r0 = 0;
        while (runs != NULL && r0 < nruns && runs[r0] < start[b])
            r0++;
        int64_t steps = runs != NULL ? nruns - r0 : 0;
        int64_t *cur = steps > 1 ? (int64_t *)malloc((size_t)steps * sizeof(int64_t)) : NULL;
        if (cur == NULL) { /* one step (or no step list): in order */
            for (int64_t j = start[b]; j < end; j++)
                kept_row_add(ps + (at[j] / c) * p, xs + (at[j] % c) * p, d[j], p);
            continue;
        }
        for (int64_t r = 0; r < steps; r++)
            cur[r] = runs[r0 + r];
        int64_t rows = KEPT_BLOCK_FLOATS / p > 0 ? KEPT_BLOCK_FLOATS / p : 1;
        for (int64_t o0 = 0; o0 < o; o0 += rows) {
            const int64_t limit = (o0 + rows) * c; /* the block's entries: at < limit */
            for (int64_t r = 0; r < steps; r++) {
                const int64_t stop = r + 1 < steps ? runs[r0 + r + 1] : end;
                int64_t j = cur[r];
                for (; j < stop && at[j] < limit; j++)
                    kept_row_add(ps + (at[j] / c) * p, xs + (at[j] % c) * p, d[j], p);
                cur[r] = j;
            }
        }
        free(cur);
    }
}

static inline __attribute__((always_inline)) double act_residual_kept_body(
    int64_t ch, int64_t plane, const float *restrict p0, const float *restrict bias, float *restrict g, int64_t gstride,
    const float *restrict y, float lo, float hi, float wlo, float whi, float gscale, double *restrict gsum,
    const int BOUNDS, const int SSE, const int GSUM) {
    double acc[16] = {0.0}, tail = 0.0;
    for (int64_t c = 0; c < ch; c++) {
        const float bv = bias ? bias[c] : 0.0f;
        const float *restrict pc = p0 + c * plane, *restrict yc = y + c * plane;
        float *restrict gc = g + c * gstride;
        double gs[16] = {0.0}, gt = 0.0;
        int64_t q = 0;
        for (; q + 16 <= plane; q += 16)
            for (int t = 0; t < 16; t++) {
                float x = bias ? pc[q + t] + bv : pc[q + t];
                float a = x < lo ? lo : (x > hi ? hi : x);
                float r = a - yc[q + t];
                if (SSE)
                    acc[t] += (double)r * (double)r;
                float m = RESID_MASK(BOUNDS, x);
                float v = gscale * r * m;
                gc[q + t] = v;
                if (GSUM)
                    gs[t] += (double)v;
            }
        for (; q < plane; q++) {
            float x = bias ? pc[q] + bv : pc[q];
            float a = x < lo ? lo : (x > hi ? hi : x);
            float r = a - yc[q];
            if (SSE)
                tail += (double)r * (double)r;
            float m = RESID_MASK(BOUNDS, x);
            float v = gscale * r * m;
            gc[q] = v;
            if (GSUM)
                gt += (double)v;
        }
        if (GSUM) {
            for (int t = 0; t < 16; t++)
                gt += gs[t];
            gsum[c] = gt;
        }
    }
    double total = tail;
    for (int t = 0; SSE && t < 16; t++)
        total += acc[t];
    return total;
}

/* act_residual_row for a row of kept outputs: the pre-activation values are p0's row plus the bias of each channel
 * (ch channels of plane floats; bias NULL: none), read from p0 and written as the output gradient into g, with
 * gsum[c] (not NULL) the float64 sum of channel c's gradient (the bias gradient's terms). The 16 float64 lane
 * sums run within each channel, a channel's tail (plane % 16) into one more sum. want_sse 0: the sum of r^2 not
 * taken (0 returned); each case its own copy of the loop (act_residual_kept_body). */
__attribute__((noinline)) static double act_residual_kept_row(int64_t ch, int64_t plane, const float *restrict p0,
                                                             const float *restrict bias, float *restrict g,
                                                             int64_t gstride, const float *restrict y, float lo,
                                                             float hi, float wlo, float whi, float gscale,
                                                             double *restrict gsum, int want_sse) {
    double total = 0.0;
#define KEPT_CASE(B, S, G)                                                                                             \
    total = act_residual_kept_body(ch, plane, p0, bias, g, gstride, y, lo, hi, wlo, whi, gscale, gsum, B, S, G)
    RESID_DISPATCH(KEPT_CASE, wlo, whi, want_sse, gsum != NULL);
#undef KEPT_CASE
    return total;
}

/* rows b in [b0, b1) of the mini-batch: the kept outputs p0[idx[b]] plus the bias against target[idx[b]] (each
 * row ch * plane floats), the gradient into g's row b, sse[b] (sse not NULL) the row's sum, gsum[b * ch + c] (gsum not NULL) its
 * channels' gradient sums. With by_channel, x (not NULL: the layer's input [n, xc, plane]) is gathered the same way
 * into xg ([xc, nb, plane]: the mini-batch's input rows side by side per channel, the weight gradient's other
 * operand) */
void qt_act_residual_kept(int64_t b0, int64_t b1, int64_t ch, int64_t plane, const float *p0, const float *bias,
                          float *g, const float *target, const int64_t *idx, float lo, float hi, float wlo, float whi,
                          float gscale, double *sse, double *gsum, int64_t nb, int64_t by_channel, const float *x,
                          int64_t xc, float *xg) {
    int64_t len = ch * plane;
    for (int64_t b = b0; b < b1; b++) { /* g: [nb, ch, plane], or [ch, nb, plane] with by_channel */
        double v = act_residual_kept_row(ch, plane, p0 + idx[b] * len, bias,
                                         by_channel ? g + b * plane : g + b * len, by_channel ? nb * plane : plane,
                                         target + idx[b] * len, lo, hi, wlo, whi, gscale, gsum ? gsum + b * ch : NULL,
                                         sse != NULL);
        if (sse != NULL)
            sse[b] = v;
        if (by_channel && x)
            for (int64_t c = 0; c < xc; c++)
                memcpy(xg + (c * nb + b) * plane, x + (idx[b] * xc + c) * plane, (size_t)plane * sizeof(float));
    }
}

/* ------------------------------------------------------------------------------ small Gram-matrix layers */
/* QuadraticLayerLoss.gradient in one call for small layers (a few torch operations' dispatch outweighs their
 * products there) and for AdaQuant's integer weights (dw sparse: the weight moves on its grid, and dw is zero where
 * the rounding has not flipped). The rows ids[0..nids) of flat (each len floats: H [g k k], G [g o k], then with the
 * bias S [g k] and Y [g o]) are summed in order into acc; dw = w - w0 ([g o k]); per group
 *   R = (dw H - G) f2                                       ([o k], f2 = 2 f)
 * and with the bias (b, b0 not NULL; db = b - b0):
 *   R += db s^T f2;   gb = (dw . s + nl db - Y) f2           ([g o])
 * The products accumulate along rows of H (vectorized along k), in the order of k, skipping the rows a zero of dw
 * multiplies: the same bits as every row added while H is finite (a zero times a finite value adds +-0, and a sum
 * that starts at +0 is never -0; the caller keeps non-finite Gram matrices off this path). Only the rows of H
 * some nonzero of dw multiplies are summed (cols: scratch for k + 1 int32 per group, then k more). sse (not NULL): the
 * mini-batch's loss without its constant, dw^T H dw - 2 dw.G + 2 db dw.s + nl db^2 - 2 db Y (unscaled), in float64.
 * filled (not NULL: H computed lazily, QuadraticLayerLoss's sparse depthwise layers): 1 per row of H ([g k]) that
 * holds its values; returns 1, with R, gb and sse unwritten, when a nonzero of dw needs a row that does not (the
 * caller fills it and calls again), else 0. */
/* r = sum_t d[nzi[t]] h[nzi[t], :] over the nz nonzeros of the row d, in the order of t (k floats; h: the group's
 * H, k x k): each element's sum runs in that order, four rows of h per pass over r (r loaded and stored once per
 * four), so the bits of adding one row at a time. */
__attribute__((noinline)) static void sparse_row_product(int64_t k, float *restrict r, int32_t nz,
                                                         const int32_t *restrict nzi, const float *restrict d,
                                                         const float *restrict h) {
    for (int64_t j = 0; j < k; j++)
        r[j] = 0.0f;
    int32_t t = 0;
    for (; t + 4 <= nz; t += 4) {
        const float a0 = d[nzi[t]], a1 = d[nzi[t + 1]], a2 = d[nzi[t + 2]], a3 = d[nzi[t + 3]];
        const float *restrict h0 = h + (int64_t)nzi[t] * k, *restrict h1 = h + (int64_t)nzi[t + 1] * k;
        const float *restrict h2 = h + (int64_t)nzi[t + 2] * k, *restrict h3 = h + (int64_t)nzi[t + 3] * k;
        for (int64_t j = 0; j < k; j++) {
            float x = r[j];
            x += a0 * h0[j];
            x += a1 * h1[j];
            x += a2 * h2[j];
            x += a3 * h3[j];
            r[j] = x;
        }
    }
    for (; t < nz; t++) {
        const float a = d[nzi[t]];
        const float *restrict h0 = h + (int64_t)nzi[t] * k;
        for (int64_t j = 0; j < k; j++)
            r[j] += a * h0[j];
    }
}

int qt_gram_gradient(int64_t nids, const int64_t *ids, const float *flat, int64_t len, int64_t g, int64_t o,
                     int64_t k, const float *w, const float *w0, const float *b, const float *b0, float nl, float f2,
                     float *acc, float *dw, float *R, float *gb, int32_t *cols, const uint8_t *filled, double *sse) {
    int64_t n = g * o * k, hl = g * k * k;
    for (int64_t q = 0; q < n; q++)
        dw[q] = w[q] - w0[q];
    /* the rows of acc summed: H's rows a nonzero of dw multiplies, then G, S, Y whole */
    const float *r0 = flat + ids[0] * len, *r1 = nids > 1 ? flat + ids[1] * len : NULL;
    int32_t *ncols = cols + g * k; /* per group: how many of its columns are used */
    for (int64_t gi = 0; gi < g; gi++) {
        int32_t *c = cols + gi * k, nc = 0;
        for (int64_t kk = 0; kk < k; kk++) /* the group's columns a nonzero uses, row by row (in cache) */
            c[kk] = 0;
        for (int64_t oi = 0; oi < o; oi++) {
            const float *d = dw + (gi * o + oi) * k;
            for (int64_t kk = 0; kk < k; kk++)
                c[kk] |= d[kk] != 0.0f;
        }
        for (int64_t kk = 0; kk < k; kk++)
            if (c[kk]) {
                if (filled != NULL && !filled[gi * k + kk])
                    return 1; /* a row of H not computed yet: nothing written but scratch */
                c[nc++] = (int32_t)kk; /* (nc <= kk: the flags not read yet stay in place) */
            }
        ncols[gi] = nc;
        for (int32_t t = 0; t < nc; t++) {
            int64_t at = (gi * k + c[t]) * k;
            if (r1 == NULL)
                for (int64_t j = 0; j < k; j++)
                    acc[at + j] = r0[at + j];
            else
                for (int64_t j = 0; j < k; j++)
                    acc[at + j] = r0[at + j] + r1[at + j];
            for (int64_t i = 2; i < nids; i++) {
                const float *ri = flat + ids[i] * len + at;
                for (int64_t j = 0; j < k; j++)
                    acc[at + j] += ri[j];
            }
        }
    }
    if (r1 == NULL)
        for (int64_t q = hl; q < len; q++)
            acc[q] = r0[q];
    else
        for (int64_t q = hl; q < len; q++)
            acc[q] = r0[q] + r1[q];
    for (int64_t i = 2; i < nids; i++) {
        const float *ri = flat + ids[i] * len;
        for (int64_t q = hl; q < len; q++)
            acc[q] += ri[q];
    }
    const float *H = acc, *G = acc + hl, *S = G + g * o * k, *Y = S + g * k;
    double total = 0.0;
    int32_t *nzi = cols + g * (k + 1); /* a row's nonzeros (k int32 after the columns' counts) */
    for (int64_t gi = 0; gi < g; gi++) {
        const int32_t *c = cols + gi * k;
        int32_t nc = ncols[gi];
        for (int64_t oi = 0; oi < o; oi++) {
            float *r = R + (gi * o + oi) * k;
            const float *d = dw + (gi * o + oi) * k, *gr = G + (gi * o + oi) * k;
            int32_t nz = 0;
            for (int32_t t = 0; t < nc; t++) { /* the row's nonzeros, in column order, without branches */
                int32_t cc = c[t];
                nzi[nz] = cc;
                nz += d[cc] != 0.0f;
            }
            sparse_row_product(k, r, nz, nzi, d, H + gi * k * k);
            for (int64_t j = 0; j < k; j++)
                r[j] -= gr[j];
            if (sse != NULL)
                for (int32_t t = 0; t < nc; t++) { /* dw.(dw H - G) - dw.G: the nonzeros of dw */
                    double a = d[c[t]];
                    total += a * ((double)r[c[t]] - (double)gr[c[t]]);
                }
            if (b != NULL) {
                int64_t ci = gi * o + oi;
                float db = b[ci] - b0[ci];
                const float *sv = S + gi * k;
                float ws = 0.0f;
                for (int64_t j = 0; j < k; j++) {
                    ws += d[j] * sv[j];
                    r[j] += db * sv[j];
                }
                gb[ci] = (ws + nl * db - Y[ci]) * f2;
                if (sse != NULL)
                    total += (double)db * (2.0 * (double)ws + (double)nl * (double)db - 2.0 * (double)Y[ci]);
            }
            for (int64_t j = 0; j < k; j++)
                r[j] *= f2;
        }
    }
    if (sse != NULL)
        *sse = total;
    return 0;
}

/* ----------------------------------------------------------------------------------- AdaQuant's INT32 bias */
/* The bias quantizer's arithmetic (formats/integer.py, round_bias then dequantize): q = clamp(rint(b / s64), lo, hi)
 * in float64 (IEEE division, round half to even, NaN kept), bq = (float)q * s32 (one float32 rounding, one float32
 * multiply: the torch expression's bits), keep = 1 where lo < q < hi (the gradient passes), else 0 (NaN: 0). The
 * scales have n elements, or one (s_step 0). */
void qt_bias_values(int64_t n, const float *b, const double *s64, const float *s32, int64_t s_step, double lo,
                    double hi, float *bq, float *keep) {
    for (int64_t i = 0; i < n; i++) {
        double q = rint((double)b[i] / s64[i * s_step]);
        q = q < lo ? lo : (q > hi ? hi : q);
        bq[i] = (float)q * s32[i * s_step];
        keep[i] = (float)((q > lo) & (q < hi));
    }
}

/* Adam's step on p (n floats) for the gradient g keep (the bias's straight-through gradient) */
void qt_masked_adam(int64_t n, float *p, const float *g, const float *keep, float *m, float *v, float b1, float b2,
                    float eps, float lr_c1, float inv_c2) {
    for (int64_t i = 0; i < n; i++)
        p[i] = adam_update(p[i], g[i] * keep[i], m + i, v + i, b1, b2, eps, lr_c1, inv_c2);
}

/* -------------------------------------------------------------- depthwise convolution, forward and weight gradient */
/* The zero-padded plane of x (h x w floats; ph rows above and below, pw columns left and right) split into its sw
 * column phases: out[(r hp + row) wq + j] = xpad[row][sw j + r] (0 outside x), hp rows, wq columns per phase. A
 * strided convolution then reads contiguous runs: column sw x + b is phase b % sw, index x + b / sw. */
static void phase_plane(const float *restrict x, int64_t h, int64_t w, int64_t ph, int64_t pw, int64_t hp, int64_t sw,
                        int64_t wq, float *restrict out) {
    for (int64_t r = 0; r < sw; r++) {
        /* the columns j of phase r inside x: 0 <= sw j + r - pw < w */
        int64_t j0 = pw > r ? (pw - r + sw - 1) / sw : 0;
        int64_t j1 = (w + pw - r + sw - 1) / sw;
        j1 = j1 < wq ? j1 : wq;
        j0 = j0 < j1 ? j0 : j1;
        for (int64_t row = 0; row < hp; row++) {
            float *o = out + (r * hp + row) * wq;
            int64_t sy = row - ph;
            if (sy < 0 || sy >= h) {
                __builtin_memset(o, 0, (size_t)wq * sizeof(float));
                continue;
            }
            const float *src = x + sy * w + r - pw;
            __builtin_memset(o, 0, (size_t)j0 * sizeof(float));
            if (sw == 1)
                __builtin_memcpy(o + j0, src + j0, (size_t)(j1 - j0) * sizeof(float));
            else
                for (int64_t j = j0; j < j1; j++)
                    o[j] = src[sw * j];
            __builtin_memset(o + j1, 0, (size_t)(wq - j1) * sizeof(float));
        }
    }
}

#define VL 16 /* output columns per register block: one 512-bit vector of floats (two 256-bit ones on AVX2) */
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

static inline vf loadu(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* a whole block stored: one 64-byte copy with AVX-512; two 256-bit halves otherwise (GCC copied a 64-byte vector
 * to memory through the stack in 16-byte pieces there) */
static inline void storeu(float *p, vf v) {
#ifdef __AVX512F__
    __builtin_memcpy(p, &v, sizeof v);
#else
    typedef float vh __attribute__((vector_size(VL / 2 * sizeof(float))));
    vh lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    vh hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    __builtin_memcpy(p, &lo, sizeof lo);
    __builtin_memcpy(p + VL / 2, &hi, sizeof hi);
#endif
}

/* the first n (<= VL) lanes of a block: a full one is one vector load / store; a partial one a masked load / store
 * with AVX-512 (a copy of a variable length compiles to `rep movs`, about 30 cycles a block: it was half of these
 * kernels' time), lane by lane otherwise */
#if defined(__AVX512F__)
/* one masked instruction whatever n (a branch between a full and a masked access split the kernels' loops in two,
 * and GCC then stored every accumulator to memory each block) */
static inline __mmask16 lanes_mask(int64_t n) { return n >= VL ? (__mmask16)0xFFFFu : (__mmask16)((1u << n) - 1u); }

static inline vf load_n(const float *p, int64_t n) { return (vf)_mm512_maskz_loadu_ps(lanes_mask(n), p); }

static inline void store_n(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, lanes_mask(n), (__m512)v); }
#else
static inline vf load_n(const float *p, int64_t n) {
    if (n == VL)
        return loadu(p);
    vf v = (vf){0};
    for (int64_t t = 0; t < n; t++)
        v[t] = p[t];
    return v;
}

static inline void store_n(float *p, vf v, int64_t n) {
    if (n == VL) {
        storeu(p, v);
        return;
    }
    for (int64_t t = 0; t < n; t++)
        p[t] = v[t];
}
#endif

/* DW_BIAS_LAST: every depthwise forward (these, the AVX2 forms and the channel-blocked ones) starts its sum from
 * `init`, a multiply-add per tap in tap order, and stores it plus `post`: out = (init + taps) + post. The bias goes
 * first by default (init = 0 + bias, post = 0: the sum never is -0 from +0, so + 0 changes nothing) or, with `last`,
 * last (init = 0, post = B = 0 + bias, +0 for a -0 bias). Last, an output kept without its bias (bias 0: S + 0) and
 * given its bias later, (S + 0) + B, is the fresh output's float (B is never -0, so the sign of a zero S does not
 * matter): AdaQuant's kept depthwise planes (qt_depthwise_direct's `kept`) train on the bias-last forward, the same
 * bits as computing it fresh; everything else keeps the bias-first floats. */
#if !(defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)) /* (AVX2: dw_forward8_* below) */
/* one plane's output: out[y][x] = (init + sum_i w[i] xpad[sh y + a_i][sw x + b_i]) + post (DW_BIAS_LAST), the taps i =
 * a kw + b accumulated in order in register blocks of VL output columns; a block reads up to VL - 1 columns past the
 * row's last output: the next row's, or the scratch's zeroed slack; those lanes are not stored. Explicit vectors: left
 * to itself GCC vectorizes across the taps with gathers. With 9 taps their broadcast weights and offsets sit in
 * registers for the plane (GCC reloaded both from memory for every block); other tap counts run two blocks side by side
 * (independent chains of multiply-adds: a block alone waits on its k multiply-adds' latency; 5x5 taps 10-15% faster,
 * 3x3 ones 5% slower that way). */
/* the 9-tap kernel, its weights and offsets in arrays of exactly 9 entries (arrays sized for the largest tap count
 * stayed in memory) */
static void dw_forward_k9(const float *restrict pp, int64_t wq, const int64_t *restrict off, int64_t sh, int64_t ho,
                          int64_t wo, const float *restrict w, float init, float post, float *restrict out) {
    vf wv[9];
    int64_t o[9];
    for (int i = 0; i < 9; i++) {
        wv[i] = (vf){0} + w[i];
        o[i] = off[i];
    }
    for (int64_t y = 0; y < ho; y++)
        for (int64_t x0 = 0; x0 < wo; x0 += VL) {
            vf acc = (vf){0} + init;
            const float *row = pp + sh * y * wq + x0;
            for (int i = 0; i < 9; i++)
                acc += wv[i] * loadu(row + o[i]);
            store_n(out + y * wo + x0, acc + post, wo - x0 < VL ? wo - x0 : VL);
        }
}

/* ... any k: the weights and offsets read as they are needed */
static void dw_forward_any(const float *restrict pp, int64_t wq, int64_t k, const int64_t *restrict off, int64_t sh,
                           int64_t ho, int64_t wo, const float *restrict w, float init, float post,
                           float *restrict out) {
    for (int64_t y = 0; y < ho; y++) {
        const float *row = pp + sh * y * wq;
        int64_t x0 = 0;
        for (; x0 + VL < wo; x0 += 2 * VL) {
            vf acc = (vf){0} + init, acc2 = acc;
            for (int64_t i = 0; i < k; i++) {
                acc += w[i] * loadu(row + x0 + off[i]);
                acc2 += w[i] * loadu(row + x0 + VL + off[i]);
            }
            store_n(out + y * wo + x0, acc + post, VL);
            store_n(out + y * wo + x0 + VL, acc2 + post, wo - x0 - VL < VL ? wo - x0 - VL : VL);
        }
        if (x0 < wo) {
            vf acc = (vf){0} + init;
            for (int64_t i = 0; i < k; i++)
                acc += w[i] * loadu(row + x0 + off[i]);
            store_n(out + y * wo + x0, acc + post, wo - x0);
        }
    }
}

#endif

/* one plane's weight gradient, added to tot (k doubles): tot[i] += sum_{y, x} g[y][x] xpad[sh y + a_i][sw x + b_i],
 * every tap's VL float lanes in registers over the plane (a block of g read once for all taps; lanes past the row
 * end multiply zero), then summed in float64 */
/* the sum of a vector's lanes in float64, in lane order */
static inline void add_lanes(vf a, double *restrict tot) {
    float lanes[VL];
    __builtin_memcpy(lanes, &a, sizeof lanes);
    double sum = 0.0;
    for (int t = 0; t < VL; t++)
        sum += (double)lanes[t];
    *tot += sum;
}

/* DW_WGRAD_N: the gradient of taps off[0..N) with N named accumulators (an array of them, even of a constant size,
 * lived in memory: GCC stored every accumulator each block) */
#define DW_TAP(i) a##i += gv * loadu(row + o##i)
#define DW_WGRAD_HEAD                                                                                                  \
    for (int64_t y = 0; y < ho; y++)                                                                                   \
        for (int64_t x0 = 0; x0 < wo; x0 += VL) {                                                                      \
            vf gv = load_n(g + y * wo + x0, wo - x0 < VL ? wo - x0 : VL);                                              \
            const float *row = pp + sh * y * wq + x0;

#if defined(__AVX512F__) || !defined(__AVX2__)
static void dw_wgrad_k9(const float *restrict pp, int64_t wq, const int64_t *restrict off, int64_t sh, int64_t ho,
                        int64_t wo, const float *restrict g, double *restrict tot) {
    vf a0 = (vf){0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0;
    int64_t o0 = off[0], o1 = off[1], o2 = off[2], o3 = off[3], o4 = off[4], o5 = off[5], o6 = off[6], o7 = off[7],
            o8 = off[8];
    DW_WGRAD_HEAD
            DW_TAP(0); DW_TAP(1); DW_TAP(2); DW_TAP(3); DW_TAP(4); DW_TAP(5); DW_TAP(6); DW_TAP(7); DW_TAP(8);
        }
    add_lanes(a0, tot); add_lanes(a1, tot + 1); add_lanes(a2, tot + 2); add_lanes(a3, tot + 3);
    add_lanes(a4, tot + 4); add_lanes(a5, tot + 5); add_lanes(a6, tot + 6); add_lanes(a7, tot + 7);
    add_lanes(a8, tot + 8);
}

static void dw_wgrad_k5(const float *restrict pp, int64_t wq, const int64_t *restrict off, int64_t sh, int64_t ho,
                        int64_t wo, const float *restrict g, double *restrict tot) {
    vf a0 = (vf){0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0;
    int64_t o0 = off[0], o1 = off[1], o2 = off[2], o3 = off[3], o4 = off[4];
    DW_WGRAD_HEAD
            DW_TAP(0); DW_TAP(1); DW_TAP(2); DW_TAP(3); DW_TAP(4);
        }
    add_lanes(a0, tot); add_lanes(a1, tot + 1); add_lanes(a2, tot + 2); add_lanes(a3, tot + 3);
    add_lanes(a4, tot + 4);
}

#else
/* the same on AVX2: each half of a block's sixteen lanes in its own pass over the plane, nine (five) named 256-bit
 * accumulators (eighteen registers in the sixteen-lane form: GCC kept them on the stack); each lane's float sum is
 * the same, and the lanes are summed in float64 in lane order as add_lanes does */
static const int32_t half_lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1};

static inline vf8 load8_n(const float *p, int64_t n) { /* lanes [0, n) of p, zeros after (n may be <= 0) */
    n = n < 0 ? 0 : (n > 8 ? 8 : n);
    return (vf8)_mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(half_lanes + 8 - n)));
}

#define DW_TAP8(i)                                                                                                     \
    do {                                                                                                               \
        vf8 xv;                                                                                                        \
        __builtin_memcpy(&xv, row + o##i, sizeof xv);                                                                  \
        a##i += gv * xv;                                                                                               \
    } while (0)
#define DW_WGRAD8_PASS(TAPS)                                                                                           \
    for (int64_t y = 0; y < ho; y++)                                                                                   \
        for (int64_t x0 = 0; x0 < wo; x0 += VL) {                                                                      \
            vf8 gv = load8_n(g + y * wo + x0 + hf, (wo - x0 < VL ? wo - x0 : VL) - hf);                              \
            const float *row = pp + sh * y * wq + x0 + hf;                                                             \
            TAPS;                                                                                                      \
        }
/* lanes of the taps' accumulators: the first half kept, then every tap's sixteen lanes summed in order */
#define DW_LANES8(i)                                                                                                   \
    do {                                                                                                               \
        if (hf == 0)                                                                                                   \
            __builtin_memcpy(lo[i], &a##i, sizeof a##i);                                                               \
        else {                                                                                                         \
            double sum = 0.0;                                                                                          \
            for (int t = 0; t < 8; t++)                                                                                \
                sum += (double)lo[i][t];                                                                               \
            for (int t = 0; t < 8; t++)                                                                                \
                sum += (double)a##i[t];                                                                                \
            tot[i] += sum;                                                                                             \
        }                                                                                                              \
    } while (0)

static void dw_wgrad_k9(const float *restrict pp, int64_t wq, const int64_t *restrict off, int64_t sh, int64_t ho,
                        int64_t wo, const float *restrict g, double *restrict tot) {
    int64_t o0 = off[0], o1 = off[1], o2 = off[2], o3 = off[3], o4 = off[4], o5 = off[5], o6 = off[6], o7 = off[7],
            o8 = off[8];
    float lo[9][8] = {{0}};
    for (int64_t hf = 0; hf < VL; hf += 8) {
        vf8 a0 = {0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0;
        DW_WGRAD8_PASS(DW_TAP8(0); DW_TAP8(1); DW_TAP8(2); DW_TAP8(3); DW_TAP8(4); DW_TAP8(5); DW_TAP8(6);
                       DW_TAP8(7); DW_TAP8(8))
        DW_LANES8(0); DW_LANES8(1); DW_LANES8(2); DW_LANES8(3); DW_LANES8(4); DW_LANES8(5); DW_LANES8(6);
        DW_LANES8(7); DW_LANES8(8);
    }
}

static void dw_wgrad_k5(const float *restrict pp, int64_t wq, const int64_t *restrict off, int64_t sh, int64_t ho,
                        int64_t wo, const float *restrict g, double *restrict tot) {
    int64_t o0 = off[0], o1 = off[1], o2 = off[2], o3 = off[3], o4 = off[4];
    float lo[5][8] = {{0}};
    for (int64_t hf = 0; hf < VL; hf += 8) {
        vf8 a0 = {0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0;
        DW_WGRAD8_PASS(DW_TAP8(0); DW_TAP8(1); DW_TAP8(2); DW_TAP8(3); DW_TAP8(4))
        DW_LANES8(0); DW_LANES8(1); DW_LANES8(2); DW_LANES8(3); DW_LANES8(4);
    }
}
#endif

/* ... any k, one tap at a time over the plane (the same float lanes and sums per tap) */
static void dw_wgrad_any(const float *restrict pp, int64_t wq, int64_t k, const int64_t *restrict off, int64_t sh,
                         int64_t ho, int64_t wo, const float *restrict g, double *restrict tot) {
    for (int64_t i = 0; i < k; i++) {
        vf acc = (vf){0};
        for (int64_t y = 0; y < ho; y++)
            for (int64_t x0 = 0; x0 < wo; x0 += VL) {
                vf gv = load_n(g + y * wo + x0, wo - x0 < VL ? wo - x0 : VL);
                acc += gv * loadu(pp + sh * y * wq + x0 + off[i]);
            }
        double sum = 0.0;
        for (int t = 0; t < VL; t++)
            sum += (double)acc[t];
        tot[i] += sum;
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* The forward on AVX2: blocks of eight output columns (one 256-bit vector), four blocks side by side in the plane's
 * block order (y, x0), rows mixed, so that even a 7- or 14-wide plane keeps four independent chains of multiply-adds;
 * each block's lanes get dw_forward_k9's / dw_forward_any's operations in their order (from init a multiply-add
 * per tap with the weight as those take it: plus 0 for 9 taps, as it is otherwise; then post), so the same floats.
 * The sixteen-lane forms spilled on AVX2: their accumulators and weights went through the stack in 8-byte pieces
 * every tap (0.9 GMAC/s on 5x5 kernels). A block reads up to 7 columns past the row's last output, as the
 * sixteen-lane form reads up to 15; those lanes are not stored. */
#define DW_FWD8_BLOCK(j)                                                                                               \
    const float *in##j = pp + sh * (bq##j / nbx) * wq + 8 * (bq##j % nbx);                                           \
    vf8 a##j = iv
#define DW_FWD8_STORE(j)                                                                                               \
    do {                                                                                                               \
        int64_t y_ = bq##j / nbx, x_ = 8 * (bq##j % nbx), n_ = wo - x_ < 8 ? wo - x_ : 8;                              \
        float *o_ = out + y_ * wo + x_;                                                                                \
        const vf8 s_ = a##j + pv;                                                                                      \
        if (n_ == 8)                                                                                                   \
            __builtin_memcpy(o_, &s_, sizeof s_);                                                                      \
        else                                                                                                           \
            for (int64_t t_ = 0; t_ < n_; t_++)                                                                        \
                o_[t_] = s_[t_];                                                                                       \
    } while (0)
#define DW_FORWARD8(NAME, KK, WEIGHT)                                                                                  \
    static void NAME(const float *restrict pp, int64_t wq, int64_t k, const int64_t *restrict off, int64_t sh,      \
                     int64_t ho, int64_t wo, const float *restrict w, float init, float post,                       \
                     float *restrict out) {                                                                            \
        const vf8 iv = (vf8){0} + init, pv = (vf8){0} + post;                                                          \
        const int64_t nbx = (wo + 7) / 8, nblk = ho * nbx;                                                             \
        int64_t q = 0;                                                                                                 \
        for (; q + 4 <= nblk; q += 4) {                                                                                \
            const int64_t bq0 = q, bq1 = q + 1, bq2 = q + 2, bq3 = q + 3;                                              \
            DW_FWD8_BLOCK(0); DW_FWD8_BLOCK(1); DW_FWD8_BLOCK(2); DW_FWD8_BLOCK(3);                                   \
            _Pragma("GCC unroll 25") for (int64_t i = 0; i < (KK); i++) {                                              \
                const vf8 wv = WEIGHT;                                                                                 \
                const int64_t oi = off[i];                                                                             \
                vf8 t0, t1, t2, t3;                                                                                    \
                __builtin_memcpy(&t0, in0 + oi, sizeof t0);                                                            \
                __builtin_memcpy(&t1, in1 + oi, sizeof t1);                                                            \
                __builtin_memcpy(&t2, in2 + oi, sizeof t2);                                                            \
                __builtin_memcpy(&t3, in3 + oi, sizeof t3);                                                            \
                a0 = fma8(wv, t0, a0); a1 = fma8(wv, t1, a1); a2 = fma8(wv, t2, a2); a3 = fma8(wv, t3, a3);            \
            }                                                                                                          \
            DW_FWD8_STORE(0); DW_FWD8_STORE(1); DW_FWD8_STORE(2); DW_FWD8_STORE(3);                                   \
        }                                                                                                              \
        for (; q < nblk; q++) {                                                                                        \
            const int64_t bq0 = q;                                                                                     \
            DW_FWD8_BLOCK(0);                                                                                          \
            _Pragma("GCC unroll 25") for (int64_t i = 0; i < (KK); i++) {                                              \
                const vf8 wv = WEIGHT;                                                                                 \
                vf8 t0;                                                                                                \
                __builtin_memcpy(&t0, in0 + off[i], sizeof t0);                                                        \
                a0 = fma8(wv, t0, a0);                                                                                 \
            }                                                                                                          \
            DW_FWD8_STORE(0);                                                                                          \
        }                                                                                                              \
        (void)k;                                                                                                       \
    }
static inline vf8 bcast8(float v) { return (vf8){v, v, v, v, v, v, v, v}; }
/* a multiply-add in one rounding, as written: GCC's contraction of `a += w * x` is what the sixteen-lane forms get,
 * but it left some of these eight-lane loops as a multiply and an add (other floats) */
static inline vf8 fma8(vf8 w, vf8 x, vf8 a) { return (vf8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)a); }
DW_FORWARD8(dw_forward8_k9, 9, bcast8(0.0f + w[i]))
DW_FORWARD8(dw_forward8_k25, 25, bcast8(w[i]))
DW_FORWARD8(dw_forward8_any, k, bcast8(w[i]))
#endif

/* the kernels with the common tap counts as constants (the tap loops unrolled, weights, offsets and the gradient's
 * lanes in registers) */
__attribute__((noinline)) static void dw_forward_plane(const float *pp, int64_t wq, int64_t k, const int64_t *off,
                                                      int64_t sh, int64_t ho, int64_t wo, const float *w, float bias,
                                                      int last, float *out) {
    const float init = last ? 0.0f : 0.0f + bias, post = last ? 0.0f + bias : 0.0f; /* DW_BIAS_LAST */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (k == 9)
        dw_forward8_k9(pp, wq, k, off, sh, ho, wo, w, init, post, out);
    else if (k == 25)
        dw_forward8_k25(pp, wq, k, off, sh, ho, wo, w, init, post, out);
    else
        dw_forward8_any(pp, wq, k, off, sh, ho, wo, w, init, post, out);
#else
    if (k == 9)
        dw_forward_k9(pp, wq, off, sh, ho, wo, w, init, post, out);
    else
        dw_forward_any(pp, wq, k, off, sh, ho, wo, w, init, post, out);
#endif
}

__attribute__((noinline)) static void dw_wgrad_plane(const float *pp, int64_t wq, int64_t k, const int64_t *off,
                                                    int64_t sh, int64_t ho, int64_t wo, const float *g, double *tot) {
    if (k == 9)
        dw_wgrad_k9(pp, wq, off, sh, ho, wo, g, tot);
    else if (k == 25) /* five groups of five taps: g read five times, 25 taps' lanes and offsets exceed the registers */
        for (int64_t i0 = 0; i0 < 25; i0 += 5)
            dw_wgrad_k5(pp, wq, off + i0, sh, ho, wo, g, tot + i0);
    else
        dw_wgrad_any(pp, wq, k, off, sh, ho, wo, g, tot);
}

/* tap (a, b) reads the phase planes from offset off[a kw + b] = ((b % sw) hp + a) wq + b / sw (then sh y wq + x) */
static void tap_offsets(int64_t kh, int64_t kw, int64_t sw, int64_t hp, int64_t wq, int64_t *off) {
    for (int64_t a = 0; a < kh; a++)
        for (int64_t b = 0; b < kw; b++)
            off[a * kw + b] = ((b % sw) * hp + a) * wq + b / sw;
}

/* A depthwise Conv2d (one output per input channel, dilation 1, stride sh / sw, kernel kh x kw) on the rows idx[b] of x
 * ([N, c, h, w]): planes p = b c + ch in [p0, p1) of out ([B, c, ho, wo]). weight: [c, kh kw]; bias: [c] or NULL. The
 * zero padding: pt rows above, pl columns left, pb rows below and pr columns right of each plane (a Conv2d's ph / pw on
 * both sides, or an ONNX Pad's asymmetric padding read straight from the unpadded planes: the same bits as on the
 * planes padded beforehand). scratch: sw hp wq + VL floats, hp = h + pt + pb, wq = ceil((w + pl + pr) / sw), the last
 * VL zero. last: the bias after the taps (DW_BIAS_LAST). */
void qt_depthwise_forward_pads(int64_t p0, int64_t p1, int64_t c, const int64_t *idx, const float *x, int64_t h,
                               int64_t w, int64_t pt, int64_t pl, int64_t pb, int64_t pr, int64_t kh, int64_t kw,
                               int64_t sh, int64_t sw, int64_t ho, int64_t wo, const float *weight, const float *bias,
                               float *out, float *scratch, int64_t last) {
    int64_t hp = h + pt + pb, wq = (w + pl + pr + sw - 1) / sw, k = kh * kw;
    int64_t off[k];
    tap_offsets(kh, kw, sw, hp, wq, off);
    for (int64_t p = p0; p < p1; p++) {
        int64_t b = p / c, ch = p % c;
        phase_plane(x + (idx[b] * c + ch) * h * w, h, w, pt, pl, hp, sw, wq, scratch);
        dw_forward_plane(scratch, wq, k, off, sh, ho, wo, weight + ch * k, bias ? bias[ch] : 0.0f, (int)last,
                         out + p * ho * wo);
    }
}

/* Its weight gradient for the output gradient g ([nb, c, ho, wo]): gw[ch] (kh kw floats) for channels ch in [c0, c1),
 * summed over the nb samples in float64. scratch as above; tot: kh kw doubles. */
void qt_depthwise_wgrad(int64_t c0, int64_t c1, int64_t c, int64_t nb, const int64_t *idx, const float *x, int64_t h,
                        int64_t w, int64_t ph, int64_t pw, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ho,
                        int64_t wo, const float *g, float *gw, float *scratch, double *tot) {
    int64_t hp = h + 2 * ph, wq = (w + 2 * pw + sw - 1) / sw, k = kh * kw;
    int64_t off[k];
    tap_offsets(kh, kw, sw, hp, wq, off);
    for (int64_t ch = c0; ch < c1; ch++) {
        for (int64_t i = 0; i < k; i++)
            tot[i] = 0.0;
        for (int64_t b = 0; b < nb; b++) {
            phase_plane(x + (idx[b] * c + ch) * h * w, h, w, ph, pw, hp, sw, wq, scratch);
            dw_wgrad_plane(scratch, wq, k, off, sh, ho, wo, g + (b * c + ch) * ho * wo, tot);
        }
        for (int64_t i = 0; i < k; i++)
            gw[ch * k + i] = (float)tot[i];
    }
}

/* phase_plane for the planes p in [p0, p1) of x ([N, c, h, w], p = n c + ch) into out[p] (sw hp wq + VL floats each,
 * the last VL zero): qt_depthwise_direct's phases of every sample, once per layer instead of once per plane and
 * iteration */
void qt_depthwise_phase_prepare(int64_t p0, int64_t p1, const float *x, int64_t h, int64_t w, int64_t ph, int64_t pw,
                                int64_t sh, int64_t sw, float *out) {
    int64_t hp = h + 2 * ph, wq = (w + 2 * pw + sw - 1) / sw, phased = sw * hp * wq + VL;
    (void)sh;
    for (int64_t p = p0; p < p1; p++) {
        phase_plane(x + p * h * w, h, w, ph, pw, hp, sw, wq, out + p * phased);
        __builtin_memset(out + p * phased + sw * hp * wq, 0, VL * sizeof(float));
    }
}

/* The direct layer loss of a depthwise convolution through a clamp in one pass per plane (DirectLayerLoss.gradient):
 * for channels ch in [c0, c1) and each of the nb samples idx[b], the plane's padded phases (phase_plane, once), its
 * output (dw_forward_plane) into `plane` (ho wo floats, in cache), the residual and output gradient in place
 * (act_residual_row: g = gscale (clamp(p, lo, hi) - target) m), its weight gradient from the same phases
 * (dw_wgrad_plane) and its bias gradient; nothing of the output goes to memory. The forward, act_residual and wgrad
 * calls' arithmetic, plane for plane: gw the same bits (the samples summed in order per channel), g the same floats;
 * gb[ch] = sum of g over the channel's planes in float64 (not torch's float32 sum), sse[ch] = sum r^2 (float64). gb
 * NULL: not computed; gw NULL: neither gradient, the loss alone (no weight-gradient pass). scratch and tot as
 * qt_depthwise_wgrad's. phases: every plane of x already split into its phases, [N][c][sw hp wq + VL] (phase_plane's
 * layout, its last VL floats zero; qt_depthwise_phase_prepare), read instead of phase_plane per call (the same values:
 * the same bits), or NULL. last: the bias added after the taps instead of before them (DW_BIAS_LAST). kept (AdaQuant's
 * kept outputs, or NULL; with last): every sample's planes of the output without the bias, [N][c][ho wo]
 * (DW_BIAS_LAST), for the weights kwts ([N][c][kh kw]) they were computed with where valid ([N][c]) is 1: a plane whose
 * channel's weight has other bits, or that is not valid, is computed again (and kwts, valid updated); the output is
 * then the kept plane plus the bias instead of a forward: the same floats (DW_BIAS_LAST). */
/* whether sample n's kept plane p = n c + ch is out of date with the channel's weight wc (k floats) */
static inline int dw_kept_stale(const uint8_t *valid, const float *kwts, int64_t p, const float *wc, int64_t k) {
    return !valid[p] || __builtin_memcmp(kwts + p * k, wc, (size_t)k * sizeof(float)) != 0;
}
/* kept plane p computed again from its phases pp (the forward with bias 0) for the channel's weight wc, kwts and valid
 * updated */
static void dw_kept_fill(float *kept, float *kwts, uint8_t *valid, int64_t p, const float *pp, int64_t wq, int64_t k,
                         const int64_t *off, int64_t sh, int64_t ho, int64_t wo, const float *wc) {
    dw_forward_plane(pp, wq, k, off, sh, ho, wo, wc, 0.0f, 1, kept + p * ho * wo);
    __builtin_memcpy(kwts + p * k, wc, (size_t)k * sizeof(float));
    valid[p] = 1;
}
/* out[q] = kp[q] + (0 + bias) for the plane's len floats: the fresh forward's last addition (DW_BIAS_LAST); out may be
 * kp itself */
static void dw_add_bias(int64_t len, const float *kp, float bias, float *out) {
    const float bn = 0.0f + bias;
    if (out == kp) {
        for (int64_t q = 0; q < len; q++)
            out[q] += bn;
        return;
    }
    const float *restrict src = kp;
    float *restrict dst = out;
    for (int64_t q = 0; q < len; q++)
        dst[q] = src[q] + bn;
}
void qt_depthwise_direct(int64_t c0, int64_t c1, int64_t c, int64_t nb, const int64_t *idx, const float *x, int64_t h,
                         int64_t w, int64_t ph, int64_t pw, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ho,
                         int64_t wo, const float *weight, const float *bias, const float *target, float lo, float hi,
                         float wlo, float whi, float gscale, float *gw, float *gb, double *sse, float *scratch,
                         float *plane, double *tot, const float *phases, int64_t last, float *kept, float *kwts,
                         uint8_t *valid) {
    int64_t hp = h + 2 * ph, wq = (w + 2 * pw + sw - 1) / sw, k = kh * kw, len = ho * wo;
    int64_t phased = sw * hp * wq + VL; /* floats per plane of `phases` */
    int64_t off[k];
    tap_offsets(kh, kw, sw, hp, wq, off);
    for (int64_t ch = c0; ch < c1; ch++) {
        for (int64_t i = 0; i < k; i++)
            tot[i] = 0.0;
        double total = 0.0, gsum = 0.0;
        const float *wc = weight + ch * k;
        for (int64_t b = 0; b < nb; b++) {
            int64_t p = idx[b] * c + ch;
            int stale = kept != NULL && dw_kept_stale(valid, kwts, p, wc, k);
            const float *pp = scratch;
            if (phases != NULL)
                pp = phases + p * phased;
            else if (kept == NULL || stale || gw != NULL) /* (a kept plane's loss alone reads no phases) */
                phase_plane(x + p * h * w, h, w, ph, pw, hp, sw, wq, scratch);
            if (kept != NULL) {
                if (stale)
                    dw_kept_fill(kept, kwts, valid, p, pp, wq, k, off, sh, ho, wo, wc);
                dw_add_bias(len, kept + p * len, bias ? bias[ch] : 0.0f, plane);
            } else
                dw_forward_plane(pp, wq, k, off, sh, ho, wo, wc, bias ? bias[ch] : 0.0f, (int)last, plane);
            total += act_residual_row(len, plane, target + p * len, lo, hi, wlo, whi, gscale, sse != NULL);
            if (gw != NULL)
                dw_wgrad_plane(pp, wq, k, off, sh, ho, wo, plane, tot);
            if (gb != NULL) {
                double acc[8] = {0.0};
                int64_t q = 0;
                for (; q + 8 <= len; q += 8)
                    for (int t = 0; t < 8; t++)
                        acc[t] += (double)plane[q + t];
                for (; q < len; q++)
                    acc[0] += (double)plane[q];
                for (int t = 0; t < 8; t++)
                    gsum += acc[t];
            }
        }
        for (int64_t i = 0; gw != NULL && i < k; i++)
            gw[ch * k + i] = (float)tot[i];
        if (gb != NULL)
            gb[ch] = (float)gsum;
        if (sse != NULL)
            sse[ch] = total;
    }
}

/* The kept outputs (qt_depthwise_direct's kept, kwts, valid) of every sample n in [0, nn) for channels ch in [c0, c1),
 * brought up to date with `weight` (planes out of date computed again), plus the bias, into out ([nn][c][ho wo]; may be
 * kept itself): the layer's output, the same floats as qt_depthwise_forward_pads' with last (DW_BIAS_LAST). scratch,
 * phases as qt_depthwise_direct's. */
void qt_depthwise_kept_output(int64_t c0, int64_t c1, int64_t c, int64_t nn, const float *x, int64_t h, int64_t w,
                              int64_t ph, int64_t pw, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ho,
                              int64_t wo, const float *weight, const float *bias, float *kept, float *kwts,
                              uint8_t *valid, float *out, float *scratch, const float *phases) {
    int64_t hp = h + 2 * ph, wq = (w + 2 * pw + sw - 1) / sw, k = kh * kw, len = ho * wo;
    int64_t phased = sw * hp * wq + VL;
    int64_t off[k];
    tap_offsets(kh, kw, sw, hp, wq, off);
    for (int64_t ch = c0; ch < c1; ch++) {
        const float *wc = weight + ch * k;
        for (int64_t n = 0; n < nn; n++) {
            int64_t p = n * c + ch;
            if (dw_kept_stale(valid, kwts, p, wc, k)) {
                const float *pp = scratch;
                if (phases != NULL)
                    pp = phases + p * phased;
                else
                    phase_plane(x + p * h * w, h, w, ph, pw, hp, sw, wq, scratch);
                dw_kept_fill(kept, kwts, valid, p, pp, wq, k, off, sh, ho, wo, wc);
            }
            dw_add_bias(len, kept + p * len, bias ? bias[ch] : 0.0f, out + p * len);
        }
    }
}

/* act_residual_row on a row of the channel-blocked layout (n = positions x GB floats: lane q % GB is the channel),
 * its sums per channel: sse[t] += r^2 (sse not NULL) and gs[t] += g (gs not NULL) (float64, position order), p := g.
 * The same expressions as act_residual_row, so the same g; each case its own copy of the loop. */
static inline __attribute__((always_inline)) void act_residual_lanes_body(int64_t n, float *restrict p,
                                                                          const float *restrict y, float lo, float hi,
                                                                          float wlo, float whi, float gscale,
                                                                          double *restrict sse, double *restrict gs,
                                                                          const int BOUNDS, const int SSE,
                                                                          const int GSUM) {
    double acc[GB], gac[GB];
    for (int t = 0; t < GB; t++) {
        acc[t] = SSE ? sse[t] : 0.0;
        gac[t] = GSUM ? gs[t] : 0.0;
    }
    for (int64_t q = 0; q < n; q += GB)
        for (int t = 0; t < GB; t++) {
            float x = p[q + t];
            float a = x < lo ? lo : (x > hi ? hi : x);
            float r = a - y[q + t];
            if (SSE)
                acc[t] += (double)r * (double)r;
            float m = RESID_MASK(BOUNDS, x);
            float g = gscale * r * m;
            p[q + t] = g;
            if (GSUM)
                gac[t] += (double)g;
        }
    for (int t = 0; t < GB; t++) {
        if (SSE)
            sse[t] = acc[t];
        if (GSUM)
            gs[t] = gac[t];
    }
}
static void act_residual_lanes(int64_t n, float *restrict p, const float *restrict y, float lo, float hi, float wlo,
                               float whi, float gscale, double *restrict sse, double *restrict gs) {
#define LANES_CASE(B, S, G) act_residual_lanes_body(n, p, y, lo, hi, wlo, whi, gscale, sse, gs, B, S, G)
    RESID_DISPATCH(LANES_CASE, wlo, whi, sse != NULL, gs != NULL);
#undef LANES_CASE
}

#if !(defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)) /* (AVX2: dwb8_plane_* below) */
/* one output row of the channel-blocked forward: prow[xx GB + t] = (iv + sum_i w_i xs(xx step + off_i)) + pv
 * (DW_BIAS_LAST: the bias in iv or in pv per lane), the taps in order (qt_depthwise_forward's multiply-adds, so its
 * floats). P positions side by side: P independent chains of multiply-adds (one chain waits on each multiply-add's
 * latency, 4 cycles); K taps as a constant keeps the weights in registers. */
#define DWB_FORWARD(NAME, K, P)                                                                                        \
    static void NAME(const float *restrict xs, const int64_t *restrict off, int64_t k, int64_t step, int64_t wo,     \
                     const float *restrict wb, vf iv, vf pv, float *restrict prow) {                                  \
        vf wv[K];                                                                                                      \
        int64_t o[K];                                                                                                  \
        for (int64_t i = 0; i < (K); i++) {                                                                            \
            wv[i] = loadu(wb + i * GB);                                                                                \
            o[i] = off[i];                                                                                             \
        }                                                                                                              \
        int64_t xx = 0;                                                                                                \
        for (; xx + (P) <= wo; xx += (P)) {                                                                            \
            const float *base = xs + xx * step;                                                                        \
            vf acc[P];                                                                                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < (P); j++) acc[j] = iv;                                        \
            _Pragma("GCC unroll 25") for (int64_t i = 0; i < (K); i++)                                                 \
                _Pragma("GCC unroll 8") for (int j = 0; j < (P); j++) acc[j] += wv[i] * loadu(base + j * step + o[i]); \
            _Pragma("GCC unroll 8") for (int j = 0; j < (P); j++)                                                      \
                storeu(prow + (xx + j) * GB, acc[j] + pv);                                                             \
        }                                                                                                              \
        for (; xx < wo; xx++) {                                                                                        \
            const float *base = xs + xx * step;                                                                        \
            vf acc = iv;                                                                                               \
            _Pragma("GCC unroll 25") for (int64_t i = 0; i < (K); i++) acc += wv[i] * loadu(base + o[i]);             \
            storeu(prow + xx * GB, acc + pv);                                                                          \
        }                                                                                                              \
        (void)k;                                                                                                       \
    }
DWB_FORWARD(dwb_forward_k9, 9, 8)
DWB_FORWARD(dwb_forward_k25, 25, 4)
static void dwb_forward_any(const float *restrict xs, const int64_t *restrict off, int64_t k, int64_t step, int64_t wo,
                            const float *restrict wb, vf iv, vf pv, float *restrict prow) {
    int64_t xx = 0;
    for (; xx + 4 <= wo; xx += 4) {
        const float *base = xs + xx * step;
        vf a0 = iv, a1 = iv, a2 = iv, a3 = iv;
        for (int64_t i = 0; i < k; i++) {
            vf wv = loadu(wb + i * GB);
            a0 += wv * loadu(base + off[i]);
            a1 += wv * loadu(base + step + off[i]);
            a2 += wv * loadu(base + 2 * step + off[i]);
            a3 += wv * loadu(base + 3 * step + off[i]);
        }
        storeu(prow + xx * GB, a0 + pv);
        storeu(prow + (xx + 1) * GB, a1 + pv);
        storeu(prow + (xx + 2) * GB, a2 + pv);
        storeu(prow + (xx + 3) * GB, a3 + pv);
    }
    for (; xx < wo; xx++) {
        const float *base = xs + xx * step;
        vf acc = iv;
        for (int64_t i = 0; i < k; i++)
            acc += loadu(wb + i * GB) * loadu(base + off[i]);
        storeu(prow + xx * GB, acc + pv);
    }
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* The channel-blocked forward of a whole plane on AVX2: each 8-channel half of the block on its own (one 256-bit
 * vector), DWB8_P positions side by side across rows (independent chains of multiply-adds even on a 7-wide plane), each
 * tap's weight loaded once per group; every lane gets dwb_forward_*'s operations in their order (from init a
 * multiply-add per tap in tap order, then post), so the same floats. The sixteen-lane forms spilled on AVX2: their nine
 * or twenty-five weights and eight accumulators are two registers each (522 of 943 instructions of dwb_forward_k9 went
 * through the stack). */
#define DWB8_P 8
#define DWB8_PLANE(NAME, KK)                                                                                           \
    static void NAME(const float *restrict xs, const int64_t *restrict off, int64_t k, int64_t sh, int64_t wp,       \
                     int64_t step, int64_t ho, int64_t wo, const float *restrict wb, const float *restrict init16,    \
                     const float *restrict post16, float *restrict prow) {                                             \
        const int64_t len = ho * wo;                                                                                   \
        for (int64_t hf = 0; hf < GB; hf += 8) {                                                                       \
            vf8 iv, bv;                                                                                                \
            __builtin_memcpy(&iv, init16 + hf, sizeof iv);                                                             \
            __builtin_memcpy(&bv, post16 + hf, sizeof bv);                                                             \
            int64_t q = 0;                                                                                             \
            for (; q + DWB8_P <= len; q += DWB8_P) {                                                                   \
                const float *in[DWB8_P];                                                                               \
                vf8 a[DWB8_P];                                                                                         \
                _Pragma("GCC unroll 8") for (int j = 0; j < DWB8_P; j++) {                                             \
                    int64_t y = (q + j) / wo, xx = (q + j) % wo;                                                       \
                    in[j] = xs + sh * y * wp * GB + xx * step + hf;                                                    \
                    a[j] = iv;                                                                                         \
                }                                                                                                      \
                for (int64_t i = 0; i < (KK); i++) {                                                                   \
                    vf8 w;                                                                                             \
                    __builtin_memcpy(&w, wb + i * GB + hf, sizeof w);                                                  \
                    const int64_t oi = off[i];                                                                         \
                    _Pragma("GCC unroll 8") for (int j = 0; j < DWB8_P; j++) {                                         \
                        vf8 t;                                                                                         \
                        __builtin_memcpy(&t, in[j] + oi, sizeof t);                                                    \
                        a[j] = fma8(w, t, a[j]);                                                                       \
                    }                                                                                                  \
                }                                                                                                      \
                _Pragma("GCC unroll 8") for (int j = 0; j < DWB8_P; j++) {                                             \
                    const vf8 s_ = a[j] + bv;                                                                          \
                    __builtin_memcpy(prow + (q + j) * GB + hf, &s_, sizeof s_);                                        \
                }                                                                                                      \
            }                                                                                                          \
            for (; q < len; q++) {                                                                                     \
                int64_t y = q / wo, xx = q % wo;                                                                       \
                const float *in0 = xs + sh * y * wp * GB + xx * step + hf;                                             \
                vf8 a0 = iv;                                                                                           \
                for (int64_t i = 0; i < (KK); i++) {                                                                   \
                    vf8 w, t;                                                                                          \
                    __builtin_memcpy(&w, wb + i * GB + hf, sizeof w);                                                  \
                    __builtin_memcpy(&t, in0 + off[i], sizeof t);                                                      \
                    a0 = fma8(w, t, a0);                                                                               \
                }                                                                                                      \
                a0 += bv;                                                                                              \
                __builtin_memcpy(prow + q * GB + hf, &a0, sizeof a0);                                                  \
            }                                                                                                          \
        }                                                                                                              \
        (void)k;                                                                                                       \
    }
DWB8_PLANE(dwb8_plane_k9, 9)
DWB8_PLANE(dwb8_plane_k25, 25)
DWB8_PLANE(dwb8_plane_any, k)
#endif

/* the weight gradient of taps [i0, i0 + T) over the plane: s_i = sum_{y, x} g(y, x) xs(sh y wp GB + x step + off_i), one
 * float32 vector per tap (T independent chains: the plane's positions in order for each), added into gtot in float64 */
#define DWB_WGRAD(NAME, T)                                                                                             \
    static void NAME(const float *restrict xs, const int64_t *restrict off, int64_t i0, int64_t sh, int64_t wp,      \
                     int64_t step, int64_t ho, int64_t wo, const float *restrict g, double *restrict gtot) {          \
        vf s[T];                                                                                                       \
        _Pragma("GCC unroll 8") for (int j = 0; j < (T); j++) s[j] = (vf){0};                                         \
        for (int64_t y = 0; y < ho; y++) {                                                                             \
            const float *xr = xs + sh * y * wp * GB, *gy = g + y * wo * GB;                                            \
            for (int64_t xx = 0; xx < wo; xx++) {                                                                      \
                vf gv = loadu(gy + xx * GB);                                                                           \
                const float *xp = xr + xx * step;                                                                      \
                _Pragma("GCC unroll 8") for (int j = 0; j < (T); j++) s[j] += gv * loadu(xp + off[i0 + j]);           \
            }                                                                                                          \
        }                                                                                                              \
        for (int j = 0; j < (T); j++)                                                                                  \
            for (int t = 0; t < GB; t++)                                                                               \
                gtot[(i0 + j) * GB + t] += (double)s[j][t];                                                            \
    }
DWB_WGRAD(dwb_wgrad_1, 1)
#ifdef __AVX512F__
DWB_WGRAD(dwb_wgrad_8, 8)
#else
/* dwb_wgrad_8 on AVX2: the same sums per lane, eight lanes (one 256-bit vector) at a time, eight named accumulators
 * (the sixteen-lane form's eight accumulators need sixteen registers, and GCC kept them on the stack) */
static void dwb_wgrad_8(const float *restrict xs, const int64_t *restrict off, int64_t i0, int64_t sh, int64_t wp,
                        int64_t step, int64_t ho, int64_t wo, const float *restrict g, double *restrict gtot) {
    const int64_t o0 = off[i0], o1 = off[i0 + 1], o2 = off[i0 + 2], o3 = off[i0 + 3], o4 = off[i0 + 4],
                  o5 = off[i0 + 5], o6 = off[i0 + 6], o7 = off[i0 + 7];
    for (int64_t hf = 0; hf < GB; hf += 8) {
        vf8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0}, s5 = {0}, s6 = {0}, s7 = {0};
        for (int64_t y = 0; y < ho; y++) {
            const float *xr = xs + sh * y * wp * GB + hf, *gy = g + y * wo * GB + hf;
            for (int64_t xx = 0; xx < wo; xx++) {
                vf8 gv, t;
                __builtin_memcpy(&gv, gy + xx * GB, sizeof gv);
                const float *xq = xr + xx * step;
#define DWB_TAP8(j)                                                                                                    \
    __builtin_memcpy(&t, xq + o##j, sizeof t);                                                                         \
    s##j += gv * t
                DWB_TAP8(0); DWB_TAP8(1); DWB_TAP8(2); DWB_TAP8(3); DWB_TAP8(4); DWB_TAP8(5); DWB_TAP8(6); DWB_TAP8(7);
#undef DWB_TAP8
            }
        }
        for (int t = 0; t < 8; t++) {
            gtot[(i0 + 0) * GB + hf + t] += (double)s0[t];
            gtot[(i0 + 1) * GB + hf + t] += (double)s1[t];
            gtot[(i0 + 2) * GB + hf + t] += (double)s2[t];
            gtot[(i0 + 3) * GB + hf + t] += (double)s3[t];
            gtot[(i0 + 4) * GB + hf + t] += (double)s4[t];
            gtot[(i0 + 5) * GB + hf + t] += (double)s5[t];
            gtot[(i0 + 6) * GB + hf + t] += (double)s6[t];
            gtot[(i0 + 7) * GB + hf + t] += (double)s7[t];
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* dwb_wgrad_8's sums for the taps [i0, i0 + T) with T (<= DWBW_MAX) a constant per instance, in one pass per
 * 8-channel half: a 3x3 kernel's nine taps in one pass instead of eight and then one more (a whole pass over the plane
 * and the gradient for one tap), a 5x5's 25 in three (12, 12, 1) instead of four. The same float32 sums per lane and
 * tap (positions in order), added into gtot in float64 as dwb_wgrad_8 adds them. */
#define DWBW_MAX 12
static inline __attribute__((always_inline)) void dwbw_taps(const int T, const float *restrict xs,
                                                            const int64_t *restrict off, int64_t i0, int64_t sh,
                                                            int64_t wp, int64_t step, int64_t ho, int64_t wo,
                                                            const float *restrict g, double *restrict gtot) {
    int64_t o[DWBW_MAX];
    _Pragma("GCC unroll 12") for (int j = 0; j < T; j++) o[j] = off[i0 + j];
    for (int64_t hf = 0; hf < GB; hf += 8) {
        vf8 a[DWBW_MAX];
        _Pragma("GCC unroll 12") for (int j = 0; j < T; j++) a[j] = (vf8){0};
        for (int64_t y = 0; y < ho; y++) {
            const float *xr = xs + sh * y * wp * GB + hf, *gy = g + y * wo * GB + hf;
            for (int64_t xx = 0; xx < wo; xx++) {
                vf8 gv;
                __builtin_memcpy(&gv, gy + xx * GB, sizeof gv);
                const float *xq = xr + xx * step;
                _Pragma("GCC unroll 12") for (int j = 0; j < T; j++) {
                    vf8 t;
                    __builtin_memcpy(&t, xq + o[j], sizeof t);
                    a[j] += gv * t;
                }
            }
        }
        _Pragma("GCC unroll 12") for (int j = 0; j < T; j++)
            for (int t = 0; t < 8; t++)
                gtot[(i0 + j) * GB + hf + t] += (double)a[j][t];
    }
}
__attribute__((noinline)) static void dwb_wgrad_taps(int64_t n, const float *xs, const int64_t *off, int64_t i0,
                                                     int64_t sh, int64_t wp, int64_t step, int64_t ho, int64_t wo,
                                                     const float *g, double *gtot) {
    if (n == 12)
        dwbw_taps(12, xs, off, i0, sh, wp, step, ho, wo, g, gtot);
    else /* n == 9 */
        dwbw_taps(9, xs, off, i0, sh, wp, step, ho, wo, g, gtot);
}
#endif

/* the channel-blocked forward of a whole plane into prow (ho wo GB floats): the AVX2 forms on AVX2 (dwb8_plane_*),
 * else the sixteen-lane forms row by row; the same floats either way */
static void dwb_forward_plane(const float *restrict xs, const int64_t *restrict off, int64_t k, int64_t sh, int64_t wp,
                              int64_t step, int64_t ho, int64_t wo, const float *restrict wb,
                              const float *restrict bias16, int last, float *restrict prow) {
    float init16[GB], post16[GB]; /* DW_BIAS_LAST: bias16 (0 + bias per lane) first or last */
    for (int64_t t = 0; t < GB; t++) {
        init16[t] = last ? 0.0f : bias16[t];
        post16[t] = last ? bias16[t] : 0.0f;
    }
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    (k == 9 ? dwb8_plane_k9 : (k == 25 ? dwb8_plane_k25 : dwb8_plane_any))(xs, off, k, sh, wp, step, ho, wo, wb,
                                                                           init16, post16, prow);
#else
    void (*forward)(const float *, const int64_t *, int64_t, int64_t, int64_t, const float *, vf, vf, float *) =
        k == 9 ? dwb_forward_k9 : (k == 25 ? dwb_forward_k25 : dwb_forward_any);
    vf iv = loadu(init16), pv = loadu(post16);
    for (int64_t y = 0; y < ho; y++)
        forward(xs + sh * y * wp * GB, off, k, step, wo, wb, iv, pv, prow + y * wo * GB);
#endif
}

/* the cn channels' planes of one sample and block (src: the first plane, h x w floats each) interleaved into xs'
 * interior (hp x wp columns of GB floats, rows and columns past ph / pw; its zero border left as it is) */
static void dwb_interleave_planes(float *xs, const float *src, int64_t h, int64_t w, int64_t ph, int64_t pw, int64_t wp,
                                  int64_t cn) {
    for (int64_t r = 0; r < h; r++)
        interleave(xs + ((r + ph) * wp + pw) * GB, src + r * w, w, h * w, cn);
}

/* qt_depthwise_direct_blocked's xs and ts of every sample: for the (sample, block) pairs q in [q0, q1) of n x
 * ceil(c / GB), the block's zero-padded planes interleaved into xs_all[q] (hp wp GB floats) and its target rows into
 * ts_all[q] (ho wo GB floats; channels past c zero), as the kernel interleaves them per call */
void qt_depthwise_blocked_prepare(int64_t q0, int64_t q1, int64_t c, const float *x, int64_t h, int64_t w,
                                  int64_t ph, int64_t pw, const float *target, int64_t len, float *xs_all,
                                  float *ts_all) {
    int64_t hp = h + 2 * ph, wp = w + 2 * pw, plane = h * w, nblk = (c + GB - 1) / GB;
    for (int64_t q = q0; q < q1; q++) {
        int64_t n = q / nblk, c0 = (q % nblk) * GB, cn = c - c0 < GB ? c - c0 : GB;
        float *xs = xs_all + q * hp * wp * GB;
        __builtin_memset(xs, 0, (size_t)(hp * wp * GB) * sizeof(float));
        dwb_interleave_planes(xs, x + (n * c + c0) * plane, h, w, ph, pw, wp, cn);
        interleave(ts_all + q * len * GB, target + (n * c + c0) * len, len, len, cn);
    }
}

/* qt_depthwise_direct with GB channels per vector instead of VL output columns, for small planes (a 7 x 7 output
 * fills 7 of 16 lanes per plane row there, and each plane pays its own padded copy and lane sums). Per block of GB
 * channels and sample: the zero-padded planes interleaved (xs: hp wp columns of GB floats; the border zeroed once per
 * call and never written) and the block's target rows (ts: ho wo x GB); then over the plane
 *   p = bias + sum_i w_i x(pos + o_i)          dwb_forward_*: qt_depthwise_forward's floats (the bias last with
 *                                              `last`: DW_BIAS_LAST)
 *   r = clamp(p, lo, hi) - target; g = gscale r m       act_residual_lanes: act_residual_row's floats
 *   gw_i += g x(pos + o_i)                     one float32 vector per tap over the plane, then float64 per channel
 *   gb += g, sse += r^2                        float64 per channel, in position order
 * p, r and g are qt_depthwise_direct's bits; gw, gb and sse are sums of the same terms in another order (float
 * rounding apart). Work items: blocks [q0, q1) of ceil(c / GB). Scratch (floats): xs hp wp GB, ts ho wo GB, wb k GB,
 * prow ho wo GB (the plane's outputs, then its output gradient); tot: (k + 2) GB doubles. gw NULL: the loss alone;
 * gb NULL: no bias gradient. xs_all / ts_all (both or neither): every sample's planes and target rows already in
 * that layout, [N][ceil(c / GB)][hp wp GB] and [N][ceil(c / GB)][ho wo GB] (qt_depthwise_blocked_prepare), read
 * instead of interleaved per call (the same values, so the same bits; xs and ts unused then). last: as
 * qt_depthwise_direct's. kept (or NULL; with last): qt_depthwise_direct's kept outputs in this layout,
 * [N][ceil(c / GB)][ho wo GB] (the block's sums without the bias), for the block weights kwts
 * ([N][ceil(c / GB)][kh kw GB], wb's layout) where valid ([N][ceil(c / GB)]) is 1: a block whose weights have other
 * bits is computed again (every lane: the lanes whose weights did not change get their kept floats again), and the
 * output is the kept block plus the bias. */
static const float zero16[GB] = {0};
/* the channel-blocked kernels' tap offsets in an interleaved padded plane (wp columns of GB floats) */
static void dwb_offsets(int64_t kh, int64_t kw, int64_t wp, int64_t *off) {
    for (int64_t a = 0; a < kh; a++)
        for (int64_t b = 0; b < kw; b++)
            off[a * kw + b] = (a * wp + b) * GB;
}
/* block q's weights interleaved (wb: k x GB, zeros past the cn channels) and its biases as 0 + bias (bb: GB) */
static void dwb_block_weights(const float *weight, const float *bias, int64_t k, int64_t c0, int64_t cn, float *wb,
                              float *bb) {
    for (int64_t i = 0; i < k; i++)
        for (int64_t t = 0; t < GB; t++)
            wb[i * GB + t] = t < cn ? weight[(c0 + t) * k + i] : 0.0f;
    for (int64_t t = 0; t < GB; t++)
        bb[t] = (bias != NULL && t < cn) ? 0.0f + bias[c0 + t] : 0.0f; /* (+0 for -0: DW_BIAS_LAST) */
}
/* whether kept block pq is out of date with the block weights wb (not valid, or kwts' copy has other bits) */
static inline int dwb_kept_stale(const uint8_t *valid, const float *kwts, int64_t pq, const float *wb, int64_t k) {
    return !valid[pq] || __builtin_memcmp(kwts + pq * k * GB, wb, (size_t)(k * GB) * sizeof(float)) != 0;
}
/* kept block pq (kept + pq ho wo GB) computed again from the interleaved planes xb (the forward with bias 0) for the
 * block weights wb, kwts and valid updated: dw_kept_fill's channel-blocked twin */
static void dwb_kept_fill(float *kept, float *kwts, uint8_t *valid, int64_t pq, const float *wb, int64_t k,
                          const float *xb, const int64_t *off, int64_t sh, int64_t wp, int64_t step, int64_t ho,
                          int64_t wo) {
    dwb_forward_plane(xb, off, k, sh, wp, step, ho, wo, wb, zero16, 1, kept + pq * ho * wo * GB);
    __builtin_memcpy(kwts + pq * k * GB, wb, (size_t)(k * GB) * sizeof(float));
    valid[pq] = 1;
}
void qt_depthwise_direct_blocked(int64_t q0, int64_t q1, int64_t c, int64_t nb, const int64_t *idx, const float *x,
                                 int64_t h, int64_t w, int64_t ph, int64_t pw, int64_t kh, int64_t kw, int64_t sh,
                                 int64_t sw, int64_t ho, int64_t wo, const float *weight, const float *bias,
                                 const float *target, float lo, float hi, float wlo, float whi, float gscale, float *gw,
                                 float *gb, double *sse, float *xs, float *ts, float *wb, float *prow, double *tot,
                                 const float *xs_all, const float *ts_all, int64_t last, float *kept, float *kwts,
                                 uint8_t *valid) {
    int64_t hp = h + 2 * ph, wp = w + 2 * pw, k = kh * kw, len = ho * wo, plane = h * w, step = sw * GB;
    int64_t nblk = (c + GB - 1) / GB;
    int64_t off[k];
    dwb_offsets(kh, kw, wp, off);
    if (xs_all == NULL)
        __builtin_memset(xs, 0, (size_t)(hp * wp * GB) * sizeof(float));
    double *gtot = tot, *ssel = tot + k * GB, *gsl = ssel + GB;
    for (int64_t q = q0; q < q1; q++) {
        int64_t c0 = q * GB, cn = c - c0 < GB ? c - c0 : GB;
        float bb[GB];
        dwb_block_weights(weight, bias, k, c0, cn, wb, bb);
        for (int64_t j = 0; j < (k + 2) * GB; j++)
            tot[j] = 0.0;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xs, *tb = ts;
            if (xs_all != NULL) { /* the caller's interleaved padded planes and target rows of every sample */
                xb = xs_all + (idx[b] * nblk + q) * hp * wp * GB;
                tb = ts_all + (idx[b] * nblk + q) * len * GB;
            } else {
                dwb_interleave_planes(xs, x + (idx[b] * c + c0) * plane, h, w, ph, pw, wp, cn);
                interleave(ts, target + (idx[b] * c + c0) * len, len, len, cn);
            }
            if (kept != NULL) {
                int64_t pq = idx[b] * nblk + q;
                if (dwb_kept_stale(valid, kwts, pq, wb, k))
                    dwb_kept_fill(kept, kwts, valid, pq, wb, k, xb, off, sh, wp, step, ho, wo);
                const float *kb = kept + pq * len * GB;
                for (int64_t j = 0; j < len; j++)
                    for (int64_t t = 0; t < GB; t++)
                        prow[j * GB + t] = kb[j * GB + t] + bb[t];
            } else
                dwb_forward_plane(xb, off, k, sh, wp, step, ho, wo, wb, bb, (int)last, prow);
            act_residual_lanes(len * GB, prow, tb, lo, hi, wlo, whi, gscale, sse != NULL ? ssel : NULL,
                               gb != NULL ? gsl : NULL);
            if (gw != NULL) { /* one float32 vector per tap over the plane, eight taps at a time */
                int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
                if (k == 9) /* (AVX2: nine taps in one pass, 12 at a time otherwise) */
                    i = 9, dwb_wgrad_taps(9, xb, off, 0, sh, wp, step, ho, wo, prow, gtot);
                for (; i + 12 <= k; i += 12)
                    dwb_wgrad_taps(12, xb, off, i, sh, wp, step, ho, wo, prow, gtot);
#endif
                for (; i + 8 <= k; i += 8)
                    dwb_wgrad_8(xb, off, i, sh, wp, step, ho, wo, prow, gtot);
                for (; i < k; i++)
                    dwb_wgrad_1(xb, off, i, sh, wp, step, ho, wo, prow, gtot);
            }
        }
        for (int64_t t = 0; t < cn; t++) {
            for (int64_t i = 0; gw != NULL && i < k; i++)
                gw[(c0 + t) * k + i] = (float)gtot[i * GB + t];
            if (gb != NULL)
                gb[c0 + t] = (float)gsl[t];
            if (sse != NULL)
                sse[c0 + t] = ssel[t];
        }
    }
}

/* qt_depthwise_kept_output on qt_depthwise_direct_blocked's kept blocks: for the blocks q in [q0, q1) of every sample
 * n in [0, nn), blocks out of date computed again, then the kept sums plus the bias de-interleaved into out
 * ([nn][c][ho wo]): the same floats as qt_depthwise_forward_pads' with last. xs (hp wp GB floats) and wb (kh kw GB
 * floats): scratch; xs_all: the prepared planes ([N][ceil(c / GB)][hp wp GB]) or NULL. */
void qt_depthwise_kept_output_blocked(int64_t q0, int64_t q1, int64_t c, int64_t nn, const float *x, int64_t h,
                                      int64_t w, int64_t ph, int64_t pw, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                      int64_t ho, int64_t wo, const float *weight, const float *bias, float *kept,
                                      float *kwts, uint8_t *valid, float *out, float *xs, float *wb,
                                      const float *xs_all) {
    int64_t hp = h + 2 * ph, wp = w + 2 * pw, k = kh * kw, len = ho * wo, plane = h * w, step = sw * GB;
    int64_t nblk = (c + GB - 1) / GB;
    int64_t off[k];
    dwb_offsets(kh, kw, wp, off);
    if (xs_all == NULL)
        __builtin_memset(xs, 0, (size_t)(hp * wp * GB) * sizeof(float));
    for (int64_t q = q0; q < q1; q++) {
        int64_t c0 = q * GB, cn = c - c0 < GB ? c - c0 : GB;
        float bb[GB];
        dwb_block_weights(weight, bias, k, c0, cn, wb, bb);
        for (int64_t n = 0; n < nn; n++) {
            int64_t pq = n * nblk + q;
            if (dwb_kept_stale(valid, kwts, pq, wb, k)) { /* (the planes only for a block to compute again) */
                const float *xb = xs;
                if (xs_all != NULL)
                    xb = xs_all + pq * hp * wp * GB;
                else
                    dwb_interleave_planes(xs, x + (n * c + c0) * plane, h, w, ph, pw, wp, cn);
                dwb_kept_fill(kept, kwts, valid, pq, wb, k, xb, off, sh, wp, step, ho, wo);
            }
            const float *kb = kept + pq * len * GB;
            for (int64_t t = 0; t < cn; t++) {
                float *o = out + (n * c + c0 + t) * len;
                for (int64_t j = 0; j < len; j++)
                    o[j] = kb[j * GB + t] + bb[t];
            }
        }
    }
}

/* ------------------------------------------------------------ a small Gram-matrix layer's AdaQuant iteration */
/* Fast finetune's iteration of a small Gram-matrix layer under AdaQuant, without its loss, in one call: the trained
 * INT32 bias's values and mask (qt_bias_values), the mini-batch's gradients from the Gram matrices with those values
 * (qt_gram_gradient), AdaQuant's straight-through step with Adam on the weight and the weight's next values
 * (qt_adaquant_adam), then Adam's step on the bias (qt_masked_adam): the four calls the Python loop makes, in its
 * order and with its arguments, so its bits, without four trips through ctypes and their Python (about 30 us of
 * the 70 an iteration of such a layer took). b NULL: no trained bias (its two calls skipped). Returns 1, having
 * changed nothing the caller keeps, when qt_gram_gradient asks for a row of H first (filled); else 0. */
typedef struct {
    int64_t nids;
    const int64_t *ids;
    const float *flat;
    int64_t len, g, o, k;
    const float *wq, *w0, *b0;
    float nl, f2;
    float *acc, *dw, *R, *gb;
    int32_t *cols;
    const uint8_t *filled;
    int64_t rows, channels, inner;
    float *w;
    const float *outside;
    float *m, *v;
    float b1, b2, eps, lr_c1, inv_c2;
    const float *scale, *zp;
    float lo, hi;
    float *next, *next_outside;
    int64_t nb;
    float *b;
    const double *s64;
    const float *s32;
    int64_t s_step;
    double blo, bhi;
    float *bq, *keep, *mb, *vb;
    float lr_c1b, inv_c2b;
} gram_adaquant_args;

int qt_gram_adaquant_iteration(const gram_adaquant_args *a) {
    if (a->b != NULL)
        qt_bias_values(a->nb, a->b, a->s64, a->s32, a->s_step, a->blo, a->bhi, a->bq, a->keep);
    if (qt_gram_gradient(a->nids, a->ids, a->flat, a->len, a->g, a->o, a->k, a->wq, a->w0,
                         a->b != NULL ? a->bq : NULL, a->b0, a->nl, a->f2, a->acc, a->dw, a->R, a->gb, a->cols,
                         a->filled, NULL))
        return 1; /* a row of H to fill first (qt_gram_gradient): the weight, bias and moments untouched */
    qt_adaquant_adam(0, a->rows, a->channels, a->inner, a->w, a->R, a->outside, a->m, a->v, a->b1, a->b2, a->eps,
                     a->lr_c1, a->inv_c2, a->scale, a->zp, a->lo, a->hi, a->next, a->next_outside, NULL, 0, NULL,
                     NULL, NULL);
    if (a->b != NULL)
        qt_masked_adam(a->nb, a->b, a->gb, a->keep, a->mb, a->vb, a->b1, a->b2, a->eps, a->lr_c1b, a->inv_c2b);
    return 0;
}

/* The same for AdaRound: the mini-batch's gradient from the Gram matrices at the soft-quantized weight wq
 * (qt_gram_gradient, no bias), then the gradient with respect to alpha with the regulariser at beta and Adam's step
 * on alpha with the next soft-quantized weight (qt_adaround_grad with its moments): the two calls the Python loop
 * makes, with its arguments, so its bits. */
typedef struct {
    int64_t nids;
    const int64_t *ids;
    const float *flat;
    int64_t len, g, o, k;
    const float *wq, *w0;
    float nl, f2;
    float *acc, *dw, *R;
    int32_t *cols;
    int64_t rows, channels, inner;
    float *alpha;
    const float *floor, *scale, *zp;
    float lo, hi, beta, reg;
    float *m, *v;
    float b1, b2, eps, lr_c1, inv_c2;
    float *next;
    float *sig;
    int64_t sig_valid;
} gram_adaround_args;

void qt_gram_adaround_iteration(const gram_adaround_args *a) {
    qt_gram_gradient(a->nids, a->ids, a->flat, a->len, a->g, a->o, a->k, a->wq, a->w0, NULL, NULL, a->nl, a->f2,
                     a->acc, a->dw, a->R, NULL, a->cols, NULL, NULL);
    qt_adaround_grad(0, a->rows, a->channels, a->inner, a->alpha, a->floor, a->scale, a->zp, a->lo, a->hi, a->R,
                     a->beta, a->reg, NULL, a->m, a->v, a->b1, a->b2, a->eps, a->lr_c1, a->inv_c2, a->next, a->sig,
                     a->sig_valid);
}

/* the library's interface version, checked at load */
int qt_cpu_steps_version(void) { return 34; }
