// Rotary position embedding in place, rotate-half pairing, in the arithmetic of engine.model.rope's
// apply_rotary (transformers' q·cos + rotate_half(q)·sin): for j < D/2,
//   x[j] ← fl(fl(x[j]·c) − fl(x[j+D/2]·s)),  x[j+D/2] ← fl(fl(x[j+D/2]·c) + fl(x[j]·s)).
// -ffp-contract=off keeps each product rounded, so the result is bit-identical to the torch ops
// it replaces (a chunk, four multiplies, a subtract, an add and a concatenation per layer). bf16
// x, cos and sin round every product, difference and sum to bf16, as torch's bf16 ops do (each
// computes in fp32 and rounds once): bit for bit apply_rotary in bf16 too.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <type_traits>

#include "ops.h"
#include "qmatmul_core.h"

namespace {

using namespace tandem_qmm;

// T's arithmetic rounds each operation to T: float's, and c10::BFloat16's (fp32 inside, rounded once).
template <typename T>
void rotate(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xs = x.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* ss = sin.data_ptr<T>();
  // Tokens are independent: a 2,048-token step's 30 calls took 41 ms on one thread and on two alike.
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cs + t * cos.stride(0);
      const T* s = ss + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        T* first = xs + t * x.stride(0) + h * x.stride(1);
        T* second = first + half;
        int64_t j = 0;
        if constexpr (std::is_same_v<T, c10::BFloat16>) {  // eight lanes at a time, each op rounded as below
          auto* f16 = reinterpret_cast<uint16_t*>(first);
          auto* s16 = reinterpret_cast<uint16_t*>(second);
          const auto* c16 = reinterpret_cast<const uint16_t*>(c);
          const auto* n16 = reinterpret_cast<const uint16_t*>(s);
          for (; j + 8 <= half; j += 8) {
            const Vec a = load(f16 + j), b = load(s16 + j), cv = load(c16 + j), sv = load(n16 + j);
            const Vec ac = round_bf16(mul(a, cv)), bs = round_bf16(mul(b, sv));
            const Vec bc = round_bf16(mul(b, cv)), as = round_bf16(mul(a, sv));
            store(f16 + j, sub(ac, bs));
            store(s16 + j, add(bc, as));
          }
        }
        for (; j < half; ++j) {
          const T a = first[j], b = second[j];
          const T ac = a * c[j], bs = b * s[j], bc = b * c[j], as = a * s[j];
          first[j] = ac - bs;
          second[j] = bc + as;
        }
      }
    }
  });
}

}  // namespace

namespace TANDEM_OPS {

// x fp32 or bf16 [T, heads, D] (rows contiguous, any outer strides: a view into the fused QKV
// output), cos and sin of x's dtype [T, 1, D/2]; rotates x in place and returns it.
at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 3 &&
                  x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be float32 or bfloat16 [T, heads, head_dim] with contiguous rows and an even head_dim");
  const int64_t tokens = x.size(0), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->dim() == 3 && t->size(0) == tokens && t->size(1) == 1 &&
                    t->size(2) == half && t->stride(2) == 1,
                "cos and sin must be [", tokens, ", 1, ", half, "] in x's dtype with contiguous rows");
  }
  if (x.scalar_type() == at::kFloat) {
    rotate<float>(x, cos, sin);
  } else {
    rotate<c10::BFloat16>(x, cos, sin);
  }
  return x;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)", &TANDEM_OPS::rotary_);
}
