// The K-quant super-blocks as a GGUF file holds them, shared by the two
// multiplies of gguf_kquant_cpu.cpp: the float32 tiles there, the integers
// of gguf_kquant_integer_cpu.cpp. Layouts are spelled out in
// gguf_kquant_cpu.cpp's header comment.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gguf_iq4nl_values.h"

// The integer path needs AVX2's byte multiplies (VPMADDUBSW) and F16C; below
// that (class baseline) every step takes the float32 tiles.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FLEET_KQUANT_INTEGER 1
#else
#define FLEET_KQUANT_INTEGER 0
#endif

namespace fleet_kquant {

constexpr int64_t SUPER = 256;  // weights per super-block, every type here

// ggml's GGMLQuantizationType values. IQ4_XS is no K-quant by name, but it
// is laid out as one: 256-weight super-blocks with per-sub-block scales.
enum KQuantType : int64_t { Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23 };

inline void check_type(int64_t type) {
  TORCH_CHECK(type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS,
              "GGUF quantization type ", type,
              " has no K-quant CPU kernel (Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14, IQ4_XS=23 do)");
}

constexpr int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 136;  // IQ4_XS
  }
}

template <typename F>
void with_type(int64_t type, F&& f) {
  check_type(type);
  switch (type) {
    case Q2_K: f(std::integral_constant<int64_t, Q2_K>{}); break;
    case Q3_K: f(std::integral_constant<int64_t, Q3_K>{}); break;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q5_K: f(std::integral_constant<int64_t, Q5_K>{}); break;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); break;
    default: f(std::integral_constant<int64_t, IQ4_XS>{}); break;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// The 6-bit scale and min of sub-block j (0..7) of Q4_K/Q5_K's 12 packed
// bytes: bytes 0-3 hold the scales of 0-3 (and the top bits of 4-7's), 4-7
// their mins (likewise), 8-11 the low 4 bits of 4-7's scale (low nibble)
// and min (high nibble).
inline void scale_and_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// The 16 6-bit scales of Q3_K's 12 packed bytes, before their offset of -32
// (sub-block j, 16 weights), as byte j % 4 of word j / 4: the low 4 bits from
// byte j % 8 (its low nibble for j < 8, its high one above), the top 2 from
// bits 2 (j / 4) of byte 8 + j % 4. Four scales to a 32-bit word, as
// llama.cpp unpacks them (words, not bytes: the integer path builds its
// vector from them in registers).
inline std::array<uint32_t, 4> q3_k_scale_words(const uint8_t* packed) {
  uint32_t word[3];
  std::memcpy(word, packed, sizeof(word));
  const uint32_t low4 = 0x0F0F0F0F, low2 = 0x03030303;
  return {(word[0] & low4) | ((word[2] & low2) << 4), (word[1] & low4) | (((word[2] >> 2) & low2) << 4),
          ((word[0] >> 4) & low4) | (((word[2] >> 4) & low2) << 4),
          ((word[1] >> 4) & low4) | (((word[2] >> 6) & low2) << 4)};
}

// The 6-bit scales of IQ4_XS's 8 sub-blocks (32 weights), before their
// offset of -32, as byte j of the result: the low 4 bits are nibble j of the
// 4 bytes at byte 4, the top 2 bits 2j of the uint16 at byte 2 (in a
// register: the integer path's vector is built from it without a store).
inline uint64_t iq4_xs_scale_bits(const uint8_t* block) {
  uint16_t high;
  uint32_t low;
  std::memcpy(&high, block + 2, sizeof(high));
  std::memcpy(&low, block + 4, sizeof(low));
  uint64_t bits = 0;
  for (int j = 0; j < 8; ++j) {
    const uint64_t scale = ((low >> (4 * j)) & 0xF) | (((high >> (2 * j)) & 3) << 4);
    bits |= scale << (8 * j);
  }
  return bits;
}

// y [M, N] = x W^T (+ bias) for x float32 [M, K] rounded to Q8_K, W the
// file's rows of super-blocks of `type` (gguf_kquant_integer_cpu.cpp; only
// where FLEET_KQUANT_INTEGER).
template <typename Out>
void integer_multiply(int64_t type, const float* x, const uint8_t* rows, int64_t M, int64_t K, int64_t N,
                      const Out* bias, Out* y);

}  // namespace fleet_kquant
