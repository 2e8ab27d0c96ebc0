// RMSNorm of fp32 rows, as transformers' LlamaRMSNorm computes it in float32:
//   y = fl(fl(x · r) · w),  r = 1 / sqrt(mean(x²) + eps),  the mean of squares in float32.
// One op instead of the five or six torch runs on CPU for F.rms_norm (pow, mean, add, rsqrt, mul):
// at batch 1 each of those costs more in dispatch than its arithmetic. Each row is computed alone,
// in one fixed order (eight lanes of squares, summed as hsum sums them, then the tail), so a row's
// result does not depend on the batch it came in; multiplies and adds stay separate (no FMA), so
// both builds give the same bits. Registered beside the quantized products (qmatmul.cpp).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "qmatmul_core.h"
#include "ops.h"

namespace {

using namespace tandem_qmm;

void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  Vec squares = zero();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const Vec v = load(x + k);
    squares = add(squares, mul(v, v));
  }
  float sum = hsum(squares);
  for (int64_t t = k; t < n; ++t) sum += x[t] * x[t];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec rv = broadcast(&r);
  for (k = 0; k + 8 <= n; k += 8) store(y + k, mul(mul(load(x + k), rv), load(w + k)));
  for (; k < n; ++k) y[k] = (x[k] * r) * w[k];
}

}  // namespace

namespace TANDEM_OPS {

// x fp32 [..., n] (rows contiguous), weight fp32 [n]: fp32 shaped like x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be float32 [..., n]");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
              "weight must be contiguous float32 [", n, "]");
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty_like(input);
  const int64_t rows = n == 0 ? 0 : input.numel() / n;
  const float* xs = input.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
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
