/* qtorch-onnx: CPU copies of formats/ functions, one pass over memory instead of a chain of torch operations.
 * Built on first use by qtorch_onnx/cpu_kernels.py (cc -O3 -march=native -fno-math-errno -fno-trapping-math,
 * qtorch_onnx/native.py), loaded with ctypes; no torch headers. Like the Triton kernels, each function is an
 * accelerated copy of a formats/ function and is tested against it bit for bit (tests/test_cpu_kernels.py).
 *
 * qt_fake_quantize_tensor: formats/integer.py's fake_quantize for one (per-tensor) scale and zero point and a
 * type of at most 16 bits (docs/numerics.md section 1), the same float32 operations in the same order as its
 * fused path (_fake_quantize_fused):
 *   v = x / scale (IEEE division);  v = rint(v) (round half to even: the default rounding mode);  v = v + zp;
 *   c = clamp(v, qmin, qmax), NaN -> qmin;  y = (c - zp) * scale
 * No multiply is followed by an add the compiler could contract into one rounding (keep it so when editing).
 *
 * qt_bfp_values: formats/bfp.py's bfp_reference for bfp_method to_bfp without the bfloat16 conversion (BFP16 and
 * the other widths, block sizes and rounding modes; docs/numerics.md sections 4 and 5), with its straight-through
 * mask (section 8) on request. qt_bfp_prime_values: the same for to_bfp_prime (MX4 / MX6 / MX9, section 6).
 * qt_mx_values: formats/mx.py's mx_reference (MXINT8, MXFP8 / 6 / 4, section 7).
 *
 * qt_bf16_qdq: formats/floating.py's scaled_bf16 in its Q/DQ form (Quark's ExtendedQuantizeLinear /
 * ExtendedDequantizeLinear to bfloat16, zero point +0.0, one scale; docs/numerics.md section 3):
 *   v = x / scale + 0.0 (IEEE division; the + 0.0 turns -0.0 into +0.0);  b = bf16 bits of v, round to nearest
 *   even on the bit pattern ((u + 0x7FFF + lsb) >> 16: overflow to +-Inf, subnormals kept), NaN -> 0x7FC1;
 *   y = (float(b) - 0.0) scale, NaN -> 0x7FC00000
 *
 * qt_fp16_round: formats/floating.py's fp16_round (Quark's ExtendedQuantizeLinear / ExtendedDequantizeLinear to
 * float16, scale and zero point ignored; docs/numerics.md section 3): clip to +-65504 (NaN stays NaN), round to
 * float16 (IEEE, to nearest even; subnormals kept), widen back; with `keep`, the straight-through mask (1 where
 * |x| <= 65504 or x is not finite). Only where the compiler has _Float16 (qt_fp16_available); NaN payloads are
 * the conversion's (only NaN-ness is contractual, as for torch's). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef union { uint32_t u; float f; } bits32;

void qt_fake_quantize_tensor(int64_t i0, int64_t i1, const float *x, float *y, float scale, float zp, float qmin,
                             float qmax) {
    for (int64_t i = i0; i < i1; i++) {
        float v = rintf(x[i] / scale) + zp;
        float c = v < qmin ? qmin : (v > qmax ? qmax : v);
        c = c != c ? qmin : c; /* NaN: v compares false both ways and stays NaN above */
        y[i] = (c - zp) * scale;
    }
}

void qt_bf16_qdq(int64_t i0, int64_t i1, const float *x, float *y, float scale) {
    for (int64_t i = i0; i < i1; i++) {
        bits32 v, q, o;
        v.f = x[i] / scale + 0.0f;
        uint32_t r = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
        uint32_t b = (v.u & 0x7fffffffu) > 0x7f800000u ? 0x7fc1u : r; /* NaN: Quark's BFloat16 NaN */
        q.u = b << 16;
        o.f = (q.f - 0.0f) * scale;
        o.u = (o.u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : o.u; /* every NaN result: 0x7FC00000 */
        y[i] = o.f;
    }
}

#if defined(__FLT16_MAX__)
int qt_fp16_available(void) { return 1; }

void qt_fp16_round(int64_t i0, int64_t i1, const float *x, float *y, float *keep) {
    for (int64_t i = i0; i < i1; i++) {
        float v = x[i] < -65504.0f ? -65504.0f : (x[i] > 65504.0f ? 65504.0f : x[i]);
        y[i] = (float)(_Float16)v;
    }
    if (keep)
        for (int64_t i = i0; i < i1; i++) {
            float a = fabsf(x[i]);
            keep[i] = (a <= 65504.0f || !(a < INFINITY)) ? 1.0f : 0.0f; /* NaN and +-Inf pass their gradient */
        }
}
#else
int qt_fp16_available(void) { return 0; }

void qt_fp16_round(int64_t i0, int64_t i1, const float *x, float *y, float *keep) {
    (void)i0, (void)i1, (void)x, (void)y, (void)keep;
}
#endif

/* ------------------------------------------------------------------------------------------------------ BFP */
/* Blocks of `block` elements along the block axis of a tensor seen as [outer, n, inner] (the last block of a row
 * zero-padded: zeros have E = 0, so a partial block is a smaller one); per block the shared exponent field S = the
 * largest exponent field E of its finite elements, the step 2^(S - 127 - (m - 1)) (exact; subnormal below
 * 2^-126, never below 2^-149 for m <= 23), r = round(x / step) in the rounding mode (the quotient of a division by
 * a power of two is exact wherever it matters: it can only underflow where r is 0), y = clamp(r, -(2^m - 1),
 * 2^m - 1) step (exact); Inf / NaN elements pass through unchanged. keep (when asked for) = 1 where the gradient
 * passes (not clipped, or Inf / NaN), else 0. The same float32 operations as the torch reference: the same bits.
 *
 * Two passes per piece of the tensor (BFP_CH elements): every element's shared exponent field into a scratch, then
 * one elementwise loop the compiler vectorizes (bfp_apply, one copy per rounding mode and mask choice). */
#define BFP_CH 256

static inline uint32_t exp_field(float x) {
    bits32 b;
    b.f = x;
    return (b.u >> 23) & 0xffu;
}

static inline float exp2_f(int32_t k) { /* formats/block.py exp2_int for -149 <= k <= 127, branch-free */
    bits32 b;
    int32_t sh = k + 149;
    sh = sh < 0 ? 0 : (sh > 31 ? 31 : sh);
    b.u = k >= -126 ? (uint32_t)(k + 127) << 23 : 1u << sh;
    return b.f;
}

/* rounding_mode 2 (half to even; a nonzero quotient that rounds to zero gives +0.0), 1 (half toward +inf), else
 * half away from zero; modes 0 and 1 keep the quotient's sign on a zero result (formats/block.py round_with_mode) */
static inline __attribute__((always_inline)) float bfp_round(float q, int mode) {
    if (mode == 2) {
        float r = rintf(q);
        return (r == 0.0f) & (q != 0.0f) ? 0.0f : r;
    }
    float r;
    if (mode == 1) {
        float f = floorf(q);
        r = f + (float)(q - f >= 0.5f);
    } else {
        float t = truncf(q);
        float sg = (float)(q > 0.0f) - (float)(q < 0.0f);
        r = t + (fabsf(q - t) >= 0.5f ? sg : 0.0f);
    }
    return copysignf(fabsf(r), q);
}

static inline __attribute__((always_inline)) void bfp_apply(int64_t len, const float *restrict x,
                                                            const uint32_t *restrict s, int32_t m, int mode,
                                                            float *restrict y, float *restrict keep, int with_keep) {
    float lim = (float)((1 << m) - 1);
    for (int64_t i = 0; i < len; i++) {
        float step = exp2_f((int32_t)s[i] - 127 - (m - 1)); /* the step's exponent is >= -149 */
        float xi = x[i];
        float r = bfp_round(xi / step, mode);
        float c = r < -lim ? -lim : (r > lim ? lim : r);
        int special = exp_field(xi) == 255u;
        y[i] = special ? xi : c * step;
        if (with_keep)
            keep[i] = (float)(special | !(fabsf(r) > lim));
    }
}

/* bfp_apply with the mask's presence a constant too (one copy per rounding mode and mask choice) */
static inline __attribute__((always_inline)) void bfp_apply_mode(int64_t len, const float *restrict x,
                                                                 const uint32_t *restrict s, int32_t m, int mode,
                                                                 float *restrict y, float *restrict keep) {
    if (keep != NULL)
        bfp_apply(len, x, s, m, mode, y, keep, 1);
    else
        bfp_apply(len, x, s, m, mode, y, keep, 0);
}

__attribute__((noinline)) static void bfp_apply_any(int64_t len, const float *restrict x, const uint32_t *restrict s,
                                                    int32_t m, int mode, float *restrict y, float *restrict keep) {
    if (mode == 2)
        bfp_apply_mode(len, x, s, m, 2, y, keep);
    else if (mode == 1)
        bfp_apply_mode(len, x, s, m, 1, y, keep);
    else
        bfp_apply_mode(len, x, s, m, 0, y, keep);
}

/* whole contiguous blocks (inner 1): every element's shared exponent field */
__attribute__((noinline)) static void bfp_shared_contiguous(int64_t len, const float *restrict x, int64_t block,
                                                            uint32_t *restrict s) {
    for (int64_t b = 0; b < len; b += block) {
        uint32_t mx = 0;
        for (int64_t i = b; i < b + block; i++) {
            uint32_t e = exp_field(x[i]);
            e = e == 255u ? 0u : e;
            mx = e > mx ? e : mx;
        }
        for (int64_t i = b; i < b + block; i++)
            s[i] = mx;
    }
}

/* ... for blocks of 8 (BFP16's): the maximum by halves, which the compiler vectorizes */
__attribute__((noinline)) static void bfp_shared_contiguous8(int64_t len, const float *restrict x,
                                                             uint32_t *restrict s) {
    for (int64_t b = 0; b < len; b += 8) {
        uint32_t e[8];
        for (int i = 0; i < 8; i++) {
            uint32_t v = exp_field(x[b + i]);
            e[i] = v == 255u ? 0u : v;
        }
        for (int i = 0; i < 4; i++)
            e[i] = e[i] > e[i + 4] ? e[i] : e[i + 4];
        for (int i = 0; i < 2; i++)
            e[i] = e[i] > e[i + 2] ? e[i] : e[i + 2];
        uint32_t mx = e[0] > e[1] ? e[0] : e[1];
        for (int i = 0; i < 8; i++)
            s[b + i] = mx;
    }
}

/* the elementwise rule of a format with BFP's shared exponent (the largest exponent field of a block's finite
 * elements, in s): BFP's (bfp_apply) or OCP MX's (mx_apply), over len elements, with its parameters */
typedef void (*shared_rule)(int64_t len, const float *x, const uint32_t *s, const void *params, float *y,
                            float *keep);

/* rows o in [o0, o1) of x seen as [outer, n, inner], blocks of `block` along n: every element's shared exponent field
 * into a scratch (BFP_CH at a time), then `rule` over the piece; y (and keep, unless NULL) laid out like x */
static void shared_values(int64_t o0, int64_t o1, int64_t n, int64_t inner, int64_t block, const float *x, float *y,
                          float *keep, shared_rule rule, const void *params) {
    uint32_t s[BFP_CH] __attribute__((aligned(64)));
    if (inner == 1 && n % block == 0 && block <= BFP_CH) { /* whole contiguous blocks: pieces of whole blocks */
        int64_t e0 = o0 * n, e1 = o1 * n, piece = (BFP_CH / block) * block;
        for (int64_t c = e0; c < e1; c += piece) {
            int64_t len = e1 - c < piece ? e1 - c : piece;
            if (block == 8)
                bfp_shared_contiguous8(len, x + c, s);
            else
                bfp_shared_contiguous(len, x + c, block, s);
            rule(len, x + c, s, params, y + c, keep ? keep + c : NULL);
        }
        return;
    }
    /* any layout: per block, the shared exponent field of each inner position (BFP_CH of them at a time), then the
     * block's rows of inner values */
    for (int64_t o = o0; o < o1; o++)
        for (int64_t j0 = 0; j0 < inner; j0 += BFP_CH) {
            int64_t w = inner - j0 < BFP_CH ? inner - j0 : BFP_CH;
            for (int64_t b = 0; b < n; b += block) {
                int64_t be = b + block < n ? b + block : n;
                for (int64_t j = 0; j < w; j++)
                    s[j] = 0;
                for (int64_t a = b; a < be; a++) {
                    const float *row = x + (o * n + a) * inner + j0;
                    for (int64_t j = 0; j < w; j++) {
                        uint32_t e = exp_field(row[j]);
                        e = e == 255u ? 0u : e;
                        s[j] = e > s[j] ? e : s[j];
                    }
                }
                for (int64_t a = b; a < be; a++) {
                    int64_t off = (o * n + a) * inner + j0;
                    rule(w, x + off, s, params, y + off, keep ? keep + off : NULL);
                }
            }
        }
}

typedef struct {
    int32_t m, mode;
} bfp_params;

static void bfp_rule(int64_t len, const float *x, const uint32_t *s, const void *params, float *y, float *keep) {
    const bfp_params *p = (const bfp_params *)params;
    bfp_apply_any(len, x, s, p->m, p->mode, y, keep);
}

/* rows o in [o0, o1) of x seen as [outer, n, inner], blocks of `block` along n, m magnitude bits (1..23), rounding
 * mode `mode`; y (and keep, unless NULL) laid out like x */
void qt_bfp_values(int64_t o0, int64_t o1, int64_t n, int64_t inner, int64_t block, int64_t m, int64_t mode,
                   const float *x, float *y, float *keep) {
    bfp_params p = {(int32_t)m, (int32_t)mode};
    shared_values(o0, o1, n, inner, block, x, y, keep, bfp_rule, &p);
}

/* ---------------------------------------------------------------------------------------------------- OCP MX */
/* formats/mx.py's _mx_blocks and quantize_mx_element (docs/numerics.md section 7): the block's scale
 * X = 2^(S - 127 - emax) (exact, possibly subnormal, not clamped to E8M0), v = x / X (float32 division, exact where
 * it matters), then the element grid:
 *   int8: k = R(64 v) in the rounding mode (other modes as 0), clipped where k lies outside [-128, 127],
 *         q = clamp(k, -128, 127) / 64
 *   FP:   step = 2^(max(E(v) - 127, 1 - bias) - mbits), r = rint(v / step) (half to even), every zero +0.0,
 *         q = r step, clipped where |q| > max_norm, q clamped to +-max_norm
 * y = q X; Inf / NaN elements pass through. keep = 1 where not clipped (or Inf / NaN). */
typedef struct {
    int32_t is_int, mbits, bias, emax, mode;
    float max_norm;
} mx_params;

static inline __attribute__((always_inline)) void mx_apply(int64_t len, const float *restrict x,
                                                           const uint32_t *restrict s, int32_t is_int, int32_t mbits,
                                                           int32_t bias, int32_t emax, float max_norm, int mode,
                                                           float *restrict y, float *restrict keep, int with_keep) {
    for (int64_t i = 0; i < len; i++) {
        float xi = x[i];
        float scale = exp2_f((int32_t)s[i] - 127 - emax);
        float v = xi / scale;
        float q;
        int clipped;
        if (is_int) {
            float k = bfp_round(v * 64.0f, mode);
            clipped = (k > 127.0f) | (k < -128.0f);
            q = (k < -128.0f ? -128.0f : (k > 127.0f ? 127.0f : k)) * (1.0f / 64.0f);
        } else {
            int32_t ev = (int32_t)exp_field(v) - 127;
            float step = exp2_f((ev > 1 - bias ? ev : 1 - bias) - mbits);
            float r = rintf(v / step);
            r = r == 0.0f ? 0.0f : r;
            q = r * step;
            clipped = fabsf(q) > max_norm;
            q = q < -max_norm ? -max_norm : (q > max_norm ? max_norm : q);
        }
        int special = exp_field(xi) == 255u;
        y[i] = special ? xi : q * scale;
        if (with_keep)
            keep[i] = (float)(special | !clipped);
    }
}

/* mx_apply with the element kind, the rounding mode (int8 only) and the mask's presence constants in each copy (the
 * loops vectorize) */
static inline __attribute__((always_inline)) void mx_apply_kind(int64_t len, const float *x, const uint32_t *s,
                                                                const mx_params *p, int is_int, int mode, float *y,
                                                                float *keep) {
    if (keep != NULL)
        mx_apply(len, x, s, is_int, p->mbits, p->bias, p->emax, p->max_norm, mode, y, keep, 1);
    else
        mx_apply(len, x, s, is_int, p->mbits, p->bias, p->emax, p->max_norm, mode, y, keep, 0);
}

static void mx_rule(int64_t len, const float *x, const uint32_t *s, const void *params, float *y, float *keep) {
    const mx_params *p = (const mx_params *)params;
    if (!p->is_int)
        mx_apply_kind(len, x, s, p, 0, 2, y, keep);
    else if (p->mode == 2)
        mx_apply_kind(len, x, s, p, 1, 2, y, keep);
    else if (p->mode == 1)
        mx_apply_kind(len, x, s, p, 1, 1, y, keep);
    else /* other modes behave as 0 */
        mx_apply_kind(len, x, s, p, 1, 0, y, keep);
}

/* rows o in [o0, o1) of x seen as [outer, n, inner], blocks of `block` along n; the element type by is_int (int8) or
 * mbits / bias (FP), its emax and max_norm; rounding mode (int8 only); y (and keep, unless NULL) laid out like x */
void qt_mx_values(int64_t o0, int64_t o1, int64_t n, int64_t inner, int64_t block, int64_t is_int, int64_t mbits,
                  int64_t bias, int64_t emax, float max_norm, int64_t mode, const float *x, float *y, float *keep) {
    mx_params p = {(int32_t)is_int, (int32_t)mbits, (int32_t)bias, (int32_t)emax, (int32_t)mode, max_norm};
    shared_values(o0, o1, n, inner, block, x, y, keep, mx_rule, &p);
}

/* ------------------------------------------------------------------------------------------------ BFP-prime */
/* formats/bfp.py's _bfp_prime_blocks (docs/numerics.md section 6: MX4 / MX6 / MX9 and other BFP-prime widths), one
 * block of n (<= block) elements gathered into xb (the rest of the block is the zero padding: E = 0, no effect on
 * the maxima): S = max E over the block, Inf / NaN included; per sub-block of `sub` elements its own maximum E_s and
 * shift = min(S - E_s, 2^shift_bits - 1); the 24-bit significand (0 for zeros and subnormals: they flush) shifted
 * right by t = min(S - shift - E + 24 - m, 31) with the rounding mode's carry on the remainder, a carry into 2^m
 * suppressed (saturated); y = copysign(q 2^k_hi 2^(k - k_hi)), k = S - 127 - shift + 1 - m, k_hi = max(k, -126) (one
 * exact product, then one rounding into the subnormals); every element NaN (0x7FFFFFFF) when S = 255. keep: 1 where
 * not saturated or the element is Inf / NaN (a NaN block's other elements included: with a wide shift they can
 * saturate). Integer arithmetic throughout, as the reference's int32 tensors. */
static inline float exp2_bits(int32_t k) { /* formats/block.py exp2_int: exact 2^k, 0 below 2^-149 */
    bits32 b;
    if (k >= -126)
        b.u = (uint32_t)(k > 127 ? 255 : k + 127) << 23;
    else
        b.u = k < -149 ? 0u : 1u << (k + 149);
    return b.f;
}

static void prime_block(int64_t n, const float *xb, int64_t sub, int32_t m, int32_t shift_max, int mode, float *yb,
                        float *kb) {
    uint32_t e[n];
    int32_t shared = 0;
    for (int64_t i = 0; i < n; i++) {
        e[i] = exp_field(xb[i]);
        shared = (int32_t)e[i] > shared ? (int32_t)e[i] : shared;
    }
    uint32_t qmax = (1u << m) - 1u;
    for (int64_t s0 = 0; s0 < n; s0 += sub) {
        int64_t s1 = s0 + sub < n ? s0 + sub : n;
        int32_t esub = 0;
        for (int64_t i = s0; i < s1; i++)
            esub = (int32_t)e[i] > esub ? (int32_t)e[i] : esub;
        int32_t shift = shared - esub < shift_max ? shared - esub : shift_max;
        int32_t k = shared - 127 - shift + 1 - m, k_hi = k > -126 ? k : -126;
        float f_hi = exp2_bits(k_hi), f_lo = exp2_bits(k - k_hi);
        for (int64_t i = s0; i < s1; i++) {
            bits32 b;
            b.f = xb[i];
            uint32_t mant = e[i] != 0 ? (b.u & 0x7FFFFFu) | 0x800000u : 0u;
            int32_t t = shared - shift - (int32_t)e[i] + (24 - m);
            t = t < 31 ? t : 31;
            uint32_t q = mant >> t, rem = mant - (q << t), half = 1u << (t - 1);
            int up;
            if (mode == 0)
                up = rem >= half;
            else if (mode == 1)
                up = (rem > half) | ((rem == half) & ((int32_t)b.u >= 0));
            else
                up = (rem > half) | ((rem == half) & (int)(q & 1u));
            int saturated = up & (q == qmax);
            q += (uint32_t)(up & !saturated);
            yb[i] = copysignf(((float)q * f_hi) * f_lo, xb[i]);
            if (kb != NULL) /* an Inf / NaN element passes; the others' saturation counts even in a NaN block */
                kb[i] = (float)(!saturated | (e[i] == 255u));
        }
    }
    if (shared == 255) { /* an Inf / NaN anywhere in the block: every element NaN */
        bits32 nan;
        nan.u = 0x7FFFFFFFu;
        for (int64_t i = 0; i < n; i++)
            yb[i] = nan.f;
    }
}

/* prime_block on whole contiguous blocks of 16 (MX4 / MX6 / MX9's) with sub-blocks of 1, 2, 4, 8 or 16: the same
 * integer arithmetic on the 16 lanes of one vector (GCC vector extensions; a sub-block's maximum by lane swaps), the
 * rounding mode a constant. The scalar version runs at about 5 ns an element. */
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef float vf16 __attribute__((vector_size(64)));

/* lane selects by comparison masks (C has no vector ?: ; a comparison gives -1 / 0 per lane) */
static inline vu16 vsel(vi16 mask, vu16 a, vu16 b) { return (a & (vu16)mask) | (b & ~(vu16)mask); }
static inline vi16 vmax(vi16 a, vi16 b) { return (vi16)vsel(a > b, (vu16)a, (vu16)b); }
static inline vi16 vmin(vi16 a, vi16 b) { return (vi16)vsel(a < b, (vu16)a, (vu16)b); }

static inline vu16 exp2_vec(vi16 k) { /* exp2_bits' bit patterns lane by lane, for k <= 128 */
    vu16 normal = (vu16)((vmin(k, (vi16){0} + 127) + 127) << 23);
    vi16 sh = vmax(vmin(k + 149, (vi16){0} + 31), (vi16){0});
    vu16 sub = vsel(k < -149, (vu16){0}, ((vu16){0} + 1u) << (vu16)sh);
    return vsel(k >= -126, normal, sub);
}

/* the outputs (bit patterns) and pass masks of 16 lanes: elements u (their exponent fields e), their blocks' shared
 * fields vs and their sub-blocks' maxima es; a lane of a block with Inf / NaN (vs = 255) is NaN */
static inline __attribute__((always_inline)) vu16 prime_lanes(vu16 u, vi16 e, vi16 vs, vi16 es, int32_t m,
                                                              int32_t shift_max, int mode, vu16 *pass) {
    vi16 shift = vmin(vs - es, (vi16){0} + shift_max);
    vu16 mant = ((u & 0x7FFFFFu) | 0x800000u) & (vu16)(e != 0);
    vi16 t = vmin(vs - shift - e + (24 - m), (vi16){0} + 31);
    vu16 q = mant >> (vu16)t;
    vu16 rem = mant - (q << (vu16)t);
    vu16 half = ((vu16){0} + 1u) << (vu16)(t - 1);
    vu16 up; /* lane masks: all ones or zero */
    if (mode == 0)
        up = (vu16)(rem >= half);
    else if (mode == 1)
        up = (vu16)(rem > half) | ((vu16)(rem == half) & (vu16)((vi16)u >= 0));
    else
        up = (vu16)(rem > half) | ((vu16)(rem == half) & (vu16)((q & 1u) == 1u));
    vu16 saturated = up & (vu16)(q == ((1u << m) - 1u));
    q += up & ~saturated & 1u;
    vi16 k = vs - 127 - shift + 1 - m;
    vi16 k_hi = vmax(k, (vi16){0} - 126);
    vu16 fh = exp2_vec(k_hi), fl = exp2_vec(k - k_hi);
    vf16 fhf, flf;
    __builtin_memcpy(&fhf, &fh, sizeof fh);
    __builtin_memcpy(&flf, &fl, sizeof fl);
    vf16 mag = (__builtin_convertvector(q, vf16) * fhf) * flf;
    vu16 bits;
    __builtin_memcpy(&bits, &mag, sizeof bits);
    bits = (bits & 0x7FFFFFFFu) | (u & 0x80000000u);
    *pass = ~saturated | (vu16)(e == 255);
    return vsel(vs == 255, (vu16){0} + 0x7FFFFFFFu, bits);
}

static inline void store_lanes(float *y, float *kb, vu16 bits, vu16 pass) {
    __builtin_memcpy(y, &bits, sizeof bits);
    if (kb != NULL) {
        vf16 kv = __builtin_convertvector(pass & 1u, vf16);
        __builtin_memcpy(kb, &kv, sizeof kv);
    }
}

/* one contiguous block of 16, its elements the lanes (a sub-block's maximum by lane swaps) */
static inline __attribute__((always_inline)) void prime_block16v(const float *restrict xb, int sub, int32_t m,
                                                                 int32_t shift_max, int mode, float *restrict yb,
                                                                 float *restrict kb) {
    vu16 u;
    __builtin_memcpy(&u, xb, sizeof u);
    vi16 e = (vi16)((u >> 23) & 0xffu);
    int32_t shared = 0;
    for (int i = 0; i < 16; i++)
        shared = e[i] > shared ? e[i] : shared;
    vi16 es = e;
    static const vi16 swap1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    static const vi16 swap2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    static const vi16 swap4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    static const vi16 swap8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    if (sub >= 2)
        es = vmax(es, __builtin_shuffle(es, swap1));
    if (sub >= 4)
        es = vmax(es, __builtin_shuffle(es, swap2));
    if (sub >= 8)
        es = vmax(es, __builtin_shuffle(es, swap4));
    if (sub >= 16)
        es = vmax(es, __builtin_shuffle(es, swap8));
    vu16 pass;
    vu16 bits = prime_lanes(u, e, (vi16){0} + shared, es, m, shift_max, mode, &pass);
    store_lanes(yb, kb, bits, pass);
}

/* blocks along a strided axis: 16 neighbouring positions of the inner dimension are the lanes, each lane its own
 * block; the block's `len` rows (stride `inner`) are read twice, for the maxima and for the outputs */
static inline __attribute__((always_inline)) void prime_columns16(const float *restrict x, int64_t inner,
                                                                  int64_t len, int64_t sub, int32_t m,
                                                                  int32_t shift_max, int mode, float *restrict y,
                                                                  float *restrict keep) {
    vi16 vs = (vi16){0};
    for (int64_t a = 0; a < len; a++) {
        vu16 u;
        __builtin_memcpy(&u, x + a * inner, sizeof u);
        vs = vmax(vs, (vi16)((u >> 23) & 0xffu));
    }
    for (int64_t s0 = 0; s0 < len; s0 += sub) {
        int64_t s1 = s0 + sub < len ? s0 + sub : len;
        vi16 es = (vi16){0};
        for (int64_t a = s0; a < s1; a++) {
            vu16 u;
            __builtin_memcpy(&u, x + a * inner, sizeof u);
            es = vmax(es, (vi16)((u >> 23) & 0xffu));
        }
        for (int64_t a = s0; a < s1; a++) {
            vu16 u, pass;
            __builtin_memcpy(&u, x + a * inner, sizeof u);
            vu16 bits = prime_lanes(u, (vi16)((u >> 23) & 0xffu), vs, es, m, shift_max, mode, &pass);
            store_lanes(y + a * inner, keep != NULL ? keep + a * inner : NULL, bits, pass);
        }
    }
}

__attribute__((noinline)) static void prime_columns16_any(const float *restrict x, int64_t inner, int64_t len,
                                                          int64_t sub, int32_t m, int32_t shift_max, int mode,
                                                          float *restrict y, float *restrict keep) {
    if (mode == 2)
        prime_columns16(x, inner, len, sub, m, shift_max, 2, y, keep);
    else if (mode == 1)
        prime_columns16(x, inner, len, sub, m, shift_max, 1, y, keep);
    else
        prime_columns16(x, inner, len, sub, m, shift_max, 0, y, keep);
}

__attribute__((noinline)) static void prime_blocks16(int64_t nblocks, const float *restrict x, int sub, int32_t m,
                                                     int32_t shift_max, int mode, float *restrict y,
                                                     float *restrict keep) {
    for (int64_t b = 0; b < nblocks; b++) {
        float *kb = keep != NULL ? keep + b * 16 : NULL;
        if (mode == 2)
            prime_block16v(x + b * 16, sub, m, shift_max, 2, y + b * 16, kb);
        else if (mode == 1)
            prime_block16v(x + b * 16, sub, m, shift_max, 1, y + b * 16, kb);
        else
            prime_block16v(x + b * 16, sub, m, shift_max, 0, y + b * 16, kb);
    }
}

/* rows o in [o0, o1) of x seen as [outer, n, inner], blocks of `block` (<= BFP_PRIME_MAX_BLOCK) along n, sub-blocks
 * of `sub`, m magnitude bits, shift_bits, rounding mode; y (and keep, unless NULL) laid out like x. Vectorized where
 * the layout allows: whole contiguous blocks of 16 (inner 1; sub-blocks of 1-16 elements, a power of two), or 16
 * neighbouring inner positions as lanes (a strided block axis, an activation's channels); the rest (the inner tail)
 * block by block, gathered into a local array, computed, scattered back. */
#define BFP_PRIME_MAX_BLOCK 1024
void qt_bfp_prime_values(int64_t o0, int64_t o1, int64_t n, int64_t inner, int64_t block, int64_t sub, int64_t m,
                         int64_t shift_bits, int64_t mode, const float *x, float *y, float *keep) {
    float xb[BFP_PRIME_MAX_BLOCK], yb[BFP_PRIME_MAX_BLOCK], kb[BFP_PRIME_MAX_BLOCK];
    int32_t shift_max = (int32_t)((1u << shift_bits) - 1u);
    if (inner == 1 && block == 16 && n % 16 == 0 && (sub == 1 || sub == 2 || sub == 4 || sub == 8 || sub == 16)) {
        prime_blocks16((o1 - o0) * n / 16, x + o0 * n, (int)sub, (int32_t)m, shift_max, (int)mode, y + o0 * n,
                       keep != NULL ? keep + o0 * n : NULL);
        return;
    }
    for (int64_t o = o0; o < o1; o++)
        for (int64_t b = 0; b < n; b += block) {
            int64_t len = n - b < block ? n - b : block, j16 = inner - inner % 16;
            for (int64_t j = 0; j < j16; j += 16) /* 16 positions at a time, each lane its own block */
                prime_columns16_any(x + (o * n + b) * inner + j, inner, len, sub, (int32_t)m, shift_max, (int)mode,
                                    y + (o * n + b) * inner + j, keep != NULL ? keep + (o * n + b) * inner + j : NULL);
            for (int64_t j = j16; j < inner; j++) {
                const float *src = x + (o * n + b) * inner + j;
                for (int64_t i = 0; i < len; i++)
                    xb[i] = src[i * inner];
                prime_block(len, xb, sub, (int32_t)m, shift_max, (int)mode, yb, keep != NULL ? kb : NULL);
                float *dst = y + (o * n + b) * inner + j;
                for (int64_t i = 0; i < len; i++)
                    dst[i * inner] = yb[i];
                if (keep != NULL) {
                    float *kd = keep + (o * n + b) * inner + j;
                    for (int64_t i = 0; i < len; i++)
                        kd[i * inner] = kb[i];
                }
            }
        }
}

int qt_cpu_kernels_version(void) { return 9; }
