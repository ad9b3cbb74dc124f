// The K-quant super-blocks as a GGUF file holds them, shared by the two
// multiplies of gguf_kquant_cpu.cpp: the float32 tiles there, the integers
// of gguf_kquant_integer_cpu.cpp. Layouts are spelled out in
// gguf_kquant_cpu.cpp's header comment.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

// The integer path needs AVX2's byte multiplies (VPMADDUBSW) and F16C; below
// that (class baseline) every step takes the float32 tiles.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FLEET_KQUANT_INTEGER 1
#else
#define FLEET_KQUANT_INTEGER 0
#endif

namespace fleet_kquant {

constexpr int64_t SUPER = 256;  // weights per super-block, every type here

enum KQuantType : int64_t { Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's GGMLQuantizationType values

inline void check_type(int64_t type) {
  TORCH_CHECK(type == Q4_K || type == Q5_K || type == Q6_K, "GGUF quantization type ", type,
              " has no K-quant CPU kernel (Q4_K=12, Q5_K=13, Q6_K=14 do)");
}

constexpr int64_t block_bytes(int64_t type) { return type == Q4_K ? 144 : type == Q5_K ? 176 : 210; }

template <typename F>
void with_type(int64_t type, F&& f) {
  check_type(type);
  switch (type) {
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q5_K: f(std::integral_constant<int64_t, Q5_K>{}); break;
    default: f(std::integral_constant<int64_t, Q6_K>{}); break;
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

// y [M, N] = x W^T (+ bias) for x float32 [M, K] rounded to Q8_K, W the
// file's rows of super-blocks of `type` (gguf_kquant_integer_cpu.cpp; only
// where FLEET_KQUANT_INTEGER).
template <typename Out>
void integer_multiply(int64_t type, const float* x, const uint8_t* rows, int64_t M, int64_t K, int64_t N,
                      const Out* bias, Out* y);

}  // namespace fleet_kquant
