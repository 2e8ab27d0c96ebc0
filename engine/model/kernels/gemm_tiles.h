// What the kernels' own GEMMs (bf16_gemm.cpp, int8_gemm.cpp) share: where a register tile writes, and
// the order the tiles run in. Built only where AVX-512 is (both GEMMs are).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace tandem_gemm {

constexpr int64_t kLine = 64;  // bytes a prefetch brings

// Where a tile writes: y's rows of `n` columns, in fp32 or bf16, bias added in fp32.
struct Output {
  void* y;
  bool fp32;
  int64_t n;
  const float* bias;
  int64_t first_row = 0;  // y's row that the tiles' row 0 is

  void store(int64_t tile_row, int64_t col, __m512 v) const {
    const int64_t row = first_row + tile_row;
    const int64_t valid = std::min<int64_t>(16, n - col);
    const __mmask16 mask = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + col));
    if (fp32) {
      _mm512_mask_storeu_ps(static_cast<float*>(y) + row * n + col, mask, v);
    } else {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);  // round to nearest even, as torch's conversion
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + row * n + col, mask, h);
    }
  }
};

// Row blocks of `block_rows` whose x stays in L2 while every column group passes over it: for each,
// `block(first_row, rows)`, then the block's column groups of up to `group` panels spread over the
// threads, and in each group the block's row tiles in turn, `tile(m0, rows, first_panel, panels,
// ahead, lines)` with m0 relative to the block; each tile prefetches its share (`lines` cache lines
// from `ahead`) of the next group's panels, `panel_bytes` each from `weights`, while it computes.
template <typename Block, typename Tile>
void schedule_tiles(int64_t m, int64_t block_rows, int64_t tile_rows, int64_t panels, int64_t group,
                    int64_t panel_bytes, const char* weights, Block block, Tile tile) {
  const int64_t groups = (panels + group - 1) / group;
  for (int64_t first_row = 0; first_row < m; first_row += block_rows) {
    const int64_t rows_here = std::min(block_rows, m - first_row), row_tiles = (rows_here + tile_rows - 1) / tile_rows;
    block(first_row, rows_here);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * group, count = std::min(group, panels - first);
        const int64_t next = first + count, next_count = std::min(group, std::max<int64_t>(0, panels - next));
        const char* ahead = weights + next * panel_bytes;
        const int64_t total = next_count * panel_bytes / kLine, share = (total + row_tiles - 1) / row_tiles;
        for (int64_t t = 0; t < row_tiles; ++t) {
          const int64_t from = std::min(total, t * share);
          tile(t * tile_rows, std::min(tile_rows, rows_here - t * tile_rows), first, count, ahead + from * kLine,
               std::min(share, total - from));
        }
      }
    });
  }
}

}  // namespace tandem_gemm

#endif
