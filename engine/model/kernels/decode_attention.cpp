// Paged decode attention over a dense fp32 or bf16 KV cache: one query token per sequence, each
// attending to its whole context, after this step's K/V rows are stored at their slots.
//
// The torch path (engine/attention/reference.py) gathers every sequence's blocks into a padded
// copy, builds a visibility mask and runs SDPA; at batch 1 that is a dozen ops a layer whose
// dispatch costs more than the arithmetic. This op reads the pages in place through the block
// table. Pages: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is row s % block_size of
// block s / block_size. A task is one (sequence, KV head): the query heads that share that KV head
// (grouped-query attention) share one pass over the block table; a score is eight keys' products
// reduced together, a weighted sum one pass over the value rows per query head. Softmax is exact
// in fp32 (all scores, their max, exp, sum, then the weighted sum of values divided by the sum),
// each sequence alone, so a row's result does not depend on the batch it came in. bf16 pages are
// widened to fp32 as they are read (exact) and this step's rows rounded to nearest-even as they are
// stored, as torch's conversion rounds them: half the bytes of fp32 pages to stream.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "exp8.h"
#include "ops.h"

namespace {

using namespace tandem_qmm;

constexpr int64_t kKeys = 8;     // keys scored together: one vector of eight scores
constexpr int64_t kDimVecs = 8;  // value dimensions accumulated at once: 8 vectors of 8 (a 64-wide head in registers)
constexpr int64_t kAhead = 8;    // rows ahead to prefetch
// A batch of one sequence (three KV heads for the shipped model) is faster on one thread: split
// 2:1 over two it took 37 us a layer against 31 (200 positions, AMD EPYC).
constexpr int64_t kMinTasksPerThread = 4;

// The pages are scattered blocks whose rows are a KV-head stride apart: the hardware prefetcher
// alone left the op waiting on them. With this and the eight-key scores, a decode batch of 32 at
// 170 positions took 1.6-2.0 ms a layer against 3.0-3.2 before, the pages of 30 layers streaming
// from memory (one thread, AMD EPYC, back to back).
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
#if TANDEM_SIMD
  for (int64_t d = 0; d < n; d += 64 / sizeof(T)) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T0);
#endif
}

// A page element: fp32, or bf16 as its raw bits (qmatmul_core.h's load widens either).
inline void store_row(float* to, const float* from, int64_t n) { std::copy(from, from + n, to); }
inline void store_row(uint16_t* to, const float* from, int64_t n) {
  for (int64_t d = 0; d < n; ++d) to[d] = c10::BFloat16(from[d]).x;
}

// Lane i of the result is the sum of acc[i]'s lanes, ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), in
// both builds: eight horizontal sums for the price of about one.
inline Vec sum_lanes8(const Vec acc[kKeys]) {
#if TANDEM_SIMD
  const __m256 t0 = _mm256_hadd_ps(acc[0].v, acc[1].v), t1 = _mm256_hadd_ps(acc[2].v, acc[3].v);
  const __m256 t2 = _mm256_hadd_ps(acc[4].v, acc[5].v), t3 = _mm256_hadd_ps(acc[6].v, acc[7].v);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [0123 of a0..a3 | 4567 of a0..a3]
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
#else
  Vec r;
  for (int i = 0; i < kKeys; ++i) {
    const float* l = acc[i].v;
    r.v[i] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
  return r;
#endif
}

// s[j] = scale·(query · key j) for j < len, n (a multiple of 8) dimensions: eight keys at a time,
// each key's row read once and its eight partial sums reduced together (sum_lanes8). A last group
// of fewer than eight keys repeats the last row and drops the extra scores, so every score is one
// fixed sequence of operations whatever the context length.
template <typename T>
void scores(const float* query, const T* base, const int64_t* rows, int64_t len, int64_t n, float sc, float* s) {
  const Vec scale = broadcast(&sc);
  for (int64_t j0 = 0; j0 < len; j0 += kKeys) {
    const T* key[kKeys];
    for (int64_t i = 0; i < kKeys; ++i) key[i] = base + rows[std::min(j0 + i, len - 1)];
    for (int64_t i = j0 + kAhead; i < std::min(j0 + kAhead + kKeys, len); ++i) prefetch_row(base + rows[i], n);
    Vec acc[kKeys];
    for (int64_t i = 0; i < kKeys; ++i) acc[i] = zero();
    for (int64_t d = 0; d < n; d += 8) {
      const Vec qv = load(query + d);
#pragma GCC unroll 8
      for (int64_t i = 0; i < kKeys; ++i) acc[i] = fma(qv, load(key[i] + d), acc[i]);
    }
    float lanes[kKeys];
    store(lanes, mul(sum_lanes8(acc), scale));
    std::copy(lanes, lanes + std::min(kKeys, len - j0), s + j0);
  }
}

// out[0:n] = Σ_j p[j] · rows[j][0:n] / sum, n a multiple of 8: up to 64 dimensions at a time held in
// registers while the rows stream past once each, in context order.
template <typename T>
void weighted_sum(const float* p, const T* base, const int64_t* rows, int64_t len, float sum, float* out,
                  int64_t n) {
  for (int64_t d0 = 0; d0 < n; d0 += 8 * kDimVecs) {
    const int64_t vecs = std::min(kDimVecs, (n - d0) / 8);
    Vec acc[kDimVecs];
    for (int64_t c = 0; c < kDimVecs; ++c) acc[c] = zero();
    if (vecs == kDimVecs) {
      for (int64_t j = 0; j < len; ++j) {
        if (j + kAhead < len) prefetch_row(base + rows[j + kAhead] + d0, 8 * kDimVecs);
        const Vec w = broadcast(p + j);
        const T* row = base + rows[j] + d0;
#pragma GCC unroll 8
        for (int64_t c = 0; c < kDimVecs; ++c) acc[c] = fma(w, load(row + 8 * c), acc[c]);
      }
    } else {
      for (int64_t j = 0; j < len; ++j) {
        const Vec w = broadcast(p + j);
        const T* row = base + rows[j] + d0;
        for (int64_t c = 0; c < vecs; ++c) acc[c] = fma(w, load(row + 8 * c), acc[c]);
      }
    }
    for (int64_t c = 0; c < vecs; ++c) {
      float lanes[8];
      store(lanes, acc[c]);
      for (int l = 0; l < 8; ++l) out[d0 + 8 * c + l] = lanes[l] / sum;
    }
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

// Stores this step's k, v rows at their slots, then attends every (sequence, KV head) into out.
template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, T* keys, T* values, int64_t kv_heads,
            int64_t block_size, int64_t max_blocks, const int64_t* slots, const int32_t* tables, const int32_t* lens,
            float sc, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2), row = kv_heads * head_dim;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      store_row(keys + slots[b] * row + h * head_dim, k.data_ptr<float>() + b * k.stride(0) + h * k.stride(1), head_dim);
      store_row(values + slots[b] * row + h * head_dim, v.data_ptr<float>() + b * v.stride(0) + h * v.stride(1),
                head_dim);
    }
  }
  float* outs = out.data_ptr<float>();
  const float* qs = q.data_ptr<float>();
  const int64_t group = heads / kv_heads, q_seq = q.stride(0), q_head = q.stride(1);
  at::parallel_for(0, batch * kv_heads, kMinTasksPerThread, [&](int64_t begin, int64_t end) {
    std::vector<float> all_scores;
    std::vector<int64_t> rows;  // where each context position's row of this KV head starts in the pages
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads, len = lens[b];
      const int32_t* table = tables + b * max_blocks;
      rows.resize(len);
      for (int64_t block = 0, j = 0; j < len; ++block) {  // block by block: no division per position
        const int64_t first = table[block] * block_size * row + kvh * head_dim;
        for (int64_t offset = 0; offset < block_size && j < len; ++offset, ++j) rows[j] = first + offset * row;
      }
      all_scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const float* query = qs + b * q_seq + (kvh * group + g) * q_head;
        float* s = all_scores.data() + g * len;
        scores(query, keys, rows.data(), len, head_dim, sc, s);
        float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t j = 0; j < len; ++j) top = std::max(top, s[j]);
        exp_shifted(s, len, top);
        for (int64_t j = 0; j < len; ++j) sum += s[j];
        weighted_sum(s, values, rows.data(), len, sum, outs + (b * heads + kvh * group + g) * head_dim, head_dim);
      }
    }
  });
}

}  // namespace

namespace TANDEM_OPS {

// Stores fp32 k, v [B, KVH, D] at slot_mapping [B] (rounded to the pages' dtype), then returns fp32 [B, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16) &&
                  k_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && v_cache.is_contiguous(),
              "caches must be contiguous float32 or bfloat16 [num_blocks, block_size, num_kv_heads, head_dim], alike");
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2),
                head_dim = k_cache.size(3), batch = q.size(0), heads = q.dim() == 3 ? q.size(1) : 0;
  check_float_rows(q, "q", heads, head_dim, batch);
  check_float_rows(k, "k", kv_heads, head_dim, batch);
  check_float_rows(v, "v", kv_heads, head_dim, batch);
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0, "query heads (", heads, ") must be a multiple of KV heads (",
              kv_heads, ")");
  TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8, got ", head_dim);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == batch,
              "slot_mapping must be contiguous int64 [", batch, "]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == batch,
              "block_tables must be contiguous int32 [", batch, ", max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == batch,
              "seq_lens must be contiguous int32 [", batch, "]");
  const int64_t max_blocks = block_tables.size(1);
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
  at::Tensor out = at::empty({batch, heads, head_dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (k_cache.scalar_type() == at::kFloat) {
    attend(q, k, v, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), kv_heads, block_size, max_blocks, slots,
           tables, lens, static_cast<float>(scale), out);
  } else {
    attend(q, k, v, reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
           reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()), kv_heads, block_size, max_blocks, slots,
           tables, lens, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor",
        &TANDEM_OPS::decode_attention);
}
