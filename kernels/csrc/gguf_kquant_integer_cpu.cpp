// The integer multiply of K-quant super-blocks (kernels/quantized.py takes it
// for steps of few rows), llama.cpp's scheme: each row of x is rounded once
// per call to Q8_K, per 256 values
//   d = max|x| / 127 (float32), q = round(x / d) (int8, |q| <= 127),
//   bsums = the 16 int16 sums of each 16 q's,
// and each super-block of a weight row is multiplied with it in integers:
//   Q2_K, Q4_K, Q5_K: y += d_w d_x sum_j sc_j (q_w . q_x)_j - dmin_w d_x sum_j m_j bsum_j
//   Q3_K:             y += d_w d_x sum_j sc_j ((q_w + 4 . q_x)_j - 4 bsum_j)
//   Q6_K:             y += d_w d_x sum_j sc_j ((q_w . q_x)_j - 32 bsum_j)
//   IQ4_XS:           y += d_w d_x sum_j sc_j (|v_w| . sign(v_w) q_x)_j
// (j the sub-blocks: 8 of 32 weights for Q4_K, Q5_K and IQ4_XS, 16 of 16 for
// the others; bsum_j their sum of q_x; v_w IQ4_XS's entries of IQ4_NL's
// table), which is the dequantized weights times the rounded x: the integers
// are exact, and each super-block adds one float32 product into lanes that
// are summed when the row is done.
//
// The weights' integers are unpacked into vectors of unsigned bytes (2 to 6
// bits, Q3_K's q + 4, IQ4_XS's magnitudes) in the order of k, so that x's q
// load as they are (IQ4_XS's with the entries' signs): VPMADDUBSW multiplies
// them with q and adds pairs (int16: at most 2 * 127 * 127), and VPMADDWD
// multiplies those by the sub-block's scale, which sits in every int16 lane
// of the sub-block's, and adds pairs into int32; AVX512-VNNI's VPDPWSSD does
// that multiply-add and the accumulation in one instruction. (VPDPBUSD would
// sum four byte products into an int32 lane, which then needs its own
// multiply by the scale: as many instructions.) Vectors are AVX-512's 64
// bytes (classes avx512 and up), or AVX2's 32.
//
// The weights stay the file's rows, one row of super-blocks per output
// feature: each thread takes contiguous output features (at::parallel_for),
// and each super-block, once unpacked, serves ROWS_PER_PASS rows of x.
//
// Compiled only where FLEET_KQUANT_INTEGER (gguf_kquant.h).
#include "gguf_kquant.h"

#if FLEET_KQUANT_INTEGER
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <limits>
#include <utility>
#include <vector>

#include "simd_avx2.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FLEET_KQUANT_AVX512 1
#endif

namespace fleet_kquant {
namespace {

// ---- x as Q8_K -------------------------------------------------------------------------

struct Q8K {
  std::vector<int8_t> q;       // [M][K]
  std::vector<float> d;        // [M][blocks]
  std::vector<int16_t> bsums;  // [M][blocks][16]
};

// [sum of v[0], ..., sum of v[7]]: each v's 8 int32 lanes added up.
inline __m256i sums_of_8(const __m256i* v) {
  // Each hadd pairs lanes within 128-bit halves: after two rounds, the low
  // half holds the low halves' sums of v[0..3] (or v[4..7]), the high half their high halves'.
  const __m256i first = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i second = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(first, second, 0x20),
                          _mm256_permute2x128_si256(first, second, 0x31));
}

// One super-block of x: q = x * (127 / max|x|) rounded to nearest even, d and
// the 16 bsums as Q8K keeps them. A NaN makes d NaN, so that every output it
// reaches is NaN, as the float32 product's would be.
void quantize_block(const float* x, int8_t* q, float& d, int16_t* bsums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 max = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int i = 0; i < 32; ++i) {
    const __m256 v = _mm256_loadu_ps(x + 8 * i);
    max = _mm256_max_ps(max, _mm256_andnot_ps(sign, v));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  const float amax = reduce_max8(max);
  const __m256 scale = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i sixteens[16];  // int32 partial sums of each 16 q's
  for (int g = 0; g < 8; ++g) {
    __m256i ints[4];
    for (int i = 0; i < 4; ++i) {
      ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * g + 8 * i), scale));
    }
    // The packs interleave 4-value groups of the four vectors; the permute puts them back in order.
    const __m256i bytes =
        _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
    _mm256_storeu_si256((__m256i*)(q + 32 * g),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    sixteens[2 * g] = _mm256_add_epi32(ints[0], ints[1]);
    sixteens[2 * g + 1] = _mm256_add_epi32(ints[2], ints[3]);
  }
  // packs interleaves the halves of the two: [0-3, 8-11 | 4-7, 12-15]; the permute puts them in order.
  const __m256i packed = _mm256_packs_epi32(sums_of_8(sixteens), sums_of_8(sixteens + 8));
  _mm256_storeu_si256((__m256i*)bsums, _mm256_permute4x64_epi64(packed, 0xD8));
  d = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
}

Q8K quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / SUPER;
  Q8K rows{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<int16_t>(M * blocks * 16)};
  at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_block(x + i * SUPER, rows.q.data() + i * SUPER, rows.d[i], rows.bsums.data() + 16 * i);
    }
  });
  return rows;
}

// ---- vectors of weight bytes -------------------------------------------------------------

#if FLEET_KQUANT_AVX512
using Vec = __m512i;
constexpr int VEC_BYTES = 64;
constexpr int ROWS_PER_PASS = 8;  // rows of x per unpacked super-block: 8 int32 sums in registers

inline Vec load_vec(const int8_t* p) { return _mm512_loadu_si512(p); }
inline Vec zero_vec() { return _mm512_setzero_si512(); }

// acc + sum over lane pairs of (w . x pairs) * scales: int16 products of the
// unsigned weights and q, times the int16 scales, into int32.
inline Vec dot_add(Vec acc, Vec w, Vec x, Vec scales) {
  const Vec pairs = _mm512_maddubs_epi16(w, x);
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, pairs, scales);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scales));
#endif
}

// The 16 int32 lanes added into 8.
inline __m256i narrow(Vec v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// int16 lanes 0-15 from lane `low` of 8 int16, lanes 16-31 from lane `high`.
inline Vec halves16(__m128i eight, int low, int high) {
  const Vec index = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(short(low)), _mm512_set1_epi16(short(high)));
  return _mm512_permutexvar_epi16(index, _mm512_castsi128_si512(eight));
}
#else
using Vec = __m256i;
constexpr int VEC_BYTES = 32;
constexpr int ROWS_PER_PASS = 4;  // AVX2's 16 registers: the weights, scales and 4 sums stay in them

inline Vec load_vec(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline Vec zero_vec() { return _mm256_setzero_si256(); }

inline Vec dot_add(Vec acc, Vec w, Vec x, Vec scales) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scales));
}

inline __m256i narrow(Vec v) { return v; }
#endif

constexpr int VECTORS = SUPER / VEC_BYTES;  // per super-block

inline Vec low_nibbles(Vec v) {
#if FLEET_KQUANT_AVX512
  return _mm512_and_si512(v, _mm512_set1_epi8(0xF));
#else
  return _mm256_and_si256(v, _mm256_set1_epi8(0xF));
#endif
}

// ---- per-sub-block scales, as int16 lanes against vector i's weights ---------------------

// One scale per 32 weights (Q4_K, Q5_K, IQ4_XS): 8 int16.
struct PerThirtyTwo {
#if FLEET_KQUANT_AVX512
  __m128i scales;

  explicit PerThirtyTwo(__m128i eight) : scales(eight) {}
  // Vector i: sub-blocks 2i (bytes 0-31) and 2i + 1 (32-63).
  Vec of(int i) const { return halves16(scales, 2 * i, 2 * i + 1); }
#else
  __m256i both;  // the 8 scales in both 128-bit halves

  explicit PerThirtyTwo(__m128i eight) : both(_mm256_broadcastsi128_si256(eight)) {}
  // Vector i: sub-block i.
  Vec of(int i) const { return _mm256_shuffle_epi8(both, _mm256_set1_epi16(short(2 * i | (2 * i + 1) << 8))); }
#endif
};

// One scale per 16 weights (Q2_K, Q3_K, Q6_K): 16 int16, which also weigh x's 16 bsums.
struct PerSixteen {
  __m256i all;
#if !FLEET_KQUANT_AVX512
  __m256i pairs[2];  // scales 8h .. 8h + 7 as int32 lanes of two equal int16
#endif

  explicit PerSixteen(__m256i sixteen) : all(sixteen) {
#if !FLEET_KQUANT_AVX512
    for (int h = 0; h < 2; ++h) {
      const __m256i wide = _mm256_cvtepi16_epi32(h ? _mm256_extracti128_si256(all, 1) : _mm256_castsi256_si128(all));
      pairs[h] = _mm256_or_si256(_mm256_and_si256(wide, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(wide, 16));
    }
#endif
  }

#if FLEET_KQUANT_AVX512
  // int16 lane l: sub-block 4i + l / 8.
  Vec of(int i) const {
    alignas(64) static constexpr int16_t index[4][32] = {
#define FLEET_SIXTEENS(s) s, s, s, s, s, s, s, s
        {FLEET_SIXTEENS(0), FLEET_SIXTEENS(1), FLEET_SIXTEENS(2), FLEET_SIXTEENS(3)},
        {FLEET_SIXTEENS(4), FLEET_SIXTEENS(5), FLEET_SIXTEENS(6), FLEET_SIXTEENS(7)},
        {FLEET_SIXTEENS(8), FLEET_SIXTEENS(9), FLEET_SIXTEENS(10), FLEET_SIXTEENS(11)},
        {FLEET_SIXTEENS(12), FLEET_SIXTEENS(13), FLEET_SIXTEENS(14), FLEET_SIXTEENS(15)},
#undef FLEET_SIXTEENS
    };
    return _mm512_permutexvar_epi16(_mm512_load_si512(index[i]), _mm512_castsi256_si512(all));
  }
#else
  // int16 lanes 0-7: sub-block 2i, 8-15: 2i + 1.
  Vec of(int i) const {
    const int j = 2 * (i % 4);
    return _mm256_permutevar8x32_epi32(pairs[i / 4], _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1));
  }
#endif
};

// ---- what the types share ------------------------------------------------------------------

// The super-block's float32 lanes for a row of x, before d_x, for the types
// with mins (Q2_K, Q4_K, Q5_K): d sums - dmin (m . bsums), m 16 int16 (one
// per bsum).
inline __m256 minus_mins(__m256i sums, __m256 d, __m256i mins, __m256 dmin, __m256i bsums) {
  const __m256 offsets = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bsums)), dmin);
  return _mm256_fmsub_ps(_mm256_cvtepi32_ps(sums), d, offsets);
}

// The same for the types stored with an offset of -2^SHIFT on q (Q3_K: 4,
// Q6_K: 32), whose vectors hold q + 2^SHIFT: d (sums - 2^SHIFT (sc . bsums)).
template <int SHIFT>
__m256 minus_offset(__m256i sums, __m256 d, const PerSixteen& scales, __m256i bsums) {
  const __m256i offsets = _mm256_slli_epi32(_mm256_madd_epi16(scales.all, bsums), SHIFT);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums, offsets)), d);
}

// w with bit BIT set where vector i's high bit is (Q3_K's third, Q5_K's
// fifth; w's bit BIT is clear). AVX2: bit i of each of the 32 high-bit bytes;
// AVX-512 (the bytes in both halves): bit 2i in bytes 0-31, 2i + 1 in 32-63.
template <int BIT>
inline Vec with_high_bit(Vec w, Vec high_bits, int i) {
#if FLEET_KQUANT_AVX512
  const Vec bits =
      _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * i))), _mm256_set1_epi8(char(1 << (2 * i + 1))), 1);
  return _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(high_bits, bits), w, _mm512_set1_epi8(1 << BIT));
#else
  const __m256i moved = i <= BIT ? _mm256_slli_epi16(high_bits, BIT - i) : _mm256_srli_epi16(high_bits, i - BIT);
  return _mm256_or_si256(w, _mm256_and_si256(moved, _mm256_set1_epi8(1 << BIT)));
#endif
}

// 32 bytes (Q3_K's high bits, Q5_K's fifth bits) as with_high_bit reads them.
inline Vec high_bit_bytes(const uint8_t* p) {
  const __m256i bytes = _mm256_loadu_si256((const __m256i*)p);
#if FLEET_KQUANT_AVX512
  return _mm512_broadcast_i64x4(bytes);
#else
  return bytes;
#endif
}

// ---- the types' super-blocks, decoded -------------------------------------------------------

// half_at with F16C's conversion (the same value).
inline float half_of(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

// Q2_K (and Q3_K, with its high bits): weight k = 128 h + 32 s + l takes bits
// 2s of quant byte 32 h + l; Q3_K's high bit is bit k / 32 of byte k % 32.
// Q3_K's vectors hold q + 4 (0..7: the high bit as stored).
template <int64_t TYPE>
struct TwoOrThreeBits {
  const uint8_t* quants;
  __m256 d, dmin;
  PerSixteen scales;
  __m256i mins;  // Q2_K's, 16 int16
  Vec high_bits;

  explicit TwoOrThreeBits(const uint8_t* block)
      : quants(block + (TYPE == Q2_K ? 16 : 32)),
        d(_mm256_set1_ps(half_of(block + (TYPE == Q2_K ? 80 : 108)))),
        dmin(_mm256_set1_ps(TYPE == Q2_K ? half_of(block + 82) : 0.f)),
        scales(scales_of_block(block)),
        mins(TYPE == Q2_K ? nibbles_of_scale_bytes(block, 4) : _mm256_setzero_si256()),
        high_bits(TYPE == Q3_K ? high_bit_bytes(block) : zero_vec()) {}

  // Q2_K's 16 scale bytes' low (shift 0: scales) or high (4: mins) nibbles as int16.
  static __m256i nibbles_of_scale_bytes(const uint8_t* block, int shift) {
    const __m128i bytes = _mm_srli_epi16(_mm_loadu_si128((const __m128i*)block), shift);
    return _mm256_cvtepu8_epi16(_mm_and_si128(bytes, _mm_set1_epi8(0xF)));
  }

  // Q2_K: 4-bit, unsigned; Q3_K: the unpacked 6 bits, - 32.
  static __m256i scales_of_block(const uint8_t* block) {
    if constexpr (TYPE == Q2_K) {
      return nibbles_of_scale_bytes(block, 0);
    } else {
      const auto words = q3_k_scale_words(block + 96);
      const __m128i bits = _mm_setr_epi32(int(words[0]), int(words[1]), int(words[2]), int(words[3]));
      return _mm256_cvtepi8_epi16(_mm_sub_epi8(bits, _mm_set1_epi8(32)));
    }
  }

#if FLEET_KQUANT_AVX512
  // Vector i: weights 64i .. 64i + 63, quant bytes 32 (i / 2) ..: bits 4 (i % 2) (bytes 0-31), + 2 (32-63).
  Vec weights(int i) const {
    const Vec both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(quants + 32 * (i / 2))));
    const Vec shifted = _mm512_srli_epi16(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 2), 4 * (i % 2));
    const Vec w = _mm512_and_si512(shifted, _mm512_set1_epi8(3));
#else
  // Vector i: weights 32i .. 32i + 31, bits 2 (i % 4) of quant bytes 32 (i / 4) ...
  Vec weights(int i) const {
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(quants + 32 * (i / 4)));
    const Vec w = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * (i % 4)), _mm256_set1_epi8(3));
#endif
    if constexpr (TYPE == Q3_K) return with_high_bit<2>(w, high_bits, i);
    return w;
  }
  Vec scales_of(int i) const { return scales.of(i); }

  __m256 finish(__m256i sums, __m256i bsums) const {
    if constexpr (TYPE == Q2_K) return minus_mins(sums, d, mins, dmin, bsums);
    return minus_offset<2>(sums, d, scales, bsums);
  }
};

// The 8 scales (bytes 0-7) and 8 mins (bytes 8-15) of Q4_K/Q5_K's 12 packed
// bytes, as scale_and_min reads them, four to a 32-bit word: scales and
// mins 0-3 are the low 6 bits of words 0 and 1, those of 4-7 take their low
// 4 bits from word 2's nibbles and their top 2 from the top of words 0 and 1.
inline __m128i scales_and_mins(const uint8_t* packed) {
  uint32_t word[3];
  std::memcpy(word, packed, sizeof(word));
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, top2 = 0x03030303;
  const uint32_t out[4] = {word[0] & low6, (word[2] & low4) | (((word[0] >> 6) & top2) << 4), word[1] & low6,
                           ((word[2] >> 4) & low4) | (((word[1] >> 6) & top2) << 4)};
  return _mm_loadu_si128((const __m128i*)out);
}

// Q4_K (and Q5_K, with its fifth bits): 32 bytes of nibbles hold sub-block
// 2c (low) and 2c + 1 (high); bit j of fifth-bit byte l is weight l of sub-block j.
template <int64_t TYPE>
struct FourOrFiveBits {
  const uint8_t* nibbles;
  __m256 d, dmin;
  PerThirtyTwo scales;
  __m256i mins;  // 16 int16: each sub-block's min twice, against its two bsums
  Vec fifth;

  explicit FourOrFiveBits(const uint8_t* block) : FourOrFiveBits(block, scales_and_mins(block + 4)) {}
  FourOrFiveBits(const uint8_t* block, __m128i packed)
      : nibbles(block + (TYPE == Q5_K ? 48 : 16)),
        d(_mm256_set1_ps(half_of(block))),
        dmin(_mm256_set1_ps(half_of(block + 2))),
        scales(_mm_cvtepu8_epi16(packed)),
        mins(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(packed, packed))),
        fifth(TYPE == Q5_K ? high_bit_bytes(block + 16) : zero_vec()) {}

#if FLEET_KQUANT_AVX512
  // Vector i: sub-blocks 2i (bytes 0-31) and 2i + 1 (32-63).
  Vec weights(int i) const {
    const Vec both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(nibbles + 32 * i)));
    const Vec w = low_nibbles(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4));
#else
  // Vector i: sub-block i.
  Vec weights(int i) const {
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(nibbles + 32 * (i / 2)));
    const Vec w = low_nibbles(i % 2 ? _mm256_srli_epi16(bytes, 4) : bytes);
#endif
    if constexpr (TYPE == Q5_K) return with_high_bit<4>(w, fifth, i);
    return w;
  }
  Vec scales_of(int i) const { return scales.of(i); }

  __m256 finish(__m256i sums, __m256i bsums) const { return minus_mins(sums, d, mins, dmin, bsums); }
};

// Q6_K: each half (128 weights) has 64 bytes of low nibbles and 32 of high
// 2-bit pairs; its group g of 32 weights takes nibble g / 2 of bytes
// 32 (g % 2) + l and bits 2g of pair byte l; a scale per 16 weights. The
// vectors hold q as stored (q - 32 is the weight's integer).
struct SixBits {
  const uint8_t* low;
  const uint8_t* high;
  __m256 d;
  PerSixteen scales;

  explicit SixBits(const uint8_t* block)
      : low(block),
        high(block + 128),
        d(_mm256_set1_ps(half_of(block + 208))),
        scales(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 192)))) {}

#if FLEET_KQUANT_AVX512
  // Vector i: weights 64i .. 64i + 63, half i / 2: its groups 0-1 (i even:
  // low nibbles, pair bits 0-3) or 2-3 (high nibbles, bits 4-7).
  Vec weights(int i) const {
    const Vec nibbles = _mm512_loadu_si512(low + 64 * (i / 2));
    const __m256i pair_bytes = _mm256_loadu_si256((const __m256i*)(high + 32 * (i / 2)));
    // Bytes 0-31 with pair bits 0-1 (or 4-5) where 32-63 have bits 2-3 (6-7).
    const Vec pairs = _mm512_inserti64x4(_mm512_castsi256_si512(pair_bytes), _mm256_srli_epi16(pair_bytes, 2), 1);
    const Vec top = _mm512_and_si512(i % 2 ? pairs : _mm512_slli_epi16(pairs, 4), _mm512_set1_epi8(0x30));
    return _mm512_or_si512(low_nibbles(i % 2 ? _mm512_srli_epi16(nibbles, 4) : nibbles), top);
  }
#else
  // Vector i: group g = i % 4 of half i / 4.
  Vec weights(int i) const {
    const int half = i / 4, g = i % 4;
    const __m256i nibbles = _mm256_loadu_si256((const __m256i*)(low + 64 * half + 32 * (g % 2)));
    const __m256i pair_bytes = _mm256_loadu_si256((const __m256i*)(high + 32 * half));
    const int shift = 2 * g - 4;  // pair bits 2g .. 2g + 1 to 4 .. 5
    const __m256i top = shift < 0 ? _mm256_slli_epi16(pair_bytes, -shift) : _mm256_srli_epi16(pair_bytes, shift);
    return _mm256_or_si256(low_nibbles(g / 2 ? _mm256_srli_epi16(nibbles, 4) : nibbles),
                           _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
  }
#endif
  Vec scales_of(int i) const { return scales.of(i); }

  __m256 finish(__m256i sums, __m256i bsums) const { return minus_offset<5>(sums, d, scales, bsums); }
};

// IQ4_XS: sub-block j (32 weights) has nibble bytes 16j .. 16j + 15, weight
// l < 16 in the low nibble of byte l, l + 16 in its high one, each indexing
// IQ4_NL's table of signed values. VPMADDUBSW needs unsigned weights, so the
// vectors hold the entries' magnitudes (at most 127: a pair of products stays
// within int16) and x's q take the entries' signs.
struct IQ4XS {
  const uint8_t* nibbles;
  __m256 d;
  PerThirtyTwo scales;

  explicit IQ4XS(const uint8_t* block) : nibbles(block + 8), d(_mm256_set1_ps(half_of(block))), scales(scales_of_block(block)) {}

  static __m128i scales_of_block(const uint8_t* block) {
    const __m128i bits = _mm_cvtsi64_si128(int64_t(iq4_xs_scale_bits(block)));
    return _mm_cvtepi8_epi16(_mm_sub_epi8(bits, _mm_set1_epi8(32)));
  }

#if FLEET_KQUANT_AVX512
  // Vector i: sub-blocks 2i, 2i + 1, one 128-bit lane each of low and high nibbles.
  Vec entries(int i) const {
    const Vec bytes = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(nibbles + 32 * i)));
    const Vec lanes = _mm512_shuffle_i64x2(bytes, bytes, 0x50);  // 128-bit lanes 0, 0, 1, 1
    const Vec table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)fleet_gguf::KVALUES_IQ4NL));
    return _mm512_shuffle_epi8(table, low_nibbles(_mm512_mask_srli_epi16(lanes, 0xFF00FF00u, lanes, 4)));
  }
  Vec weights(int i) const { return _mm512_abs_epi8(entries(i)); }
  __mmask64 signs(int i) const { return _mm512_movepi8_mask(entries(i)); }  // set: negative
#else
  // Vector i: sub-block i.
  Vec entries(int i) const {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)(nibbles + 16 * i));
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)fleet_gguf::KVALUES_IQ4NL));
    return _mm256_shuffle_epi8(table, low_nibbles(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes)));
  }
  Vec weights(int i) const { return _mm256_abs_epi8(entries(i)); }
  __m256i signs(int i) const { return entries(i); }  // no entry is zero
#endif
  Vec scales_of(int i) const { return scales.of(i); }

  __m256 finish(__m256i sums, __m256i) const { return _mm256_mul_ps(_mm256_cvtepi32_ps(sums), d); }
};

// x's q with the signs of IQ4XS::signs.
#if FLEET_KQUANT_AVX512
inline Vec with_signs(Vec q, __mmask64 negative) { return _mm512_mask_sub_epi8(q, negative, zero_vec(), q); }
#else
inline Vec with_signs(Vec q, __m256i signs) { return _mm256_sign_epi8(q, signs); }
#endif

template <int64_t TYPE>
using Decoded = std::conditional_t<
    TYPE == Q2_K || TYPE == Q3_K, TwoOrThreeBits<TYPE>,
    std::conditional_t<TYPE == Q6_K, SixBits, std::conditional_t<TYPE == IQ4_XS, IQ4XS, FourOrFiveBits<TYPE>>>>;

// ---- the multiply ------------------------------------------------------------------------

// out[r] = row . x[m0 + r] for R rows of x, row one weight row of super-blocks.
template <int64_t TYPE, int R>
void dot_rows(const uint8_t* row, const Q8K& x, int64_t m0, int64_t K, float* out) {
  const int64_t blocks = K / SUPER;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Decoded<TYPE> w(row + b * block_bytes(TYPE));
    const int8_t* q = x.q.data() + m0 * K + b * SUPER;
    Vec sums[R];
    for (int r = 0; r < R; ++r) sums[r] = zero_vec();
#pragma GCC unroll 8
    for (int i = 0; i < VECTORS; ++i) {
      const Vec weights = w.weights(i), scales = w.scales_of(i);
      if constexpr (TYPE == IQ4_XS) {
        const auto signs = w.signs(i);
        for (int r = 0; r < R; ++r) {
          sums[r] = dot_add(sums[r], weights, with_signs(load_vec(q + r * K + i * VEC_BYTES), signs), scales);
        }
      } else {
        for (int r = 0; r < R; ++r) sums[r] = dot_add(sums[r], weights, load_vec(q + r * K + i * VEC_BYTES), scales);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * blocks + b;
      const __m256i bsums = _mm256_loadu_si256((const __m256i*)(x.bsums.data() + 16 * at));
      acc[r] = _mm256_fmadd_ps(w.finish(narrow(sums[r]), bsums), _mm256_broadcast_ss(&x.d[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce_add8(acc[r]);
}

using DotRows = void (*)(const uint8_t*, const Q8K&, int64_t, int64_t, float*);

template <int64_t TYPE, int... R>
constexpr std::array<DotRows, sizeof...(R) + 1> dot_rows_table(std::integer_sequence<int, R...>) {
  return {nullptr, dot_rows<TYPE, R + 1>...};
}

// Output features per task at least: each thread streams a contiguous run of weight rows.
constexpr int64_t FEATURE_GRAIN = 16;

template <int64_t TYPE, typename Out>
void multiply_type(const float* x, const uint8_t* rows, int64_t M, int64_t K, int64_t N, const Out* bias, Out* y) {
  static constexpr auto DOT_ROWS = dot_rows_table<TYPE>(std::make_integer_sequence<int, ROWS_PER_PASS>{});
  const Q8K q = quantize_rows(x, M, K);
  const int64_t row_bytes = K / SUPER * block_bytes(TYPE);
  at::parallel_for(0, N, FEATURE_GRAIN, [&](int64_t begin, int64_t end) {
    float sums[ROWS_PER_PASS];
    for (int64_t n = begin; n < end; ++n) {
      const float offset = bias ? float(bias[n]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
        const int64_t tile = std::min<int64_t>(ROWS_PER_PASS, M - m0);
        DOT_ROWS[tile](rows + n * row_bytes, q, m0, K, sums);
        for (int64_t r = 0; r < tile; ++r) y[(m0 + r) * N + n] = Out(sums[r] + offset);
      }
    }
  });
}

}  // namespace

template <typename Out>
void integer_multiply(int64_t type, const float* x, const uint8_t* rows, int64_t M, int64_t K, int64_t N,
                      const Out* bias, Out* y) {
  with_type(type, [&](auto kind) { multiply_type<decltype(kind)::value>(x, rows, M, K, N, bias, y); });
}

template void integer_multiply<float>(int64_t, const float*, const uint8_t*, int64_t, int64_t, int64_t,
                                      const float*, float*);
template void integer_multiply<c10::BFloat16>(int64_t, const float*, const uint8_t*, int64_t, int64_t, int64_t,
                                              const c10::BFloat16*, c10::BFloat16*);
template void integer_multiply<c10::Half>(int64_t, const float*, const uint8_t*, int64_t, int64_t, int64_t,
                                          const c10::Half*, c10::Half*);

}  // namespace fleet_kquant
#endif
