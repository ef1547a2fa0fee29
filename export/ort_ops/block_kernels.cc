// qtorch-onnx ONNX Runtime operator library: runs of blocks (see block_kernels.h).
//
// Dispatch: the rounding mode, the bfloat16 pre-rounding and the common block lengths (8, 16, 32) become
// template parameters, so the per-element loops have compile-time trip counts and vectorize; any other
// length uses the generic instantiation. On x86-64 with GCC or Clang the entry points are cloned for AVX2
// (target_clones, resolved once when the library is loaded); the clones differ in instruction selection
// only: the source has no FMA-contractible expression and is compiled with -ffp-contract=off.
#include "block_kernels.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && defined(__linux__) && \
    !defined(QTORCH_ORT_NO_MULTIVERSION)
#define QTORCH_ORT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QTORCH_ORT_CLONES
#endif

namespace qtorch_ort {
namespace {

template <int MODE, bool PRE, int N>
QTORCH_ORT_INLINE void bfp_run(const float* in, float* out, int64_t n, int64_t count, int m) {
  for (int64_t j = 0; j < count; ++j) bfp_block_t<MODE, PRE, N>(in + j * n, out + j * n, n, m);
}

template <int MODE, bool PRE>
QTORCH_ORT_INLINE void bfp_run_n(const float* in, float* out, int64_t n, int64_t count, int m) {
  switch (n) {
    case 8: return bfp_run<MODE, PRE, 8>(in, out, n, count, m);
    case 16: return bfp_run<MODE, PRE, 16>(in, out, n, count, m);
    case 32: return bfp_run<MODE, PRE, 32>(in, out, n, count, m);
    default: return bfp_run<MODE, PRE, 0>(in, out, n, count, m);
  }
}

template <int MODE>
QTORCH_ORT_INLINE void prime_run_n(const float* in, float* out, int64_t n, int64_t count, const BfpParams& p) {
  if (n == 16) {
    for (int64_t j = 0; j < count; ++j)
      bfp_prime_block_t<MODE, 16>(in + j * n, out + j * n, n, p.m, p.sub_block_size, p.shift_bits);
  } else {
    for (int64_t j = 0; j < count; ++j)
      bfp_prime_block_t<MODE, 0>(in + j * n, out + j * n, n, p.m, p.sub_block_size, p.shift_bits);
  }
}

template <bool INT8, int MODE>
QTORCH_ORT_INLINE void mx_run_n(const float* in, float* out, int64_t n, int64_t count, const MXElement& el) {
  switch (n) {
    case 16:
      for (int64_t j = 0; j < count; ++j) mx_block_t<INT8, MODE, 16>(in + j * n, out + j * n, n, el);
      return;
    case 32:
      for (int64_t j = 0; j < count; ++j) mx_block_t<INT8, MODE, 32>(in + j * n, out + j * n, n, el);
      return;
    default:
      for (int64_t j = 0; j < count; ++j) mx_block_t<INT8, MODE, 0>(in + j * n, out + j * n, n, el);
  }
}

}  // namespace

QTORCH_ORT_CLONES
void bfp_blocks(const float* in, float* out, int64_t n, int64_t count, const BfpParams& p) {
  if (p.prime) {
    const float* src = in;
    if (p.pre_bf16) {  // formats/bfp.py rounds the whole input to bfloat16 first: round into out, then in place
      for (int64_t i = 0; i < n * count; ++i) out[i] = bfloat16_round_quark(in[i]);
      src = out;
    }
    if (p.mode == 2) prime_run_n<2>(src, out, n, count, p);
    else if (p.mode == 1) prime_run_n<1>(src, out, n, count, p);
    else prime_run_n<0>(src, out, n, count, p);
    return;
  }
  if (p.pre_bf16) {
    if (p.mode == 2) bfp_run_n<2, true>(in, out, n, count, p.m);
    else if (p.mode == 1) bfp_run_n<1, true>(in, out, n, count, p.m);
    else bfp_run_n<0, true>(in, out, n, count, p.m);
  } else {
    if (p.mode == 2) bfp_run_n<2, false>(in, out, n, count, p.m);
    else if (p.mode == 1) bfp_run_n<1, false>(in, out, n, count, p.m);
    else bfp_run_n<0, false>(in, out, n, count, p.m);
  }
}

QTORCH_ORT_CLONES
void mx_blocks(const float* in, float* out, int64_t n, int64_t count, const MXElement& el, int mode) {
  if (el.ebits != 0) mx_run_n<false, 2>(in, out, n, count, el);
  else if (mode == 2) mx_run_n<true, 2>(in, out, n, count, el);
  else if (mode == 1) mx_run_n<true, 1>(in, out, n, count, el);
  else mx_run_n<true, 0>(in, out, n, count, el);  // 0 and every other value (docs/numerics.md section 7)
}

}  // namespace qtorch_ort
