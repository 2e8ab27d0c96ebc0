// Rotary position embedding in place, rotate-half pairing, in the arithmetic of engine.model.rope's
// apply_rotary (transformers' q·cos + rotate_half(q)·sin): for j < D/2,
//   x[j] ← fl(fl(x[j]·c) − fl(x[j+D/2]·s)),  x[j+D/2] ← fl(fl(x[j+D/2]·c) + fl(x[j]·s)).
// -ffp-contract=off keeps each product rounded, so the result is bit-identical to the torch ops
// it replaces (a chunk, four multiplies, a subtract, an add and a concatenation per layer).

#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include "ops.h"

namespace TANDEM_OPS {

// x fp32 [T, heads, D] (rows contiguous, any outer strides: a view into the fused QKV output),
// cos and sin fp32 [T, 1, D/2]; rotates x in place and returns it.
at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be float32 [T, heads, head_dim] with contiguous rows and an even head_dim");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == tokens && t->size(1) == 1 &&
                    t->size(2) == half && t->stride(2) == 1,
                "cos and sin must be float32 [", tokens, ", 1, ", half, "] with contiguous rows");
  }
  float* xs = x.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* ss = sin.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cs + t * cos.stride(0);
    const float* s = ss + t * sin.stride(0);
    for (int64_t h = 0; h < heads; ++h) {
      float* first = xs + t * x.stride(0) + h * x.stride(1);
      float* second = first + half;
      for (int64_t j = 0; j < half; ++j) {
        const float a = first[j], b = second[j];
        first[j] = a * c[j] - b * s[j];
        second[j] = b * c[j] + a * s[j];
      }
    }
  }
  return x;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)", &TANDEM_OPS::rotary_);
}
