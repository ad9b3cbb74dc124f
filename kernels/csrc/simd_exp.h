// e^x on 16 floats (AVX-512F) or 8 (AVX2 + FMA), shared by the CPU kernels:
// each is compiled only where its instruction set is on, so any kernel may
// include this file.
//
// x clamped to [-87, 88] (e^-87 ~ 1.6e-38 is still a normal float); Cephes'
// expf polynomial on the reduced argument r = x - n ln 2, times 2^n. Max
// error ~2 ulp. Both widths compute the same values lane for lane.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// The constants both widths use: ln 2 split in two for an exact reduction,
// and the polynomial's coefficients, highest power first.
namespace fleet_exp_poly {
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kLeadingCoefficient = 1.9875691500e-4f;
constexpr float kHigherCoefficients[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                                         5.0000001201e-1f};
}  // namespace fleet_exp_poly

#if defined(__AVX512F__)
// 2^n applied with scalef.
static inline __attribute__((always_inline)) __m512 fleet_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(fleet_exp_poly::kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(fleet_exp_poly::kLn2Low), r);
  __m512 p = _mm512_set1_ps(fleet_exp_poly::kLeadingCoefficient);
  for (float c : fleet_exp_poly::kHigherCoefficients) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// No scalef: 2^n is built from its exponent bits, n + 127 in [1, 254] after
// the clamp, so it is a normal float and p * 2^n rounds as scalef does.
static inline __attribute__((always_inline)) __m256 fleet_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(fleet_exp_poly::kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(fleet_exp_poly::kLn2Low), r);
  __m256 p = _mm256_set1_ps(fleet_exp_poly::kLeadingCoefficient);
  for (float c : fleet_exp_poly::kHigherCoefficients) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif
