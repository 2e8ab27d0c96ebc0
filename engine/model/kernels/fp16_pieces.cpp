// fbgemm's fp16-weight product (torch's fbgemm_linear_fp16_weight_fp32_activation) over a weight
// packed in pieces of rows, the pieces spread over torch's threads.
//
// torch runs that product on one thread, so beside this build's threaded kernels it served only
// one-thread workers. Here each task computes whole pieces with torch's own op, each output column
// by the same fbgemm product whatever the thread count (so y is too), and copies them into y's columns.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/fbgemm_linear_fp16_weight_fp32_activation.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace {

// y = x·Wᵀ (+ bias) for W packed as pieces: piece i holds rows[i] consecutive rows of W (each packed
// by fbgemm_pack_gemm_matrix_fp16), x fp32 [M, K], bias fp32 [Σ rows] or none: fp32 [M, Σ rows].
at::Tensor fp16_pieces(const at::Tensor& x, at::TensorList packed, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(!packed.empty() && packed.size() == rows.size(), "need one row count per packed piece");
  std::vector<int64_t> first(rows.size() + 1, 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(rows[i] > 0, "piece rows must be positive");
    first[i + 1] = first[i] + rows[i];
  }
  const int64_t M = x.size(0), N = first.back();
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous float32 [", N, "]");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  const int64_t pieces = static_cast<int64_t>(packed.size());
  // Raw copies, not copy_(): torch's inference mode does not follow into the worker threads, and
  // an in-place update of an inference tensor outside it is refused.
  at::parallel_for(0, pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::optional<at::Tensor> piece_bias;
      if (bias.has_value()) piece_bias = bias->narrow(0, first[i], rows[i]);
      const at::Tensor part = at::fbgemm_linear_fp16_weight_fp32_activation(x, packed[i], piece_bias);
      TORCH_CHECK(part.size(0) == M && part.size(1) == rows[i], "piece ", i, " does not hold ", rows[i], " rows");
      const float* values = part.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) std::copy(values + m * rows[i], values + (m + 1) * rows[i], out + m * N + first[i]);
    }
  });
  return y;
}

}  // namespace

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("fp16_pieces(Tensor x, Tensor[] packed, Tensor? bias, int[] rows) -> Tensor", &fp16_pieces);
}
