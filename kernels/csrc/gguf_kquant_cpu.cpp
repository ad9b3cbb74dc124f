// Linear layers and embeddings whose weights stay in a GGUF file's K-quant
// super-blocks (kernels/quantized.py), on every CPU class: y = x W^T (+ b)
// from the blocks, and embedding rows looked up in them.
//
// A weight stays as the file rows it: one row of super-blocks of 256 weights
// per output feature, each as ggml lays it out (gguf-py's quants.py reads the
// same bytes):
//   Q2_K (84 bytes): 16 bytes of 4-bit scale (low) and min (high) per
//     sub-block of 16, 64 bytes of 2-bit quants, fp16 d, fp16 dmin;
//     w = d sc q - dmin m
//   Q3_K (110 bytes): 32 bytes of high bits, 64 of 2-bit low quants, 12 of
//     packed 6-bit scales (16 sub-blocks of 16), fp16 d;
//     w = d (sc - 32) (q - (high bit ? 0 : 4))
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales and
//     mins (8 sub-blocks of 32), 128 bytes of nibbles;
//     w = d sc q - dmin m
//   Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits before the nibbles
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
//     int8 scales (16 sub-blocks of 16), fp16 d;  w = d sc (q - 32)
//   IQ4_XS (136 bytes): fp16 d, 2 + 4 bytes of packed 6-bit scales (8
//     sub-blocks of 32), 128 bytes of nibbles indexing IQ4_NL's table;
//     w = d (sc - 32) KVALUES_IQ4NL[q]
// d sc q is exact in float32 (d's 11 significant bits, and at most 12 of the
// scale and quant together: Q6_K's 7-bit scales by 5-bit q, IQ4_XS's 5-bit
// scales by 7-bit table entries), so the weights are gguf-py's whatever the
// order of the products: only the subtraction of dmin m (Q2_K, Q4_K, Q5_K)
// rounds, once.
//
// The multiply has two paths, and kernels/quantized.py chooses between them
// (gguf_kquant_linear_by names the path; gguf_kquant_integer_compiled says
// whether this class has the first). The integer path (classes with AVX2)
// rounds x to Q8_K and multiplies the blocks' integers
// (gguf_kquant_integer_cpu.cpp). The float32 tiles, on every class, take
// TILE output features at a time: per super-block, their weights are
// dequantized into a float32 tile [TILE][256], rounded to x's dtype as
// loading dequantized weights did, and multiplied against ROWS rows of x at a
// time, accumulating in float32: the dequantized model's products, summed in
// another order (LANES partial sums per row and feature, one vector register
// wide, added up at the end). The tile code is plain C++ with GCC's vector
// extension for those registers, so every CPU class compiles the same code
// for its own -march: 4 lanes on x86-64 baseline (SSE2), 8 on AVX2, 16 on
// AVX-512.
//
// Registered in torch.ops.fleet_cpu.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "gguf_kquant.h"

namespace {

using namespace fleet_kquant;

constexpr int64_t TILE = 16;    // output features per tile
constexpr int64_t ROWS = 4;     // rows of x per pass over a tile: their sums stay in registers
// Partial sums per row and feature: one vector register of the class's
// instruction set (x86-64 baseline has SSE2's 4 lanes).
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#elif defined(__AVX__)
constexpr int64_t LANES = 8;
#else
constexpr int64_t LANES = 4;
#endif

// Q2_K and Q3_K: weight k = 128 h + 32 s + l takes bits 2s of quant byte
// 32 h + l; Q3_K's high bit is bit k / 32 of byte k % 32 (set: q as it is,
// clear: q - 4). A scale (and Q2_K's min) per 16 weights.
template <int64_t TYPE>
void dequantize_2_or_3_bits(const uint8_t* block, float* out) {
  const uint8_t* quants = block + (TYPE == Q2_K ? 16 : 32);
  const uint8_t* high_bits = block;
  uint8_t scale_bits[16];
  if constexpr (TYPE == Q3_K) {
    const auto words = q3_k_scale_words(block + 96);
    std::memcpy(scale_bits, words.data(), sizeof(scale_bits));
  }
  const float d = half_at(block + (TYPE == Q2_K ? 80 : 108)), dmin = TYPE == Q2_K ? half_at(block + 82) : 0.f;
  for (int j = 0; j < 16; ++j) {
    const int k0 = 16 * j, shift = 2 * (k0 / 32 % 4), high = k0 / 32;
    const uint8_t* q = quants + 32 * (k0 / 128) + k0 % 32;
    const uint8_t* h = high_bits + k0 % 32;
    // exact products: d by a 4- or 6-bit scale, then by a 2- or 3-bit quant
    const float step = TYPE == Q2_K ? d * float(block[j] & 0xF) : d * float(int(scale_bits[j]) - 32);
    const float offset = TYPE == Q2_K ? dmin * float(block[j] >> 4) : 0.f;
    for (int l = 0; l < 16; ++l) {
      int v = (q[l] >> shift) & 3;
      if constexpr (TYPE == Q3_K) v -= (h[l] >> high) & 1 ? 0 : 4;
      out[k0 + l] = step * float(v) - offset;  // one rounding (Q2_K's), as gguf-py's
    }
  }
}

// Sub-block pairs of Q4_K/Q5_K: 32 bytes of nibbles hold sub-block 2c (low)
// and 2c + 1 (high); Q5_K's bit j of fifth-bit byte l is weight l of sub-block j.
template <int64_t TYPE>
void dequantize_4_or_5_bits(const uint8_t* block, float* out) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* packed = block + 4;
  const uint8_t* high_bits = block + 16;
  const uint8_t* nibbles = block + (TYPE == Q5_K ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    scale_and_min(packed, j, scale, min);
    const float step = d * float(scale), offset = dmin * float(min);  // exact products
    const uint8_t* q = nibbles + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    float* w = out + 32 * j;
    for (int l = 0; l < 32; ++l) {
      int v = (q[l] >> shift) & 0xF;
      if constexpr (TYPE == Q5_K) v |= ((high_bits[l] >> j) & 1) << 4;
      w[l] = step * float(v) - offset;  // step * v is exact: one rounding, as gguf-py's
    }
  }
}

// Q6_K: each half (128 weights) has 64 bytes of low nibbles and 32 of high
// 2-bit pairs; its group g of 32 weights takes nibble g / 2 of bytes
// 32 (g % 2) + l and bits 2g of pair byte l; a scale per 16 weights.
void dequantize_6_bits(const uint8_t* block, float* out) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* high = block + 128 + 32 * half;
    for (int g = 0; g < 4; ++g) {
      const uint8_t* low = block + 64 * half + 32 * (g % 2);
      const int low_shift = 4 * (g / 2), high_shift = 2 * g;
      int8_t q[32];
      for (int l = 0; l < 32; ++l) {
        q[l] = int8_t((((low[l] >> low_shift) & 0xF) | (((high[l] >> high_shift) & 3) << 4)) - 32);
      }
      float* w = out + 128 * half + 32 * g;
      for (int sixteen = 0; sixteen < 2; ++sixteen) {
        const float step = d * float(scales[8 * half + 2 * g + sixteen]);  // exact, and so is step * q
        for (int l = 16 * sixteen; l < 16 * sixteen + 16; ++l) w[l] = step * float(q[l]);
      }
    }
  }
}

// IQ4_XS: sub-block j (32 weights) has bytes 16 j .. 16 j + 15 of the
// nibbles, weight l < 16 in the low nibble of byte l, l + 16 in its high one,
// each an index into IQ4_NL's table.
void dequantize_iq4_xs(const uint8_t* block, float* out) {
  const float d = half_at(block);
  const uint64_t scale_bits = iq4_xs_scale_bits(block);
  for (int j = 0; j < 8; ++j) {
    const float step = d * float(int((scale_bits >> (8 * j)) & 0x3F) - 32);  // exact, and so is step * an entry
    const uint8_t* q = block + 8 + 16 * j;
    float* w = out + 32 * j;
    for (int l = 0; l < 16; ++l) {
      w[l] = step * float(fleet_gguf::KVALUES_IQ4NL[q[l] & 0xF]);
      w[l + 16] = step * float(fleet_gguf::KVALUES_IQ4NL[q[l] >> 4]);
    }
  }
}

// The 256 float32 weights of one super-block: gguf-py's values, bit for bit.
template <int64_t TYPE>
void dequantize_block(const uint8_t* block, float* out) {
  if constexpr (TYPE == Q2_K || TYPE == Q3_K) {
    dequantize_2_or_3_bits<TYPE>(block, out);
  } else if constexpr (TYPE == Q6_K) {
    dequantize_6_bits(block, out);
  } else if constexpr (TYPE == IQ4_XS) {
    dequantize_iq4_xs(block, out);
  } else {
    dequantize_4_or_5_bits<TYPE>(block, out);
  }
}

// ---- the multiply ---------------------------------------------------------------------

using Tile = float[TILE][SUPER];

// tile[j] = the weights of super-block b of feature j < `features` (rows of
// `row_bytes`), rounded to Model.
template <int64_t TYPE, typename Model>
void dequantize_tile(const uint8_t* rows, int64_t row_bytes, int64_t b, int64_t features, Tile& tile) {
  for (int64_t j = 0; j < features; ++j) {
    dequantize_block<TYPE>(rows + j * row_bytes + b * block_bytes(TYPE), tile[j]);
    if constexpr (!std::is_same_v<Model, float>) {
      for (int64_t k = 0; k < SUPER; ++k) tile[j][k] = float(Model(tile[j][k]));
    }
  }
}

// LANES floats: one vector register of the class (GCC's and Clang's vector
// extension, lowered to whatever instructions -march allows).
using Lanes = float __attribute__((vector_size(LANES * sizeof(float))));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// acc[r][f] (LANES partial sums, lane l summing the k = l mod LANES) +=
// w[f][k] x[r][k] for R rows of x (stride K) and F features (stride SUPER;
// acc's stride LANES per feature, TILE * LANES per row). The R * F sums stay
// in registers; each load of w serves R rows and each of x F features.
template <int R, int F>
void multiply_features(const float* w, const float* x, int64_t K, float* acc) {
  Lanes sums[R][F];
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) sums[r][f] = load_lanes(acc + (r * TILE + f) * LANES);
  for (int64_t k = 0; k < SUPER; k += LANES) {
    Lanes weights[F];
    for (int f = 0; f < F; ++f) weights[f] = load_lanes(w + f * SUPER + k);
    for (int r = 0; r < R; ++r) {
      const Lanes xs = load_lanes(x + r * K + k);
      for (int f = 0; f < F; ++f) sums[r][f] += weights[f] * xs;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) std::memcpy(acc + (r * TILE + f) * LANES, &sums[r][f], sizeof(Lanes));
}

// The tile's features < `features` times R rows, two features at a time (so
// that each load of x serves two).
template <int R>
void multiply_tile(const Tile& tile, int64_t features, const float* x, int64_t K, float* acc) {
  int64_t j = 0;
  for (; j + 2 <= features; j += 2) multiply_features<R, 2>(tile[j], x, K, acc + j * LANES);
  if (j < features) multiply_features<R, 1>(tile[j], x, K, acc + j * LANES);
}

using MultiplyTile = void (*)(const Tile&, int64_t, const float*, int64_t, float*);
constexpr MultiplyTile MULTIPLY_TILE[ROWS + 1] = {nullptr, multiply_tile<1>, multiply_tile<2>, multiply_tile<3>,
                                                  multiply_tile<4>};

// y [M, N] = x W^T (+ bias) for x float32 [M, K], W the file's rows of blocks.
template <int64_t TYPE, typename Model>
void multiply_rows(const float* x, const uint8_t* rows, int64_t M, int64_t K, int64_t N, const Model* bias,
                   Model* y) {
  const int64_t blocks = K / SUPER, row_bytes = blocks * block_bytes(TYPE);
  const int64_t tiles = (N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * TILE * LANES);  // [M][TILE][LANES]
    alignas(64) Tile tile;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE, features = std::min(TILE, N - n0);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        dequantize_tile<TYPE, Model>(rows + n0 * row_bytes, row_bytes, b, features, tile);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
          MULTIPLY_TILE[std::min(ROWS, M - m0)](tile, features, x + m0 * K + b * SUPER, K,
                                                acc.data() + m0 * TILE * LANES);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < features; ++j) {
          const float* lanes = acc.data() + (m * TILE + j) * LANES;
          float sum = bias ? float(bias[n0 + j]) : 0.f;
          for (int64_t l = 0; l < LANES; ++l) sum += lanes[l];
          y[m * N + n0 + j] = Model(sum);
        }
      }
    }
  });
}

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t in_features) {
  check_type(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous [rows, row bytes] uint8, a GGUF tensor's super-blocks");
  TORCH_CHECK(in_features % SUPER == 0 && blocks.size(1) == in_features / SUPER * block_bytes(type), "rows of ",
              blocks.size(1), " bytes do not hold ", in_features, " input features of GGUF type ", type, " (",
              block_bytes(type), " bytes per ", SUPER, " weights)");
}

template <typename Model>
at::Tensor multiply(const at::Tensor& x, const at::Tensor& blocks, int64_t type, const std::optional<at::Tensor>& bias,
                    bool integer) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const at::Tensor x_float = x.to(at::kFloat).contiguous();
  const Model* b = bias.has_value() && bias->defined() ? bias->data_ptr<Model>() : nullptr;
#if FLEET_KQUANT_INTEGER
  if (integer) {
    integer_multiply<Model>(type, x_float.data_ptr<float>(), blocks.data_ptr<uint8_t>(), M, K, N, b,
                            y.data_ptr<Model>());
    return y;
  }
#endif
  with_type(type, [&](auto kind) {
    multiply_rows<decltype(kind)::value, Model>(x_float.data_ptr<float>(), blocks.data_ptr<uint8_t>(), M, K, N, b,
                                                y.data_ptr<Model>());
  });
  return y;
}

// y = x W^T (+ bias) by the path named: the integers of Q8_K-rounded x, or
// the float32 tiles (kernels/quantized.py chooses).
at::Tensor gguf_kquant_linear_by(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t out_features,
                                 const std::optional<at::Tensor>& bias, bool integer) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && x.dim() == 2 &&
                  x.is_contiguous(),
              "x: contiguous [M, K] float32, bfloat16 or float16");
  check_blocks(blocks, type, x.size(1));
  TORCH_CHECK(blocks.size(0) == out_features, "blocks hold ", blocks.size(0), " rows, not ", out_features,
              " output features");
  TORCH_CHECK(!(bias.has_value() && bias->defined()) ||
                  (bias->scalar_type() == dtype && bias->numel() == out_features && bias->is_contiguous()),
              "bias: contiguous [N] in x's dtype");
  TORCH_CHECK(!integer || FLEET_KQUANT_INTEGER, "the K-quant integer path needs AVX2 (CPU class avx2 and up)");
  switch (dtype) {
    case at::kFloat: return multiply<float>(x, blocks, type, bias, integer);
    case at::kBFloat16: return multiply<at::BFloat16>(x, blocks, type, bias, integer);
    default: return multiply<at::Half>(x, blocks, type, bias, integer);
  }
}

// Whether this CPU class's build has the integer path (FLEET_KQUANT_INTEGER).
bool gguf_kquant_integer_compiled() { return FLEET_KQUANT_INTEGER; }

// ---- rows of a table (embeddings) -----------------------------------------------------

// 16 float32s rounded to bfloat16 as c10::BFloat16 rounds them (to nearest
// even; NaN to 0x7FC0), a vector at a time: a bfloat16 prefill dequantizes
// every weight (kernels/quantized.py), and 8192x2048 of Q4_K take 2.5 ms on
// one thread so, against 7.3 ms into float16 by the element-wise constructor.
inline void store_bfloat16(const float* in, at::BFloat16* out) {
  using Bits = uint32_t __attribute__((vector_size(64)));
  using Floats = float __attribute__((vector_size(64)));
  using Halves = uint16_t __attribute__((vector_size(32)));
  Floats value;
  std::memcpy(&value, in, sizeof(value));
  Bits bits;
  std::memcpy(&bits, in, sizeof(bits));
  const Bits rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  const Bits is_nan = reinterpret_cast<Bits>(value != value);  // all ones where NaN
  const Halves narrow = __builtin_convertvector((rounded & ~is_nan) | (is_nan & 0x7FC0), Halves);
  std::memcpy(out, &narrow, sizeof(narrow));
}

template <typename Out>
void store_weights(const float* weights, Out* out) {
  if constexpr (std::is_same_v<Out, at::BFloat16>) {
    for (int64_t k = 0; k < SUPER; k += 16) store_bfloat16(weights + k, out + k);
  } else {
    for (int64_t k = 0; k < SUPER; ++k) out[k] = Out(weights[k]);
  }
}

// out[t] = the weights of row row_of(t) of `rows`, for t < T.
template <int64_t TYPE, typename Out, typename RowOf>
void dequantize_rows(const uint8_t* rows, int64_t K, int64_t T, RowOf row_of, Out* out) {
  const int64_t blocks = K / SUPER, row_bytes = blocks * block_bytes(TYPE);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    float weights[SUPER];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < blocks; ++b) {
        dequantize_block<TYPE>(rows + row_of(t) * row_bytes + b * block_bytes(TYPE), weights);
        store_weights(weights, out + t * K + b * SUPER);
      }
    }
  });
}

template <typename F>
void with_out_dtype(at::ScalarType dtype, F&& f) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "GGUF rows dequantize into float32, bfloat16 or float16, not ", dtype);
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: f(at::Half{}); break;
  }
}

at::Tensor gguf_kquant_rows(const at::Tensor& blocks, int64_t type, int64_t in_features, const at::Tensor& ids,
                            at::ScalarType dtype) {
  const int64_t K = in_features;
  check_blocks(blocks, type, K);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids: contiguous int64 [T]");
  const int64_t T = ids.size(0), rows = blocks.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "row ", id[t], " outside the table of ", rows);
  }
  at::Tensor out = at::empty({T, K}, blocks.options().dtype(dtype));
  with_type(type, [&](auto kind) {
    with_out_dtype(dtype, [&](auto out_type) {
      dequantize_rows<decltype(kind)::value>(blocks.data_ptr<uint8_t>(), K, T, [id](int64_t t) { return id[t]; },
                                             out.data_ptr<decltype(out_type)>());
    });
  });
  return out;
}

// out = rows [first_row, first_row + out.size(0)) of the weight, dequantized
// into a buffer the caller keeps (kernels/quantized.py: a fresh tensor of a
// whole weight would be page-faulted in on every prefill step).
void gguf_kquant_dequantize_into(const at::Tensor& blocks, int64_t type, int64_t first_row, at::Tensor& out) {
  check_blocks(blocks, type, out.size(-1));
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out: contiguous [rows, in_features]");
  const int64_t T = out.size(0), K = out.size(1);
  TORCH_CHECK(first_row >= 0 && first_row + T <= blocks.size(0), "rows [", first_row, ", ", first_row + T,
              ") outside the weight's ", blocks.size(0));
  with_type(type, [&](auto kind) {
    with_out_dtype(out.scalar_type(), [&](auto out_type) {
      dequantize_rows<decltype(kind)::value>(blocks.data_ptr<uint8_t>(), K, T,
                                             [first_row](int64_t t) { return first_row + t; },
                                             out.data_ptr<decltype(out_type)>());
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleet_cpu, m) {
  m.def(
      "gguf_kquant_linear_by(Tensor x, Tensor blocks, int quant_type, int out_features, Tensor? bias, bool integer) "
      "-> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("gguf_kquant_integer_compiled() -> bool", &gguf_kquant_integer_compiled);
  m.def("gguf_kquant_rows(Tensor blocks, int quant_type, int in_features, Tensor ids, ScalarType dtype) -> Tensor");
  m.def("gguf_kquant_dequantize_into(Tensor blocks, int quant_type, int first_row, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) {
  m.impl("gguf_kquant_linear_by", &gguf_kquant_linear_by);
  m.impl("gguf_kquant_rows", &gguf_kquant_rows);
  m.impl("gguf_kquant_dequantize_into", &gguf_kquant_dequantize_into);
}
