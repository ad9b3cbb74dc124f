// y = x W^T (+ b) with bfloat16-stored weights, for steps of a few rows
// (decode) on a CPU with AVX-512 (kernels/linear.py decides when).
//
// A decode step reads every weight once and does little arithmetic with it:
// with few rows it costs what the weights take to stream from memory, and a
// bfloat16 copy streams half the bytes of float32. Widening bfloat16 to
// float32 is exact (a 16-bit shift), so the products are the float32 model's;
// only the order of the float32 sums differs from a float32 GEMM.
//
// Weights come packed in panels of PANEL output features, k-major:
// packed[panel][k][j] = W[panel * PANEL + j][k] (zero rows pad the last
// panel), so each k of a panel is one 64-byte line, read in order. A task
// computes one panel for up to ROWS rows of x at a time: per k it widens the
// line into two float32 vectors, broadcasts each row's x[m][k] and does 2
// FMAs per row into 2 * ROWS accumulators that stay in registers.
//
// A bfloat16 model's activations are bfloat16 too. Where the CPU has
// AVX512-BF16, each pair of k is one VDPBF16PS per row and half-panel: the
// two lines of the pair are interleaved in registers (VPERMT2W) into
// (W[j][k], W[j][k+1]) pairs, and the row's (x[k], x[k+1]) is broadcast as
// one 32-bit word; half the instructions of widening. Elsewhere the
// activations are widened to float32 on the way in. Either way the result
// is the float32 sum of bfloat16 products, rounded once to bfloat16, which
// is what oneDNN's bfloat16 GEMM computes, faster for a few rows than its call.
//
// x: [M, K] float32 or bfloat16, contiguous. packed: [ceil(N / PANEL), K, PANEL]
// bfloat16. b: [N] in x's dtype, or None. y: [M, N] in x's dtype.
// Registered in torch.ops.fleet_cpu.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "simd_convert.h"
#define FLEET_LIN_AVX512 1
#endif
#if FLEET_LIN_AVX512 && defined(__AVX512BF16__)
#define FLEET_LIN_AVX512_BF16 1
#endif

namespace {

constexpr int64_t PANEL = 32;  // output features per panel: two 16-lane vectors
constexpr int64_t ROWS = 8;    // rows of x per pass over a panel: 16 accumulators

inline float widen(uint16_t bits) {
  uint32_t word = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

#if FLEET_LIN_AVX512
inline __m512 widen16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// y[m][0, valid) = acc[m] + bias for MR rows; Out is float or at::BFloat16.
template <int MR, typename Out>
inline void store_panel(const __m512 (&acc)[MR][2], const Out* bias, Out* y, int64_t ldy, int64_t valid) {
  const __mmask16 mask0 = tail_mask(valid), mask1 = tail_mask(valid - 16);
  const __m512 b0 = bias ? load16(bias, mask0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? load16(bias + 16, mask1) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    store16(y + m * ldy, _mm512_add_ps(acc[m][0], b0), mask0);
    store16(y + m * ldy + 16, _mm512_add_ps(acc[m][1], b1), mask1);
  }
}

// out[m][j] for MR rows of x (rows of length K, stride K) and one panel;
// `valid` output features of the panel are stored, plus bias.
template <int MR>
void panel_rows(const float* x, int64_t K, const uint16_t* panel, const float* bias, float* y, int64_t ldy,
                int64_t valid) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = widen16(panel + k * PANEL), w1 = widen16(panel + k * PANEL + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
    }
  }
  store_panel<MR>(acc, bias, y, ldy, valid);
}
#else
// out[m][j] for MR rows of x (rows of length K, stride K) and one panel;
// `valid` output features of the panel are stored, plus bias.
template <int MR>
void panel_rows(const float* x, int64_t K, const uint16_t* panel, const float* bias, float* y, int64_t ldy,
                int64_t valid) {
  float acc[MR][PANEL] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < MR; ++m)
      for (int64_t j = 0; j < PANEL; ++j) acc[m][j] += x[m * K + k] * widen(panel[k * PANEL + j]);
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < valid; ++j) y[m * ldy + j] = acc[m][j] + (bias ? bias[j] : 0.f);
}
#endif

#if FLEET_LIN_AVX512_BF16
// Lanes 2i and 2i+1 of a pair vector: output feature i of the half-panel at
// k and at k + 1 (index bit 5 picks the second line).
inline __m512i pair_index(int half) {
  alignas(64) int16_t index[32];
  for (int i = 0; i < 16; ++i) {
    index[2 * i] = int16_t(half * 16 + i);
    index[2 * i + 1] = int16_t(32 + half * 16 + i);
  }
  return _mm512_load_si512(index);
}

// (x[k], x[k + 1]) as one 32-bit word (x[k + 1] = 0 past the row's end).
inline uint32_t x_pair(const at::BFloat16* row, int64_t k, int64_t K) {
  const uint32_t low = row[k].x, high = k + 1 < K ? row[k + 1].x : 0;
  return (high << 16) | low;
}

// As panel_rows, for bfloat16 x (rows of length K, stride K) and y.
template <int MR>
void panel_rows_bf16(const at::BFloat16* x, int64_t K, const uint16_t* panel, const at::BFloat16* bias,
                     at::BFloat16* y, int64_t ldy, int64_t valid) {
  const __m512i first = pair_index(0), second = pair_index(1);
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i line0 = _mm512_loadu_si512(panel + k * PANEL);
    const __m512i line1 = k + 1 < K ? _mm512_loadu_si512(panel + (k + 1) * PANEL) : _mm512_setzero_si512();
    const __m512bh w0 = (__m512bh)_mm512_permutex2var_epi16(line0, first, line1);
    const __m512bh w1 = (__m512bh)_mm512_permutex2var_epi16(line0, second, line1);
    for (int m = 0; m < MR; ++m) {
      // A whole pair is broadcast straight from memory (no scalar assembly).
      int32_t pair;
      if (k + 1 < K) {
        std::memcpy(&pair, x + m * K + k, sizeof(pair));
      } else {
        pair = int32_t(x_pair(x + m * K, k, K));
      }
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xv);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xv);
    }
  }
  store_panel<MR>(acc, bias, y, ldy, valid);
}

using PanelRowsBf16 = void (*)(const at::BFloat16*, int64_t, const uint16_t*, const at::BFloat16*, at::BFloat16*,
                               int64_t, int64_t);
constexpr PanelRowsBf16 PANEL_ROWS_BF16[ROWS + 1] = {
    nullptr, panel_rows_bf16<1>, panel_rows_bf16<2>, panel_rows_bf16<3>, panel_rows_bf16<4>,
    panel_rows_bf16<5>, panel_rows_bf16<6>, panel_rows_bf16<7>, panel_rows_bf16<8>};
#endif

using PanelRows = void (*)(const float*, int64_t, const uint16_t*, const float*, float*, int64_t, int64_t);
constexpr PanelRows PANEL_ROWS[ROWS + 1] = {nullptr,          panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>,
                                            panel_rows<5>,    panel_rows<6>, panel_rows<7>, panel_rows<8>};

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == PANEL &&
                  packed.is_contiguous(),
              "packed: contiguous [panels, K, ", PANEL, "] bfloat16");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == x.size(1), "x has ", x.size(1), " features, the packed weight expects ", packed.size(1));
  TORCH_CHECK(out_features > (panels - 1) * PANEL && out_features <= panels * PANEL, out_features,
              " output features do not fill ", panels, " panels of ", PANEL);
}

// y = x W^T (+ b), one task per panel: Scalar is float or at::BFloat16,
// kernels the matching PANEL_ROWS table.
template <typename Scalar, typename Kernel>
at::Tensor multiply_panels(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                           const std::optional<at::Tensor>& bias, const Kernel* kernels) {
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0);
  const Scalar* b = bias.has_value() && bias->defined() ? static_cast<const Scalar*>(bias->data_ptr()) : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  const Scalar* xp = static_cast<const Scalar*>(x.data_ptr());
  const uint16_t* wp = static_cast<const uint16_t*>(packed.data_ptr());
  Scalar* yp = static_cast<Scalar*>(y.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t n0 = panel * PANEL, valid = std::min(PANEL, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t rows = std::min(ROWS, M - m0);
        kernels[rows](xp + m0 * K, K, wp + panel * K * PANEL, b ? b + n0 : nullptr, yp + m0 * N + n0, N, valid);
      }
    }
  });
  return y;
}

at::Tensor linear_bf16_weight(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                              const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous [M, K] float32 or bfloat16");
  check_packed(x, packed, out_features);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == dtype && bias->numel() == out_features && bias->is_contiguous()),
              "bias: contiguous [N] in x's dtype");
  if (dtype == at::kFloat) return multiply_panels<float>(x, packed, out_features, bias, PANEL_ROWS);
#if FLEET_LIN_AVX512_BF16
  return multiply_panels<at::BFloat16>(x, packed, out_features, bias, PANEL_ROWS_BF16);
#else
  std::optional<at::Tensor> bias_float;
  if (has_bias) bias_float = bias->to(at::kFloat);
  return multiply_panels<float>(x.to(at::kFloat), packed, out_features, bias_float, PANEL_ROWS).to(at::kBFloat16);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleet_cpu, m) {
  m.def("linear_bf16_weight(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) { m.impl("linear_bf16_weight", &linear_bf16_weight); }
