// RMSNorm of fp32 rows, as transformers' LlamaRMSNorm computes it in float32:
//   y = fl(fl(x · r) · w),  r = 1 / sqrt(mean(x²) + eps),  the mean of squares in float32.
// One op instead of the five or six torch runs on CPU for F.rms_norm (pow, mean, add, rsqrt, mul):
// at batch 1 each of those costs more in dispatch than its arithmetic. Each row is computed alone,
// in one fixed order (eight lanes of squares, summed as hsum sums them, then the tail), so a row's
// result does not depend on the batch it came in; multiplies and adds stay separate (no FMA), so
// both builds give the same bits. Registered beside the quantized products (qmatmul.cpp).
//
// bf16 rows (a bf16 model, engine.model.llama.rms_norm) follow transformers' arithmetic for them:
// normalise in float32, round to bf16, multiply by the bf16 weight (rounded again), as
// F.rms_norm(x.float()).to(bf16) * w computes; on CPU that was seven torch ops and three tensors.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>

#include "qmatmul_core.h"
#include "ops.h"

namespace {

using namespace tandem_qmm;

inline float widen(float v) { return v; }
inline float widen(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

// 1 / sqrt(mean(x²) + eps) of a row of fp32 values or bf16 bits, widened (exact): eight lanes of
// squares summed as hsum sums them, then the tail.
template <typename P>
float inverse_rms(const P* x, int64_t n, float eps) {
  Vec squares = zero();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const Vec v = load(x + k);
    squares = add(squares, mul(v, v));
  }
  float sum = hsum(squares);
  for (int64_t t = k; t < n; ++t) sum += widen(x[t]) * widen(x[t]);
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float r = inverse_rms(x, n, eps);
  const Vec rv = broadcast(&r);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) store(y + k, mul(mul(load(x + k), rv), load(w + k)));
  for (; k < n; ++k) y[k] = (x[k] * r) * w[k];
}

// Each output rounded twice: x·r to bf16, then its product with the weight.
void norm_row_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t n, float eps) {
  const auto* x16 = reinterpret_cast<const uint16_t*>(x);
  const auto* w16 = reinterpret_cast<const uint16_t*>(w);
  const float r = inverse_rms(x16, n, eps);
  const Vec rv = broadcast(&r);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    store(reinterpret_cast<uint16_t*>(y) + k, mul(round_bf16(mul(load(x16 + k), rv)), load(w16 + k)));
  }
  for (; k < n; ++k) y[k] = c10::BFloat16(static_cast<float>(x[k]) * r) * w[k];  // bf16 · bf16 rounds once
}

}  // namespace

namespace TANDEM_OPS {

// x fp32 or bf16 [..., n] (rows contiguous), weight [n] of x's dtype: shaped like x, in its dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() >= 1,
              "x must be float32 or bfloat16 [..., n]");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == n,
              "weight must be contiguous [", n, "] in x's dtype");
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty_like(input);
  const int64_t rows = n == 0 ? 0 : input.numel() / n;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* xs = input.data_ptr<c10::BFloat16>();
    const c10::BFloat16* w = weight.data_ptr<c10::BFloat16>();
    c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row_bf16(xs + r * n, w, ys + r * n, n, e);
    });
    return y;
  }
  const float* xs = input.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xs + r * n, w, ys + r * n, n, e);
  });
  return y;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &TANDEM_OPS::rms_norm);
}
