// The kernels' arithmetic, free of torch (qmatmul.cpp wraps it as torch ops; see its header comment).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_SIMD 1
#else
#define TANDEM_SIMD 0
#endif

namespace tandem_qmm {


constexpr int64_t kChunk = 32;        // weights per unpack step; group sizes are multiples of it
constexpr int64_t kRowsPerTask = 64;  // output rows per parallel task: their weights stay in cache across row blocks of x
constexpr int64_t kBlockRows = 8;     // rows interleaved in the packed layout (see Problem)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the weight stream to prefetch (see prefetch_ahead)

#if TANDEM_SIMD
struct Vec {
  __m256 v;
};
inline Vec zero() { return {_mm256_setzero_ps()}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec broadcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
// Eight bf16 values (raw bits) widened to fp32: exact, a bf16 is an fp32's upper half.
inline Vec load(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
}
// Each lane rounded to bf16 as c10::BFloat16 rounds (nearest even; NaN to the quiet 0x7FC0), as
// raw bits in the low half of each 32-bit lane.
inline __m256i bf16_bits(Vec a) {
  const __m256i bits = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}
// a rounded to bf16 and widened back: the fp32 value of the bf16 a rounds to.
inline Vec round_bf16(Vec a) { return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a), 16))}; }
inline void store(uint16_t* p, Vec a) {
  const __m256i bits = bf16_bits(a);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

// ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), the order the scalar build uses too.
inline float hsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// Chunk `half` (0 or 1) of a 4-bit span (see Problem): lane l of w[j] is q·16^j for weight 8j + l of
// the chunk. No byte shuffles: a mask per j and one conversion (the 16^j is undone in x, see kX4Scale).
inline void unpack4(const uint8_t* p, int64_t half, bool full, Vec w[4]) {
  __m256i v = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                   : _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (half) v = _mm256_srli_epi32(v, 16);
  for (int j = 0; j < 4; ++j) w[j].v = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * j))));
}

#if defined(__AVX512F__)
// Sixteen bf16 values (raw bits) widened to fp32: exact, as `load` widens eight.
inline __m512 widen16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

inline void unpack8(const int8_t* p, Vec w[4]) {
  for (int s = 0; s < 4; ++s) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * s));
    w[s].v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}
#else
struct Vec {
  float v[8];
};
inline Vec zero() { return {}; }
inline Vec load(const float* p) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = p[l];
  return r;
}
inline Vec broadcast(const float* p) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = *p;
  return r;
}
inline Vec mul(Vec a, Vec b) {
  for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l];
  return a;
}
inline Vec add(Vec a, Vec b) {
  for (int l = 0; l < 8; ++l) a.v[l] += b.v[l];
  return a;
}
inline Vec sub(Vec a, Vec b) {
  for (int l = 0; l < 8; ++l) a.v[l] -= b.v[l];
  return a;
}
inline Vec fma(Vec a, Vec b, Vec c) {
  for (int l = 0; l < 8; ++l) c.v[l] += a.v[l] * b.v[l];
  return c;
}
inline void store(float* p, Vec a) {
  for (int l = 0; l < 8; ++l) p[l] = a.v[l];
}
inline Vec load(const uint16_t* p) {
  Vec r;
  for (int l = 0; l < 8; ++l) {
    const uint32_t bits = uint32_t(p[l]) << 16;
    std::memcpy(&r.v[l], &bits, sizeof bits);
  }
  return r;
}
inline uint16_t bf16_bits(float f) {  // c10::BFloat16's rounding: nearest even, NaN to 0x7FC0
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return f != f ? uint16_t(0x7FC0) : uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
inline Vec round_bf16(Vec a) {
  for (int l = 0; l < 8; ++l) {
    const uint32_t bits = uint32_t(bf16_bits(a.v[l])) << 16;
    std::memcpy(&a.v[l], &bits, sizeof bits);
  }
  return a;
}
inline void store(uint16_t* p, Vec a) {
  for (int l = 0; l < 8; ++l) p[l] = bf16_bits(a.v[l]);
}
inline float hsum(Vec a) {
  const float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
  return (s0 + s2) + (s1 + s3);
}
inline void unpack4(const uint8_t* p, int64_t half, bool full, Vec w[4]) {
  for (int l = 0; l < 8; ++l) {
    uint32_t v = full ? (uint32_t(p[4 * l]) | uint32_t(p[4 * l + 1]) << 8 | uint32_t(p[4 * l + 2]) << 16 |
                         uint32_t(p[4 * l + 3]) << 24)
                      : (uint32_t(p[2 * l]) | uint32_t(p[2 * l + 1]) << 8);
    if (half) v >>= 16;
    for (int j = 0; j < 4; ++j) w[j].v[l] = static_cast<float>(v & (0xFu << (4 * j)));
  }
}
inline void unpack8(const int8_t* p, Vec w[4]) {
  for (int j = 0; j < 32; ++j) w[j / 8].v[j % 8] = static_cast<float>(p[j]);
}
#endif

// 4-bit weights come as w[j] = q·16^j (unpack4); x is read multiplied by 16^-j to match (exact:
// powers of two), so each product x·q, and every sum of them, is what it would be on q itself.
constexpr float kX4Scale[4] = {1.0f, 1.0f / 16, 1.0f / 256, 1.0f / 4096};

// The packed weight, in blocks of kBlockRows rows (the last block padded), scales and offsets
// [blocks, groups, kBlockRows]. Within a block, 8-bit weights go chunk by chunk (32 weights), each
// row's chunk in turn; 4-bit weights span by span (64 weights, a last one of 32 where K is an odd
// number of chunks), each row's span in turn: a span is 8 little-endian 32-bit words (16-bit for a
// 32-weight span), word l holding in its nibble s the weight 8s + l. A tile of up to 8 rows then
// reads one stream and finds each row at a fixed offset.
struct Problem {
  const float* x;
  int64_t M, K, N;
  const uint8_t* q;
  const float* scale;
  const float* offset;  // nullptr: no offset
  int64_t groups, chunks_per_group;
  const float* group_sums;  // [M, groups] when there is an offset
  const float* bias;        // nullptr: no bias
  float* y;
};

template <int BITS>
inline const uint8_t* block_base(const Problem& p, int64_t n) {
  // A block holds 8 rows of K weights of BITS bits: K·BITS bytes.
  return p.q + (n / kBlockRows) * p.K * BITS;
}

// The weights of chunk c of row j (0..7) of a block, as unpack4/unpack8 give them.
template <int BITS>
inline void load_chunk(const Problem& p, const uint8_t* block, int64_t j, int64_t c, Vec w[4]) {
  if constexpr (BITS == 4) {
    const int64_t span = c / 2;
    const bool full = (span + 1) * 2 * kChunk <= p.K;
    unpack4(block + span * kBlockRows * kChunk + j * (full ? kChunk : kChunk / 2), c % 2, full, w);
  } else {
    unpack8(reinterpret_cast<const int8_t*>(block + (c * kBlockRows + j) * kChunk), w);
  }
}

// A model's weights are larger than the caches and stream from memory once a step; the hardware
// prefetcher alone leaves a one-row product waiting on them (measured: a third slower). So the
// first tile of a block asks for the bytes kPrefetchBytes beyond the chunk it unpacks.
template <int BITS>
inline void prefetch_ahead(const uint8_t* block, int64_t c) {
#if TANDEM_SIMD
  constexpr int64_t step = kBlockRows * kChunk * BITS / 8;  // bytes of one chunk of a block's 8 rows
  const char* ahead = reinterpret_cast<const char*>(block + c * step + kPrefetchBytes);
  for (int64_t line = 0; line < step; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
#endif
}

inline int64_t block_group(const Problem& p, int64_t n) {
  // Index of row n's group 0 in scale/offset; group g is kBlockRows further on per group.
  return (n / kBlockRows) * p.groups * kBlockRows + n % kBlockRows;
}

inline void finish(const Problem& p, int64_t m, int64_t n, float dot) { p.y[m * p.N + n] = dot; }

// y[m, n] += Σ_g offset[n, g]·sums[m, g] in group order, then + bias[n]: eight rows of a block
// at a time, one lane each, so every output gets the same sequence of operations.
inline void epilogue(const Problem& p, int64_t n_begin, int64_t n_end) {
  if (p.offset == nullptr && p.bias == nullptr) return;
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kBlockRows) {
      Vec extra = zero();
      if (p.offset != nullptr) {
        const float* offset = p.offset + block_group(p, n0);
        const float* sums = p.group_sums + m * p.groups;
        for (int64_t g = 0; g < p.groups; ++g) extra = fma(broadcast(sums + g), load(offset + g * kBlockRows), extra);
      }
      float lanes[kBlockRows];
      store(lanes, extra);
      for (int64_t n = n0; n < std::min(n_end, n0 + kBlockRows); ++n) {
        float y = p.y[m * p.N + n];
        if (p.offset != nullptr) y += lanes[n - n0];
        if (p.bias != nullptr) y += p.bias[n];
        p.y[m * p.N + n] = y;
      }
    }
  }
}

// One row of x against a whole block of 4-bit weights in groups of 32: the arithmetic of
// tile<4, true, 1, 8> (so the same bits), written out for batch-1 decode, which is most of a
// step's time. The generic tile reread the span bounds from memory and spilled its accumulators
// every chunk (perf, AMD EPYC: 6.8 G weights/s with the weights in cache); here the bounds are
// hoisted, the chunk's x stays in four registers and the eight accumulators in eight.
inline void row_block_4bit_groups_of_32(const Problem& p, int64_t m0, int64_t n0) {
  const uint8_t* block = block_base<4>(p, n0);
  const float* scale = p.scale + block_group(p, n0);
  const float* x = p.x + m0 * p.K;
  const int64_t chunks = p.K / kChunk, full_chunks = p.K / (2 * kChunk) * 2;
  Vec acc[kBlockRows];
#pragma GCC unroll 8
  for (int j = 0; j < kBlockRows; ++j) acc[j] = zero();
  auto chunk = [&](int64_t c, bool full) {
    prefetch_ahead<4>(block, c);
    const float* xc = x + c * kChunk;
    const Vec x0 = load(xc), x1 = load(xc + 8), x2 = load(xc + 16), x3 = load(xc + 24);
    const uint8_t* span = block + (c / 2) * kBlockRows * kChunk;
    const int64_t row_bytes = full ? kChunk : kChunk / 2;
#pragma GCC unroll 8
    for (int j = 0; j < kBlockRows; ++j) {
      Vec w[4];
      unpack4(span + j * row_bytes, c % 2, full, w);
      Vec v = mul(w[0], x0);
      v = fma(w[1], x1, v);
      v = fma(w[2], x2, v);
      v = fma(w[3], x3, v);
      acc[j] = fma(v, broadcast(scale + c * kBlockRows + j), acc[j]);
    }
  };
  for (int64_t c = 0; c < full_chunks; ++c) chunk(c, true);
  for (int64_t c = full_chunks; c < chunks; ++c) chunk(c, false);
#pragma GCC unroll 8
  for (int j = 0; j < kBlockRows; ++j) finish(p, m0, n0 + j, hsum(acc[j]));
}

// MB rows of x against NB rows of W (within one block): MB*NB accumulators, at most 8, so with the
// small loops unrolled they all stay in registers.
template <int BITS, bool GROUPS_OF_32, int MB, int NB>
void tile(const Problem& p, int64_t m0, int64_t n0) {
  if constexpr (BITS == 4 && GROUPS_OF_32 && MB == 1 && NB == kBlockRows) {
    if (n0 % kBlockRows == 0) return row_block_4bit_groups_of_32(p, m0, n0);
  }
  const uint8_t* block = block_base<BITS>(p, n0);
  const int64_t row0 = n0 % kBlockRows;
  const float* scale = p.scale + block_group(p, n0);
  const float* x = p.x + m0 * p.K;
  Vec acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = zero();
  for (int64_t g = 0; g < p.groups; ++g, scale += kBlockRows) {
    for (int64_t c = g * p.chunks_per_group; c < (g + 1) * p.chunks_per_group; ++c) {
      if (row0 == 0) prefetch_ahead<BITS>(block, c);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        Vec w[4];
        load_chunk<BITS>(p, block, row0 + j, c, w);
        const Vec d = broadcast(scale + j);
        if constexpr (GROUPS_OF_32) {
          // A group is one chunk: scale its dot product once (one multiply instead of four).
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            const float* xr = x + i * p.K + c * kChunk;
            Vec v = mul(w[0], load(xr));
#pragma GCC unroll 3
            for (int s = 1; s < 4; ++s) v = fma(w[s], load(xr + 8 * s), v);
            acc[i][j] = fma(v, d, acc[i][j]);
          }
        } else {
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) w[s] = mul(w[s], d);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            const float* xr = x + i * p.K + c * kChunk;
#pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) acc[i][j] = fma(w[s], load(xr + 8 * s), acc[i][j]);
          }
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) finish(p, m0 + i, n0 + j, hsum(acc[i][j]));
}

template <int BITS, bool GROUPS_OF_32, int MB, int NB>
void columns(const Problem& p, int64_t m0, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) tile<BITS, GROUPS_OF_32, MB, NB>(p, m0, n);
  for (; n < n_end; ++n) tile<BITS, GROUPS_OF_32, MB, 1>(p, m0, n);
}

// Output rows [n_begin, n_end) (n_begin a multiple of kBlockRows) for every row of x: row blocks
// of x outer, so the weights of these rows stay in cache while each block of x passes over them.
template <int BITS, bool GROUPS_OF_32>
void rows_task(const Problem& p, int64_t n_begin, int64_t n_end) {
  int64_t m = 0;
  for (; m + 8 <= p.M; m += 8) columns<BITS, GROUPS_OF_32, 8, 1>(p, m, n_begin, n_end);
  if (p.M - m >= 4) {
    columns<BITS, GROUPS_OF_32, 4, 2>(p, m, n_begin, n_end);
    m += 4;
  }
  if (p.M - m >= 2) {
    columns<BITS, GROUPS_OF_32, 2, 4>(p, m, n_begin, n_end);
    m += 2;
  }
  if (p.M - m >= 1) columns<BITS, GROUPS_OF_32, 1, 8>(p, m, n_begin, n_end);
  epilogue(p, n_begin, n_end);
}

// Rows [begin, end) of the fp32 weight [N, K]: fl(fl(scale·q) + offset) per element.
template <int BITS>
void dequantize_rows(const Problem& p, float* out, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* block = block_base<BITS>(p, n);
    const int64_t first_group = block_group(p, n);
    for (int64_t c = 0; c < p.K / kChunk; ++c) {
      const int64_t g = first_group + (c / p.chunks_per_group) * kBlockRows;
      Vec w[4];
      load_chunk<BITS>(p, block, n % kBlockRows, c, w);
      const Vec d = broadcast(p.scale + g);
      for (int s = 0; s < 4; ++s) {
        if constexpr (BITS == 4) w[s] = mul(w[s], broadcast(&kX4Scale[s]));  // q itself: exact
        Vec v = mul(w[s], d);
        if (p.offset != nullptr) v = add(v, broadcast(p.offset + g));
        store(out + n * p.K + c * kChunk + 8 * s, v);
      }
    }
  }
}

}  // namespace tandem_qmm
