// y = x W^T (+ b) with float32 activations and bfloat16-stored weights, for
// steps of a few dozen rows (decode) on a CPU that computes bfloat16 only by
// emulation (kernels/linear.py decides when).
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
// x: [M, K] float32, contiguous. packed: [ceil(N / PANEL), K, PANEL] bfloat16.
// b: [N] float32 or None. Registered in torch.ops.fleet_cpu.
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FLEET_LIN_AVX512 1
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

// out[m][j] for MR rows of x (rows of length K, stride K) and one panel;
// `valid` output features of the panel are stored, plus bias.
#if FLEET_LIN_AVX512
inline __m512 widen16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

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
  const __mmask16 mask0 = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __mmask16 mask1 = valid >= 32 ? __mmask16(0xFFFF) : valid <= 16 ? __mmask16(0) : __mmask16((1u << (valid - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(y + m * ldy, mask0, _mm512_add_ps(acc[m][0], b0));
    _mm512_mask_storeu_ps(y + m * ldy + 16, mask1, _mm512_add_ps(acc[m][1], b1));
  }
}
#else
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

using PanelRows = void (*)(const float*, int64_t, const uint16_t*, const float*, float*, int64_t, int64_t);
constexpr PanelRows PANEL_ROWS[ROWS + 1] = {nullptr,          panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>,
                                            panel_rows<5>,    panel_rows<6>, panel_rows<7>, panel_rows<8>};

at::Tensor linear_bf16_weight(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K] float32");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == PANEL &&
                  packed.is_contiguous(),
              "packed: contiguous [panels, K, ", PANEL, "] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the packed weight expects ", packed.size(1));
  TORCH_CHECK(N > (panels - 1) * PANEL && N <= panels * PANEL, out_features, " output features do not fill ",
              panels, " panels of ", PANEL);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "bias: [N] float32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t n0 = panel * PANEL, valid = std::min(PANEL, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t rows = std::min(ROWS, M - m0);
        PANEL_ROWS[rows](xp + m0 * K, K, wp + panel * K * PANEL, b ? b + n0 : nullptr, yp + m0 * N + n0, N, valid);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleet_cpu, m) {
  m.def("linear_bf16_weight(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) { m.impl("linear_bf16_weight", &linear_bf16_weight); }
