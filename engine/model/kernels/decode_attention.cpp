// Paged decode attention over a dense fp32 or bf16 KV cache: one query token per sequence, each
// attending to its whole context, after this step's K/V rows are stored at their slots.
//
// The torch path (engine/attention/reference.py) gathers every sequence's blocks into a padded
// copy, builds a visibility mask and runs SDPA; at batch 1 that is a dozen ops a layer whose
// dispatch costs more than the arithmetic. This op reads the pages in place through the block
// table. Pages: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is row s % block_size of
// block s / block_size. A task is one (sequence, KV head): the query heads that share that KV head
// (grouped-query attention) share one pass over the block table and read each key and value row once
// (attend_group); a score is one key's products reduced together with its pass's others. Softmax is exact
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
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "exp8.h"
#include "ops.h"

namespace {

using namespace tandem_qmm;

constexpr int64_t kAhead = 16;   // rows ahead to prefetch
// A batch of one sequence (three KV heads for the shipped model) is faster on one thread at a short
// context: split 2:1 over two it took 37 us a layer against 31 (200 positions, AMD EPYC). What pays
// for a thread is the rows it reads, not its task count: a thread takes at least this many context
// rows (four tasks of 200), so one sequence of 2,500 positions is split over two threads.
constexpr int64_t kMinRowsPerThread = 800;

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

// The query heads that share a KV head (grouped-query attention) are served together, G at a time:
// each key and value row is read and widened once for all G, not once per head. How many keys a
// score pass takes and how many value vectors a weighted-sum pass holds are set so that the
// accumulators, the G query (or weight) vectors and the row in flight fit the AVX2 build's sixteen
// registers: G x keys + G + 1 and G x vectors + G + 1. Served this way a decode batch of 32 at 175
// positions took 0.29 ms a layer against 0.54 (pages in cache) and 0.47 against 0.79 (30 layers'
// pages streaming from memory), one head at a time before (one thread, AMD EPYC Zen 5).
template <int G>
struct GroupShape {
  static constexpr int64_t kKeys = G == 1 ? 8 : G <= 3 ? 4 : 2;  // keys scored per pass
  static constexpr int64_t kVecs = G == 1 ? 8 : G <= 3 ? 4 : 2;  // value vectors of 8 dimensions per pass
};
constexpr int kMaxGroup = 4;  // larger groups are served in pieces of at most this many heads

// out[i] = the sum of acc[i]'s lanes, ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), for K = 8, 4 or 2
// accumulators, in both builds: the horizontal sums of several accumulators for the price of about one.
template <int64_t K>
inline void sum_lanes(const Vec acc[K], float out[K]) {
#if TANDEM_SIMD
  __m256 u;
  if constexpr (K == 8) {
    const __m256 t0 = _mm256_hadd_ps(acc[0].v, acc[1].v), t1 = _mm256_hadd_ps(acc[2].v, acc[3].v);
    const __m256 t2 = _mm256_hadd_ps(acc[4].v, acc[5].v), t3 = _mm256_hadd_ps(acc[6].v, acc[7].v);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [0123 of a0..a3 | 4567 of a0..a3]
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
    return;
  } else if constexpr (K == 4) {
    u = _mm256_hadd_ps(_mm256_hadd_ps(acc[0].v, acc[1].v), _mm256_hadd_ps(acc[2].v, acc[3].v));
  } else {
    static_assert(K == 2, "sum_lanes takes 8, 4 or 2 accumulators");
    const __m256 t = _mm256_hadd_ps(acc[0].v, acc[1].v);
    u = _mm256_hadd_ps(t, t);
  }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  std::copy(lanes, lanes + K, out);
#else
  for (int64_t i = 0; i < K; ++i) {
    const float* l = acc[i].v;
    out[i] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
#endif
}

// s[g·stride + j] = scale·(query g · key j) for the G query heads and j < len, n (a multiple of 8)
// dimensions: kKeys keys at a time, each key's row read once for all G, each score's eight partial
// sums reduced with its pass's others (sum_lanes). A last pass of fewer keys repeats the last row and
// drops the extra scores, so every score is one fixed sequence of operations whatever the length.
template <typename T, int G>
void scores(const float* const query[G], const T* base, const int64_t* rows, int64_t len, int64_t n, float sc,
            float* s, int64_t stride, int64_t ahead) {
  constexpr int64_t K = GroupShape<G>::kKeys;
  for (int64_t j0 = 0; j0 < len; j0 += K) {
    const T* key[K];
    for (int64_t i = 0; i < K; ++i) key[i] = base + rows[std::min(j0 + i, len - 1)];
    for (int64_t i = j0 + kAhead; i < std::min(j0 + kAhead + K, len); ++i) prefetch_row(base + rows[i], ahead);
    Vec acc[G][K];
    for (int g = 0; g < G; ++g)
      for (int64_t i = 0; i < K; ++i) acc[g][i] = zero();
    for (int64_t d = 0; d < n; d += 8) {
      Vec qv[G];
      for (int g = 0; g < G; ++g) qv[g] = load(query[g] + d);
#pragma GCC unroll 8
      for (int64_t i = 0; i < K; ++i) {
        const Vec kv = load(key[i] + d);
        for (int g = 0; g < G; ++g) acc[g][i] = fma(qv[g], kv, acc[g][i]);
      }
    }
    const int64_t m = std::min(K, len - j0);
    for (int g = 0; g < G; ++g) {
      float lanes[K];
      sum_lanes<K>(acc[g], lanes);
      for (int64_t i = 0; i < m; ++i) s[g * stride + j0 + i] = lanes[i] * sc;
    }
  }
}

// out[g][0:n] = Σ_j p[g·stride + j] · rows[j][0:n] / sum[g] for the G query heads, n a multiple of 8:
// kVecs vectors of dimensions at a time held in registers for all G while the rows stream past once
// each, in context order.
template <typename T, int G>
void weighted_sums(const float* p, int64_t stride, const T* base, const int64_t* rows, int64_t len,
                   const float sum[G], float* const out[G], int64_t n, int64_t ahead) {
  constexpr int64_t V = GroupShape<G>::kVecs;
  for (int64_t d0 = 0; d0 < n; d0 += 8 * V) {
    const int64_t vecs = std::min(V, (n - d0) / 8);
    Vec acc[G][V];
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < V; ++c) acc[g][c] = zero();
    for (int64_t j = 0; j < len; ++j) {
      if (d0 == 0 && j + kAhead < len) prefetch_row(base + rows[j + kAhead], ahead);  // later passes find the row cached
      Vec w[G];
      for (int g = 0; g < G; ++g) w[g] = broadcast(p + g * stride + j);
      const T* row = base + rows[j] + d0;
      if (vecs == V) {
#pragma GCC unroll 8
        for (int64_t c = 0; c < V; ++c) {
          const Vec x = load(row + 8 * c);
          for (int g = 0; g < G; ++g) acc[g][c] = fma(w[g], x, acc[g][c]);
        }
      } else {
        for (int64_t c = 0; c < vecs; ++c) {
          const Vec x = load(row + 8 * c);
          for (int g = 0; g < G; ++g) acc[g][c] = fma(w[g], x, acc[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t c = 0; c < vecs; ++c) {
        float lanes[8];
        store(lanes, acc[g][c]);
        for (int l = 0; l < 8; ++l) out[g][d0 + 8 * c + l] = lanes[l] / sum[g];
      }
    }
  }
}

// s[j] ← exp(s[j] − top), eight at a time in the AVX2 build (exp8.h); returns Σ s[j], eight lanes
// at a time then hsum's order (the scalar build adds in the same order).
float exp_shifted(float* s, int64_t len, float top) {
  int64_t j = 0;
  Vec lanes = zero();
#if TANDEM_SIMD
  const __m256 shift = _mm256_set1_ps(top);
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, e);
    lanes = add(lanes, Vec{e});
  }
#else
  for (; j + 8 <= len; j += 8) {
    for (int64_t l = 0; l < 8; ++l) s[j + l] = std::exp(s[j + l] - top);
    lanes = add(lanes, load(s + j));
  }
#endif
  float sum = hsum(lanes);
  for (; j < len; ++j) sum += (s[j] = std::exp(s[j] - top));
  return sum;
}

// Each of G heads' len scores (stride apart) replaced by exp(score − the head's max); sums[g] their sum.
template <int G>
void exponentiate(float* s, int64_t stride, int64_t len, float sums[G]) {
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * stride;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) top = std::max(top, sg[j]);
    sums[g] = exp_shifted(sg, len, top);
  }
}

#if defined(__AVX512F__)
// The AVX-512 builds' forms of scores and weighted_sums, for head sizes of a multiple of 16: the same
// passes over 16 lanes, half the instructions of eight. A score's 16 partial sums are folded to eight
// (lane l + lane l+8) and then reduced as sum_lanes reduces eight; the weighted sums hold 64 dimensions
// of every head of the group at once. 32 sequences at 175 positions, one thread of an AMD EPYC Zen 5,
// 30 layers' pages streaming from memory, builds alternated: 0.54-0.56 ms a layer through eight lanes,
// 0.45-0.49 through 16 (in cache: 0.31 and 0.26).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return widen16(p); }
inline Vec fold(__m512 a) { return {_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))}; }

// s[g·stride + i] = sc · (the sum of acc[g][i]'s 16 lanes) for i < m.
template <int G, int64_t K>
inline void store_scores16(const __m512 (&acc)[G][K], int64_t m, float sc, float* s, int64_t stride) {
  for (int g = 0; g < G; ++g) {
    Vec folded[K];
    for (int64_t i = 0; i < K; ++i) folded[i] = fold(acc[g][i]);
    float lanes[K];
    sum_lanes<K>(folded, lanes);
    for (int64_t i = 0; i < m; ++i) s[g * stride + i] = lanes[i] * sc;
  }
}

template <typename T, int G>
void scores16(const float* const query[G], const T* base, const int64_t* rows, int64_t len, int64_t n, float sc,
              float* s, int64_t stride, int64_t ahead) {
  constexpr int64_t K = GroupShape<G>::kKeys;
  for (int64_t j0 = 0; j0 < len; j0 += K) {
    const T* key[K];
    for (int64_t i = 0; i < K; ++i) key[i] = base + rows[std::min(j0 + i, len - 1)];
    for (int64_t i = j0 + kAhead; i < std::min(j0 + kAhead + K, len); ++i) prefetch_row(base + rows[i], ahead);
    __m512 acc[G][K];
    for (int g = 0; g < G; ++g)
      for (int64_t i = 0; i < K; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
#pragma GCC unroll 8
      for (int64_t i = 0; i < K; ++i) {
        const __m512 kv = load16(key[i] + d);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[g][i] = _mm512_fmadd_ps(_mm512_loadu_ps(query[g] + d), kv, acc[g][i]);
      }
    }
    store_scores16<G, K>(acc, std::min(K, len - j0), sc, s + j0, stride);
  }
}

template <typename T, int G>
void weighted_sums16(const float* p, int64_t stride, const T* base, const int64_t* rows, int64_t len,
                     const float sum[G], float* const out[G], int64_t n, int64_t ahead) {
  constexpr int64_t V = 4;  // 64 dimensions a pass
  for (int64_t d0 = 0; d0 < n; d0 += 16 * V) {
    const int64_t vecs = std::min(V, (n - d0) / 16);
    __m512 acc[G][V];
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < V; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      if (d0 == 0 && j + kAhead < len) prefetch_row(base + rows[j + kAhead], ahead);
      __m512 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(p[g * stride + j]);
      const T* row = base + rows[j] + d0;
      if (vecs == V) {
#pragma GCC unroll 4
        for (int64_t c = 0; c < V; ++c) {
          const __m512 x = load16(row + 16 * c);
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(w[g], x, acc[g][c]);
        }
      } else {
        for (int64_t c = 0; c < vecs; ++c) {
          const __m512 x = load16(row + 16 * c);
          for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(w[g], x, acc[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 total = _mm512_set1_ps(sum[g]);
      for (int64_t c = 0; c < vecs; ++c) _mm512_storeu_ps(out[g] + d0 + 16 * c, _mm512_div_ps(acc[g][c], total));
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// bf16 pages in the avx512bf16 build, head sizes of a multiple of 32: the passes multiply bf16 pairs
// with vdpbf16ps (products exact, sums in fp32) instead of widening every element first. The
// queries are rounded to bf16 (a bf16 model's queries already are bf16 values) and the weighted sums
// take the exponentials rounded to bf16 (2^-9 relative), where torch's bf16 attention rounds them;
// the sum they are divided by stays the fp32 one. 32 sequences at 175 positions, one thread of an
// AMD EPYC Zen 5, per layer: see docs/benchmarks.md.
constexpr int64_t kMaxChunks = 8;  // dimensions in chunks of 32: head sizes up to 256

template <int G>
void scores_bf16(const float* const query[G], const uint16_t* base, const uint16_t* values, const int64_t* rows,
                 int64_t len, int64_t n, float sc, float* s, int64_t stride, int64_t ahead) {
  for (int64_t i = 0; i < std::min(kAhead, len); ++i) prefetch_row(base + rows[i], ahead);
  constexpr int64_t K = GroupShape<G>::kKeys;
  const int64_t chunks = n / 32;
  __m512bh q[G][kMaxChunks];
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      q[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(query[g] + 32 * c + 16), _mm512_loadu_ps(query[g] + 32 * c));
  for (int64_t j0 = 0; j0 < len; j0 += K) {
    const uint16_t* key[K];
    for (int64_t i = 0; i < K; ++i) key[i] = base + rows[std::min(j0 + i, len - 1)];
    for (int64_t i = j0 + kAhead; i < std::min(j0 + kAhead + K, len); ++i) prefetch_row(base + rows[i], ahead);
    // the values the weighted sums read next, so that pass starts on rows already in cache
    for (int64_t i = j0; i < std::min(j0 + K, len); ++i) prefetch_row(values + rows[i], ahead);
    __m512 acc[G][K];
    for (int g = 0; g < G; ++g)
      for (int64_t i = 0; i < K; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 8
      for (int64_t i = 0; i < K; ++i) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(key[i] + 32 * c);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q[g][c], kv);
      }
    }
    store_scores16<G, K>(acc, std::min(K, len - j0), sc, s + j0, stride);
  }
}

// p[g·stride + j] = bf16(e[g·stride + j]) for j < len, and 0 at len when len is odd: the weights as
// pairs of keys.
template <int G>
void round_weights(const float* e, int64_t stride, int64_t len, uint16_t* p) {
  for (int g = 0; g < G; ++g) {
    const float* from = e + g * stride;
    uint16_t* to = p + g * stride;
    int64_t j = 0;
    for (; j + 16 <= len; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(from + j)));
    for (; j < len; ++j) to[j] = c10::BFloat16(from[j]).x;
    if (len % 2) to[len] = 0;
  }
}

// out[g][0:n] = Σ_j p[g][j] · rows[j][0:n] / sum[g], keys two at a time: the two rows interleaved
// (vpunpck{l,h}wd) are the pairs vdpbf16ps multiplies by the two weights. Interleaving within 128-bit
// lanes leaves dimensions 8L..8L+3 of a 32-dimension chunk in the low result's lanes 4L..4L+3 and
// 8L+4..8L+7 in the high one's: kLow and kHigh put them back in order.
template <int G>
void weighted_sums_bf16(const uint16_t* p, int64_t stride, const uint16_t* base, const int64_t* rows, int64_t len,
                        const float sum[G], float* const out[G], int64_t n, int64_t ahead) {
  constexpr int64_t V = 2;  // chunks of 32 dimensions a pass
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t d0 = 0; d0 < n; d0 += 32 * V) {
    const int64_t chunks = std::min(V, (n - d0) / 32);
    __m512 lo[G][V], hi[G][V];
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < V; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 2) {
      if (d0 == 0) {
        for (int64_t i = j + kAhead; i < std::min(j + kAhead + 2, len); ++i) prefetch_row(base + rows[i], ahead);
      }
      __m512bh w[G];
      for (int g = 0; g < G; ++g) {
        uint32_t pair;
        std::memcpy(&pair, p + g * stride + j, sizeof pair);
        w[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      }
      const uint16_t* a = base + rows[j] + d0;
      const uint16_t* b = base + rows[std::min(j + 1, len - 1)] + d0;  // an odd last key pairs with itself, weight 0
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(b + 32 * c);
        const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(x, y), high = (__m512bh)_mm512_unpackhi_epi16(x, y);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          lo[g][c] = _mm512_dpbf16_ps(lo[g][c], w[g], low);
          hi[g][c] = _mm512_dpbf16_ps(hi[g][c], w[g], high);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 total = _mm512_set1_ps(sum[g]);
      for (int64_t c = 0; c < chunks; ++c) {
        float* o = out[g] + d0 + 32 * c;
        _mm512_storeu_ps(o, _mm512_div_ps(_mm512_permutex2var_ps(lo[g][c], first, hi[g][c]), total));
        _mm512_storeu_ps(o + 16, _mm512_div_ps(_mm512_permutex2var_ps(lo[g][c], second, hi[g][c]), total));
      }
    }
  }
}
#endif

// The softmax-weighted sums of G query heads that share a KV head, over len rows of the pages.
template <typename T, int G>
void attend_group(const float* const query[G], const T* keys, const T* values, const int64_t* rows, int64_t len,
                  int64_t head_dim, int64_t ahead, float sc, float* s, uint16_t* pairs, float* const out[G]) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (head_dim % 32 == 0 && head_dim <= 32 * kMaxChunks) {
      scores_bf16<G>(query, keys, values, rows, len, head_dim, sc, s, len + 1, ahead);
      float sums[G];
      exponentiate<G>(s, len + 1, len, sums);
      round_weights<G>(s, len + 1, len, pairs);
      weighted_sums_bf16<G>(pairs, len + 1, values, rows, len, sums, out, head_dim, ahead);
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  const bool wide = head_dim % 16 == 0;
  if (wide) {
    scores16<T, G>(query, keys, rows, len, head_dim, sc, s, len, ahead);
  } else {
    scores<T, G>(query, keys, rows, len, head_dim, sc, s, len, ahead);
  }
#else
  scores<T, G>(query, keys, rows, len, head_dim, sc, s, len, ahead);
#endif
  float sums[G];
  exponentiate<G>(s, len, len, sums);
#if defined(__AVX512F__)
  if (wide) {
    weighted_sums16<T, G>(s, len, values, rows, len, sums, out, head_dim, ahead);
    return;
  }
#endif
  weighted_sums<T, G>(s, len, values, rows, len, sums, out, head_dim, ahead);
}

// Serves `count` query heads (of one KV head) in pieces of at most kMaxGroup.
template <typename T>
void attend_heads(const float* const* query, int64_t count, const T* keys, const T* values, const int64_t* rows,
                  int64_t len, int64_t head_dim, int64_t ahead, float sc, float* s, uint16_t* pairs,
                  float* const* out) {
  for (int64_t first = 0; first < count; first += kMaxGroup) {
    const float* const* q = query + first;
    float* const* o = out + first;
    switch (std::min<int64_t>(kMaxGroup, count - first)) {
      case 1: attend_group<T, 1>(q, keys, values, rows, len, head_dim, ahead, sc, s, pairs, o); break;
      case 2: attend_group<T, 2>(q, keys, values, rows, len, head_dim, ahead, sc, s, pairs, o); break;
      case 3: attend_group<T, 3>(q, keys, values, rows, len, head_dim, ahead, sc, s, pairs, o); break;
      default: attend_group<T, 4>(q, keys, values, rows, len, head_dim, ahead, sc, s, pairs, o); break;
    }
  }
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
  // A task reads its sequence's rows: tasks per thread = kMinRowsPerThread / the mean length, rounded up.
  const int64_t positions = std::accumulate(lens, lens + batch, int64_t{0});
  const int64_t grain = std::max<int64_t>(1, (kMinRowsPerThread * batch + positions - 1) / std::max<int64_t>(1, positions));
  at::parallel_for(0, batch * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> all_scores;
    std::vector<uint16_t> pairs;  // bf16 pages: the weights rounded to bf16, as pairs of keys
    std::vector<int64_t> rows;  // where each context position's row of this KV head starts in the pages
    std::vector<const float*> query(group);
    std::vector<float*> out_rows(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads, len = lens[b];
      const int32_t* table = tables + b * max_blocks;
      rows.resize(len);
      for (int64_t block = 0, j = 0; j < len; ++block) {  // block by block: no division per position
        const int64_t first = table[block] * block_size * row + kvh * head_dim;
        for (int64_t offset = 0; offset < block_size && j < len; ++offset, ++j) rows[j] = first + offset * row;
      }
      // A head's scores are len + 1 apart: room for the zero weight that pairs an odd last key.
      all_scores.resize(std::min<int64_t>(group, kMaxGroup) * (len + 1));
      pairs.resize(all_scores.size());
      for (int64_t g = 0; g < group; ++g) {
        query[g] = qs + b * q_seq + (kvh * group + g) * q_head;
        out_rows[g] = outs + (b * heads + kvh * group + g) * head_dim;
      }
      // The first KV head's task prefetches whole token rows (every KV head's part): the pages are
      // scattered blocks, and the next heads' tasks then find their rows cached.
      const int64_t ahead = kvh == 0 ? row : head_dim;
      attend_heads(query.data(), group, keys, values, rows.data(), len, head_dim, ahead, sc, all_scores.data(),
                   pairs.data(), out_rows.data());
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
