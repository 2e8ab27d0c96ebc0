// Causal attention of a prompt chunk's bf16 queries over its sequence's bf16 keys and values, with
// AVX512-BF16's dot product of bf16 pairs (vdpbf16ps) accumulating in fp32. Built only into the
// variant compiled for it (build.py's "avx512bf16"); the other builds register no such op.
//
// Why: torch's CPU flash-attention kernel took 7.5 ms a layer for a 512-token prompt of the shipped
// model (9 heads of 64, one thread, AMD EPYC Zen 5 without AMX), 40 GFLOP/s, 42% of the prompt's time;
// this op takes about 1 ms. Where the CPU has AMX, torch's kernel runs on AMX tiles, and the engine
// keeps it (engine/attention/selector.py).
//
// The arithmetic is the one torch's kernel does in bf16: scores q·k accumulated in fp32 from bf16
// products and scaled, an exact softmax in fp32 per query row (max, exp, sum: two passes over the
// row's scores, no running rescale), the exponentials rounded to bf16 and multiplied with the values
// accumulating in fp32, the sum divided out at the end and the output rounded to bf16.
//
// Layout: keys are packed per KV head as pairs of dimensions across keys (kp[p][j] = k[j][2p],
// k[j][2p+1]) and values as pairs of keys across dimensions (vp[j/2][d] = v[j][d], v[j+1][d]): the
// operand shapes vdpbf16ps multiplies 16 lanes of. A task is one query head and kTaskRows query rows,
// in tiles of kTileRows rows whose accumulators stay in registers: scores of 32 keys at a time (8
// accumulators), the weighted sum of 64 dimensions at a time (16 accumulators).

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "exp8.h"

namespace {

using namespace tandem_qmm;

constexpr int64_t kTileRows = 6;   // query rows whose accumulators are in registers together
constexpr int64_t kTaskRows = 24;  // query rows a task computes
constexpr int64_t kKeyStep = 32;   // keys a score pass covers: two vectors of 16
constexpr int64_t kDimStep = 64;   // dimensions a weighted-sum pass covers: four vectors of 16

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

inline __m512bh broadcast_pair(uint32_t bits) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits)); }

inline uint16_t to_bf16(float f) { return c10::BFloat16(f).x; }

// One KV head's keys [len rows, stride `row`] as kp[p][j] (j < padded, zero beyond len) and values as
// vp[j/2][d] (pairs of keys, zero beyond len).
void pack_head(const uint16_t* k, const uint16_t* v, int64_t row, int64_t len, int64_t padded, int64_t dim,
               uint32_t* kp, uint32_t* vp) {
  for (int64_t p = 0; p < dim / 2; ++p) {
    uint32_t* to = kp + p * padded;
    for (int64_t j = 0; j < len; ++j) to[j] = pair_at(k + j * row + 2 * p);
    std::fill(to + len, to + padded, 0u);
  }
  for (int64_t jp = 0; jp < padded / 2; ++jp) {
    uint32_t* to = vp + jp * dim;
    const int64_t j = 2 * jp;
    for (int64_t d = 0; d < dim; ++d) {
      const uint32_t lo = j < len ? v[j * row + d] : 0u, hi = j + 1 < len ? v[(j + 1) * row + d] : 0u;
      to[d] = lo | (hi << 16);
    }
  }
}

// s[r][j] = scale·(q row r · key j) for the tile's kTileRows rows and j < keys (a multiple of kKeyStep).
void tile_scores(const uint16_t* const q[kTileRows], const uint32_t* kp, int64_t padded, int64_t dim, int64_t keys,
                 float scale, float* s, int64_t s_stride) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < keys; j0 += kKeyStep) {
    __m512 acc[kTileRows][2];
    for (auto& r : acc) r[0] = r[1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * padded + j0);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * padded + j0 + 16);
#pragma GCC unroll 8
      for (int64_t r = 0; r < kTileRows; ++r) {
        const __m512bh qb = broadcast_pair(pair_at(q[r] + 2 * p));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < kTileRows; ++r) {
      _mm512_storeu_ps(s + r * s_stride + j0, _mm512_mul_ps(acc[r][0], sc));
      _mm512_storeu_ps(s + r * s_stride + j0 + 16, _mm512_mul_ps(acc[r][1], sc));
    }
  }
}

// p[0:keys] = bf16(exp(s[j] − max)) for j < visible, 0 beyond; returns Σ exp over the visible keys (fp32).
// Sixteen lanes at a time (exp16), then eight (exp8): the exponentials took 1.8 of a 512-token
// layer's 6 ms on eight lanes alone (one thread, Intel Xeon).
float row_softmax(const float* s, int64_t visible, int64_t keys, uint16_t* p) {
  __m512 tops16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t m = 0;
  for (; m + 16 <= visible; m += 16) tops16 = _mm512_max_ps(tops16, _mm512_loadu_ps(s + m));
  float top = _mm512_reduce_max_ps(tops16);
  for (; m < visible; ++m) top = std::max(top, s[m]);
  const __m512 shift16 = _mm512_set1_ps(top);
  __m512 lanes16 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift16));
    lanes16 = _mm512_add_ps(lanes16, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  const __m256 shift = _mm256_set1_ps(top);
  __m256 lanes = _mm256_add_ps(_mm512_castps512_ps256(lanes16), _mm512_extractf32x8_ps(lanes16, 1));
  for (; j + 8 <= visible; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    lanes = _mm256_add_ps(lanes, e);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + j), (__m128i)_mm256_cvtneps_pbh(e));
  }
  float sum = hsum(Vec{lanes});
  for (; j < visible; ++j) {
    const float e = std::exp(s[j] - top);
    sum += e;
    p[j] = to_bf16(e);
  }
  std::fill(p + visible, p + keys, uint16_t{0});
  return sum;
}

// out[r][0:dim] = Σ_j p[r][j]·v[j] / sum[r], rounded to bf16, over keys (a multiple of 2) of the pairs in vp.
void tile_weighted_sum(const uint16_t* p, int64_t p_stride, const uint32_t* vp, int64_t dim, int64_t keys,
                       const float sum[kTileRows], uint16_t* const out[kTileRows], int64_t rows) {
  for (int64_t d0 = 0; d0 < dim; d0 += kDimStep) {
    __m512 acc[kTileRows][4];
    for (auto& r : acc) r[0] = r[1] = r[2] = r[3] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < keys / 2; ++jp) {
      const uint32_t* vrow = vp + jp * dim + d0;
      __m512bh x[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) x[c] = (__m512bh)_mm512_loadu_si512(vrow + 16 * c);
#pragma GCC unroll 8
      for (int64_t r = 0; r < kTileRows; ++r) {
        const __m512bh pb = broadcast_pair(pair_at(p + r * p_stride + 2 * jp));
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, x[c]);
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < kTileRows; ++r) {
      if (r >= rows) break;
      const __m512 total = _mm512_set1_ps(sum[r]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + d0 + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_div_ps(acc[r][c], total)));
      }
    }
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t heads, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 3 && t.size(1) == heads && t.size(2) == dim &&
                  t.stride(2) == 1 && t.stride(1) == dim,
              name, " must be bfloat16 [rows, ", heads, ", ", dim, "] with each row's heads contiguous");
}

}  // namespace

namespace TANDEM_OPS {

// q bf16 [Lq, H, D]; k, v bf16 [S, KVH, D] (S ≥ Lq: the last Lq positions are the queries', query i
// sees keys 0..S−Lq+i); D a multiple of 64; H a multiple of KVH. Returns bf16 [Lq, H, D].
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [rows, heads, head_dim]");
  const int64_t queries = q.size(0), heads = q.size(1), dim = q.size(2), len = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(dim % kDimStep == 0, "head_dim must be a multiple of ", kDimStep, ", got ", dim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads (", heads, ") must be a multiple of KV heads (",
              kv_heads, ")");
  check_rows(q, "q", heads, dim);
  check_rows(k, "k", kv_heads, dim);
  check_rows(v, "v", kv_heads, dim);
  TORCH_CHECK(v.size(0) == len, "k and v must have as many rows");
  TORCH_CHECK(queries >= 1 && queries <= len, "queries (", queries, ") must be 1..", len, " (the keys)");
  const int64_t offset = len - queries, group = heads / kv_heads;
  const int64_t padded = (len + kKeyStep - 1) / kKeyStep * kKeyStep;
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t q_row = q.stride(0), k_row = k.stride(0), v_row = v.stride(0);

  std::vector<uint32_t> kp(kv_heads * dim / 2 * padded), vp(kv_heads * padded / 2 * dim);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      pack_head(ks + h * dim, vs + h * dim, k_row, len, padded, dim, kp.data() + h * dim / 2 * padded,
                vp.data() + h * padded / 2 * dim);
    }
  });

  at::Tensor out = at::empty({queries, heads, dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  auto* outs = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t blocks = (queries + kTaskRows - 1) / kTaskRows;
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kTaskRows * padded);
    std::vector<uint16_t> p(kTaskRows * padded);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, first = task % blocks * kTaskRows, kvh = h / group;
      const uint32_t* khead = kp.data() + kvh * dim / 2 * padded;
      const uint32_t* vhead = vp.data() + kvh * padded / 2 * dim;
      for (int64_t r0 = first; r0 < std::min(first + kTaskRows, queries); r0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, queries - r0);
        // The tile's last row sees the most keys: offset + r0 + rows of them.
        const int64_t keys = std::min(padded, (offset + r0 + rows + kKeyStep - 1) / kKeyStep * kKeyStep);
        const uint16_t* qrow[kTileRows];
        uint16_t* orow[kTileRows];
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t i = r0 + std::min(r, rows - 1);  // a short last tile repeats its last row
          qrow[r] = qs + i * q_row + h * dim;
          orow[r] = outs + (i * heads + h) * dim;
        }
        float* st = s.data();
        tile_scores(qrow, khead, padded, dim, keys, static_cast<float>(scale), st, padded);
        float sum[kTileRows];
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t visible = offset + r0 + std::min(r, rows - 1) + 1;
          sum[r] = row_softmax(st + r * padded, visible, keys, p.data() + r * padded);
        }
        tile_weighted_sum(p.data(), padded, vhead, dim, keys, sum, orow, rows);
      }
    }
  });
  return out;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &TANDEM_OPS::prefill_attention);
}

#endif  // __AVX512BF16__
