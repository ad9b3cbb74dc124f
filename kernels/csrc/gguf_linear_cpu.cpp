// Linear layers whose weights stay in a GGUF file's quantized blocks
// (kernels/quantized.py): y = x W^T (+ b) straight from the blocks, and
// embedding rows looked up in them.
//
// In the file a weight is one row of blocks per output feature; each block of
// 32 weights is, as ggml lays it out:
//   Q4_0   (18 bytes): fp16 d, 16 bytes of nibbles;           w = (q - 8) * d
//   Q4_1   (20 bytes): fp16 d, fp16 m, 16 bytes;              w = q * d + m
//   Q5_0   (22 bytes): fp16 d, 4 bytes qh, 16 bytes;          w = (q - 16) * d
//   Q5_1   (24 bytes): fp16 d, fp16 m, 4 bytes qh, 16 bytes;  w = q * d + m
//   Q8_0   (34 bytes): fp16 d, 32 int8;                       w = q * d
//   IQ4_NL (18 bytes): fp16 d, 16 bytes of nibbles;           w = KVALUES[q] * d
// (byte j of the nibbles holds weight j in its low nibble, j + 16 in its high;
// for the 5-bit types bit k of the little-endian uint32 qh is weight k's fifth
// bit; IQ4_NL's nibble indexes a table of 16 int8s).
//
// `gguf_pack` rearranges those bytes once, at load, into panels of PANEL = 32
// output features, the layout the multiply reads in order (the same bytes per
// weight as the file: d and m of the panel's 32 features, then their values):
//   packed[panel][block] = d[32] fp16, (Q4_1, Q5_1) m[32] fp16, values
// with the values of k-pair kp (k = 2 kp, 2 kp + 1 of the block) for feature
// j = 16 h + i in lane 2 i + (k & 1) of vector h: for the nibble types one
// 32-byte line per kp, vector 0 in the low nibbles and vector 1 in the high,
// and for the 5-bit types after the 16 lines the fifth bits, a uint32 per kp
// and vector (bit `lane`: 8 bytes per kp); for Q8_0 two 32-byte lines per kp.
// IQ4_NL keeps its nibbles, looked up in the table where they are unpacked.
// Features past N are zero.
//
// On a CPU with AVX512-BF16 (a bfloat16 model), steps of up to INTEGER_ROWS
// rows never dequantize: the integers of a block are exact in bfloat16, so
// per block and row of x, VDPBF16PS sums v * x over the block's k-pairs into
// 32 feature lanes, then
//   y += d * sum(v x) + c * sum(x)
// with v = 128 + q for the 4- and 5-bit types (q ORed into the bits of
// 128.0: no conversion), c = m - 128 d (Q4_1, Q5_1), -136 d (Q4_0) or -144 d
// (Q5_0); v = q, c = 0 for Q8_0, and v = KVALUES[q] (one permute of the
// table's bfloat16 bits), c = 0 for IQ4_NL. Each line of values is unpacked once per block and tile of
// TILE_ROWS rows of x. The products are exact; the float32 sums differ from
// those of the dequantized model in order, and in skipping the weights'
// rounding to bfloat16 (tests/kernels/test_gguf_linear.py states the
// tolerance). Larger steps dequantize a panel at a time into bfloat16, rounded
// as loading dequantized weights did, and multiply it for every row.
//
// Elsewhere on a CPU with AVX2 (float32 and float16 activations, and
// bfloat16 ones without AVX512-BF16), steps of up to Q8_ROWS rows do what
// llama.cpp does there: each row of x is rounded to Q8 blocks (per 32
// values d = max|x| / 127, q = round(x / d), s = d * sum(q)), and per block
//   y += d_w * d * sum(v q) + c * s
// with v the blocks' integers (nibbles 0..15, 5-bit 0..31, int8, or IQ4_NL's
// table entries, looked up with one VPSHUFB), c = m (Q4_1, Q5_1), -8 d_w
// (Q4_0), -16 d_w (Q5_0), 0 (Q8_0, IQ4_NL): the dequantized weights times the
// rounded x. VPMADDUBSW multiplies the unsigned weights (for the signed ones,
// |v| against q with v's sign) by the k-pair of q broadcast to every lane pair, which suits the
// pair layout above as it is: one 16-bit sum per feature and k-pair, added up
// in int16 while that cannot overflow and widened to int32 (AVX-VNNI's
// VPDPBUSD would want 4 k of a feature in adjacent bytes, so it is not used). Larger
// steps dequantize each block into a float32 tile in that same lane order
// (each feature's even and odd k in adjacent lanes), rounded to the model's
// dtype as loading dequantized weights did, and multiply it for every row
// with FMAs into two sums per feature, added when the panel is stored: the
// dequantized model's products, summed in another order.
// Without AVX2, each block is dequantized into a float32 tile, rounded the
// same way, and multiplied in plain loops.
//
// Registered in torch.ops.fleet_cpu.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "gguf_iq4nl_values.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include "simd_convert.h"
#define FLEET_GGUF_AVX512_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#define FLEET_GGUF_AVX2 1
#endif

namespace {

constexpr int64_t BLOCK = 32;  // weights per block, every type here
constexpr int64_t PANEL = 32;  // output features per panel
constexpr int64_t PAIRS = BLOCK / 2;

// ggml's GGMLQuantizationType values
enum QuantType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20 };

// IQ4_NL's weights: d times the entry its nibble indexes (ggml's kvalues_iq4nl).
constexpr const int8_t (&KVALUES)[16] = fleet_gguf::KVALUES_IQ4NL;

void check_type(int64_t type) {
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == IQ4_NL,
              "GGUF quantization type ", type, " has no CPU kernel (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, IQ4_NL=20 do)");
}

// What sets the types apart: a stored m (w = q d + m), a fifth bit per
// weight, values that are signed (int8, or IQ4_NL's table: no offset), and
// else the offset of w = (q + offset) d.
constexpr bool has_min(int64_t type) { return type == Q4_1 || type == Q5_1; }
constexpr bool has_fifth_bit(int64_t type) { return type == Q5_0 || type == Q5_1; }
constexpr bool signed_values(int64_t type) { return type == Q8_0 || type == IQ4_NL; }
constexpr int offset_of(int64_t type) { return type == Q4_0 ? -8 : type == Q5_0 ? -16 : 0; }

// Bytes of one block in the file, and of one panel's block once packed.
constexpr int64_t file_block_bytes(int64_t type) {
  return type == Q8_0 ? 34 : 18 + (has_min(type) ? 2 : 0) + (has_fifth_bit(type) ? 4 : 0);
}
constexpr int64_t NIBBLE_BYTES = PANEL * BLOCK / 2;  // a panel's block of nibbles, before any fifth bits
constexpr int64_t scale_bytes(int64_t type) { return has_min(type) ? 4 * PANEL : 2 * PANEL; }
constexpr int64_t value_bytes(int64_t type) {
  return type == Q8_0 ? PANEL * BLOCK : NIBBLE_BYTES + (has_fifth_bit(type) ? PANEL * BLOCK / 8 : 0);
}
constexpr int64_t panel_block_bytes(int64_t type) { return scale_bytes(type) + value_bytes(type); }

inline float half_bits_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

inline uint16_t half_at(const uint8_t* p, int64_t index) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * index, sizeof(bits));
  return bits;
}

// The integer of weight k (0..31) of a file block, before offset and scale
// (IQ4_NL's: the nibble, before its table).
template <int64_t TYPE>
inline int file_value(const uint8_t* block, int64_t k) {
  if constexpr (TYPE == Q8_0) return reinterpret_cast<const int8_t*>(block + 2)[k];
  const uint8_t* q = block + 2 + (has_min(TYPE) ? 2 : 0) + (has_fifth_bit(TYPE) ? 4 : 0);
  const int nibble = k < 16 ? q[k] & 0xF : q[k - 16] >> 4;
  if constexpr (!has_fifth_bit(TYPE)) return nibble;
  const uint8_t* qh = q - 4;
  return nibble | ((qh[k / 8] >> (k % 8)) & 1) << 4;
}

// Where weight (feature j, k) of a panel's block sits among its values, and
// how to read it back (the inverse of gguf_pack).
inline int64_t lane_of(int64_t j, int64_t k) { return 2 * (j % 16) + (k & 1); }

// Byte `lane / 8` of the fifth bits of (kp, vector h) holds lane's bit `lane % 8`.
inline int64_t fifth_bit_byte(int64_t kp, int64_t h, int64_t lane) { return NIBBLE_BYTES + kp * 8 + 4 * h + lane / 8; }

template <int64_t TYPE>
inline int packed_value(const uint8_t* values, int64_t j, int64_t k) {
  const int64_t kp = k / 2, lane = lane_of(j, k);
  if constexpr (TYPE == Q8_0) return reinterpret_cast<const int8_t*>(values)[kp * 64 + (j / 16) * 32 + lane];
  const uint8_t byte = values[kp * 32 + lane];
  const int nibble = j < 16 ? byte & 0xF : byte >> 4;
  if constexpr (!has_fifth_bit(TYPE)) return nibble;
  return nibble | ((values[fifth_bit_byte(kp, j / 16, lane)] >> (lane % 8)) & 1) << 4;
}

// The float32 weight of integer q with the block's d and m.
template <int64_t TYPE>
inline float weight_of(int q, float d, float m) {
  if constexpr (has_min(TYPE)) return float(q) * d + m;  // d * q is exact: one rounding, as gguf-py's
  if constexpr (TYPE == IQ4_NL) return float(KVALUES[q]) * d;
  return float(q + offset_of(TYPE)) * d;
}

template <typename F>
void with_type(int64_t type, F&& f) {
  check_type(type);
  switch (type) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); break;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); break;
    case Q5_0: f(std::integral_constant<int64_t, Q5_0>{}); break;
    case Q5_1: f(std::integral_constant<int64_t, Q5_1>{}); break;
    case IQ4_NL: f(std::integral_constant<int64_t, IQ4_NL>{}); break;
    default: f(std::integral_constant<int64_t, Q8_0>{}); break;
  }
}

// ---- packing ------------------------------------------------------------------------

template <int64_t TYPE>
void pack_panels(const uint8_t* rows, int64_t N, int64_t K, uint8_t* packed) {
  const int64_t blocks = K / BLOCK, row_bytes = blocks * file_block_bytes(TYPE);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* out = packed + (p * blocks + b) * panel_block_bytes(TYPE);
        uint8_t* values = out + scale_bytes(TYPE);
        for (int64_t j = 0; j < PANEL && p * PANEL + j < N; ++j) {
          const uint8_t* block = rows + (p * PANEL + j) * row_bytes + b * file_block_bytes(TYPE);
          std::memcpy(out + 2 * j, block, 2);                                        // d
          if constexpr (has_min(TYPE)) std::memcpy(out + 2 * PANEL + 2 * j, block + 2, 2);  // m
          for (int64_t k = 0; k < BLOCK; ++k) {
            const int q = file_value<TYPE>(block, k);
            const int64_t kp = k / 2, lane = lane_of(j, k);
            if constexpr (TYPE == Q8_0) {
              values[kp * 64 + (j / 16) * 32 + lane] = uint8_t(int8_t(q));
            } else {
              values[kp * 32 + lane] |= uint8_t(j < 16 ? q & 0xF : (q & 0xF) << 4);
              if (has_fifth_bit(TYPE) && q & 16) values[fifth_bit_byte(kp, j / 16, lane)] |= uint8_t(1 << (lane % 8));
            }
          }
        }
      }
    }
  });
}

at::Tensor gguf_pack(const at::Tensor& rows, int64_t type, int64_t in_features) {
  check_type(type);
  const int64_t K = in_features, N = rows.size(0);
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous(),
              "rows: contiguous [N, row bytes] uint8, a GGUF tensor's blocks");
  TORCH_CHECK(K % BLOCK == 0 && rows.size(1) == K / BLOCK * file_block_bytes(type), "rows of ", rows.size(1),
              " bytes do not hold ", K, " weights of GGUF type ", type);
  at::Tensor packed = at::zeros({(N + PANEL - 1) / PANEL, K / BLOCK, panel_block_bytes(type)}, rows.options());
  with_type(type, [&](auto kind) {
    pack_panels<decltype(kind)::value>(rows.data_ptr<uint8_t>(), N, K, packed.data_ptr<uint8_t>());
  });
  return packed;
}

void check_packed(const at::Tensor& packed, int64_t type, int64_t K, int64_t N) {
  check_type(type);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(1) * BLOCK == K && packed.size(2) == panel_block_bytes(type),
              "packed: contiguous [panels, ", K / BLOCK, ", ", panel_block_bytes(type), "] uint8 of GGUF type ", type,
              " (gguf_pack's layout) for ", K, " input features");
  TORCH_CHECK(N > (packed.size(0) - 1) * PANEL && N <= packed.size(0) * PANEL, N, " output features do not fill ",
              packed.size(0), " panels of ", PANEL);
}

// ---- portable: dequantized tiles (CPUs without AVX2) ---------------------------------

#if !FLEET_GGUF_AVX2

// tile[k][j] = weight (feature j, k) of a panel's block, rounded to Model.
template <int64_t TYPE, typename Model>
void dequantize_tile(const uint8_t* panel_block, float (&tile)[BLOCK][PANEL]) {
  const uint8_t* values = panel_block + scale_bytes(TYPE);
  for (int64_t j = 0; j < PANEL; ++j) {
    const float d = half_bits_to_float(half_at(panel_block, j));
    const float m = has_min(TYPE) ? half_bits_to_float(half_at(panel_block, PANEL + j)) : 0.f;
    for (int64_t k = 0; k < BLOCK; ++k)
      tile[k][j] = float(Model(weight_of<TYPE>(packed_value<TYPE>(values, j, k), d, m)));
  }
}

template <int64_t TYPE, typename Model, typename Out>
void tiled_rows(const float* x, const uint8_t* packed, int64_t M, int64_t K, int64_t N, const Out* bias, Out* y) {
  const int64_t blocks = K / BLOCK, panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * PANEL);
    float tile[BLOCK][PANEL];
    for (int64_t p = begin; p < end; ++p) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        dequantize_tile<TYPE, Model>(packed + (p * blocks + b) * panel_block_bytes(TYPE), tile);
        for (int64_t m = 0; m < M; ++m) {
          float* row_acc = acc.data() + m * PANEL;
          const float* xb = x + m * K + b * BLOCK;
          for (int64_t k = 0; k < BLOCK; ++k)
            for (int64_t j = 0; j < PANEL; ++j) row_acc[j] += tile[k][j] * xb[k];
        }
      }
      const int64_t valid = std::min(PANEL, N - p * PANEL);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < valid; ++j)
          y[m * N + p * PANEL + j] = Out(acc[m * PANEL + j] + (bias ? float(bias[p * PANEL + j]) : 0.f));
    }
  });
}
#endif

// ---- AVX2: Q8 activations against the blocks' integers, and float32 tiles --------------

#if FLEET_GGUF_AVX2
// Steps of up to this many rows (decode) quantize x to Q8 and multiply
// integers, llama.cpp's AVX2 scheme; larger ones (prefill) dequantize each
// block into float32 once and multiply it exactly for every row. Measured
// with `FLEET_CPU_ISA=avx2 python -P scripts/bench_gguf_linear.py --dtype
// float32 --shapes up down` on a Sapphire Rapids core held to AVX2: the Q8
// path is 2.7x faster at 1 row, 1.2-1.4x at 32 and still 1.2x at 128, so the
// bound is where steps stop being decode, as INTEGER_ROWS's, not speed.
constexpr int64_t Q8_ROWS = 32;
constexpr int Q8_TILE = 4;     // rows of x per pass of the integer path
constexpr int FLOAT_TILE = 3;  // rows of x per pass of the float32 path: 12 accumulators
// Rows of x the float32 path takes through all of a task's panels before the
// next rows: 64 rows of 576-1536 inputs stay in L2 while every panel reads
// them (with all of a 2048-token prefill's rows, x streamed from memory once
// per panel: 0.4-0.55x MKL's float32 GEMM on the dequantized weights; the
// blocks are dequantized once per chunk instead, which costs less).
constexpr int64_t FLOAT_CHUNK = 64;

// x's rows as Q8 blocks: q[m * K + k], and per block of 32 (index m * blocks + b)
// the scale d = max|x| / 127 (float32, where a GGUF file rounds it to fp16) and
// s = d * sum(q), the sum of the rounded x that Q4_1's m and Q4_0's -8 multiply.
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

// One block of 32 float32s as Q8: q = x * (127 / max|x|) rounded to nearest
// even (|q| <= 127), d and s as Q8Rows keeps them.
inline void quantize_block(const float* x, int8_t* q, float& d, float& s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], max = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    max = _mm256_max_ps(max, _mm256_andnot_ps(sign, v[i]));
  }
  const float amax = reduce_max8(max);
  const __m256 scale = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i ints[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));  // the default rounding: to nearest even
    sum = _mm256_add_epi32(sum, ints[i]);
  }
  // The packs interleave 4-value groups of the four vectors; the permute puts them back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  d = amax / 127.f;
  s = d * reduce_add8(_mm256_cvtepi32_ps(sum));
}

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / BLOCK;
  Q8Rows rows{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * blocks)};
  for (int64_t i = 0; i < M * blocks; ++i)
    quantize_block(x + i * BLOCK, rows.q.data() + i * BLOCK, rows.d[i], rows.s[i]);
  return rows;
}

// 16 int16 per-feature sums a and b (features 0-15, as maddubs leaves them)
// added into int32 lanes: the unpacks pair a and b feature by feature within
// each 128-bit half, so lanes hold features 0-3, 8-11 (low) and 4-7, 12-15
// (high); in_feature_order undoes that once per block.
inline void add_widened(__m256i a, __m256i b, __m256i& low, __m256i& high) {
  const __m256i ones = _mm256_set1_epi16(1);
  low = _mm256_add_epi32(low, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), ones));
  high = _mm256_add_epi32(high, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), ones));
}

inline void in_feature_order(__m256i& low, __m256i& high) {
  const __m256i first = _mm256_permute2x128_si256(low, high, 0x20), second = _mm256_permute2x128_si256(low, high, 0x31);
  low = first;
  high = second;
}

// x[m]'s k-pair at k as 16 copies of its two int8s: maddubs then multiplies
// each feature's pair of weights (lanes 2i, 2i + 1) by it and adds the two.
inline __m256i pair_of(const int8_t* x, int64_t k) {
  int16_t pair;
  std::memcpy(&pair, x + k, sizeof(pair));
  return _mm256_set1_epi16(pair);
}

// 0x10 in byte i where bit i of the uint32 at `bits` is set, else 0.
inline __m256i fifth_bits(const uint8_t* bits) {
  uint32_t word;
  std::memcpy(&word, bits, sizeof(word));
  const __m256i spread = _mm256_shuffle_epi8(  // byte i <- byte i / 8 of the word
      _mm256_set1_epi32(int32_t(word)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201));  // bit i % 8 of byte i
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(0x10));
}

// The 32 values of k-pair kp for features 16h .. 16h + 15 as bytes in lane
// order: unsigned integers (nibbles, with the fifth bits ORed in), or signed
// ones (Q8_0's int8, IQ4_NL's nibbles looked up in KVALUES).
template <int64_t TYPE>
inline __m256i value_line(const uint8_t* values, int h, int64_t kp) {
  if constexpr (TYPE == Q8_0) return _mm256_loadu_si256((const __m256i*)(values + kp * 64 + 32 * h));
  const __m256i bytes = _mm256_loadu_si256((const __m256i*)(values + kp * 32));
  const __m256i nibbles = _mm256_and_si256(h == 0 ? bytes : _mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0xF));
  if constexpr (TYPE == IQ4_NL) {
    const __m128i table = _mm_loadu_si128((const __m128i*)KVALUES);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles);
  } else if constexpr (has_fifth_bit(TYPE)) {
    return _mm256_or_si256(nibbles, fifth_bits(values + fifth_bit_byte(kp, h, 0)));
  }
  return nibbles;
}

// int16 sums over k-pairs kp0 .. kp0 + RUN - 1 of the unsigned values of
// features 16h .. 16h + 15 times each row of q.
template <int64_t TYPE, int MR, int64_t RUN>
inline void unsigned_dots(const uint8_t* values, int h, int64_t kp0, const int8_t* q, int64_t K,
                          __m256i (&part)[MR]) {
  for (int m = 0; m < MR; ++m) part[m] = _mm256_setzero_si256();
  for (int64_t kp = kp0; kp < kp0 + RUN; ++kp) {
    const __m256i w = value_line<TYPE>(values, h, kp);
    for (int m = 0; m < MR; ++m)
      part[m] = _mm256_add_epi16(part[m], _mm256_maddubs_epi16(w, pair_of(q + m * K, 2 * kp)));
  }
}

// Row m's integer dot products over the block with features 16h .. 16h + 15
// (low: 16h + 0-7, high: 16h + 8-15); rows of q have stride K and start at
// the block.
template <int64_t TYPE, int MR>
inline void half_dots(const uint8_t* values, int h, const int8_t* q, int64_t K, __m256i (&low)[MR],
                      __m256i (&high)[MR]) {
  for (int m = 0; m < MR; ++m) low[m] = high[m] = _mm256_setzero_si256();
  if constexpr (signed_values(TYPE)) {
    // A product of int8s takes up to 15 bits: every k-pair's sum is widened.
    for (int64_t kp = 0; kp < PAIRS; kp += 2) {
      const __m256i w0 = value_line<TYPE>(values, h, kp), w1 = value_line<TYPE>(values, h, kp + 1);
      const __m256i abs0 = _mm256_abs_epi8(w0), abs1 = _mm256_abs_epi8(w1);
      for (int m = 0; m < MR; ++m) {  // maddubs takes one unsigned operand: |w| times x with w's sign
        const __m256i p0 = _mm256_maddubs_epi16(abs0, _mm256_sign_epi8(pair_of(q + m * K, 2 * kp), w0));
        const __m256i p1 = _mm256_maddubs_epi16(abs1, _mm256_sign_epi8(pair_of(q + m * K, 2 * kp + 2), w1));
        add_widened(p0, p1, low[m], high[m]);
      }
    }
  } else {
    // A nibble times an int8 takes up to 12 bits: 8 k-pairs add up in int16
    // (8 * 2 * 15 * 127 < 2^15), the two halves of the block then widen; a
    // 5-bit value 13 bits: runs of 4 k-pairs (4 * 2 * 31 * 127 < 2^15).
    constexpr int64_t RUN = has_fifth_bit(TYPE) ? PAIRS / 4 : PAIRS / 2;
    for (int64_t kp = 0; kp < PAIRS; kp += 2 * RUN) {
      __m256i first[MR], second[MR];
      unsigned_dots<TYPE, MR, RUN>(values, h, kp, q, K, first);
      unsigned_dots<TYPE, MR, RUN>(values, h, kp + RUN, q, K, second);
      for (int m = 0; m < MR; ++m) add_widened(first[m], second[m], low[m], high[m]);
    }
  }
  for (int m = 0; m < MR; ++m) in_feature_order(low[m], high[m]);
}

// acc[m] (32 floats per row) += d * dx * dots + c * s for MR rows, with
// c = m (Q4_1, Q5_1), offset * d (Q4_0, Q5_0), none for the signed types:
// the dequantized weights times the rounded x, up to float32 rounding.
template <int64_t TYPE, int MR>
void integer_tile(const uint8_t* panel_block, const Q8Rows& x, int64_t m0, int64_t b, int64_t K, float* acc) {
  const int64_t blocks = K / BLOCK;
  const int8_t* q = x.q.data() + m0 * K + b * BLOCK;
  __m256i dots[4][MR];  // [features 8v .. 8v + 7][row]
  half_dots<TYPE, MR>(panel_block + scale_bytes(TYPE), 0, q, K, dots[0], dots[1]);
  half_dots<TYPE, MR>(panel_block + scale_bytes(TYPE), 1, q, K, dots[2], dots[3]);
  for (int v = 0; v < 4; ++v) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(panel_block + 16 * v)));
    const __m256 c = has_min(TYPE)
                         ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(panel_block + 2 * PANEL + 16 * v)))
                         : _mm256_mul_ps(_mm256_set1_ps(float(offset_of(TYPE))), d);  // unused for signed types
    for (int m = 0; m < MR; ++m) {
      const int64_t i = (m0 + m) * blocks + b;
      float* lanes = acc + m * PANEL + 8 * v;
      __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[v][m]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[i])),
                                   _mm256_loadu_ps(lanes));
      if constexpr (!signed_values(TYPE)) sum = _mm256_fmadd_ps(c, _mm256_set1_ps(x.s[i]), sum);
      _mm256_storeu_ps(lanes, sum);
    }
  }
}

// y[m][n0 + j] = sums[m][j] + bias for a panel's `valid` features.
template <typename Out>
void store_panel(const float* sums, int64_t M, const Out* bias, Out* y, int64_t N, int64_t n0, int64_t valid) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < valid; ++j)
      y[m * N + n0 + j] = Out(sums[m * PANEL + j] + (bias ? float(bias[n0 + j]) : 0.f));
}

template <int64_t TYPE>
using IntegerTile = void (*)(const uint8_t*, const Q8Rows&, int64_t, int64_t, int64_t, float*);
template <int64_t TYPE>
constexpr IntegerTile<TYPE> INTEGER_TILE_FOR[Q8_TILE + 1] = {nullptr, integer_tile<TYPE, 1>, integer_tile<TYPE, 2>,
                                                             integer_tile<TYPE, 3>, integer_tile<TYPE, 4>};

// y [M, N] = x W^T + bias with x rounded to Q8: each task takes panels, and
// each block of a panel serves every row of x while it is in L1.
template <int64_t TYPE, typename Out>
void q8_rows(const float* x, const uint8_t* packed, int64_t M, int64_t K, int64_t N, const Out* bias, Out* y) {
  const int64_t blocks = K / BLOCK, panels = (N + PANEL - 1) / PANEL;
  const Q8Rows rows = quantize_rows(x, M, K);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * PANEL);
    for (int64_t p = begin; p < end; ++p) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* panel_block = packed + (p * blocks + b) * panel_block_bytes(TYPE);
        for (int64_t m0 = 0; m0 < M; m0 += Q8_TILE) {
          const int64_t tile = std::min<int64_t>(Q8_TILE, M - m0);
          INTEGER_TILE_FOR<TYPE>[tile](panel_block, rows, m0, b, K, acc.data() + m0 * PANEL);
        }
      }
      store_panel(acc.data(), M, bias, y, N, p * PANEL, std::min(PANEL, N - p * PANEL));
    }
  });
}

// tile[kp * 64 + 32 h + lane]: a panel's block dequantized in the packed
// order (lane 2i + e holds feature 16h + i at k = 2 kp + e), rounded to Model
// as loading dequantized weights did.
template <int64_t TYPE, typename Model>
void dequantize_pairs(const uint8_t* panel_block, float* tile) {
  const uint8_t* values = panel_block + scale_bytes(TYPE);
  const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);  // lanes 2i, 2i + 1 <- feature i
  __m256 d[8], m[8];  // per 8 lanes: features 4t .. 4t + 3, twice each
  for (int t = 0; t < 8; ++t) {
    const auto four = [&](int64_t offset) {  // 4 fp16 at panel_block + offset, each in two lanes
      return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadl_epi64((const __m128i*)(panel_block + offset))), twice);
    };
    d[t] = four(8 * t);
    // (q - 8) d = q d - 8 d, both exact (and (q - 16) d); q d + m rounds once, as gguf-py's.
    m[t] = has_min(TYPE) ? four(2 * PANEL + 8 * t) : _mm256_mul_ps(_mm256_set1_ps(float(offset_of(TYPE))), d[t]);
  }
  for (int64_t kp = 0; kp < PAIRS; ++kp) {
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = value_line<TYPE>(values, h, kp);
      const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
      for (int g = 0; g < 4; ++g) {  // lanes 8g .. 8g + 7
        const __m128i eight = g % 2 == 0 ? halves[g / 2] : _mm_srli_si128(halves[g / 2], 8);
        const __m256i ints = signed_values(TYPE) ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
        const int t = 4 * h + g;
        _mm256_storeu_ps(tile + kp * 64 + 8 * t,
                         round_to<Model>(_mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), d[t], m[t])));
      }
    }
  }
}

// acc[m][lane] += tile lane * x[m] at the lane's k, for MR rows (stride K,
// starting at the block) and the 32 lanes of features 16h .. 16h + 15: each
// feature's even and odd k sum apart until the panel is stored.
template <int MR>
void float_tile(const float* tile, const float* x, int64_t K, float* acc, int h) {
  __m256 sums[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) sums[m][v] = _mm256_loadu_ps(acc + m * 2 * PANEL + 32 * h + 8 * v);
  for (int64_t kp = 0; kp < PAIRS; ++kp) {
    __m256 w[4];
    for (int v = 0; v < 4; ++v) w[v] = _mm256_loadu_ps(tile + kp * 64 + 32 * h + 8 * v);
    for (int m = 0; m < MR; ++m) {
      const __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(x + m * K + 2 * kp)));
      for (int v = 0; v < 4; ++v) sums[m][v] = _mm256_fmadd_ps(w[v], pair, sums[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + m * 2 * PANEL + 32 * h + 8 * v, sums[m][v]);
}

using FloatTile = void (*)(const float*, const float*, int64_t, float*, int);
constexpr FloatTile FLOAT_TILE_FOR[FLOAT_TILE + 1] = {nullptr, float_tile<1>, float_tile<2>, float_tile<3>};

// y [M, N] = x W^T + bias exactly, for more rows: each block of a panel is
// dequantized once into float32 and multiplied for every row.
template <int64_t TYPE, typename Model, typename Out>
void float_rows(const float* x, const uint8_t* packed, int64_t M, int64_t K, int64_t N, const Out* bias, Out* y) {
  const int64_t blocks = K / BLOCK, panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(FLOAT_CHUNK * 2 * PANEL), sums(FLOAT_CHUNK * PANEL);  // acc: even and odd k per feature
    alignas(32) float tile[PAIRS * 2 * PANEL];
    for (int64_t c0 = 0; c0 < M; c0 += FLOAT_CHUNK) {
      const int64_t rows = std::min(FLOAT_CHUNK, M - c0);
      const float* chunk = x + c0 * K;
      for (int64_t p = begin; p < end; ++p) {
        std::fill(acc.begin(), acc.begin() + rows * 2 * PANEL, 0.f);
        for (int64_t b = 0; b < blocks; ++b) {
          dequantize_pairs<TYPE, Model>(packed + (p * blocks + b) * panel_block_bytes(TYPE), tile);
          for (int64_t m0 = 0; m0 < rows; m0 += FLOAT_TILE)
            for (int h = 0; h < 2; ++h)
              FLOAT_TILE_FOR[std::min<int64_t>(FLOAT_TILE, rows - m0)](tile, chunk + m0 * K + b * BLOCK, K,
                                                                       acc.data() + m0 * 2 * PANEL, h);
        }
        for (int64_t i = 0; i < rows * PANEL; ++i) sums[i] = acc[2 * i] + acc[2 * i + 1];
        store_panel(sums.data(), rows, bias, y + c0 * N, N, p * PANEL, std::min(PANEL, N - p * PANEL));
      }
    }
  });
}
#endif

// ---- straight from the blocks (bfloat16 models on AVX512-BF16) ----------------------

#if FLEET_GGUF_AVX512_BF16
constexpr int TILE_ROWS = 8;  // rows of x per pass: 16 accumulators
// Steps of up to this many rows take the integers straight from the blocks;
// larger ones dequantize a panel at a time into bfloat16 first (the
// unpacking and the per-block scaling cost more than the dequantizing
// there). Measured with `python -P scripts/bench_gguf_linear.py` on a 2-core
// AVX512-BF16 EPYC, SmolLM2's shapes.
constexpr int64_t INTEGER_ROWS = 32;

// The integers of k-pair kp as 16-bit lanes of two vectors (features 0-15,
// 16-31), for the nibble types: the nibbles, plus 16 where the fifth bit is
// set (the masked add ORs it in), or (IQ4_NL) each nibble's entry of `table`,
// 16-bit lanes indexed by it.
template <int64_t TYPE>
inline void unpack_nibbles(const uint8_t* values, int64_t kp, __m512i table, __m512i& low, __m512i& high) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(values + kp * 32)));
  low = _mm512_and_si512(bytes, _mm512_set1_epi16(0xF));
  high = _mm512_srli_epi16(bytes, 4);
  if constexpr (TYPE == IQ4_NL) {
    low = _mm512_permutexvar_epi16(low, table);
    high = _mm512_permutexvar_epi16(high, table);
  } else if constexpr (has_fifth_bit(TYPE)) {
    uint32_t bits[2];
    std::memcpy(bits, values + fifth_bit_byte(kp, 0, 0), sizeof(bits));
    low = _mm512_mask_add_epi16(low, __mmask32(bits[0]), low, _mm512_set1_epi16(0x10));
    high = _mm512_mask_add_epi16(high, __mmask32(bits[1]), high, _mm512_set1_epi16(0x10));
  }
}

// KVALUES as 16-bit lanes (twice: a permute index is 5 bits), in bfloat16
// (the top half of the float32: exact, |v| <= 127) or as int16, built at
// compile time (building them per block made IQ4_NL's 1-row steps 3x slower).
struct KvalueLanes {
  alignas(64) uint16_t lanes[32];
};
constexpr KvalueLanes kvalue_lanes(bool bfloat16) {
  KvalueLanes table{};
  for (int i = 0; i < 32; ++i) {
    const int8_t v = KVALUES[i % 16];
    table.lanes[i] = bfloat16 ? uint16_t(std::bit_cast<uint32_t>(float(v)) >> 16) : uint16_t(int16_t(v));
  }
  return table;
}
constexpr KvalueLanes KVALUES_BF16 = kvalue_lanes(true), KVALUES_INT16 = kvalue_lanes(false);
inline __m512i kvalues_bf16() { return _mm512_load_si512(KVALUES_BF16.lanes); }
inline __m512i kvalues_int16() { return _mm512_load_si512(KVALUES_INT16.lanes); }

// The two value vectors (features 0-15, 16-31) of k-pair kp; `table`: kvalues_bf16() for IQ4_NL.
template <int64_t TYPE>
inline void unpack_pair(const uint8_t* values, int64_t kp, __m512i table, __m512bh& low, __m512bh& high) {
  if constexpr (TYPE == Q8_0) {
    const uint8_t* line = values + kp * 64;
    for (int h = 0; h < 2; ++h) {
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(line + 32 * h))));
      const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(line + 32 * h + 16))));
      (h == 0 ? low : high) = _mm512_cvtne2ps_pbh(b, a);  // exact: |q| <= 128
    }
  } else {
    __m512i ints[2];
    unpack_nibbles<TYPE>(values, kp, table, ints[0], ints[1]);
    if constexpr (TYPE == IQ4_NL) {  // the table's bfloat16 bits already
      low = (__m512bh)ints[0];
      high = (__m512bh)ints[1];
    } else {
      const __m512i bias = _mm512_set1_epi16(0x4300);  // the bits of 128.0: OR q < 128 in, get 128 + q
      low = (__m512bh)_mm512_or_si512(ints[0], bias);
      high = (__m512bh)_mm512_or_si512(ints[1], bias);
    }
  }
}

// acc[m] += the k-pair's two value vectors times x[m]'s pair at k (rows of
// stride K), one VDPBF16PS per vector and row.
template <int MR>
inline void add_pair(__m512 (&acc)[MR][2], __m512bh low, __m512bh high, const at::BFloat16* x, int64_t K, int64_t k) {
  for (int m = 0; m < MR; ++m) {
    int32_t pair;
    std::memcpy(&pair, x + m * K + k, sizeof(pair));
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
    acc[m][0] = _mm512_dpbf16_ps(acc[m][0], low, xv);
    acc[m][1] = _mm512_dpbf16_ps(acc[m][1], high, xv);
  }
}

// y[m][0, valid) = sums[m] + bias for `rows` rows (row m's 32 float32 lanes
// from lanes(m)), rounded to bfloat16.
template <typename Lanes>
inline void store_rows(Lanes lanes, int64_t rows, const at::BFloat16* bias, at::BFloat16* y, int64_t ldy,
                       int64_t valid) {
  const __mmask16 mask0 = tail_mask(valid), mask1 = tail_mask(valid - 16);
  const __m512 b0 = bias ? load16(bias, mask0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? load16(bias + 16, mask1) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const auto [low, high] = lanes(m);
    store16(y + m * ldy, _mm512_add_ps(low, b0), mask0);
    store16(y + m * ldy + 16, _mm512_add_ps(high, b1), mask1);
  }
}

// Each row's sum over the block of v * x, into 32 feature lanes (two
// vectors). Rows of x are bfloat16 with stride K, starting at the block.
template <int64_t TYPE, int MR>
inline void block_dots(const uint8_t* values, const at::BFloat16* x, int64_t K, __m512 (&dots)[MR][2]) {
  for (int m = 0; m < MR; ++m) dots[m][0] = dots[m][1] = _mm512_setzero_ps();
  const __m512i table = TYPE == IQ4_NL ? kvalues_bf16() : _mm512_setzero_si512();
  for (int64_t kp = 0; kp < PAIRS; ++kp) {
    __m512bh low, high;
    unpack_pair<TYPE>(values, kp, table, low, high);
    add_pair<MR>(dots, low, high, x, K, 2 * kp);
  }
}

// acc[m] (32 floats per row) += d * dots + c * (row's block sum), for MR rows.
template <int64_t TYPE, int MR>
void tile_rows(const uint8_t* panel_block, const at::BFloat16* x, const float* sums, int64_t K, int64_t blocks,
               float* acc) {
  __m512 dots[MR][2];
  block_dots<TYPE, MR>(panel_block + scale_bytes(TYPE), x, K, dots);
  for (int h = 0; h < 2; ++h) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(panel_block + 32 * h)));
    __m512 c = _mm512_setzero_ps();  // none for the signed types
    if constexpr (has_min(TYPE)) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(panel_block + 2 * PANEL + 32 * h)));
      c = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, m);
    } else if constexpr (!signed_values(TYPE)) {
      c = _mm512_mul_ps(_mm512_set1_ps(float(offset_of(TYPE) - 128)), d);
    }
    for (int m = 0; m < MR; ++m) {
      float* lanes = acc + m * PANEL + 16 * h;
      __m512 sum = _mm512_fmadd_ps(dots[m][h], d, _mm512_loadu_ps(lanes));
      if constexpr (!signed_values(TYPE)) sum = _mm512_fmadd_ps(c, _mm512_set1_ps(sums[m * blocks]), sum);
      _mm512_storeu_ps(lanes, sum);
    }
  }
}

template <int64_t TYPE>
using TileRows = void (*)(const uint8_t*, const at::BFloat16*, const float*, int64_t, int64_t, float*);
template <int64_t TYPE>
constexpr TileRows<TYPE> TILE_ROWS_FOR[TILE_ROWS + 1] = {
    nullptr, tile_rows<TYPE, 1>, tile_rows<TYPE, 2>, tile_rows<TYPE, 3>, tile_rows<TYPE, 4>,
    tile_rows<TYPE, 5>, tile_rows<TYPE, 6>, tile_rows<TYPE, 7>, tile_rows<TYPE, 8>};

// y [M, N] = x W^T + bias straight from the blocks: each task takes panels,
// and each block of a panel serves every row of x while it is in L1.
template <int64_t TYPE>
void integer_rows_bf16(const at::BFloat16* x, const uint8_t* packed, int64_t M, int64_t K, int64_t N,
                       const at::BFloat16* bias, at::BFloat16* y) {
  const int64_t blocks = K / BLOCK, panels = (N + PANEL - 1) / PANEL;
  std::vector<float> sums(signed_values(TYPE) ? 0 : M * blocks);  // sums[m * blocks + b]: x[m]'s sum over block b
  if (!signed_values(TYPE))
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const at::BFloat16* xb = x + m * K + b * BLOCK;
        sums[m * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(load16(xb, 0xFFFF), load16(xb + 16, 0xFFFF)));
      }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * PANEL);
    for (int64_t p = begin; p < end; ++p) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* panel_block = packed + (p * blocks + b) * panel_block_bytes(TYPE);
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
          const int64_t rows = std::min<int64_t>(TILE_ROWS, M - m0);
          TILE_ROWS_FOR<TYPE>[rows](panel_block, x + m0 * K + b * BLOCK, sums.data() + m0 * blocks + b, K, blocks,
                                    acc.data() + m0 * PANEL);
        }
      }
      const int64_t n0 = p * PANEL;
      const float* sums_of = acc.data();
      store_rows([&](int64_t m) { return std::pair(_mm512_loadu_ps(sums_of + m * PANEL),
                                                   _mm512_loadu_ps(sums_of + m * PANEL + 16)); },
                 M, bias ? bias + n0 : nullptr, y + n0, N, std::min(PANEL, N - n0));
    }
  });
}

// A whole panel dequantized into bfloat16 value vectors, lines[2 * kp + h]
// for the panel's k-pairs kp = 0 .. K / 2: the weights rounded as loading
// dequantized weights rounds them.
template <int64_t TYPE>
void dequantize_panel(const uint8_t* panel, int64_t blocks, __m512i* lines) {
  alignas(64) int32_t low_index[16], high_index[16];  // lane 2i + e holds feature i (of the vector's 16)
  for (int i = 0; i < 16; ++i) {
    low_index[i] = i / 2;
    high_index[i] = 8 + i / 2;
  }
  const __m512i to_low = _mm512_load_si512(low_index), to_high = _mm512_load_si512(high_index);
  const __m512i table = TYPE == IQ4_NL ? kvalues_int16() : _mm512_setzero_si512();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* panel_block = panel + b * panel_block_bytes(TYPE);
    const uint8_t* values = panel_block + scale_bytes(TYPE);
    __m512 d[2][2], m[2][2];  // [h][lanes 0-15 | 16-31]
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(panel_block + 32 * h)));
      __m512 offset = _mm512_setzero_ps();
      if constexpr (has_min(TYPE)) {
        offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(panel_block + 2 * PANEL + 32 * h)));
      } else if constexpr (offset_of(TYPE) != 0) {  // (q - 8) d = q d - 8 d, both exact (and -16)
        offset = _mm512_mul_ps(_mm512_set1_ps(float(offset_of(TYPE))), scale);
      }
      d[h][0] = _mm512_permutexvar_ps(to_low, scale);
      d[h][1] = _mm512_permutexvar_ps(to_high, scale);
      m[h][0] = _mm512_permutexvar_ps(to_low, offset);
      m[h][1] = _mm512_permutexvar_ps(to_high, offset);
    }
    for (int64_t kp = 0; kp < PAIRS; ++kp) {
      __m512i ints[2];
      if constexpr (TYPE == Q8_0) {
        ints[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(values + kp * 64)));
        ints[1] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(values + kp * 64 + 32)));
      } else {
        unpack_nibbles<TYPE>(values, kp, table, ints[0], ints[1]);
      }
      for (int h = 0; h < 2; ++h) {
        const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(ints[h])));
        const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(ints[h], 1)));
        // q d is exact, so the FMA rounds once, as gguf-py's q * d + m does.
        lines[(b * PAIRS + kp) * 2 + h] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(high, d[h][1], m[h][1]),
                                                                       _mm512_fmadd_ps(low, d[h][0], m[h][0]));
      }
    }
  }
}

// out[m][j] for MR rows of x and one dequantized panel; `valid` features
// are stored, plus bias.
template <int MR>
void panel_rows(const __m512i* lines, const at::BFloat16* x, int64_t K, const at::BFloat16* bias, at::BFloat16* y,
                int64_t ldy, int64_t valid) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    add_pair<MR>(acc, (__m512bh)lines[2 * kp], (__m512bh)lines[2 * kp + 1], x, K, 2 * kp);
  }
  store_rows([&](int64_t m) { return std::pair(acc[m][0], acc[m][1]); }, MR, bias, y, ldy, valid);
}

using PanelRows = void (*)(const __m512i*, const at::BFloat16*, int64_t, const at::BFloat16*, at::BFloat16*, int64_t,
                           int64_t);
constexpr PanelRows PANEL_ROWS[TILE_ROWS + 1] = {nullptr,       panel_rows<1>, panel_rows<2>, panel_rows<3>,
                                                 panel_rows<4>, panel_rows<5>, panel_rows<6>, panel_rows<7>,
                                                 panel_rows<8>};

// y [M, N] = x W^T + bias for more rows: a panel at a time, dequantized once.
template <int64_t TYPE>
void dequantized_rows_bf16(const at::BFloat16* x, const uint8_t* packed, int64_t M, int64_t K, int64_t N,
                           const at::BFloat16* bias, at::BFloat16* y) {
  const int64_t blocks = K / BLOCK, panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> lines(K);  // K / 2 pairs, two vectors each: K * 64 bytes
    for (int64_t p = begin; p < end; ++p) {
      dequantize_panel<TYPE>(packed + p * blocks * panel_block_bytes(TYPE), blocks, lines.data());
      const int64_t n0 = p * PANEL, valid = std::min(PANEL, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int64_t rows = std::min<int64_t>(TILE_ROWS, M - m0);
        PANEL_ROWS[rows](lines.data(), x + m0 * K, K, bias ? bias + n0 : nullptr, y + m0 * N + n0, N, valid);
      }
    }
  });
}

#endif

template <int64_t TYPE, typename Scalar>
at::Tensor multiply(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const Scalar* b = bias.has_value() && bias->defined() ? bias->data_ptr<Scalar>() : nullptr;
  const uint8_t* w = packed.data_ptr<uint8_t>();
#if FLEET_GGUF_AVX512_BF16
  if constexpr (std::is_same_v<Scalar, at::BFloat16>) {
    if (M <= INTEGER_ROWS) {
      integer_rows_bf16<TYPE>(x.data_ptr<Scalar>(), w, M, K, N, b, y.data_ptr<Scalar>());
    } else {
      dequantized_rows_bf16<TYPE>(x.data_ptr<Scalar>(), w, M, K, N, b, y.data_ptr<Scalar>());
    }
    return y;
  }
#endif
  const at::Tensor x_float = x.to(at::kFloat).contiguous();
#if FLEET_GGUF_AVX2
  if (M <= Q8_ROWS) {
    q8_rows<TYPE>(x_float.data_ptr<float>(), w, M, K, N, b, y.data_ptr<Scalar>());
  } else {
    float_rows<TYPE, Scalar>(x_float.data_ptr<float>(), w, M, K, N, b, y.data_ptr<Scalar>());
  }
#else
  tiled_rows<TYPE, Scalar>(x_float.data_ptr<float>(), w, M, K, N, b, y.data_ptr<Scalar>());
#endif
  return y;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t out_features,
                       const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && x.dim() == 2 &&
                  x.is_contiguous(),
              "x: contiguous [M, K] float32, bfloat16 or float16");
  check_packed(packed, type, x.size(1), out_features);
  TORCH_CHECK(!(bias.has_value() && bias->defined()) ||
                  (bias->scalar_type() == dtype && bias->numel() == out_features && bias->is_contiguous()),
              "bias: contiguous [N] in x's dtype");
  at::Tensor y;
  with_type(type, [&](auto kind) {
    constexpr int64_t TYPE = decltype(kind)::value;
    switch (dtype) {
      case at::kFloat: y = multiply<TYPE, float>(x, packed, out_features, bias); break;
      case at::kBFloat16: y = multiply<TYPE, at::BFloat16>(x, packed, out_features, bias); break;
      default: y = multiply<TYPE, at::Half>(x, packed, out_features, bias); break;
    }
  });
  return y;
}

// ---- rows of a packed table (embeddings) ----------------------------------------------

template <int64_t TYPE, typename Out>
void gather_rows(const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, Out* out) {
  const int64_t blocks = K / BLOCK;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = ids[t] / PANEL, j = ids[t] % PANEL;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* panel_block = packed + (p * blocks + b) * panel_block_bytes(TYPE);
        const float d = half_bits_to_float(half_at(panel_block, j));
        const float m = has_min(TYPE) ? half_bits_to_float(half_at(panel_block, PANEL + j)) : 0.f;
        for (int64_t k = 0; k < BLOCK; ++k)
          out[t * K + b * BLOCK + k] = Out(weight_of<TYPE>(packed_value<TYPE>(panel_block + scale_bytes(TYPE), j, k), d, m));
      }
    }
  });
}

at::Tensor gguf_rows(const at::Tensor& packed, int64_t type, int64_t in_features, const at::Tensor& ids,
                     at::ScalarType dtype) {
  const int64_t K = in_features;
  check_packed(packed, type, K, packed.size(0) * PANEL);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids: contiguous int64 [T]");
  const int64_t T = ids.size(0), rows = packed.size(0) * PANEL;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < rows, "row ", id[t], " outside the table of ", rows);
  at::Tensor out = at::empty({T, K}, packed.options().dtype(dtype));
  with_type(type, [&](auto kind) {
    constexpr int64_t TYPE = decltype(kind)::value;
    switch (dtype) {
      case at::kFloat: gather_rows<TYPE>(packed.data_ptr<uint8_t>(), K, id, T, out.data_ptr<float>()); break;
      case at::kBFloat16: gather_rows<TYPE>(packed.data_ptr<uint8_t>(), K, id, T, out.data_ptr<at::BFloat16>()); break;
      case at::kHalf: gather_rows<TYPE>(packed.data_ptr<uint8_t>(), K, id, T, out.data_ptr<at::Half>()); break;
      default: TORCH_CHECK(false, "GGUF rows dequantize into float32, bfloat16 or float16, not ", dtype);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleet_cpu, m) {
  m.def("gguf_pack(Tensor rows, int quant_type, int in_features) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor packed, int quant_type, int out_features, Tensor? bias) -> Tensor");
  m.def("gguf_rows(Tensor packed, int quant_type, int in_features, Tensor ids, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) {
  m.impl("gguf_pack", &gguf_pack);
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_rows", &gguf_rows);
}
