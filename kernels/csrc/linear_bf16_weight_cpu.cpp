// y = x W^T (+ b) with float32 activations and bfloat16-stored weights, for
// the few rows of a decode step on a CPU that computes bfloat16 only by
// emulation (kernels/linear.py decides when).
//
// Decoding a few sequences reads every weight once per step and does almost
// no arithmetic with it: the step costs what the weights take to stream from
// memory. A bfloat16 checkpoint held in bfloat16 streams half the bytes of
// its float32 copy, and widening bfloat16 to float32 is exact (a 16-bit
// shift), so the products are the float32 model's: only the order of the
// float32 sums differs from a float32 GEMM.
//
// x: [M, K] float32, contiguous. w: [N, K] bfloat16, contiguous. b: [N] float32.
// Parallel over blocks of output features; each task widens ROWS weight rows
// 16 values at a time and multiplies them with every row of x (x stays in L1).
// Registered in torch.ops.fleet_cpu next to the other CPU kernels.
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

constexpr int64_t ROWS = 4;      // weight rows multiplied together: each x load feeds 4 FMAs
constexpr int64_t X_ROWS = 4;    // rows of x per pass over a block of weight rows
constexpr int64_t GRAIN = 16;    // output features per parallel task (a multiple of ROWS)

inline float widen(uint16_t bits) {
  uint32_t word = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

#if FLEET_LIN_AVX512
inline __m512 widen16(const uint16_t* p, __mmask16 mask) {
  __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// out[m][r] = x[m] . w[r] for ROWS weight rows and up to X_ROWS rows of x.
template <int64_t MR>
inline void dot_block(const float* x, int64_t ldx, const uint16_t* w, int64_t K, float out[X_ROWS][ROWS]) {
  __m512 acc[MR][ROWS];
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t r = 0; r < ROWS; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    __m512 wv[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) wv[r] = widen16(w + r * K + k, mask);
    for (int64_t m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
      for (int64_t r = 0; r < ROWS; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t r = 0; r < ROWS; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}
#endif

// Rows [n0, n0 + ROWS) of the output for rows [m0, m0 + mr) of x.
void rows_block(const float* x, int64_t K, const uint16_t* w, int64_t n0, int64_t m0, int64_t mr, float out[X_ROWS][ROWS]) {
  const float* xb = x + m0 * K;
  const uint16_t* wb = w + n0 * K;
#if FLEET_LIN_AVX512
  switch (mr) {
    case 1: dot_block<1>(xb, K, wb, K, out); return;
    case 2: dot_block<2>(xb, K, wb, K, out); return;
    case 3: dot_block<3>(xb, K, wb, K, out); return;
    default: dot_block<4>(xb, K, wb, K, out); return;
  }
#else
  for (int64_t m = 0; m < mr; ++m)
    for (int64_t r = 0; r < ROWS; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += xb[m * K + k] * widen(wb[r * K + k]);
      out[m][r] = sum;
    }
#endif
}

at::Tensor linear_bf16_weight(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K] float32");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(), "w: contiguous [N, K] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x has ", K, " features, w expects ", w.size(1));
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "bias: [N] float32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t full = N - N % ROWS;
  at::parallel_for(0, full / ROWS, GRAIN / ROWS, [&](int64_t begin, int64_t end) {
    float out[X_ROWS][ROWS];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * ROWS;
      for (int64_t m0 = 0; m0 < M; m0 += X_ROWS) {
        const int64_t mr = std::min(X_ROWS, M - m0);
        rows_block(xp, K, wp, n0, m0, mr, out);
        for (int64_t m = 0; m < mr; ++m)
          for (int64_t r = 0; r < ROWS; ++r) yp[(m0 + m) * N + n0 + r] = out[m][r] + (b ? b[n0 + r] : 0.f);
      }
    }
  });
  for (int64_t n = full; n < N; ++n)  // the last N % ROWS features
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += xp[m * K + k] * widen(wp[n * K + k]);
      yp[m * N + n] = sum + (b ? b[n] : 0.f);
    }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleet_cpu, m) {
  m.def("linear_bf16_weight(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) { m.impl("linear_bf16_weight", &linear_bf16_weight); }
