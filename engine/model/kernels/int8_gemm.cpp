// y = x·Wᵀ (+ bias) for a weight of integer groups (engine.model.quantized: w = scale·q + offset) and
// activations quantized to int8 as they come in, multiplied with AVX512-VNNI's dot product of unsigned
// and signed bytes (vpdpbusd) into exact int32 sums. Built only into the variant compiled for AVX-512
// with BF16 and VNNI (build.py's "avx512bf16"); the other builds register no such op.
//
// Why: a decode batch or a prompt is bound by arithmetic, and one vpdpbusd does 64 multiply-adds
// where an FMA does 16. One thread of an Intel Xeon (Emerald Rapids, no AMX) ran vpdpbusd at 377-490
// GOP/s and 512-bit FMAs at 168 GFLOP/s in a register loop; the model's layer products at 32 and 512
// rows took 0.52 and 8.4 ms here against 1.37 and 24.1 through bf16_gemm_fma.
//
// Activations: each row's blocks of 32 are quantized symmetrically, as llama.cpp quantizes them to
// Q8 for its CPU products and vLLM's GGUF kernels for theirs: t = x · 127/amax (amax the block's
// largest |x|; an all-zero block is zeros) and, with one part, xq = round-to-nearest-even(t), x ≈
// xq · amax/127. That moves an activation by up to amax/254, which cost the shipped 135M model 2.3%
// of perplexity. With two parts the rounding error t − round(t) (exact in fp32) is quantized again,
// times 128: xq = 128·round(t) + round(128·(t − round(t))), x ≈ xq · amax/(127·128), 15 bits a block
// instead of 7 for twice the byte products (each part one vpdpbusd pass; the first pass's sums are
// shifted left by 7 before the second adds to them, so the sums stay exact in int32).
// Weights: u = q (unsigned groups) or q + 128 (signed ones: vpdpbusd takes the weight as the unsigned
// operand; q + 8 for signed 4-bit ones), so that w = d·(u − z) + m per 32-block with z = 0, 8 or 128.
// Then, per row and output,
//     y = Σ_blocks d · scale · (Σ u·xq − z·Σ xq)  +  Σ_blocks m · fl(scale · Σ xq)
// where scale is amax/127 or amax/(127·128), the integer sums are exact, and a group of more than 32
// repeats its scale and offset over its blocks. The offset term takes the quantized x, as llama.cpp's
// Q8_1 keeps d·Σq for it: Q4_1's offset is about −8·d, so the two terms nearly cancel, and x's exact
// sum there left the scale term's rounding error uncancelled (perplexity +2.3% against +0.29%). Each
// output is one fixed sequence of operations (blocks in K order), so a row's result does not depend on
// the batch it came in.
//
// Layout (engine.model.int8_activations.pack_int8_blocks): u [P][K/4][16][4] uint8, panels of 16
// outputs, one 64-byte row per four consecutive K that vpdpbusd multiplies by four broadcast bytes of
// x; d and m [P][K/32][16] fp32. Values of 4 bits (u < 16) may come as nibbles, u [P][K/8][16][4]:
// row h of a block's four holds its rows h (low nibbles) and h + 4 (high nibbles) of the byte layout.
// The weight's bytes are then half as many, which is what a product of a few rows waits for (it
// streams the weight from memory once for all its rows); a mask and a shift unpack them.

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "gemm_tiles.h"
#include "qmatmul_core.h"

namespace {

using tandem_gemm::kLine;
using tandem_gemm::Output;
using tandem_gemm::schedule_tiles;

constexpr int64_t kBlock = 32;   // activations per quantization block
constexpr int64_t kRows = 6;     // rows of x a register tile holds
constexpr int64_t kPanels = 2;   // panels of 16 outputs a register tile holds: 24 accumulators
constexpr int64_t kBlockBytes = 512 * 1024;  // x's quantized rows a row block holds: a quarter of a 2 MB L2

// x's rows as int8 blocks: per block its parts' 32 values each, the scale and the sum of the
// (combined) values.
struct QuantizedRows {
  int parts;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> qsum;
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return tandem_qmm::widen16(reinterpret_cast<const uint16_t*>(p)); }

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, QuantizedRows& out) {
  const int64_t blocks = k / kBlock, parts = out.parts;
  out.q.resize(m * k * parts);
  out.scale.resize(m * blocks);
  out.qsum.resize(m * blocks);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * blocks; i < end * blocks; ++i) {
      const T* from = x + i * kBlock;
      const __m512 a = load16(from), b = load16(from + 16);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(top > 0 ? 127.0f / top : 0.0f);
      const __m512 ta = _mm512_mul_ps(a, inv), tb = _mm512_mul_ps(b, inv);
      __m512i qa = _mm512_cvtps_epi32(ta), qb = _mm512_cvtps_epi32(tb);
      int8_t* to = out.q.data() + i * kBlock * parts;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to + 16), _mm512_cvtsepi32_epi8(qb));
      if (parts == 2) {
        const __m512 by = _mm512_set1_ps(128.0f);
        const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(ta, _mm512_cvtepi32_ps(qa)), by));
        const __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(tb, _mm512_cvtepi32_ps(qb)), by));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(to + 32), _mm512_cvtsepi32_epi8(ra));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(to + 48), _mm512_cvtsepi32_epi8(rb));
        qa = _mm512_add_epi32(_mm512_slli_epi32(qa, 7), ra);
        qb = _mm512_add_epi32(_mm512_slli_epi32(qb, 7), rb);
      }
      out.scale[i] = parts == 2 ? top / (127.0f * 128.0f) : top / 127.0f;
      out.qsum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
  });
}

struct Weight {
  const uint8_t* u;
  const float* d;
  const float* m;  // nullptr: no offsets
  int32_t zero;
  int64_t k;
  bool nibbles;  // u holds two 4-bit values a byte

  int64_t panel_bytes() const { return nibbles ? k * 8 : k * 16; }
};

// R rows of x from row m0, C panels from panel `panel`, over all K; meanwhile `lines` cache lines
// from `ahead` (the next panels) are prefetched, spread over the blocks.
template <int R, int C, bool OFFSET, bool ZERO, int PARTS, bool NIBBLES>
void tile(const QuantizedRows& x, int64_t m0, const Weight& w, int64_t panel, const Output& out, const char* ahead,
          int64_t lines) {
  const int64_t k = w.k, blocks = k / kBlock, stride = w.panel_bytes();
  const uint8_t* u = w.u + panel * stride;
  const float* d = w.d + panel * blocks * 16;
  const int8_t* xq = x.q.data() + m0 * k * PARTS;
  const int64_t every = (lines + blocks - 1) / blocks;
  __m512 f[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) f[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0, fetched = 0; b < blocks; ++b) {
    for (int64_t i = 0; i < every && fetched < lines; ++i, ++fetched) _mm_prefetch(ahead + fetched * kLine, _MM_HINT_T0);
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int part = 0; part < PARTS; ++part) {
      if (part > 0) {
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_slli_epi32(acc[r][c], 7);
      }
      if constexpr (NIBBLES) {
        const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
        for (int64_t h = 0; h < kBlock / 8; ++h) {
          __m512i lo[C], hi[C];
          for (int c = 0; c < C; ++c) {
            const __m512i v = _mm512_loadu_si512(u + c * stride + (b * 4 + h) * 64);
            lo[c] = _mm512_and_si512(v, low);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* from = xq + (r * blocks + b) * kBlock * PARTS + part * kBlock;
            int32_t first, second;
            std::memcpy(&first, from + h * 4, sizeof first);
            std::memcpy(&second, from + (h + 4) * 4, sizeof second);
            const __m512i x1 = _mm512_set1_epi32(first), x2 = _mm512_set1_epi32(second);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], lo[c], x1);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], hi[c], x2);
          }
        }
      } else {
#pragma GCC unroll 8
        for (int64_t g = 0; g < kBlock / 4; ++g) {
          __m512i wv[C];
          for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(u + c * stride + (b * 8 + g) * 64);
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, xq + (r * blocks + b) * kBlock * PARTS + part * kBlock + g * 4, sizeof four);
            const __m512i xv = _mm512_set1_epi32(four);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xv);
          }
        }
      }
    }
    __m512 dv[C];
    for (int c = 0; c < C; ++c) dv[c] = _mm512_loadu_ps(d + c * blocks * 16 + b * 16);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      const __m512 scale = _mm512_set1_ps(x.scale[i]);
      for (int c = 0; c < C; ++c) {
        __m512i sum = acc[r][c];
        if constexpr (ZERO) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(w.zero * x.qsum[i]));
        f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dv[c], scale), f[r][c]);
      }
    }
    if constexpr (OFFSET) {
      for (int c = 0; c < C; ++c) {
        const __m512 mv = _mm512_loadu_ps(w.m + (panel + c) * blocks * 16 + b * 16);
        for (int r = 0; r < R; ++r) {
          const int64_t i = (m0 + r) * blocks + b;  // the quantized block's sum, fl(scale · Σ xq)
          f[r][c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.scale[i] * static_cast<float>(x.qsum[i])), f[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out.store(m0 + r, (panel + c) * 16, f[r][c]);
}

using TileFn = void (*)(const QuantizedRows&, int64_t, const Weight&, int64_t, const Output&, const char*, int64_t);
using TileTable = std::array<std::array<TileFn, kRows>, kPanels>;

template <bool OFFSET, bool ZERO, int PARTS, bool NIBBLES, int C, int... R>
constexpr std::array<TileFn, sizeof...(R)> row_tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, C, OFFSET, ZERO, PARTS, NIBBLES>...};
}

// [c - 1][r - 1]: the tile of r rows and c panels.
template <bool OFFSET, bool ZERO, int PARTS, bool NIBBLES, int... C>
constexpr TileTable table(std::integer_sequence<int, C...>) {
  return {row_tiles<OFFSET, ZERO, PARTS, NIBBLES, C + 1>(std::make_integer_sequence<int, kRows>{})...};
}

template <int PARTS, bool NIBBLES>
constexpr std::array<TileTable, 4> tables() {
  constexpr auto panels = std::make_integer_sequence<int, kPanels>{};
  return {table<false, false, PARTS, NIBBLES>(panels), table<true, false, PARTS, NIBBLES>(panels),
          table<false, true, PARTS, NIBBLES>(panels), table<true, true, PARTS, NIBBLES>(panels)};
}

// [nibbles][parts - 1][offsets + 2·(zero ≠ 0)]
const std::array<std::array<std::array<TileTable, 4>, 2>, 2> kTables = {
    std::array<std::array<TileTable, 4>, 2>{tables<1, false>(), tables<2, false>()},
    std::array<std::array<TileTable, 4>, 2>{tables<1, true>(), tables<2, true>()}};

// Row blocks whose quantized x stays in L2 while every column group passes over it, as bf16_gemm.cpp
// runs its tiles (schedule_tiles).
void run_tiles(const QuantizedRows& x, int64_t m, const Weight& w, int64_t panels, const Output& out) {
  const TileTable& tiles = kTables[w.nibbles][x.parts - 1][(w.m != nullptr) + 2 * (w.zero != 0)];
  const int64_t block_rows = std::max<int64_t>(kRows, kBlockBytes / (w.k * x.parts) / kRows * kRows);
  int64_t block_start = 0;
  schedule_tiles(
      m, block_rows, kRows, panels, kPanels, w.panel_bytes(), reinterpret_cast<const char*>(w.u),
      [&](int64_t first_row, int64_t) { block_start = first_row; },
      [&](int64_t m0, int64_t rows, int64_t first, int64_t count, const char* ahead, int64_t lines) {
        tiles[count - 1][rows - 1](x, block_start + m0, w, first, out, ahead, lines);
      });
}

}  // namespace

namespace TANDEM_OPS {

// x fp32 or bf16 [M, K] (K a multiple of 32, rows contiguous), quantized in `parts` (1 or 2) int8
// parts, times the weight packed as u uint8 [P, K/4, 16, 4] (or its nibbles [P, K/8, 16, 4]), d and m
// (or None) fp32 [P, K/32, 16], z = 0, 8 (signed 4-bit values) or 128, of n ≤ 16·P outputs, plus fp32
// bias [n] if given: [M, n] in fp32 if fp32_out, else bf16.
at::Tensor int8_gemm(const at::Tensor& x, int64_t parts, const at::Tensor& u, const at::Tensor& d,
                     const std::optional<at::Tensor>& m, int64_t zero, int64_t n, const std::optional<at::Tensor>& bias,
                     bool fp32_out) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous fp32 or bf16 [M, K]");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0 && k % kBlock == 0, "K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(u.scalar_type() == at::kByte && u.is_contiguous() && u.dim() == 4 &&
                  (u.size(1) == k / 4 || u.size(1) == k / 8) && u.size(2) == 16 && u.size(3) == 4,
              "u must be contiguous uint8 [P, ", k / 4, " (or ", k / 8, " nibbles), 16, 4]");
  const bool nibbles = u.size(1) == k / 8;
  const int64_t panels = u.size(0);
  TORCH_CHECK(n > 16 * (panels - 1) && n <= 16 * panels, "n=", n, " does not match ", panels, " panels of 16");
  const std::vector<int64_t> groups{panels, k / kBlock, 16};
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.sizes() == groups,
              "d must be contiguous fp32 [", panels, ", ", k / kBlock, ", 16]");
  TORCH_CHECK(!m.has_value() || (m->scalar_type() == at::kFloat && m->is_contiguous() && m->sizes() == groups),
              "m must be contiguous fp32 [", panels, ", ", k / kBlock, ", 16]");
  TORCH_CHECK(zero == 0 || zero == 8 || zero == 128, "zero must be 0, 8 or 128, got ", zero);
  TORCH_CHECK(parts == 1 || parts == 2, "parts must be 1 or 2, got ", parts);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias must be contiguous fp32 [", n, "]");
  QuantizedRows xq{static_cast<int>(parts), {}, {}, {}};
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), rows, k, xq);
  } else {
    quantize_rows(x.data_ptr<at::BFloat16>(), rows, k, xq);
  }
  at::Tensor y = at::empty({rows, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const Output out{y.data_ptr(), fp32_out, n, bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const Weight w{u.data_ptr<uint8_t>(), d.data_ptr<float>(), m.has_value() ? m->data_ptr<float>() : nullptr,
                 static_cast<int32_t>(zero), k, nibbles};
  run_tiles(xq, rows, w, panels, out);
  return y;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("int8_gemm(Tensor x, int parts, Tensor u, Tensor d, Tensor? m, int zero, int n, Tensor? bias, bool fp32_out) "
        "-> Tensor",
        &TANDEM_OPS::int8_gemm);
}

#endif  // __AVX512VNNI__ && __AVX512BF16__
