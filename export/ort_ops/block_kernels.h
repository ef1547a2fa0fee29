// qtorch-onnx ONNX Runtime operator library: runs of blocks for the block formats (BFP, BFP-prime, MX).
//
// Each function quantize-dequantizes `count` consecutive blocks of `n` contiguous float32 values
// (in + j * n, j < count) into out (same layout; in == out allowed). Compiled once per instruction set
// where the compiler supports function multiversioning (x86-64: AVX2 and baseline, chosen at load time);
// every version computes the same bits (IEEE float32 operations only, no contraction into FMA).
#pragma once

#include <cstdint>

#include "numerics.h"

namespace qtorch_ort {

// Attributes of BFPQuantizeDequantize, validated (formats/bfp.py validate_bfp_attributes).
struct BfpParams {
  bool prime = false;           // bfp_method to_bfp_prime (or its alias to_bfp_prime_shared)
  int m = 7;                    // magnitude bits, bit_width - 9, in [1, 23]
  int mode = 0;                 // rounding_mode 0 / 1 / 2
  int64_t sub_block_size = 2;   // prime only
  int shift_bits = 1;           // prime only, [1, 8]
  bool pre_bf16 = false;        // convert_to_bfloat_before_bfp
};

void bfp_blocks(const float* in, float* out, int64_t n, int64_t count, const BfpParams& p);

// mode: rounding_mode (int8 elements only; values other than 1 and 2 behave as 0).
void mx_blocks(const float* in, float* out, int64_t n, int64_t count, const MXElement& el, int mode);

}  // namespace qtorch_ort
