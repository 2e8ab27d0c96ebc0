// SwiGLU's product silu(gate) · up over the fused gate/up product's output [T, 2I] (gate | up), as
// torch computes F.silu(gate) * up: fl(fl(g / fl(1 + exp(−g))) · u). One op instead of a chunk, a
// silu and a multiply a layer. The AVX2 build computes exp eight lanes at a time (exp8.h), the
// scalar build with std::exp. Rows are independent.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "exp8.h"
#include "ops.h"

namespace {

using namespace tandem_qmm;

void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#if TANDEM_SIMD
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
  }
#endif
  for (; j < n; ++j) out[j] = (gate[j] / (1.f + std::exp(-gate[j]))) * up[j];
}

}  // namespace

namespace TANDEM_OPS {

// gate_up fp32 [T, 2I] (rows contiguous): fp32 [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be float32 [T, 2 * intermediate] with contiguous rows");
  const int64_t tokens = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({tokens, n}, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  const float* in = gate_up.data_ptr<float>();
  float* outs = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(in + t * stride, in + t * stride + n, outs + t * n, n);
  });
  return out;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor", &TANDEM_OPS::silu_mul);
}
