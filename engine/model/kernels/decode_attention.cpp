// Paged decode attention over a dense fp32 KV cache: one query token per sequence, each attending
// to its whole context, after this step's K/V rows are stored at their slots.
//
// The torch path (engine/attention/reference.py) gathers every sequence's blocks into a padded
// copy, builds a visibility mask and runs SDPA; at batch 1 that is a dozen ops a layer whose
// dispatch costs more than the arithmetic. This op reads the pages in place through the block
// table. Pages: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is row s % block_size of
// block s / block_size. A task is one (sequence, KV head): the query heads that share that KV head
// (grouped-query attention) share one pass over the block table. Softmax is exact in fp32 (all
// scores, their max, exp, sum, then the weighted sum of values divided by the sum), each sequence
// alone, so a row's result does not depend on the batch it came in.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "exp8.h"

namespace {

using namespace tandem_qmm;

// Two accumulators, so consecutive FMAs do not wait on each other.
float dot(const float* a, const float* b, int64_t n) {
  Vec even = zero(), odd = zero();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    even = fma(load(a + k), load(b + k), even);
    odd = fma(load(a + k + 8), load(b + k + 8), odd);
  }
  if (k + 8 <= n) {
    even = fma(load(a + k), load(b + k), even);
    k += 8;
  }
  float s = hsum(add(even, odd));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// out[0:n] = Σ_j p[j] · rows[j][0:n] / sum, eight dimensions at a time held in registers across j.
void weighted_sum(const float* p, const float* base, const int64_t* rows, int64_t len, float sum, float* out,
                  int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    Vec even = zero(), odd = zero();
    int64_t j = 0;
    for (; j + 2 <= len; j += 2) {
      even = fma(broadcast(p + j), load(base + rows[j] + d), even);
      odd = fma(broadcast(p + j + 1), load(base + rows[j + 1] + d), odd);
    }
    if (j < len) even = fma(broadcast(p + j), load(base + rows[j] + d), even);
    float lanes[8];
    store(lanes, add(even, odd));
    for (int l = 0; l < 8; ++l) out[d + l] = lanes[l] / sum;
  }
  for (; d < n; ++d) {
    float acc = 0.f;
    for (int64_t j = 0; j < len; ++j) acc += p[j] * base[rows[j] + d];
    out[d] = acc / sum;
  }
}

// s[j] ← exp(s[j] − top), eight at a time in the AVX2 build (exp8.h).
void exp_shifted(float* s, int64_t len, float top) {
  int64_t j = 0;
#if TANDEM_SIMD
  const __m256 shift = _mm256_set1_ps(top);
  for (; j + 8 <= len; j += 8) _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)));
#endif
  for (; j < len; ++j) s[j] = std::exp(s[j] - top);
}

void check_float_rows(const at::Tensor& t, const char* name, int64_t heads, int64_t head_dim, int64_t batch) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == batch && t.size(1) == heads &&
                  t.size(2) == head_dim && t.stride(2) == 1,
              name, " must be float32 [", batch, ", ", heads, ", ", head_dim, "] with contiguous rows");
}

// Stores k, v [B, KVH, D] at slot_mapping [B], then returns fp32 [B, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "caches must be contiguous float32 [num_blocks, block_size, num_kv_heads, head_dim], alike");
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2),
                head_dim = k_cache.size(3), batch = q.size(0), heads = q.dim() == 3 ? q.size(1) : 0;
  check_float_rows(q, "q", heads, head_dim, batch);
  check_float_rows(k, "k", kv_heads, head_dim, batch);
  check_float_rows(v, "v", kv_heads, head_dim, batch);
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0, "query heads (", heads, ") must be a multiple of KV heads (",
              kv_heads, ")");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == batch,
              "slot_mapping must be contiguous int64 [", batch, "]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == batch,
              "block_tables must be contiguous int32 [", batch, ", max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == batch,
              "seq_lens must be contiguous int32 [", batch, "]");
  const int64_t max_blocks = block_tables.size(1), row = kv_heads * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slots[b] >= 0 && slots[b] < num_blocks * block_size, "slot ", slots[b], " is outside the cache");
    TORCH_CHECK(lens[b] > 0 && lens[b] <= max_blocks * block_size, "seq_len ", lens[b], " does not fit the block table");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks, "block id ",
                  tables[b * max_blocks + i], " is outside the cache");
    }
  }
  float* keys = k_cache.data_ptr<float>();
  float* values = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* kr = k.data_ptr<float>() + b * k.stride(0) + h * k.stride(1);
      const float* vr = v.data_ptr<float>() + b * v.stride(0) + h * v.stride(1);
      std::copy(kr, kr + head_dim, keys + slots[b] * row + h * head_dim);
      std::copy(vr, vr + head_dim, values + slots[b] * row + h * head_dim);
    }
  }
  at::Tensor out = at::empty({batch, heads, head_dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  float* outs = out.data_ptr<float>();
  const float* qs = q.data_ptr<float>();
  const int64_t group = heads / kv_heads, q_seq = q.stride(0), q_head = q.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> rows;  // where each context position's row of this KV head starts in the pages
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads, len = lens[b];
      const int32_t* table = tables + b * max_blocks;
      rows.resize(len);
      for (int64_t block = 0, j = 0; j < len; ++block) {  // block by block: no division per position
        const int64_t first = table[block] * block_size * row + kvh * head_dim;
        for (int64_t offset = 0; offset < block_size && j < len; ++offset, ++j) rows[j] = first + offset * row;
      }
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const float* query = qs + b * q_seq + (kvh * group + g) * q_head;
        float* s = scores.data() + g * len;
        for (int64_t j = 0; j < len; ++j) s[j] = dot(query, keys + rows[j], head_dim) * sc;
        float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t j = 0; j < len; ++j) top = std::max(top, s[j]);
        exp_shifted(s, len, top);
        for (int64_t j = 0; j < len; ++j) sum += s[j];
        weighted_sum(s, values, rows.data(), len, sum, outs + (b * heads + kvh * group + g) * head_dim, head_dim);
      }
    }
  });
  return out;
}

}  // namespace

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor",
        &decode_attention);
}
