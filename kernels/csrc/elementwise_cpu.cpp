// Fused elementwise kernels for the CPU: RMSNorm, residual add + RMSNorm, and
// SwiGLU's silu(gate) * up. Each row is read once and written once, in
// parallel over rows (at::parallel_for), 16 lanes at a time with AVX-512 where
// the compiler targets it (the CPU class's -march), else 8 at a time with AVX2
// + FMA, else plain loops.
//
// Numerics follow the torch-native versions (kernels/rmsnorm.py,
// kernels/activation.py) step by step, including their roundings to the input
// dtype:
//   rms_norm:            n = T(x * rsqrt(mean(x^2) + eps)) (statistics in fp32); out = T(w * n)
//   fused_add_rms_norm:  r = T(x + residual); out = rms_norm(r); returns (out, r)
//   silu_and_mul:        s = T(silu(gate)); out = T(s * up)
// where T(.) rounds an fp32 value to the tensor dtype (round to nearest even).
// Only the order of the fp32 sum of squares differs from torch's.
//
// dtypes: bfloat16, float16, float32; weight in x's dtype; last dim contiguous.
// Outputs are new tensors: no input is modified (the callers keep using them).
//
// Registered in torch.ops.fleet_cpu, next to paged_attention (TORCH_LIBRARY is
// in paged_attention_cpu.cpp, so this file adds a fragment).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "simd_convert.h"
#include "simd_exp.h"
#define FLEET_EW_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#include "simd_exp.h"
#define FLEET_EW_AVX2 1
#endif

namespace {

#define FLEET_EW_INLINE inline __attribute__((always_inline))

// Rows per parallel task: enough elements that a task outweighs its scheduling.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

#if FLEET_EW_AVX512
// out = T(w * T(x * inv)) over one row.
template <typename T>
FLEET_EW_INLINE void scale_row(T* out, const T* x, const T* w, float inv, int64_t D) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < D; c += 16) {
    const __mmask16 m = tail_mask(D - c);
    __m512 n = round_to<T>(_mm512_mul_ps(load16(x + c, m), s));
    store16(out + c, _mm512_mul_ps(load16(w + c, m), n), m);
  }
}

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, float eps, int64_t D) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= D; c += 32) {
    __m512 v0 = load16(x + c, 0xFFFF), v1 = load16(x + c + 16, 0xFFFF);
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  for (; c < D; c += 16) {
    __m512 v = load16(x + c, tail_mask(D - c));
    a0 = _mm512_fmadd_ps(v, v, a0);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  scale_row(out, x, w, 1.0f / std::sqrt(ss / static_cast<float>(D) + eps), D);
}

template <typename T>
void add_rms_norm_row(T* out, T* res_out, const T* x, const T* res, const T* w, float eps, int64_t D) {
  __m512 a0 = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __mmask16 m = tail_mask(D - c);
    __m512 v = round_to<T>(_mm512_add_ps(load16(x + c, m), load16(res + c, m)));
    store16(res_out + c, v, m);
    a0 = _mm512_fmadd_ps(v, v, a0);
  }
  const float ss = _mm512_reduce_add_ps(a0);
  scale_row(out, res_out, w, 1.0f / std::sqrt(ss / static_cast<float>(D) + eps), D);
}

template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t c = 0; c < I; c += 16) {
    const __mmask16 m = tail_mask(I - c);
    __m512 g = load16(gate + c, m);
    // A true divide, as torch's silu: rcp14 + a Newton step measured no faster at 2 threads, and
    // with the fused norm its extra rounding error compounded to 3e-3 in fp32 logits (tests/models/test_gguf.py).
    const __m512 d = _mm512_add_ps(one, fleet_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    const __m512 s = round_to<T>(_mm512_div_ps(g, d));
    store16(out + c, _mm512_mul_ps(s, load16(up + c, m)), m);
  }
}

#elif FLEET_EW_AVX2  // ---- AVX2: the AVX-512 code above, 8 lanes at a time ------------------
// A row's tail (under 8 elements) is loaded zero-padded and stored partially: load8/store8 with the count left.

template <typename T>
FLEET_EW_INLINE void scale_row(T* out, const T* x, const T* w, float inv, int64_t D) {
  const __m256 s = _mm256_set1_ps(inv);
  for (int64_t c = 0; c < D; c += 8) {
    __m256 n = round_to<T>(_mm256_mul_ps(load8(x + c, D - c), s));
    store8(out + c, _mm256_mul_ps(load8(w + c, D - c), n), D - c);
  }
}

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, float eps, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= D; c += 16) {
    __m256 v0 = load8(x + c), v1 = load8(x + c + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  for (; c < D; c += 8) {
    __m256 v = load8(x + c, D - c);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  const float ss = reduce_add8(_mm256_add_ps(a0, a1));
  scale_row(out, x, w, 1.0f / std::sqrt(ss / static_cast<float>(D) + eps), D);
}

template <typename T>
void add_rms_norm_row(T* out, T* res_out, const T* x, const T* res, const T* w, float eps, int64_t D) {
  __m256 a0 = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 v = round_to<T>(_mm256_add_ps(load8(x + c, D - c), load8(res + c, D - c)));
    store8(res_out + c, v, D - c);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  const float ss = reduce_add8(a0);
  scale_row(out, res_out, w, 1.0f / std::sqrt(ss / static_cast<float>(D) + eps), D);
}

template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t c = 0; c < I; c += 8) {
    __m256 g = load8(gate + c, I - c);
    // A true divide, as in the AVX-512 version.
    const __m256 d = _mm256_add_ps(one, fleet_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
    const __m256 s = round_to<T>(_mm256_div_ps(g, d));
    store8(out + c, _mm256_mul_ps(s, load8(up + c, I - c)), I - c);
  }
}

#else  // ---- plain C++ ----------------------------------------------------------

template <typename T>
FLEET_EW_INLINE float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void scale_row(T* out, const T* x, const T* w, float inv, int64_t D) {
  for (int64_t c = 0; c < D; ++c) {
    out[c] = static_cast<T>(static_cast<float>(w[c]) * round_to<T>(static_cast<float>(x[c]) * inv));
  }
}

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, float eps, int64_t D) {
  float ss = 0.0f;
  for (int64_t c = 0; c < D; ++c) {
    const float v = static_cast<float>(x[c]);
    ss += v * v;
  }
  scale_row(out, x, w, 1.0f / std::sqrt(ss / static_cast<float>(D) + eps), D);
}

template <typename T>
void add_rms_norm_row(T* out, T* res_out, const T* x, const T* res, const T* w, float eps, int64_t D) {
  float ss = 0.0f;
  for (int64_t c = 0; c < D; ++c) {
    const T sum = static_cast<T>(static_cast<float>(x[c]) + static_cast<float>(res[c]));
    res_out[c] = sum;
    const float v = static_cast<float>(sum);
    ss += v * v;
  }
  scale_row(out, res_out, w, 1.0f / std::sqrt(ss / static_cast<float>(D) + eps), D);
}

template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t I) {
  for (int64_t c = 0; c < I; ++c) {
    const float g = static_cast<float>(gate[c]);
    out[c] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * static_cast<float>(up[c]));
  }
}
#endif

// x viewed as [rows, cols] with contiguous rows of stride row_stride (copied if it cannot be).
at::Tensor as_rows(const at::Tensor& x, int64_t cols) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == cols, "expected a last dim of ", cols, ", got ", x.sizes());
  at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, cols});
  if (rows.stride(1) != 1 && rows.numel() > 0) rows = rows.contiguous();
  return rows;
}

void check_common(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU tensors only");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, what,
              ": dtype must be float32, bfloat16 or float16, got ", t);
}

void check_weight(const at::Tensor& x, const at::Tensor& weight, const char* what) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
              weight.is_contiguous(), what, ": weight must be a contiguous CPU [", x.size(-1), "], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), what, ": weight dtype ", weight.scalar_type(),
              " != x dtype ", x.scalar_type());
}

#define FLEET_EW_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME,           \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_common(x, "rms_norm");
  check_weight(x, weight, "rms_norm");
  const int64_t D = x.size(-1);
  at::Tensor xr = as_rows(x, D);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = xr.size(0);
  if (rows == 0 || D == 0) return out;
  FLEET_EW_DISPATCH(x.scalar_type(), "fleet_rms_norm", [&] {
    const scalar_t* xp = xr.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = xr.stride(0);
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(op + r * D, xp + r * xs, wp, e, D);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check_common(x, "fused_add_rms_norm");
  check_weight(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
              residual.device().is_cpu(), "fused_add_rms_norm: residual ", residual.sizes(), " ",
              residual.scalar_type(), " must match x ", x.sizes(), " ", x.scalar_type());
  const int64_t D = x.size(-1);
  at::Tensor xr = as_rows(x, D), rr = as_rows(residual, D);
  const auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor out = at::empty(x.sizes(), opts), res_out = at::empty(x.sizes(), opts);
  const int64_t rows = xr.size(0);
  if (rows == 0 || D == 0) return {out, res_out};
  FLEET_EW_DISPATCH(x.scalar_type(), "fleet_fused_add_rms_norm", [&] {
    const scalar_t* xp = xr.data_ptr<scalar_t>();
    const scalar_t* rp = rr.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* rop = res_out.data_ptr<scalar_t>();
    const int64_t xs = xr.stride(0), rs = rr.stride(0);
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_rms_norm_row(op + r * D, rop + r * D, xp + r * xs, rp + r * rs, wp, e, D);
      }
    });
  });
  return {out, res_out};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_common(x, "silu_and_mul");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: last dim must be even, got ", x.sizes());
  const int64_t D = x.size(-1), I = D / 2;
  at::Tensor xr = as_rows(x, D);
  auto shape = x.sizes().vec();
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = xr.size(0);
  if (rows == 0 || I == 0) return out;
  FLEET_EW_DISPATCH(x.scalar_type(), "fleet_silu_and_mul", [&] {
    const scalar_t* xp = xr.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = xr.stride(0);
    at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(op + r * I, xp + r * xs, xp + r * xs + I, I);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleet_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleet_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}
