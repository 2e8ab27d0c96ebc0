// Each row's argmax over fp32 logits [B, V], as torch's argmax and max(dim=1) pick it: the first of
// equal maxima, and the first NaN where a row holds one (NaN ranks above every number). Greedy
// decoding runs it once a step over the whole vocabulary: at 32 rows of the shipped model's 49,152
// columns, torch's max(dim=1) took about 2 ms a step on one core, a few per cent of the step.
//
// Eight lanes keep their own maximum and its column; a lane moves only on a strictly greater value,
// so it holds its first maximum, and of the lanes that tie the lowest column wins. NaNs never
// compare greater, so the vector loop only notes that one went by; such a row is rescanned for its
// first NaN (a model gone wrong, not the path worth speeding).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "qmatmul_core.h"
#include "ops.h"

namespace {

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(row[j])) return j;
  return -1;
}

int64_t argmax_row(const float* row, int64_t n) {
  int64_t j = 0, best_index = 0;
  float best = row[0];
  bool nan = std::isnan(best);
#if TANDEM_SIMD
  if (n >= 8) {
    __m256 best_v = _mm256_loadu_ps(row), nan_v = _mm256_cmp_ps(best_v, best_v, _CMP_UNORD_Q);
    __m256i index_v = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), column_v = index_v;
    const __m256i step = _mm256_set1_epi32(8);
    for (j = 8; j + 8 <= n; j += 8) {
      const __m256 v = _mm256_loadu_ps(row + j);
      column_v = _mm256_add_epi32(column_v, step);
      const __m256 greater = _mm256_cmp_ps(v, best_v, _CMP_GT_OQ);
      best_v = _mm256_blendv_ps(best_v, v, greater);
      index_v = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(index_v), _mm256_castsi256_ps(column_v), greater));
      nan_v = _mm256_or_ps(nan_v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, best_v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), index_v);
    best = values[0];
    best_index = indices[0];
    for (int lane = 1; lane < 8; ++lane) {
      if (values[lane] > best || (values[lane] == best && indices[lane] < best_index)) {
        best = values[lane];
        best_index = indices[lane];
      }
    }
    nan = _mm256_movemask_ps(nan_v) != 0;
  } else {
    j = 1;
  }
#else
  j = 1;
#endif
  for (; j < n; ++j) {
    nan = nan || std::isnan(row[j]);
    if (row[j] > best) {
      best = row[j];
      best_index = j;
    }
  }
  return nan ? first_nan(row, n) : best_index;
}

}  // namespace

namespace TANDEM_OPS {

// logits fp32 [B, V] (V ≥ 1, columns contiguous, rows at any stride): int64 [B].
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31) && logits.stride(1) == 1,
              "logits must be float32 [rows, columns] with contiguous columns");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* in = logits.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) tokens[r] = argmax_row(in + r * stride, n);
  });
  return out;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor", &TANDEM_OPS::argmax_rows);
}
