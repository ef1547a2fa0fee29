// qtorch-onnx ONNX Runtime operator library: scalar numerics.
//
// The third copy of the project's numerics (ARCHITECTURE.md "Rules of the house"): these functions
// reproduce, bit for bit, the torch reference functions in qtorch_onnx/formats/ (block.py, bfp.py, mx.py,
// floating.py, integer.py), written from /spec/docs/numerics.md. Every function works on float32 bit patterns
// with plain IEEE-754 float32 arithmetic (default round-to-nearest-even mode); the library is compiled
// with -ffp-contract=off and without -ffast-math so that no operation is fused or reassociated.
//
// Notation (docs/numerics.md preamble): E(x) is the 8-bit biased exponent field of a float32 (bits 30..23);
// zero and subnormals have E = 0, Inf and NaN have E = 255.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__GNUC__) || defined(__clang__)
// Forced inlining: the block loops must be compiled inside block_kernels.cc's per-ISA clones.
#define QTORCH_ORT_INLINE inline __attribute__((always_inline))
#else
#define QTORCH_ORT_INLINE inline
#endif

namespace qtorch_ort {

QTORCH_ORT_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

QTORCH_ORT_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// E(x): biased exponent field, 0..255.
QTORCH_ORT_INLINE int exponent_field(float f) { return static_cast<int>((bits_of(f) >> 23) & 0xFFu); }

// Exact float32 2^k: subnormal for -149 <= k < -126, 0 below -149, +Inf above 127 (formats/block.py exp2_int).
QTORCH_ORT_INLINE float exp2_int(int k) {
  if (k > 127) return float_of(0x7F800000u);
  if (k >= -126) return float_of(static_cast<uint32_t>(k + 127) << 23);
  if (k >= -149) return float_of(1u << (k + 149));
  return 0.0f;
}

constexpr float kTwo23 = 8388608.0f;  // 2^23: every float32 of at least this magnitude is an integer

// The rounding helpers below are written as selects rather than branches so that the compiler can
// vectorize the block loops; every int32 conversion is applied to a value below 2^23 in magnitude only.

// IEEE round half to even to an integral float32 (torch.round). Exact for every float32: below 2^23 the
// sum |v| + 2^23 lies in [2^23, 2^24) where the float32 spacing is 1, so the addition itself rounds to the
// nearest integer, ties to even; the subtraction is exact. The sign of a zero result follows v (-0.3 -> -0.0);
// Inf and NaN come back unchanged.
QTORCH_ORT_INLINE float round_half_even(float v) {
  const float a = std::fabs(v);
  const float r = std::copysign((a + kTwo23) - kTwo23, v);
  return a < kTwo23 ? r : v;
}

// Truncation toward zero (torch.trunc) through an exact int32 conversion (of |v| < 2^23 only).
QTORCH_ORT_INLINE float trunc_f(float v) {
  const bool small = std::fabs(v) < kTwo23;
  const float safe = small ? v : 0.0f;
  const float t = std::copysign(static_cast<float>(static_cast<int32_t>(safe)), v);
  return small ? t : v;
}

// Floor (torch.floor) through an exact int32 conversion (of |v| < 2^23 only).
QTORCH_ORT_INLINE float floor_f(float v) {
  const bool small = std::fabs(v) < kTwo23;
  const float safe = small ? v : 0.0f;
  const float t = static_cast<float>(static_cast<int32_t>(safe));
  const float f = t > safe ? t - 1.0f : t;
  return small ? f : v;
}

// Block-format rounding to an integral float32 (docs/numerics.md preamble; formats/block.py round_with_mode):
//   MODE 0: half away from zero, 1: half toward +infinity, 2: half to even.
// Modes 0 and 1 give a zero result the sign of v; mode 2 gives +0.0 when a nonzero v rounds to zero and
// keeps the sign of a zero v. Callers replace the result for Inf/NaN inputs.
template <int MODE>
QTORCH_ORT_INLINE float round_mode(float v) {
  if (MODE == 2) {
    const float r = round_half_even(v);
    return (r == 0.0f && v != 0.0f) ? 0.0f : r;
  } else if (MODE == 1) {
    const float f = floor_f(v);
    const float r = f + ((v - f >= 0.5f) ? 1.0f : 0.0f);  // v - floor(v) is exact in float32
    return std::copysign(std::fabs(r), v);
  } else {
    const float t = trunc_f(v);
    const float r = std::fabs(t) + ((std::fabs(v - t) >= 0.5f) ? 1.0f : 0.0f);
    return std::copysign(r, v);
  }
}

// x / 2^k for a power of two p = 2^k, computed as x * 2^-k when 2^-k is a finite float32 (k >= -127):
// both are the correctly rounded value of the same exact real number, so they agree bit for bit
// (underflow into subnormals included); a multiplication is several times faster than a division.
struct Pow2Divider {
  explicit Pow2Divider(int k) : p(exp2_int(k)), inv(exp2_int(-k)), use_inv(k >= -127) {}
  float p, inv;
  bool use_inv;
};

// Quark's convert_to_bfloat_before_bfp rounding (formats/block.py bfloat16_round): round to nearest even on
// the bit pattern, bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16 modulo 2^32, with NO NaN special case
// (a NaN whose payload sits in the low 16 bits can become Inf; that is what Quark's vectors record).
QTORCH_ORT_INLINE float bfloat16_round_quark(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t r = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
  return float_of(r);
}

// float32 -> bfloat16 bits, round to nearest even on the bit pattern (docs/numerics.md section 3), overflow to
// +-Inf, subnormals rounded; NaN -> nan_bits (Quark's ExtendedQuantizeLinear writes 0x7FC1).
QTORCH_ORT_INLINE uint16_t bfloat16_bits_rne(float x, uint16_t nan_bits) {
  const uint32_t u = bits_of(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return nan_bits;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

QTORCH_ORT_INLINE float bfloat16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// IEEE float16 -> float32, exact (subnormals included). A NaN keeps its payload in the top mantissa bits and
// is quieted, as the x86 F16C conversion does (torch's own conversion writes other NaN payloads depending
// on the element's position; NaN payloads are not part of the contract, golden README item 4).
QTORCH_ORT_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return float_of(sign | 0x7F800000u | (m ? 0x400000u : 0u) | (m << 13));
  if (e == 0) {
    if (m == 0) return float_of(sign);
    const float mag = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return float_of(sign | bits_of(mag));
  }
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

// IEEE float32 -> float16, round to nearest even (the conversion torch's .to(torch.float16) performs):
// |x| >= 65520 rounds to Inf, float16 subnormals are produced by gradual underflow, NaN stays a quiet NaN
// (payload: the top mantissa bits; only NaN-ness is part of the contract, golden README item 4).
QTORCH_ORT_INLINE uint16_t float_to_half(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 (and Inf)
  if (a >= 0x38800000u) {  // normal float16 range, >= 2^-14: round the 13 dropped bits, then rebias
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
  }
  // float16 subnormal (or zero): the value in units of 2^-24, rounded half to even (exact scaling).
  const float units = round_half_even(std::fabs(f) * 16777216.0f);
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
}

// ------------------------------------------------------------------------------------------------------
// Block formats. Each function quantize-dequantizes ONE block of n contiguous float32 values (n <= the
// block size: a partial last block behaves exactly like a zero-padded one, docs/numerics.md section 4). `in`
// is only read, `out` fully written. in == out is allowed (every element is read before it is written,
// and the shared exponents are computed before any write); partially overlapping buffers are not.
// ------------------------------------------------------------------------------------------------------

// BFP, bfp_method "to_bfp" (docs/numerics.md section 5; formats/bfp.py _bfp_blocks), m = bit_width - 9
// magnitude bits. With PRE every input value is first rounded with bfloat16_round_quark. N > 0 fixes the
// block length at compile time (n is then ignored) so that the loops vectorize without remainders.
template <int MODE, bool PRE, int N>
QTORCH_ORT_INLINE void bfp_block_t(const float* in, float* out, int64_t n_dyn, int m) {
  const int64_t n = N > 0 ? N : n_dyn;
  int shared = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = PRE ? bfloat16_round_quark(in[i]) : in[i];
    const int e = exponent_field(v);
    shared = (e != 255 && e > shared) ? e : shared;  // S = max E over elements that are not Inf/NaN
  }
  const Pow2Divider step(shared - 127 - (m - 1));     // exact power of two, possibly subnormal
  const float lim = static_cast<float>((1 << m) - 1);  // m <= 23: exact
  for (int64_t i = 0; i < n; ++i) {
    const float v = PRE ? bfloat16_round_quark(in[i]) : in[i];
    float r = round_mode<MODE>(step.use_inv ? v * step.inv : v / step.p);
    r = r > lim ? lim : (r < -lim ? -lim : r);   // saturation only clips (keeps -0.0)
    const float y = r * step.p;                  // |r| < 2^23 times a power of two >= 2^-149: exact
    out[i] = exponent_field(v) == 255 ? v : y;   // Inf / NaN pass through unchanged
  }
}

// BFP-prime / microexponents, bfp_method "to_bfp_prime" (docs/numerics.md section 6, arXiv 2302.08007;
// formats/bfp.py _bfp_prime_blocks). The block length is a multiple of sub_block_size except for a
// partial last block (then the last sub-block is partial too); shift_bits in [1, 8]. Integer arithmetic on
// the 24-bit significand in uint32 (t is clamped to 31: any t > 25 discards every bit, as t = 40 does).
template <int MODE, int N>
QTORCH_ORT_INLINE void bfp_prime_block_t(const float* in, float* out, int64_t n_dyn, int m, int64_t sub, int shift_bits) {
  const int64_t n = N > 0 ? N : n_dyn;
  int shared = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int e = exponent_field(in[i]);
    shared = e > shared ? e : shared;  // Inf / NaN included (E = 255)
  }
  if (shared == 255) {  // any Inf or NaN: the whole block becomes NaN 0x7FFFFFFF
    const float nan = float_of(0x7FFFFFFFu);
    for (int64_t i = 0; i < n; ++i) out[i] = nan;
    return;
  }
  const int max_shift = (1 << shift_bits) - 1;
  const uint32_t qmax = (1u << m) - 1u;
  constexpr int64_t kChunk = 256;  // per-element shifts are staged through a small buffer
  int32_t shift_of[kChunk];
  const int64_t chunk = sub <= kChunk ? (kChunk / sub) * sub : 0;
  for (int64_t c0 = 0; c0 < n; c0 += (chunk > 0 ? chunk : sub)) {
    const int64_t c1 = chunk > 0 ? (n - c0 < chunk ? n : c0 + chunk) : (n - c0 < sub ? n : c0 + sub);
    // shift_j = min(S - S_j, 2^d - 1) per sub-block j, S_j = max E in the sub-block
    int32_t uniform_shift = 0;
    for (int64_t j0 = c0; j0 < c1; j0 += sub) {
      const int64_t j1 = c1 - j0 < sub ? c1 : j0 + sub;
      int sub_shared = 0;
      for (int64_t i = j0; i < j1; ++i) {
        const int e = exponent_field(in[i]);
        sub_shared = e > sub_shared ? e : sub_shared;
      }
      const int sh = (shared - sub_shared < max_shift) ? shared - sub_shared : max_shift;
      if (chunk > 0) {
        for (int64_t i = j0; i < j1; ++i) shift_of[i - c0] = sh;
      } else {
        uniform_shift = sh;  // one (large) sub-block per chunk
      }
    }
    for (int64_t i = c0; i < c1; ++i) {
      const int sh = chunk > 0 ? shift_of[i - c0] : uniform_shift;
      const uint32_t u = bits_of(in[i]);
      const int e = static_cast<int>((u >> 23) & 0xFFu);
      const uint32_t mant = e ? ((u & 0x7FFFFFu) | 0x800000u) : 0u;  // subnormals flush to (signed) zero
      int t = (shared - sh - e) + (24 - m);                             // >= 1
      t = t > 31 ? 31 : t;
      uint32_t q = mant >> t;
      const uint32_t rem = mant - (q << t);
      const uint32_t half = 1u << (t - 1);
      bool up;
      if (MODE == 0) up = rem >= half;
      else if (MODE == 1) up = rem > half || (rem == half && (u >> 31) == 0u);
      else up = rem > half || (rem == half && (q & 1u) == 1u);
      q += (up && q != qmax) ? 1u : 0u;  // a kept value already at 2^m - 1 is never rounded up
      // q * 2^k, k = S - 127 - shift + 1 - m in [-155, 127]: an exact product by 2^max(k, -126), then one
      // correctly rounded product by 2^(k - max(k, -126)) in [2^-29, 1] (both normal powers of two)
      const int k = shared - 127 - sh + 1 - m;
      const int k_hi = k < -126 ? -126 : k;
      const float scale_hi = float_of(static_cast<uint32_t>(k_hi + 127) << 23);
      const float scale_lo = float_of(static_cast<uint32_t>(k - k_hi + 127) << 23);
      const float mag = (static_cast<float>(static_cast<int32_t>(q)) * scale_hi) * scale_lo;
      out[i] = float_of(bits_of(mag) | (u & 0x80000000u));  // the input's sign, zero results included
    }
  }
}

// One OCP MX element type (docs/numerics.md section 7 table; formats/mx.py MX_ELEMENTS).
struct MXElement {
  int ebits;       // 0 for int8
  int mbits;
  int bias;
  int emax;
  float max_norm;
};

// OCP MX quantize-dequantize of one block (docs/numerics.md section 7; formats/mx.py _mx_blocks and
// quantize_mx_element). int8 elements (INT8 = true) use rounding MODE; FP elements round half to even and
// saturate to max_norm; every zero FP result is +0.0.
template <bool INT8, int MODE, int N>
QTORCH_ORT_INLINE void mx_block_t(const float* in, float* out, int64_t n_dyn, const MXElement& el) {
  const int64_t n = N > 0 ? N : n_dyn;
  int shared = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int e = exponent_field(in[i]);
    shared = (e != 255 && e > shared) ? e : shared;
  }
  const Pow2Divider scale(shared - 127 - el.emax);  // >= 2^-142, not clamped to E8M0
  const int e_min = 1 - el.bias;
  for (int64_t i = 0; i < n; ++i) {
    const float x = in[i];
    const float v = scale.use_inv ? x * scale.inv : x / scale.p;  // x / X, exact power-of-two scaling
    float q;
    if (INT8) {  // the implicit scale 2^-6
      float k = round_mode<MODE>(v * 64.0f);
      k = k > 127.0f ? 127.0f : (k < -128.0f ? -128.0f : k);
      q = k * 0.015625f;
    } else {
      // step = 2^(max(floor(log2|v|), e_min) - mbits), between 2^-17 and 2^15: its inverse is exact too
      int e = exponent_field(v) - 127;
      e = e < e_min ? e_min : e;
      e = e > 127 + el.mbits ? 127 + el.mbits : e;  // only for Inf/NaN x, whose result is replaced below
      const float step = float_of(static_cast<uint32_t>(e - el.mbits + 127) << 23);
      const float inv = float_of(static_cast<uint32_t>(127 - (e - el.mbits)) << 23);
      const float r = round_half_even(v * inv);
      q = (r == 0.0f) ? 0.0f : r * step;
      q = q > el.max_norm ? el.max_norm : (q < -el.max_norm ? -el.max_norm : q);
    }
    const float y = q * scale.p;
    out[i] = exponent_field(x) == 255 ? x : y;  // Inf / NaN pass through unchanged
  }
}

}  // namespace qtorch_ort
