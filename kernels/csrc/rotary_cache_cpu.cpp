// Rotary embedding of the queries and keys, in place in the fused QKV
// projection's output, and the keys and values written to their KV cache
// slots: one pass over the new tokens instead of the ~20 torch ops of
// kernels/rotary.py + kernels/attention.write_kv_cache (which, at one decode
// row, cost more in dispatch than in arithmetic).
//
//   qkv [T, (H + 2 * KVH) * D]: q heads, then k heads, then v heads, per token
//   cos_sin [max_positions, D]: cos of each angle, then sin (halves)
//   kv_cache [2, num_blocks, block_size, KVH, D]; slot_mapping [T] int64
//
// Each element is rotated as HF's `x * cos + rotate_half(x) * sin`, with the
// roundings of the torch-native version: every product and the sum are
// rounded to the tensor dtype (no fused multiply-add contracts them).
// dtypes: bfloat16, float16, float32, one for all tensors.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "simd_convert.h"
#define FLEET_ROT_AVX512 1
#endif

namespace {

template <typename T>
inline float rounded(float value) {
  return static_cast<float>(static_cast<T>(value));  // identity for float
}

// x[0:half] and x[half:2*half] are the two halves of one head.
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
    const float x1c = rounded<T>(x1 * c), x2s = rounded<T>(x2 * s);
    const float x2c = rounded<T>(x2 * c), x1s = rounded<T>(x1 * s);
    x[i] = static_cast<T>(x1c - x2s);
    x[i + half] = static_cast<T>(x2c + x1s);
  }
}

#if FLEET_ROT_AVX512
// rotate_head, 16 pairs at a time (half a multiple of 16); the same roundings.
template <typename T>
inline void rotate_head16(T* x, const T* cos, const T* sin, int64_t half) {
  const __mmask16 all = tail_mask(16);
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = load16(x + i, all), x2 = load16(x + i + half, all);
    const __m512 c = load16(cos + i, all), s = load16(sin + i, all);
    const __m512 x1c = round_to<T>(_mm512_mul_ps(x1, c)), x2s = round_to<T>(_mm512_mul_ps(x2, s));
    const __m512 x2c = round_to<T>(_mm512_mul_ps(x2, c)), x1s = round_to<T>(_mm512_mul_ps(x1, s));
    store16(x + i, _mm512_sub_ps(x1c, x2s), all);
    store16(x + i + half, _mm512_add_ps(x2c, x1s), all);
  }
}
#endif

// One head, vectorised where the width allows (float64, which the dispatch
// refuses at run time but compiles, stays scalar).
template <typename T>
inline void rotate(T* x, const T* cos, const T* sin, int64_t half) {
#if FLEET_ROT_AVX512
  if constexpr (!std::is_same_v<T, double>) {
    if (half % 16 == 0) return rotate_head16(x, cos, sin, half);
  }
#endif
  rotate_head(x, cos, sin, half);
}

void rotary_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                       at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                       int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous [T, (H + 2 KVH) D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2, "kv_cache: contiguous [2, blocks, block_size, KVH, D]");
  const int64_t tokens = qkv.size(0), head_dim = kv_cache.size(4), half = head_dim / 2;
  TORCH_CHECK(kv_cache.size(3) == num_kv_heads && head_dim % 2 == 0, "kv_cache holds ", kv_cache.size(3), " heads of ", head_dim);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv has ", qkv.size(1), " features for ",
              num_heads, " + 2 x ", num_kv_heads, " heads of ", head_dim);
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == head_dim && cos_sin.is_contiguous(), "cos_sin: contiguous [positions, D]");
  TORCH_CHECK(qkv.scalar_type() == kv_cache.scalar_type() && qkv.scalar_type() == cos_sin.scalar_type(),
              "qkv, cos_sin and kv_cache must share one dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == tokens && positions.is_contiguous(), "positions: int64 [T]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens && slot_mapping.is_contiguous(), "slot_mapping: int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t max_position = cos_sin.size(0), num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " outside the rotary cache of ", max_position);
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the KV cache of ", num_slots);
  }
  const int64_t row = qkv.size(1), head_bytes = head_dim * qkv.element_size();
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements per slot of one of K, V
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "fleet_rotary_and_cache", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 is not supported");
    } else {
      scalar_t* base = qkv.data_ptr<scalar_t>();
      const scalar_t* table = cos_sin.data_ptr<scalar_t>();
      scalar_t* keys = kv_cache.data_ptr<scalar_t>();
      scalar_t* values = keys + kv_cache.stride(0);
      at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          scalar_t* x = base + t * row;
          const scalar_t* cos = table + pos[t] * head_dim;
          for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rotate(x + h * head_dim, cos, cos + half, half);
          const scalar_t* k = x + num_heads * head_dim;
          std::memcpy(keys + slots[t] * slot_stride, k, num_kv_heads * head_bytes);
          std::memcpy(values + slots[t] * slot_stride, k + num_kv_heads * head_dim, num_kv_heads * head_bytes);
        }
      });
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleet_cpu, m) {
  m.def("rotary_and_cache_(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) { m.impl("rotary_and_cache_", &rotary_and_cache_); }
