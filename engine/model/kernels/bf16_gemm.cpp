// y = x·Wᵀ (+ bias) for bf16 x [M, K] and a bf16 weight packed as pairs of its K dimension, with
// AVX512-BF16's dot product of bf16 pairs (vdpbf16ps) accumulating in fp32. Built only into the
// variant compiled for it (build.py's "avx512bf16"); the other builds register no such op.
//
// Why: a decode batch of 32 rows on one thread of an AMD EPYC Zen 5 (no AMX) spent 29-34 ms a step in
// oneDNN's bf16 GEMM over its packed copy, about 290 GFLOP/s, while the core's vdpbf16ps peaks near
// 430. Its time went to fetching the weight: a 32-row product reuses each weight element 32 times
// only, so every panel of the weight must already be in L2 when the rows reach it. Here each register
// tile prefetches its share of the next panel while it computes: the model's products over 32 rows,
// weights streaming from memory, take 24.5 ms a step against oneDNN's 34.1 (python -m bench
// bf16_products); the same tiles without the prefetch took 29-32 ms in a standalone test.
//
// Layout: packed[P][K/2][16][2] holds W's columns n = 16·P + lane as pairs (W[n][2p], W[n][2p+1]):
// one 64-byte row per pair of K is the operand vdpbf16ps multiplies by a broadcast pair of x.
// A register tile is up to kRows rows × kPanels panels of 16 columns (24 accumulators); the rows of
// a column group reuse its panels from L2. Each output is one fixed sequence of operations (pairs in
// K order), so a row's result does not depend on the batch it came in.
//
// bf16_gemm_fma: the same product over the same packed weight with fp32 FMAs, x widened to fp32 once
// and each loaded pair of weights split into its two bf16 halves (a shift and a mask make them fp32).
// Where a core issues two 512-bit FMAs a cycle but one vdpbf16ps, this is the faster: one thread of
// an Intel Xeon with AVX512-BF16 and no AMX multiplied bf16 at 85-98 GFLOP/s through vdpbf16ps
// (oneDNN's and ours) and fp32 at 138-166 through MKL. Each output is a sequence of single-rounding
// FMAs in K order, exact products of the bf16 values accumulated in fp32 as vdpbf16ps accumulates.

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

namespace {

using tandem_gemm::kLine;
using tandem_gemm::Output;
using tandem_gemm::schedule_tiles;

constexpr int64_t kRows = 8;     // rows of x a register tile holds
constexpr int64_t kPanels = 3;   // panels of 16 columns a register tile holds
constexpr int64_t kBlockBytes = 512 * 1024;  // x's rows a block holds: a quarter of a 2 MB L2

// R rows of x from row m0, C panels from panel `panel`, over all K/2 pairs; meanwhile `lines` cache
// lines from `ahead` are prefetched, spread over the pairs.
template <int R, int C>
void tile(const uint16_t* x, int64_t k, int64_t m0, const uint16_t* packed, int64_t panel, const Output& out,
          const char* ahead, int64_t lines) {
  const int64_t pairs = k / 2, stride = pairs * 32;  // a panel's elements
  const uint16_t* b = packed + panel * stride;
  const int64_t every = (lines + pairs - 1) / pairs;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0, fetched = 0; p < pairs; ++p) {
    for (int64_t i = 0; i < every && fetched < lines; ++i, ++fetched) _mm_prefetch(ahead + fetched * kLine, _MM_HINT_T0);
    __m512bh w[C];
    for (int c = 0; c < C; ++c) w[c] = (__m512bh)_mm512_loadu_si512(b + c * stride + p * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (m0 + r) * k + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out.store(m0 + r, (panel + c) * 16, acc[r][c]);
}

// The same tile over fp32 x with FMAs: per pair, the even halves' products for every row, then the
// odd halves', so that only C weight registers are live beside the R·C accumulators.
template <int R, int C>
void tile_fma(const float* x, int64_t k, int64_t m0, const uint16_t* packed, int64_t panel, const Output& out,
              const char* ahead, int64_t lines) {
  const int64_t pairs = k / 2, stride = pairs * 32;
  const uint16_t* b = packed + panel * stride;
  const int64_t every = (lines + pairs - 1) / pairs;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0, fetched = 0; p < pairs; ++p) {
    for (int64_t i = 0; i < every && fetched < lines; ++i, ++fetched) _mm_prefetch(ahead + fetched * kLine, _MM_HINT_T0);
    __m512 w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(b + c * stride + p * 32), 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[(m0 + r) * k + 2 * p]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, w[c], acc[r][c]);
    }
    for (int c = 0; c < C; ++c)
      w[c] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(b + c * stride + p * 32), high));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[(m0 + r) * k + 2 * p + 1]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out.store(m0 + r, (panel + c) * 16, acc[r][c]);
}

template <typename T>
using TileFn = void (*)(const T*, int64_t, int64_t, const uint16_t*, int64_t, const Output&, const char*, int64_t);

template <typename T>
using TileTable = std::array<std::array<TileFn<T>, kRows>, kPanels>;

template <int C, int... R>
constexpr std::array<TileFn<uint16_t>, sizeof...(R)> tiles_of(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, C>...};
}

template <int C, int... R>
constexpr std::array<TileFn<float>, sizeof...(R)> fma_tiles_of(std::integer_sequence<int, R...>) {
  return {&tile_fma<R + 1, C>...};
}

// kTiles[c - 1][r - 1]: the tile of r rows and c panels.
const TileTable<uint16_t> kTiles = {
    tiles_of<1>(std::make_integer_sequence<int, kRows>{}), tiles_of<2>(std::make_integer_sequence<int, kRows>{}),
    tiles_of<3>(std::make_integer_sequence<int, kRows>{})};
const TileTable<float> kFmaTiles = {fma_tiles_of<1>(std::make_integer_sequence<int, kRows>{}),
                                    fma_tiles_of<2>(std::make_integer_sequence<int, kRows>{}),
                                    fma_tiles_of<3>(std::make_integer_sequence<int, kRows>{})};

// Row blocks whose x stays in L2 while every column group passes over it (schedule_tiles). Without
// them a 2,048-row prompt's x (4.7 MB in fp32 at K = 576) is read from L3 once per group; with them
// the FMA GEMM at 2,048 rows measured 118-161 against 115-147 GFLOP/s (Intel Xeon, one thread, noisy).
// `block_x(first_row, rows)` gives the block's rows of x in the tiles' type: the bf16 rows themselves,
// or for the FMA tiles the rows widened to fp32 in a buffer that stays in L2. Widening the whole of x
// up front instead wrote and read back 4-13 MB per product, 5% of a 2,048-token step.
template <typename T, typename BlockX>
void run_tiles(const TileTable<T>& tiles, int64_t m, int64_t k, const uint16_t* ws, int64_t panels, Output out,
               BlockX block_x) {
  const int64_t block_rows = std::max<int64_t>(kRows, kBlockBytes / (k * int64_t{sizeof(T)}) / kRows * kRows);
  const T* xs = nullptr;
  schedule_tiles(
      m, block_rows, kRows, panels, kPanels, k * 16 * static_cast<int64_t>(sizeof(uint16_t)),
      reinterpret_cast<const char*>(ws),
      [&](int64_t first_row, int64_t rows) {
        xs = block_x(first_row, rows);
        out.first_row = first_row;
      },
      [&](int64_t m0, int64_t rows, int64_t first, int64_t count, const char* ahead, int64_t lines) {
        tiles[count - 1][rows - 1](xs, k, m0, ws, first, out, ahead, lines);
      });
}

// rows of bf16 x [rows, k] (k even) as fp32 into `to`: each value's bits shifted into the high half.
void widen_rows(const uint16_t* x, int64_t rows, int64_t k, float* to) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * k, last = end * k; i < last; i += 16) {
      const __mmask16 mask = last - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (last - i)) - 1);
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + i));
      _mm512_mask_storeu_ps(to + i, mask, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
  });
}

// The checks both ops make; returns y (empty rows unfilled) and the Output that writes it.
std::pair<at::Tensor, Output> prepare(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                      const std::optional<at::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 2 == 0 && k > 0, "K must be even and positive, got ", k);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(1) == k / 2 && packed.size(2) == 16 && packed.size(3) == 2,
              "packed must be contiguous bf16 [P, ", k / 2, ", 16, 2]");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(n > 16 * (panels - 1) && n <= 16 * panels, "n=", n, " does not match ", panels, " panels of 16");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be contiguous fp32 [", n, "]");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  return {y, Output{y.data_ptr(), fp32_out, n, bias_data}};
}

const uint16_t* weights(const at::Tensor& packed) {
  return reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
}

}  // namespace

namespace TANDEM_OPS {

// x bf16 [M, K] (K even, rows contiguous) times the packed weight bf16 [P, K/2, 16, 2] of n ≤ 16·P
// columns, plus fp32 bias [n] if given: [M, n] in fp32 if fp32_out, else bf16.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                     bool fp32_out) {
  auto [y, out] = prepare(x, packed, n, bias, fp32_out);
  const int64_t k = x.size(1);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  run_tiles(kTiles, x.size(0), k, weights(packed), packed.size(0), out,
            [&](int64_t first_row, int64_t) { return xs + first_row * k; });
  return y;
}

// The same product through fp32 FMAs (the arguments and result as bf16_gemm's).
at::Tensor bf16_gemm_fma(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias, bool fp32_out) {
  auto [y, out] = prepare(x, packed, n, bias, fp32_out);
  const int64_t k = x.size(1);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> wide;
  run_tiles(kFmaTiles, x.size(0), k, weights(packed), packed.size(0), out, [&](int64_t first_row, int64_t rows) {
    wide.resize(rows * k);
    widen_rows(xs + first_row * k, rows, k, wide.data());
    return static_cast<const float*>(wide.data());
  });
  return y;
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("bf16_gemm(Tensor x, Tensor packed, int n, Tensor? bias, bool fp32_out) -> Tensor", &TANDEM_OPS::bf16_gemm);
  m.def("bf16_gemm_fma(Tensor x, Tensor packed, int n, Tensor? bias, bool fp32_out) -> Tensor",
        &TANDEM_OPS::bf16_gemm_fma);
}

#endif  // __AVX512BF16__
