// 8 lanes of float32, bfloat16 or float16 as float32 vectors on AVX2: loads,
// stores (partial ones for row tails), rounding to the storage dtype (round
// to nearest even, as simd_convert.h's AVX-512 versions) and horizontal
// reductions, shared by the CPU kernels (include only where AVX2, FMA and
// F16C are on).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#define FLEET_AVX2_INLINE inline __attribute__((always_inline))

FLEET_AVX2_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
FLEET_AVX2_INLINE __m256 load8(const at::BFloat16* p) {
  // A bf16 is the top half of an fp32: widen and shift.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
FLEET_AVX2_INLINE __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// fp32 -> the fp32 whose top half is its bf16 (round to nearest even; NaN
// stays a quiet NaN), low half zero: the value a bf16 store would keep.
FLEET_AVX2_INLINE __m256i bf16_rounded(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 kept = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(kept, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}

FLEET_AVX2_INLINE void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
FLEET_AVX2_INLINE void store8(at::BFloat16* p, __m256 v) {
  const __m256i top = _mm256_srli_epi32(bf16_rounded(v), 16);  // < 2^16: the pack does not saturate
  const __m128i bits = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits);
}
FLEET_AVX2_INLINE void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The first n lanes (all 8 for n >= 8), the others zero. A row's tail goes
// through a stack copy: AVX2 has masked loads and stores of 32-bit lanes only.
template <typename T>
FLEET_AVX2_INLINE __m256 load8(const T* p, int64_t n) {
  if (n >= 8) return load8(p);
  T lanes[8] = {};
  std::copy_n(p, n, lanes);
  return load8(lanes);
}

// Stores the first n lanes (all 8 for n >= 8).
template <typename T>
FLEET_AVX2_INLINE void store8(T* p, __m256 v, int64_t n) {
  if (n >= 8) return store8(p, v);
  T lanes[8];
  store8(lanes, v);
  std::copy_n(lanes, n, p);
}

// The fp32 value of v rounded to T (what storing then loading a T would give).
template <typename T>
FLEET_AVX2_INLINE __m256 round_to(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return _mm256_castsi256_ps(bf16_rounded(v));
  } else {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

FLEET_AVX2_INLINE float reduce_add8(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

FLEET_AVX2_INLINE float reduce_max8(__m256 v) {
  __m128 max = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  max = _mm_max_ps(max, _mm_movehl_ps(max, max));
  return _mm_cvtss_f32(_mm_max_ss(max, _mm_movehdup_ps(max)));
}
