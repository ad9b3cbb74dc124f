// Fused paged attention for the CPU: each query row attends to the first
// kv_len tokens of its sequence, read straight from the paged KV cache.
//
// The torch-native path (kernels/attention.py) gathers every sequence's blocks
// into a dense copy and then runs SDPA; here each K/V row is read once, in
// place, for all the query heads that share it:
//
//   kv_cache [2, num_blocks, block_size, KVH, D]      (0 = keys, 1 = values)
//   token pos of a row's sequence -> block_tables[seq][pos / block_size], slot pos % block_size
//
//   work item = (query row, span of kv heads: all of them when there are
//   enough rows to keep the threads busy, else one). Each kv head's GQA group
//   of G query heads is scored together: s[g][j] = q[g] . k[j], then an online
//   softmax in fp32 (running max m[g] and sum l[g], rescaled once per tile of
//   kTile tokens), then acc[g] += p[g][j] * v[j]; out = acc / l. Rows are
//   prefetched a tile ahead: the blocks of a sequence are scattered.
//
// A decode is one row per sequence with kv_len = seq_len. A prefill chunk with
// cached context is one row per new token, kv_len = its position + 1 (causal).
// Consecutive rows of one sequence (seq_index given) are instead cut into
// tiles of query tokens for attention_tiles_cpu.h, which reads the context
// once per tile instead of once per token, where it has the dtype (float32;
// bfloat16 with AVX512-BF16): 2048-token prefill 36 -> 16 ms per layer.
//
// dtypes: bfloat16, float16, float32 (query and cache alike); head_dim a
// multiple of 16 up to 256; any block_size. AVX-512 intrinsics where the
// compiler targets it (the CPU class's -march), else AVX2 + FMA ones for the
// per-row path (8 lanes: same structure, register tiles sized for 16 ymm
// registers), else plain loops.
//
// Registered as the op torch.ops.fleet_cpu.paged_attention; only the op
// registration headers are included (not torch/extension.h, pybind11 and the
// whole C++ API), which makes the first build ~5x faster.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include "simd_exp.h"
#define FLEET_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#include "simd_exp.h"
#define FLEET_AVX2 1
#endif

#include "paged_attention_cpu.h"
#include "attention_tiles_cpu.h"

namespace {

using fleet_attention::Problem;
using fleet_attention::TokenCursor;

constexpr int64_t kTile = 32;  // tokens scored between two rescales of the accumulators
// Tokens between a cache row's prefetch and its use: one tile. Measured on a
// 2-core Sapphire Rapids (bf16, 64 x 320 tokens, cache in DRAM): 1.46 ms/layer
// without prefetching, 1.0 with it; 64 or 128 tokens ahead, or prefetching to
// L2 only, are no better.
constexpr int64_t kPrefetchAhead = 32;
constexpr int64_t kMaxHeadDim = 256;

// Helpers are inlined into the kernel, where a compile-time head_dim unrolls their loops.
#define FLEET_INLINE inline __attribute__((always_inline))

#if FLEET_AVX512
// ---- AVX-512 ------------------------------------------------------------------

// 16 elements as fp32.
FLEET_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
FLEET_INLINE __m512 load16(const at::BFloat16* p) {
  // A bf16 is the top half of an fp32: widen and shift.
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
FLEET_INLINE __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane j = sum of v[j]'s 16 lanes: a transpose-and-add tree, 30 shuffles for
// 16 sums instead of ~5 per sum with one horizontal reduction each.
FLEET_INLINE __m512 hsum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d] summed over that lane
    __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across 128-bit lanes: pairs of lanes, then pairs of pairs.
  __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

// q . k_j for 16 key rows; q is fp32.
template <typename T>
FLEET_INLINE __m512 dots16(const float* q, const T* const* rows, int64_t D) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), load16(rows[j]));
    for (int64_t c = 16; c < D; c += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load16(rows[j] + c), a);
    acc[j] = a;
  }
  return hsum16(acc);
}

#if defined(__AVX512BF16__)
// bf16 query and keys: products of bf16 pairs accumulated in fp32 (vdpbf16ps), no conversion.
FLEET_INLINE __m512 dots16_bf16(const at::BFloat16* q, const at::BFloat16* const* rows, int64_t D) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 32) {
      const __mmask32 m = D - c >= 32 ? ~__mmask32(0) : __mmask32(0xFFFF);  // D % 32 == 16: last half
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, q + c),
                           (__m512bh)_mm512_maskz_loadu_epi16(m, rows[j] + c));
    }
    acc[j] = a;
  }
  return hsum16(acc);
}
#endif

// acc[g][c0, c0 + 16 NC) += sum_j p[g][j] * v_j[c0, c0 + 16 NC) for NG heads.
// The NG x NC accumulators stay in registers across the tile, and are
// independent: each token's FMAs overlap instead of waiting on the previous
// token's (a chain of one accumulator per head would be latency-bound).
template <int NG, int NC, typename T>
FLEET_INLINE void add_values(float* acc, const float* p, const T* const* rows, int64_t n, int64_t D, int64_t c0) {
  __m512 a[NG][NC];
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + c0 + 16 * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 w[NG];
    for (int g = 0; g < NG; ++g) w[g] = _mm512_set1_ps(p[g * kTile + j]);
    for (int c = 0; c < NC; ++c) {
      const __m512 v = load16(rows[j] + c0 + 16 * c);
      for (int g = 0; g < NG; ++g) a[g][c] = _mm512_fmadd_ps(w[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + c0 + 16 * c, a[g][c]);
  }
}

// add_values over all of head_dim: 64 dims (4 x 16) at a time, then the rest.
template <int NG, typename T>
FLEET_INLINE void add_values(float* acc, const float* p, const T* const* rows, int64_t n, int64_t D) {
  int64_t c0 = 0;
  for (; c0 + 64 <= D; c0 += 64) add_values<NG, 4>(acc, p, rows, n, D, c0);
  switch ((D - c0) / 16) {
    case 3: add_values<NG, 3>(acc, p, rows, n, D, c0); break;
    case 2: add_values<NG, 2>(acc, p, rows, n, D, c0); break;
    case 1: add_values<NG, 1>(acc, p, rows, n, D, c0); break;
    default: break;
  }
}

#elif FLEET_AVX2
// ---- AVX2 ----------------------------------------------------------------------

// Lane j = sum of v[j]'s 8 lanes: pairwise horizontal adds within each
// 128-bit half, then the halves added.
FLEET_INLINE __m256 hsum8(const __m256* v) {
  const __m256 x0 = _mm256_hadd_ps(v[0], v[1]), x1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 x2 = _mm256_hadd_ps(v[4], v[5]), x3 = _mm256_hadd_ps(v[6], v[7]);
  // Per half: [v0, v1, v2, v3] and [v4, v5, v6, v7], each summed over that half's 4 lanes.
  const __m256 y0 = _mm256_hadd_ps(x0, x1), y1 = _mm256_hadd_ps(x2, x3);
  return _mm256_add_ps(_mm256_permute2f128_ps(y0, y1, 0x20), _mm256_permute2f128_ps(y0, y1, 0x31));
}

// q . k_j for 8 key rows; q is fp32. 8 independent accumulators, as dots16's 16.
template <typename T>
FLEET_INLINE __m256 dots8(const float* q, const T* const* rows, int64_t D) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), load8(rows[j]));
    for (int64_t c = 8; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(rows[j] + c), a);
    acc[j] = a;
  }
  return hsum8(acc);
}

// acc[g][c0, c0 + 8 NC) += sum_j p[g][j] * v_j[c0, c0 + 8 NC) for NG heads,
// the NG x NC accumulators in registers across the tile as in the AVX-512
// add_values. With NG <= 3 and NC <= 4 they, NG weights and a value fit the
// 16 ymm registers.
template <int NG, int NC, typename T>
FLEET_INLINE void add_values(float* acc, const float* p, const T* const* rows, int64_t n, int64_t D, int64_t c0) {
  __m256 a[NG][NC];
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < NC; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + c0 + 8 * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m256 w[NG];
    for (int g = 0; g < NG; ++g) w[g] = _mm256_set1_ps(p[g * kTile + j]);
    for (int c = 0; c < NC; ++c) {
      const __m256 v = load8(rows[j] + c0 + 8 * c);
      for (int g = 0; g < NG; ++g) a[g][c] = _mm256_fmadd_ps(w[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + g * D + c0 + 8 * c, a[g][c]);
  }
}

// add_values over all of head_dim (a multiple of 16): 32 dims (4 x 8) at a time, then 16 if left.
template <int NG, typename T>
FLEET_INLINE void add_values(float* acc, const float* p, const T* const* rows, int64_t n, int64_t D) {
  int64_t c0 = 0;
  for (; c0 + 32 <= D; c0 += 32) add_values<NG, 4>(acc, p, rows, n, D, c0);
  if (c0 < D) add_values<NG, 2>(acc, p, rows, n, D, c0);
}
#endif  // FLEET_AVX512 / FLEET_AVX2

// ---- one tile, any ISA ------------------------------------------------------------

// scores[g][j] = scale * q_g . k_j for j < n (rows padded to a multiple of 16
// with valid pointers). q: fp32 [G, D]; q_raw: the query heads as stored.
template <typename T>
FLEET_INLINE void score_tile(const float* q, const T* q_raw, int64_t q_raw_stride, const T* const* rows, int64_t n,
                int64_t G, int64_t D, float scale, float* scores) {
#if FLEET_AVX512
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < n; j += 16) {
      __m512 d;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        d = dots16_bf16(q_raw + g * q_raw_stride, rows + j, D);
      } else {
        d = dots16(q + g * D, rows + j, D);
      }
#else
      d = dots16(q + g * D, rows + j, D);
#endif
      _mm512_storeu_ps(scores + g * kTile + j, _mm512_mul_ps(d, s));
    }
  }
#elif FLEET_AVX2
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < n; j += 8) {
      _mm256_storeu_ps(scores + g * kTile + j, _mm256_mul_ps(dots8(q + g * D, rows + j, D), s));
    }
  }
#else
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < n; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * static_cast<float>(rows[j][d]);
      scores[g * kTile + j] = dot * scale;
    }
  }
#endif
}

// x[j] = e^(x[j] - shift) for j < n; returns their sum.
FLEET_INLINE float exp_shifted_sum(float* x, int64_t n, float shift) {
#if FLEET_AVX512
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    __m512 e = fleet_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), s));
    _mm512_mask_storeu_ps(x + j, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#elif FLEET_AVX2
  // Whole vectors, then the tail (< 8) one by one: AVX2 has no mask registers.
  const __m256 s = _mm256_set1_ps(shift);
  __m256 sums = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = fleet_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), s));
    _mm256_storeu_ps(x + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  float sum = reduce_add8(sums);
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
#else
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
#endif
}

// One online-softmax step over one head's tile of n scores: sc[j] becomes
// e^(sc[j] - new max), and the running max and sum move on. Returns the factor
// that rescales what was accumulated under the old max (1 if it held).
FLEET_INLINE float softmax_tile(float* sc, int64_t n, float& max, float& sum) {
#if FLEET_AVX512
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    m = _mm512_mask_max_ps(m, valid, m, _mm512_maskz_loadu_ps(valid, sc + j));
  }
  const float tile_max = _mm512_reduce_max_ps(m);
#elif FLEET_AVX2
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + j));
  float tile_max = reduce_max8(m);
  for (; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
#else
  const float tile_max = *std::max_element(sc, sc + n);
#endif
  const float new_max = std::max(max, tile_max);
  const float alpha = new_max == max ? 1.f : std::exp(max - new_max);  // 0 on the first tile (max = -inf)
  sum = sum * alpha + exp_shifted_sum(sc, n, new_max);
  max = new_max;
  return alpha;
}

// acc[g] += sum_{j<n} p[g][j] * v_j for all G heads.
template <typename T>
FLEET_INLINE void value_tile(float* acc, const float* p, const T* const* rows, int64_t n, int64_t G, int64_t D) {
#if FLEET_AVX512
  for (int64_t g = 0; g < G; g += 4) {  // 4 heads x 4 chunks: 16 accumulators in registers
    float* a = acc + g * D;
    const float* pg = p + g * kTile;
    switch (std::min<int64_t>(4, G - g)) {
      case 1: add_values<1>(a, pg, rows, n, D); break;
      case 2: add_values<2>(a, pg, rows, n, D); break;
      case 3: add_values<3>(a, pg, rows, n, D); break;
      default: add_values<4>(a, pg, rows, n, D); break;
    }
  }
#elif FLEET_AVX2
  for (int64_t g = 0; g < G; g += 3) {  // 3 heads x 4 chunks: 12 accumulators in registers
    float* a = acc + g * D;
    const float* pg = p + g * kTile;
    switch (std::min<int64_t>(3, G - g)) {
      case 1: add_values<1>(a, pg, rows, n, D); break;
      case 2: add_values<2>(a, pg, rows, n, D); break;
      default: add_values<3>(a, pg, rows, n, D); break;
    }
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * kTile + j];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += w * static_cast<float>(rows[j][d]);
    }
  }
#endif
}

// ---- the kernel ----------------------------------------------------------------

// Per-thread scratch for a span of up to `heads` kv heads, sized once per call.
struct Scratch {
  std::vector<float> q, acc, scores, max, sum;
  Scratch(int64_t heads, int64_t group, int64_t head_dim)
      : q(heads * group * head_dim), acc(heads * group * head_dim), scores(group * kTile), max(heads * group),
        sum(heads * group) {}
};

// Query row `query_row` against kv heads [head_begin, head_end): a span of
// heads shares the block-table walk, and a span of all of them reads each
// cache row (KVH * D contiguous elements) whole.
// kHeadDim: head_dim known at compile time (common sizes), or 0 for any.
template <typename T, int64_t kHeadDim>
void attend(const Problem<T>& p, int64_t query_row, int64_t head_begin, int64_t head_end, Scratch& s) {
  const int64_t G = p.group, D = kHeadDim ? kHeadDim : p.head_dim, bs = p.block_size;
  const int64_t heads = head_end - head_begin;
  const int64_t seq = p.seq_index ? p.seq_index[query_row] : query_row;
  const int32_t* table = p.block_tables + seq * p.table_stride;
  const int64_t kv_len = p.kv_lens[query_row];
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, kv_len - p.window) : 0;  // sliding window: its start
  const int64_t token_stride = p.num_kv_heads * D;  // between consecutive slots of a block

  // Query heads of the span, in order: [heads * G, D].
  const T* q_raw = p.query + query_row * p.query_row_stride + head_begin * G * p.query_head_stride;
  float* q = s.q.data();
  float* acc = s.acc.data();
  for (int64_t h = 0; h < heads * G; ++h) {
    for (int64_t d = 0; d < D; ++d) q[h * D + d] = static_cast<float>(q_raw[h * p.query_head_stride + d]);
  }
  std::fill(acc, acc + heads * G * D, 0.f);
  std::fill(s.max.begin(), s.max.begin() + heads * G, -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.begin() + heads * G, 0.f);

  // Cache rows are read through one cursor and prefetched kPrefetchAhead
  // tokens earlier through another: a sequence's blocks are scattered, so the
  // hardware prefetcher cannot see them coming.
  const int64_t head_offset = head_begin * D;
  TokenCursor rows_at{table, bs, token_stride, head_offset, first / bs, first % bs};
  TokenCursor prefetch_at = rows_at;
  const int64_t span_bytes = heads * D * static_cast<int64_t>(sizeof(T));
  int64_t prefetched = first;
  for (int64_t t0 = first; t0 < kv_len; t0 += kTile) {
    const int64_t n = std::min(kTile, kv_len - t0);
    for (const int64_t end = std::min(kv_len, t0 + n + kPrefetchAhead); prefetched < end; ++prefetched) {
      const int64_t offset = prefetch_at.next();
      for (int64_t byte = 0; byte < span_bytes; byte += 64) {  // every cache line, into L1
        __builtin_prefetch(reinterpret_cast<const char*>(p.keys + offset) + byte);
        __builtin_prefetch(reinterpret_cast<const char*>(p.values + offset) + byte);
      }
    }
    const T* krows_span[kTile];
    const T* vrows_span[kTile];
    rows_at.next_rows(n, p.keys, p.values, krows_span, vrows_span);
    for (int64_t h = 0; h < heads; ++h) {
      const T* krows[kTile];
      const T* vrows[kTile];
      for (int64_t j = 0; j < n; ++j) {
        krows[j] = krows_span[j] + h * D;
        vrows[j] = vrows_span[j] + h * D;
      }
      for (int64_t j = n; j < kTile; ++j) krows[j] = krows[0];  // scored 16 at a time; ignored
      float* acc_h = acc + h * G * D;
      score_tile(q + h * G * D, q_raw + h * G * p.query_head_stride, p.query_head_stride, krows, n, G, D, p.scale,
                 s.scores.data());
      // Online softmax: rescale what was accumulated under the old max.
      for (int64_t g = 0; g < G; ++g) {
        const float alpha = softmax_tile(s.scores.data() + g * kTile, n, s.max[h * G + g], s.sum[h * G + g]);
        if (alpha != 1.f) {
          for (int64_t d = 0; d < D; ++d) acc_h[g * D + d] *= alpha;
        }
      }
      value_tile(acc_h, s.scores.data(), vrows, n, G, D);
    }
  }

  T* dst = p.out + (query_row * p.num_kv_heads + head_begin) * G * D;
  for (int64_t h = 0; h < heads * G; ++h) {
    const float inv = s.sum[h] > 0.f ? 1.f / s.sum[h] : 0.f;  // kv_len 0: zeros
    for (int64_t d = 0; d < D; ++d) dst[h * D + d] = static_cast<T>(acc[h * D + d] * inv);
  }
}

// One work item: a tile of consecutive query rows of one sequence against
// one kv head (tokens > 0), or a single query row against a span of kv heads.
struct WorkItem {
  int64_t row, tokens, head_begin, head_end;
};

// Splits each run of consecutive rows of one sequence (a prefill chunk) into
// tiles where the tiled kernel has this dtype; the other rows are row items.
// Tiles come first, the longest first: ragged lengths make items unequal.
template <typename T>
std::vector<WorkItem> plan_work(const Problem<T>& p, int64_t num_rows, int64_t threads) {
  std::vector<WorkItem> tiles;
  std::vector<int64_t> single_rows;
#if FLEET_ATTENTION_TILES
  const int64_t per_tile = fleet_attention::tile_tokens(p.group);
  if (fleet_attention::has_tiles<T>() && p.seq_index && per_tile > 0 && p.window == 0) {  // tiles: whole contexts
    for (int64_t run_begin = 0, run_end; run_begin < num_rows; run_begin = run_end) {
      run_end = run_begin + 1;
      while (run_end < num_rows && p.seq_index[run_end] == p.seq_index[run_begin]) ++run_end;
      for (int64_t row = run_begin; row < run_end; row += per_tile) {
        const int64_t tokens = std::min(per_tile, run_end - row);
        if (!fleet_attention::worth_a_tile(tokens, p.group)) {
          for (int64_t r = row; r < row + tokens; ++r) single_rows.push_back(r);
          continue;
        }
        for (int64_t h = 0; h < p.num_kv_heads; ++h) tiles.push_back({row, tokens, h, h + 1});
      }
    }
    auto keys_read = [&](const WorkItem& w) { return w.tokens * p.kv_lens[w.row + w.tokens - 1]; };
    std::stable_sort(tiles.begin(), tiles.end(),
                     [&](const WorkItem& a, const WorkItem& b) { return keys_read(a) > keys_read(b); });
  } else
#endif
  {
    for (int64_t r = 0; r < num_rows; ++r) single_rows.push_back(r);
  }
  // Whole rows per item when there are enough rows to keep every thread
  // busy; else one kv head per item, for parallelism.
  const int64_t span = static_cast<int64_t>(single_rows.size()) >= 4 * threads ? p.num_kv_heads : 1;
  std::vector<WorkItem> items = std::move(tiles);
  for (int64_t r : single_rows) {
    for (int64_t h = 0; h < p.num_kv_heads; h += span) items.push_back({r, 0, h, h + span});
  }
  return items;
}

template <typename T, int64_t kHeadDim>
void run(const Problem<T>& p, int64_t num_rows) {
  const int64_t max_threads = at::get_num_threads();
  const std::vector<WorkItem> items = plan_work(p, num_rows, max_threads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::min<int64_t>(max_threads, num_items));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch(p.num_kv_heads, p.group, p.head_dim);
#if FLEET_ATTENTION_TILES
    std::optional<fleet_attention::TileScratch> tile_scratch;  // sized on this thread's first tile
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const WorkItem& w = items[i];
      if (w.tokens == 0) {
        attend<T, kHeadDim>(p, w.row, w.head_begin, w.head_end, scratch);
        continue;
      }
#if FLEET_ATTENTION_TILES
      if constexpr (fleet_attention::has_tiles<T>()) {
        if (!tile_scratch) tile_scratch.emplace(p.head_dim);
        fleet_attention::attend_tile<T, kHeadDim>(p, w.row, w.tokens, w.head_begin, *tile_scratch);
      }
#endif
    }
  }
}

// Bounds of everything the kernel will index, checked before any read.
void check_tables(const int32_t* tables, int64_t table_rows, int64_t table_stride, int64_t table_width,
                  const int32_t* seq_index, const int32_t* kv_lens, int64_t num_rows, int64_t block_size,
                  int64_t num_blocks) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t seq = seq_index ? seq_index[r] : r;
    TORCH_CHECK(seq >= 0 && seq < table_rows, "row ", r, ": sequence ", seq, " outside block_tables of ",
                table_rows, " rows");
    const int64_t len = kv_lens[r];
    TORCH_CHECK(len >= 0 && len <= table_width * block_size, "row ", r, ": kv_len ", len, " does not fit ",
                table_width, " blocks of ", block_size);
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = tables[seq * table_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "row ", r, ": block id ", id, " outside the cache's ", num_blocks,
                  " blocks");
    }
  }
}

}  // namespace

// query [R, H, D]; kv_cache [2, num_blocks, block_size, KVH, D]; block_tables int32 [S, W];
// kv_lens int32 [R]; scale; seq_index int32 [R] or None (row r -> table row r); window: > 0, each row
// attends to its last `window` keys only (sliding-window attention). Returns [R, H, D].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& kv_lens, double scale, const std::optional<at::Tensor>& seq_index,
                           int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window), got ", window);
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.dim() == 3, "query must be [rows, heads, head_dim], got ", query.sizes());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, kv_heads, "
              "head_dim], got ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query dtype ", query.scalar_type(),
              " != kv_cache dtype ", kv_cache.scalar_type());
  TORCH_CHECK(query.stride(2) == 1, "query's head_dim must be contiguous");
  const int64_t rows = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "head_dim ", head_dim, " != cache's ", kv_cache.size(4));
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= kMaxHeadDim, "head_dim=", head_dim,
              " must be a multiple of 16 up to ", kMaxHeadDim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "num_heads=", heads, " must be a multiple of num_kv_heads=",
              kv_heads);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int32 [seqs, width] with contiguous rows");
  TORCH_CHECK(kv_lens.scalar_type() == at::kInt && kv_lens.dim() == 1 && kv_lens.size(0) == rows &&
              kv_lens.is_contiguous(), "kv_lens must be contiguous int32 [", rows, "]");
  const int32_t* seq_ptr = nullptr;
  if (seq_index.has_value()) {
    const auto& si = seq_index.value();
    TORCH_CHECK(si.scalar_type() == at::kInt && si.dim() == 1 && si.size(0) == rows && si.is_contiguous(),
                "seq_index must be contiguous int32 [", rows, "]");
    seq_ptr = si.data_ptr<int32_t>();
  } else {
    TORCH_CHECK(block_tables.size(0) >= rows, "block_tables has ", block_tables.size(0), " rows for ", rows,
                " query rows");
  }
  check_tables(block_tables.data_ptr<int32_t>(), block_tables.size(0), block_tables.stride(0),
               block_tables.size(1), seq_ptr, kv_lens.data_ptr<int32_t>(), rows, block_size, num_blocks);

  auto out = at::empty({rows, heads, head_dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "fleet_paged_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 is not supported");
    } else {
      const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
      Problem<scalar_t> p{
          query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
          cache, cache + kv_cache.stride(0),
          block_tables.data_ptr<int32_t>(), block_tables.stride(0),
          seq_ptr, kv_lens.data_ptr<int32_t>(),
          out.data_ptr<scalar_t>(),
          kv_heads, heads / kv_heads, head_dim, block_size, static_cast<float>(scale), window};
      switch (head_dim) {
        case 64: run<scalar_t, 64>(p, rows); break;
        case 128: run<scalar_t, 128>(p, rows); break;
        default: run<scalar_t, 0>(p, rows); break;
      }
    }
  });
  return out;
}

TORCH_LIBRARY(fleet_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor kv_lens, float scale, "
        "Tensor? seq_index=None, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
