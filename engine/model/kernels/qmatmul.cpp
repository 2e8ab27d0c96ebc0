// Weight-only quantized matrix products for the CPU: y = x·Wᵀ (+ b), x fp32 [M, K], W integer groups.
//
// W is engine.model.quantized's representation (w = scale·q + offset per group of G weights, G a
// multiple of 32), packed by engine.model.quantized_linear.PackedWeight in blocks of 8 rows (the
// last padded), scale and offset fp32 [blocks, K/G, 8]; 8-bit values (int8) chunk by chunk (32
// weights), each row's chunk in turn; 4-bit values (0..15) span by span (64 weights), each row's
// span in turn as 8 words whose nibble s of word l is weight 8s + l (qmatmul_core.h, Problem), so
// that unpacking needs a mask and a conversion per 8 weights and no byte shuffles.
// A tile of up to 8 rows then reads one stream with each row at a fixed offset (one pointer, not
// eight: x86 has too few registers for eight).
//
// Each output y[m, n] is computed by one fixed sequence of operations whatever M, N, the tile
// shape or the thread count: eight lanes accumulate, chunk by chunk with FMA, scale·(q·x) for
// groups of 32 (a group is one chunk) or fl(scale·q)·x for larger groups; the lanes are summed in
// one fixed order, then the offset term Σ_g offset[n, g]·Σ_{k in g} x[m, k] and the bias are
// added. So a row's result does not depend on the batch it came in.
//
// Built twice (engine/model/kernels/build.py): with -mavx2 -mfma -mf16c (AVX2 intrinsics) and
// without (plain C++ over eight-lane arrays, which compilers may vectorise for the baseline ISA).
// -ffp-contract=off keeps the separate multiplies and adds separate, so dequantize() equals
// fl(fl(scale·q) + offset), torch's own rounding of the same formula.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "qmatmul_core.h"
#include "ops.h"

namespace {

using namespace tandem_qmm;

// A thread's share must be worth waking it: at batch 1 on an AMD EPYC the 576x576 product took
// 29 us on two threads against 28 on one, the 960x576 one 39 against 42.
constexpr int64_t kMinWeightRowsPerThread = 1 << 19;

template <int BITS, bool GROUPS_OF_32>
void run(const Problem& p) {
  const int64_t tasks = (p.N + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t grain = std::max<int64_t>(1, kMinWeightRowsPerThread / (kRowsPerTask * p.K * p.M));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rows_task<BITS, GROUPS_OF_32>(p, t * kRowsPerTask, std::min(p.N, (t + 1) * kRowsPerTask));
    }
  });
}

void check_weight(const at::Tensor& packed, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                  int64_t bits, int64_t group_size, int64_t rows, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0 && K % group_size == 0,
              "group size must be a multiple of 32 dividing ", K, ", got ", group_size);
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows, groups = K / group_size;
  TORCH_CHECK(packed.scalar_type() == (bits == 4 ? at::kByte : at::kChar) && packed.is_contiguous() &&
                  packed.dim() == 2 && packed.size(0) == blocks && packed.size(1) == K * bits,
              "packed weight must be contiguous ", bits == 4 ? "uint8" : "int8", " [", blocks, ", ", K * bits, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3 &&
                  scale.size(0) == blocks && scale.size(1) == groups && scale.size(2) == kBlockRows,
              "scale must be contiguous float32 [", blocks, ", ", groups, ", ", kBlockRows, "]");
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == at::kFloat && offset->is_contiguous() && offset->sizes() == scale.sizes(),
                "offset must be contiguous float32 shaped like scale");
  }
}

Problem problem(const float* x, int64_t M, int64_t K, int64_t N, const at::Tensor& packed, const at::Tensor& scale,
                const std::optional<at::Tensor>& offset, int64_t group_size, const float* sums, const float* bias,
                float* y) {
  return Problem{x, M, K, N, static_cast<const uint8_t*>(packed.data_ptr()), scale.data_ptr<float>(),
                 offset.has_value() ? offset->data_ptr<float>() : nullptr, K / group_size, group_size / kChunk,
                 sums, bias, y};
}

}  // namespace

namespace TANDEM_OPS {

// y = x·Wᵀ (+ bias) for the `rows`-row weight packed as engine.model.quantized_linear.PackedWeight.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t rows,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = rows;
  check_weight(packed, scale, offset, bits, group_size, rows, K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous float32 [", N, "]");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t groups = K / group_size;
  const float* xs = x.data_ptr<float>();
  std::vector<float> sums;
  if (offset.has_value()) {
    sums.resize(M * groups);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) s += xs[m * K + k];
        sums[m * groups + g] = s;
      }
  }
  std::vector<float> x4;
  if (bits == 4) {
    // x·16^-j at weight 8j + l of each chunk, to match unpack4's q·16^j (exact: powers of two).
    x4.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) x4[i] = xs[i] * kX4Scale[(i % K % kChunk) / 8];
    xs = x4.data();
  }
  const Problem p = problem(xs, M, K, N, packed, scale, offset, group_size, sums.empty() ? nullptr : sums.data(),
                            bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  if (M > 0 && N > 0) {
    const bool groups_of_32 = group_size == kChunk;
    if (bits == 4) {
      groups_of_32 ? run<4, true>(p) : run<4, false>(p);
    } else {
      groups_of_32 ? run<8, true>(p) : run<8, false>(p);
    }
  }
  return y;
}

}  // namespace TANDEM_OPS

namespace {

// The fp32 weight [rows, K]: fl(fl(scale·q) + offset), as QuantizedWeight.dequantize() computes it.
at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                      int64_t bits, int64_t group_size, int64_t rows) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  const int64_t K = packed.size(1) / bits;
  check_weight(packed, scale, offset, bits, group_size, rows, K);
  at::Tensor out = at::empty({rows, K}, scale.options());
  const Problem p = problem(nullptr, 0, K, rows, packed, scale, offset, group_size, nullptr, nullptr, nullptr);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    if (bits == 4) {
      dequantize_rows<4>(p, out.data_ptr<float>(), begin, end);
    } else {
      dequantize_rows<8>(p, out.data_ptr<float>(), begin, end);
    }
  });
  return out;
}

}  // namespace

// Each build registers its ops under its own namespace (-DTANDEM_OPS=tandem_avx2, ...), so both
// variants can be loaded into one process; the indirection lets the macro's argument expand.
#define TANDEM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
TANDEM_LIBRARY(TANDEM_OPS, m) {
  m.def("matmul(Tensor x, Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int rows, "
        "Tensor? bias) -> Tensor",
        &TANDEM_OPS::matmul);
  m.def("dequantize(Tensor packed, Tensor scale, Tensor? offset, int bits, int group_size, int rows) -> Tensor",
        &dequantize);
}
