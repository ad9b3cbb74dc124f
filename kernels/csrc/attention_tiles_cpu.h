// Tiled attention for prefill chunks on AVX-512 CPUs: a block of consecutive
// query tokens of one sequence against its paged keys and values, as two
// small GEMMs per tile of keys.
//
// The row kernel (paged_attention_cpu.cpp) scores one query token at a time:
// for a chunk of n tokens it reads the context n times, and every dot product
// ends in a horizontal sum. Here the G query heads of one kv head, for up to
// kTileLanes / G tokens, are the lanes of kTileVectors vectors ("rows",
// r = token * G + g):
//
//   scores  S^T[j][r] = scale * q_r . k_j   lanes over rows: each key element
//           (or bf16 pair) is broadcast against Q^T, packed once per tile, and
//           the softmax's max and sum per row are vertical, lane by lane.
//   values  O[r][d] += P[r][j] * v_j[d]     lanes over head_dim: P broadcast.
//
// bfloat16 (AVX512-BF16): both products are VDPBF16PS on pairs. Q^T holds the
// pair (q[2i], q[2i+1]) per lane; each tile's P is rounded to bfloat16 and its
// values interleaved key pair by key pair. float32: FMAs on the cache rows.
// The softmax is online in fp32 (running max and sum per row), as in the row
// kernel, and each row sees only keys [0, its kv_len).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FLEET_ATTENTION_TILES 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention_cpu.h"
#include "simd_convert.h"
#include "simd_exp.h"

namespace fleet_attention {

constexpr int64_t kTileLanes = 48;  // query rows per tile: 3 vectors of 16
constexpr int64_t kTileVectors = kTileLanes / 16;
constexpr int64_t kTileKeys = 32;  // keys per online-softmax step
constexpr int64_t kScoreKeys = 8;  // keys scored together: 8 x 3 accumulators in registers

// Whether this build has a tiled kernel for the element type.
template <typename T>
constexpr bool has_tiles() {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) return true;
#endif
  return std::is_same_v<T, float>;
}

template <typename T>
constexpr bool uses_bf16_pairs() {
  return !std::is_same_v<T, float>;
}

// Query tokens per tile for a GQA group of `group` heads (0: too wide to tile).
inline int64_t tile_tokens(int64_t group) { return kTileLanes / group; }

// A tile is worth its setup once its rows fill at least one vector.
inline bool worth_a_tile(int64_t tokens, int64_t group) { return tokens * group >= 16; }

// Per-thread scratch, sized once per call.
struct TileScratch {
  std::vector<float> qt;             // Q^T: [D][48] floats, or [D/2][48] bf16 pairs
  std::vector<float> out;            // O: [48][D]
  std::vector<float> scores;         // S^T, then P^T: [kTileKeys][48]
  std::vector<uint32_t> prob_pairs;  // P as bf16 pairs of keys: [kTileKeys/2][48]
  std::vector<uint32_t> value_pairs; // V as bf16 pairs of keys: [kTileKeys/2][D]
  alignas(64) float max[kTileLanes], sum[kTileLanes], alpha[kTileLanes];
  explicit TileScratch(int64_t head_dim)
      : qt(head_dim * kTileLanes), out(kTileLanes * head_dim), scores(kTileKeys * kTileLanes),
        prob_pairs(kTileKeys / 2 * kTileLanes), value_pairs(kTileKeys / 2 * head_dim) {}
};

#define FLEET_TILE_INLINE inline __attribute__((always_inline))

FLEET_TILE_INLINE uint32_t bf16_pair(const c10::BFloat16* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

// ---- scores: S^T[j][r] for kScoreKeys keys ---------------------------------------

// bf16: Q^T pairs [D/2][48] against the keys' pairs, broadcast.
FLEET_TILE_INLINE void score_keys(const float* qt_raw, const c10::BFloat16* const* keys, int64_t D, __m512 scale,
                                  float* st) {
#if defined(__AVX512BF16__)
  const uint32_t* qt = reinterpret_cast<const uint32_t*>(qt_raw);
  __m512 acc[kScoreKeys][kTileVectors];
  for (auto& key : acc) {
    for (auto& a : key) a = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < D / 2; ++i) {
    __m512bh q[kTileVectors];
    for (int v = 0; v < kTileVectors; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qt + i * kTileLanes + 16 * v);
    for (int k = 0; k < kScoreKeys; ++k) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(bf16_pair(keys[k] + 2 * i)));
      for (int v = 0; v < kTileVectors; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], q[v], pair);
    }
  }
  for (int k = 0; k < kScoreKeys; ++k) {
    for (int v = 0; v < kTileVectors; ++v) _mm512_storeu_ps(st + k * kTileLanes + 16 * v, _mm512_mul_ps(acc[k][v], scale));
  }
#endif
}

// float32: Q^T [D][48] against the keys' elements, broadcast.
FLEET_TILE_INLINE void score_keys(const float* qt, const float* const* keys, int64_t D, __m512 scale, float* st) {
  __m512 acc[kScoreKeys][kTileVectors];
  for (auto& key : acc) {
    for (auto& a : key) a = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; ++d) {
    __m512 q[kTileVectors];
    for (int v = 0; v < kTileVectors; ++v) q[v] = _mm512_loadu_ps(qt + d * kTileLanes + 16 * v);
    for (int k = 0; k < kScoreKeys; ++k) {
      const __m512 key = _mm512_set1_ps(keys[k][d]);
      for (int v = 0; v < kTileVectors; ++v) acc[k][v] = _mm512_fmadd_ps(q[v], key, acc[k][v]);
    }
  }
  for (int k = 0; k < kScoreKeys; ++k) {
    for (int v = 0; v < kTileVectors; ++v) _mm512_storeu_ps(st + k * kTileLanes + 16 * v, _mm512_mul_ps(acc[k][v], scale));
  }
}

// ---- online softmax over one tile -------------------------------------------------

// S^T of n keys from key t0 -> P^T in place: hides the keys a row does not see
// (key >= its kv_len), moves each row's running max and sum on, and leaves in
// alpha the factor that rescales what the row accumulated under its old max.
FLEET_TILE_INLINE void softmax_tile(float* st, int64_t n, int64_t t0, const __m512i* lens, TileScratch& s) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < kTileVectors; ++v) {
    float* col = st + 16 * v;
    __m512 tile_max = neg_inf;
    for (int64_t j = 0; j < n; ++j) {
      const __mmask16 seen = _mm512_cmpgt_epi32_mask(lens[v], _mm512_set1_epi32(static_cast<int>(t0 + j)));
      const __m512 score = _mm512_mask_mov_ps(neg_inf, seen, _mm512_loadu_ps(col + j * kTileLanes));
      _mm512_storeu_ps(col + j * kTileLanes, score);
      tile_max = _mm512_max_ps(tile_max, score);
    }
    const __m512 old_max = _mm512_loadu_ps(s.max + 16 * v);
    const __m512 new_max = _mm512_max_ps(old_max, tile_max);
    // 0 where the row had seen nothing yet (old max -inf), else e^(old - new).
    const __mmask16 had = _mm512_cmp_ps_mask(old_max, neg_inf, _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_maskz_mov_ps(had, fleet_exp16(_mm512_sub_ps(old_max, new_max)));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(s.sum + 16 * v), alpha);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 score = _mm512_loadu_ps(col + j * kTileLanes);
      const __mmask16 seen = _mm512_cmp_ps_mask(score, neg_inf, _CMP_NEQ_OQ);
      const __m512 prob = _mm512_maskz_mov_ps(seen, fleet_exp16(_mm512_sub_ps(score, new_max)));
      _mm512_storeu_ps(col + j * kTileLanes, prob);
      sum = _mm512_add_ps(sum, prob);
    }
    _mm512_storeu_ps(s.max + 16 * v, new_max);
    _mm512_storeu_ps(s.sum + 16 * v, sum);
    _mm512_storeu_ps(s.alpha + 16 * v, alpha);
  }
}

// ---- bf16 pairs for VDPBF16PS ------------------------------------------------------

// Word permutation taking [a0..a15 | b0..b15] to [a0 b0 a1 b1 ... a15 b15]
// (indices below 32 pick from the first operand, from 32 the second).
inline __m512i pair_words(int first, int second) {
  alignas(64) int16_t index[32];
  for (int i = 0; i < 16; ++i) {
    index[2 * i] = static_cast<int16_t>(first + i);
    index[2 * i + 1] = static_cast<int16_t>(second + i);
  }
  return _mm512_load_si512(index);
}

#if defined(__AVX512BF16__)
// P^T (n keys) -> bf16 pairs of consecutive keys per row: [ceil(n/2)][48].
FLEET_TILE_INLINE void pack_prob_pairs(const float* pt, int64_t n, uint32_t* pairs) {
  const __m512i interleave = pair_words(0, 16);
  for (int64_t j = 0; j < n; j += 2) {
    for (int v = 0; v < kTileVectors; ++v) {
      const __m512 even = _mm512_loadu_ps(pt + j * kTileLanes + 16 * v);
      const __m512 odd = j + 1 < n ? _mm512_loadu_ps(pt + (j + 1) * kTileLanes + 16 * v) : _mm512_setzero_ps();
      const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even | odd]
      _mm512_storeu_si512(pairs + j / 2 * kTileLanes + 16 * v, _mm512_permutexvar_epi16(interleave, words));
    }
  }
}

// Value rows (n keys) -> bf16 pairs of consecutive keys per dimension: [ceil(n/2)][D].
// An odd last key is paired with itself; its partner's probability is 0.
FLEET_TILE_INLINE void pack_value_pairs(const c10::BFloat16* const* values, int64_t n, int64_t D, uint32_t* pairs) {
  const __m512i low = pair_words(0, 32), high = pair_words(16, 48);
  for (int64_t j = 0; j < n; j += 2) {
    const c10::BFloat16* even = values[j];
    const c10::BFloat16* odd = j + 1 < n ? values[j + 1] : even;
    uint32_t* dst = pairs + j / 2 * D;
    for (int64_t c = 0; c < D; c += 32) {
      const __mmask32 m = D - c >= 32 ? ~__mmask32(0) : __mmask32(0xFFFF);  // D % 32 == 16: a last half
      const __m512i a = _mm512_maskz_loadu_epi16(m, even + c), b = _mm512_maskz_loadu_epi16(m, odd + c);
      _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(a, low, b));
      if (D - c > 16) _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}
#endif

// ---- values: O[r][c0, c0 + 16 NC) for NR rows -------------------------------------

// O[r0, r0 + NR)[c0, c0 + 16 NC) = alpha[r] * O + what `add_tile` sums into
// the accumulators (this tile's P V), which stay in registers meanwhile.
template <int NR, int NC, typename AddTile>
FLEET_TILE_INLINE void rescale_and_add(float* out, const float* alpha, int64_t D, int64_t r0, int64_t c0,
                                       AddTile&& add_tile) {
  __m512 acc[NR][NC];
  for (int i = 0; i < NR; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[r0 + i]);
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(out + (r0 + i) * D + c0 + 16 * c), a);
  }
  add_tile(acc);
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + (r0 + i) * D + c0 + 16 * c, acc[i][c]);
  }
}

// O = alpha * O + P V with bf16 pairs of keys.
struct PairedValues {
  float* out;
  const float* alpha;
  const uint32_t* probs;   // [pairs][48]
  const uint32_t* values;  // [pairs][D]
  int64_t pairs, D;

  template <int NR, int NC>
  FLEET_TILE_INLINE void block(int64_t r0, int64_t c0) const {
#if defined(__AVX512BF16__)
    rescale_and_add<NR, NC>(out, alpha, D, r0, c0, [&](__m512 (&acc)[NR][NC]) {
      for (int64_t j = 0; j < pairs; ++j) {
        __m512bh v[NC];
        for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(values + j * D + c0 + 16 * c);
        for (int i = 0; i < NR; ++i) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[j * kTileLanes + r0 + i]));
          for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], p, v[c]);
        }
      }
    });
#endif
  }
};

// O = alpha * O + P V in float32, straight from the cache rows.
struct FloatValues {
  float* out;
  const float* alpha;
  const float* probs;  // P^T: [n][48]
  const float* const* values;
  int64_t n, D;

  template <int NR, int NC>
  FLEET_TILE_INLINE void block(int64_t r0, int64_t c0) const {
    rescale_and_add<NR, NC>(out, alpha, D, r0, c0, [&](__m512 (&acc)[NR][NC]) {
      for (int64_t j = 0; j < n; ++j) {
        __m512 v[NC];
        for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(values[j] + c0 + 16 * c);
        for (int i = 0; i < NR; ++i) {
          const __m512 p = _mm512_set1_ps(probs[j * kTileLanes + r0 + i]);
          for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(p, v[c], acc[i][c]);
        }
      }
    });
  }
};

// NR rows over all of head_dim: 64 dims (4 x 16) at a time, then the rest.
template <int NR, typename Values>
FLEET_TILE_INLINE void value_rows(const Values& values, int64_t r0, int64_t D) {
  int64_t c0 = 0;
  for (; c0 + 64 <= D; c0 += 64) values.template block<NR, 4>(r0, c0);
  switch ((D - c0) / 16) {
    case 3: values.template block<NR, 3>(r0, c0); break;
    case 2: values.template block<NR, 2>(r0, c0); break;
    case 1: values.template block<NR, 1>(r0, c0); break;
    default: break;
  }
}

// All rows, 6 at a time: 6 x 4 accumulators in registers.
template <typename Values>
FLEET_TILE_INLINE void value_tile(const Values& values, int64_t rows, int64_t D) {
  int64_t r0 = 0;
  for (; r0 + 6 <= rows; r0 += 6) value_rows<6>(values, r0, D);
  switch (rows - r0) {
    case 5: value_rows<5>(values, r0, D); break;
    case 4: value_rows<4>(values, r0, D); break;
    case 3: value_rows<3>(values, r0, D); break;
    case 2: value_rows<2>(values, r0, D); break;
    case 1: value_rows<1>(values, r0, D); break;
    default: break;
  }
}

// ---- one tile of query tokens ---------------------------------------------------------

// Query rows [row_begin, row_begin + tokens) of one sequence (consecutive
// rows sharing a table row) against kv head `kv_head`; writes their outputs.
template <typename T, int64_t kHeadDim>
void attend_tile(const Problem<T>& p, int64_t row_begin, int64_t tokens, int64_t kv_head, TileScratch& s) {
  static_assert(has_tiles<T>(), "no tiled kernel for this dtype on this CPU");
  const int64_t G = p.group, D = kHeadDim ? kHeadDim : p.head_dim, rows = tokens * G;
  const int64_t seq = p.seq_index ? p.seq_index[row_begin] : row_begin;

  // Each lane's kv_len; spare lanes (zero queries) see every key, which keeps their softmax finite.
  int64_t max_len = 0;
  for (int64_t t = 0; t < tokens; ++t) max_len = std::max<int64_t>(max_len, p.kv_lens[row_begin + t]);
  alignas(64) int32_t lens[kTileLanes];
  for (int64_t r = 0; r < kTileLanes; ++r) {
    lens[r] = static_cast<int32_t>(r < rows ? p.kv_lens[row_begin + r / G] : max_len);
  }
  __m512i lens_v[kTileVectors];
  for (int v = 0; v < kTileVectors; ++v) lens_v[v] = _mm512_load_si512(lens + 16 * v);

  // Q^T, lane r = query head kv_head * G + r % G of token row_begin + r / G.
  const T* q0 = p.query + row_begin * p.query_row_stride + kv_head * G * p.query_head_stride;
  std::fill(s.qt.begin(), s.qt.end(), 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* q = q0 + (r / G) * p.query_row_stride + (r % G) * p.query_head_stride;
    if constexpr (uses_bf16_pairs<T>()) {
      uint32_t* qt = reinterpret_cast<uint32_t*>(s.qt.data());
      for (int64_t i = 0; i < D / 2; ++i) qt[i * kTileLanes + r] = bf16_pair(q + 2 * i);
    } else {
      for (int64_t d = 0; d < D; ++d) s.qt[d * kTileLanes + r] = q[d];
    }
  }
  std::fill(s.out.begin(), s.out.begin() + rows * D, 0.f);
  std::fill(s.max, s.max + kTileLanes, -std::numeric_limits<float>::infinity());
  std::fill(s.sum, s.sum + kTileLanes, 0.f);

  const __m512 scale = _mm512_set1_ps(p.scale);
  TokenCursor cursor{p.block_tables + seq * p.table_stride, p.block_size, p.num_kv_heads * D, kv_head * D};
  for (int64_t t0 = 0; t0 < max_len; t0 += kTileKeys) {
    const int64_t n = std::min(kTileKeys, max_len - t0);
    const T* keys[kTileKeys];
    const T* values[kTileKeys];
    cursor.next_rows(n, p.keys, p.values, keys, values);
    for (int64_t j = n; j < kTileKeys; ++j) keys[j] = keys[n - 1];  // scored in groups; never read back
    for (int64_t j = 0; j < n; j += kScoreKeys) score_keys(s.qt.data(), keys + j, D, scale, s.scores.data() + j * kTileLanes);
    softmax_tile(s.scores.data(), n, t0, lens_v, s);
    if constexpr (uses_bf16_pairs<T>()) {
#if defined(__AVX512BF16__)
      pack_prob_pairs(s.scores.data(), n, s.prob_pairs.data());
      pack_value_pairs(values, n, D, s.value_pairs.data());
      value_tile(PairedValues{s.out.data(), s.alpha, s.prob_pairs.data(), s.value_pairs.data(), (n + 1) / 2, D}, rows, D);
#endif
    } else {
      value_tile(FloatValues{s.out.data(), s.alpha, s.scores.data(), values, n, D}, rows, D);
    }
  }

  const int64_t heads = p.num_kv_heads * G;
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = p.out + ((row_begin + r / G) * heads + kv_head * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(s.sum[r] > 0.f ? 1.f / s.sum[r] : 0.f);  // kv_len 0: zeros
    for (int64_t c = 0; c < D; c += 16) store16(dst + c, _mm512_mul_ps(_mm512_loadu_ps(s.out.data() + r * D + c), inv), 0xFFFF);
  }
}

}  // namespace fleet_attention

#endif  // AVX-512 F/BW/VL
