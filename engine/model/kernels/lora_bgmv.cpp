// LoRA's two thin products for a step's rows grouped by adapter slot, in the spirit of Punica's BGMV:
// for each row t of slot s, y[t, columns] += (x[t] · A_s) · B_s, for every PEFT module of one of the
// model's products (qkv's q, k and v in one call). Each slot's A and B are read once for all its
// rows (a register tile of rows at a time), and only a row's own slot is multiplied: torch's masked
// form multiplies every row by every slot the step spans, and its grouped form pays a gather and a
// scatter per slot and module, which on a CPU cost more than the arithmetic (docs/benchmarks.md, lora).
//
// Layouts (engine/lora/slots.py): A [in, slots, width] (row i of slot s: `width` values, contiguous),
// B [slots, width, out]; `width` (the slots' max rank rounded up to 8) rank values past an adapter's
// rank are zero. The shrink vectorises over rank (eight lanes at a time, x broadcast), the expand over
// output columns (h broadcast), both accumulating in fp32: the low-rank vector h stays fp32 between
// them, and a bf16 y is rounded once, after its sum. The vectors are GCC's generic ones, which each
// build compiles to its own instructions (AVX-512's extra registers let it take larger tiles).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

typedef float f8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

// Rows per register tile, each row with two vectors of 8 accumulators: 16 of AVX-512's 32 registers,
// 8 of AVX2's 16, leaving room for the weights' vectors and the broadcast value.
#if defined(__AVX512F__)
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 4;
#endif
constexpr int kExpandVecs = 2;      // output vectors of 8 per tile row
constexpr int64_t kOutBlock = 128;  // output columns per expand task: their B rows stay in L1 across row tiles

// a · b + c, fused where the build has FMA (the kernels build with -ffp-contract=off, so that the
// compiler fuses nothing on its own).
inline f8 fma8(f8 a, f8 b, f8 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Exact: a bf16 is an fp32's upper half.
inline f8 load8(const c10::BFloat16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return (f8)(__builtin_convertvector(h, u32x8) << 16);
}

inline void add_store8(float* p, f8 v) {
  const f8 sum = load8(p) + v;
  std::memcpy(p, &sum, sizeof sum);
}

// fl16(y + v): rounded to nearest even as c10::BFloat16 rounds, NaN to the quiet 0x7FC0.
inline void add_store8(c10::BFloat16* p, f8 v) {
  const f8 sum = load8(p) + v;
  const u32x8 bits = (u32x8)sum;
  u32x8 rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  rounded = sum != sum ? u32x8{} + 0x7FC0 : rounded;
  const u16x8 h = __builtin_convertvector(rounded, u16x8);
  std::memcpy(p, &h, sizeof h);
}

template <typename T>
struct Module {
  const T* a;
  const T* b;
  int64_t in, out, column;
};

// One slot's run of rows in `order` (positions [begin, end)).
struct Segment {
  int64_t slot, begin, end;
};

// Calls f(std::integral_constant<int, n>) for 1 <= n <= N: a tile's row count as a compile-time
// constant, so that its accumulators stay in registers.
template <int N, typename F>
void with_rows(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// h[j, c × 8 : +V × 8] = x[rows[j]] · A_s for N rows: each of A's rows (V vectors of rank values) is
// loaded once and multiplied by every row's broadcast value (x's rows already widened into `xs`).
template <int N, int V, typename T>
void shrink_tile(const float* xs, int64_t in, const T* a, int64_t a_stride, float* h, int64_t h_stride) {
  f8 acc[N][V] = {};
  for (int64_t i = 0; i < in; ++i) {
    f8 av[V];
    for (int v = 0; v < V; ++v) av[v] = load8(a + i * a_stride + v * 8);
    for (int j = 0; j < N; ++j) {
      const float xv = xs[j * in + i];
      for (int v = 0; v < V; ++v) acc[j][v] = fma8(f8{} + xv, av[v], acc[j][v]);
    }
  }
  for (int j = 0; j < N; ++j) std::memcpy(h + j * h_stride, acc[j], sizeof acc[j]);
}

// For N rows of one slot (x's rows widened once into `xs`, shared by every module of the product),
// each module's h = x · A_s.
template <typename T>
void shrink(const T* x, int64_t x_stride, const int64_t* rows, int n, const std::vector<Module<T>>& modules,
            int64_t slot, int64_t width, int64_t slots, int64_t rank, float* h, int64_t h_module) {
  const int64_t in = modules[0].in;
  thread_local std::vector<float> xs;
  xs.resize(n * in);
  for (int j = 0; j < n; ++j)
    for (int64_t i = 0; i < in; ++i) xs[j * in + i] = static_cast<float>(x[rows[j] * x_stride + i]);
  const int64_t stride = slots * width;
  // Rank values past the adapter's rank, up to the next multiple of 8, are zero in the slot.
  const int64_t padded = (rank + 7) / 8 * 8;
  with_rows<kTileRows>(n, [&](auto rows_n) {
    for (size_t k = 0; k < modules.size(); ++k) {
      const T* a = modules[k].a + slot * width;
      float* hk = h + k * h_module;
      int64_t c = 0;
      for (; c + 16 <= padded; c += 16) shrink_tile<rows_n, 2>(xs.data(), in, a + c, stride, hk + c, width);
      if (c < padded) shrink_tile<rows_n, 1>(xs.data(), in, a + c, stride, hk + c, width);
    }
  });
}

// y[rows[j], column + o : +V×8] += Σ_r h[j, r] · B_s[r, o : +V×8] for N rows.
template <int N, int V, typename T, typename Y>
void expand_tile(const float* h, int64_t h_stride, int64_t rank, const T* b, int64_t out, int64_t o, Y* const* ys) {
  f8 acc[N][V] = {};
  for (int64_t r = 0; r < rank; ++r) {
    f8 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load8(b + r * out + o + v * 8);
    for (int j = 0; j < N; ++j) {
      const float hv = h[j * h_stride + r];
      for (int v = 0; v < V; ++v) acc[j][v] = fma8(f8{} + hv, bv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < N; ++j)
    for (int v = 0; v < V; ++v) add_store8(ys[j] + o + v * 8, acc[j][v]);
}

template <int N, typename T, typename Y>
void expand_rows(const float* h, int64_t h_stride, int64_t rank, const T* b, int64_t out, int64_t first,
                 int64_t last, Y* const* ys) {
  int64_t o = first;
  for (; o + kExpandVecs * 8 <= last; o += kExpandVecs * 8) expand_tile<N, kExpandVecs>(h, h_stride, rank, b, out, o, ys);
  for (; o + 8 <= last; o += 8) expand_tile<N, 1>(h, h_stride, rank, b, out, o, ys);
  for (; o < last; ++o)  // a width not a multiple of 8 (an uneven tensor-parallel split)
    for (int j = 0; j < N; ++j) {
      float sum = 0.f;
      for (int64_t r = 0; r < rank; ++r) sum += h[j * h_stride + r] * static_cast<float>(b[r * out + o]);
      ys[j][o] = static_cast<Y>(static_cast<float>(ys[j][o]) + sum);
    }
}

template <typename T, typename Y>
void expand(const float* h, int64_t width, int64_t rank, const Module<T>& m, int64_t slot, int64_t first,
            int64_t last, Y* const* ys, int n) {
  with_rows<kTileRows>(n, [&](auto rows_n) {
    expand_rows<rows_n>(h, width, rank, m.b + slot * width * m.out, m.out, first, last, ys);
  });
}

template <typename T, typename Y>
void lora_add(at::Tensor& y, const at::Tensor& x, at::TensorList a, at::TensorList b, at::IntArrayRef columns,
              const at::Tensor& order, const at::Tensor& segments, at::IntArrayRef ranks) {
  const int64_t slots = a[0].size(1), width = a[0].size(2), count = order.size(0);
  std::vector<Module<T>> modules;
  for (size_t k = 0; k < a.size(); ++k)
    modules.push_back({a[k].data_ptr<T>(), b[k].data_ptr<T>(), a[k].size(0), b[k].size(2), columns[k]});
  // Indices are checked once here, so that a wrong batch is an error, never a write out of bounds.
  const int64_t* rows = order.data_ptr<int64_t>();
  for (int64_t p = 0; p < count; ++p)
    TORCH_CHECK(rows[p] >= 0 && rows[p] < x.size(0), "order[", p, "] = ", rows[p], " is not a row of x");
  std::vector<Segment> runs;
  for (int64_t g = 0; g < segments.size(0); ++g) {
    const int64_t* s = segments.data_ptr<int64_t>() + g * 3;
    TORCH_CHECK(s[0] >= 0 && s[0] < slots && 0 <= s[1] && s[1] <= s[2] && s[2] <= count, "segment ", g,
                " (slot ", s[0], ", ", s[1], " to ", s[2], ") is outside the slots or the order");
    if (ranks[s[0]] > 0) runs.push_back({s[0], s[1], s[2]});
  }
  // The low-rank vectors, fp32 [module, position in order, width].
  std::vector<float> h(modules.size() * count * width);
  // Shrink tasks: (segment, tile of rows), every module of the product over the tile's x.
  std::vector<std::array<int64_t, 2>> tiles;
  for (size_t g = 0; g < runs.size(); ++g)
    for (int64_t p = runs[g].begin; p < runs[g].end; p += kTileRows) tiles.push_back({int64_t(g), p});
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [g, p] = tiles[t];
      const Segment& run = runs[g];
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, run.end - p));
      shrink(xp, x.stride(0), rows + p, n, modules, run.slot, width, slots, ranks[run.slot], h.data() + p * width,
             count * width);
    }
  });
  // Expand tasks: (module, segment, block of output columns), each over all the segment's rows.
  std::vector<std::array<int64_t, 3>> tasks;
  for (size_t k = 0; k < modules.size(); ++k)
    for (size_t g = 0; g < runs.size(); ++g)
      for (int64_t o = 0; o < modules[k].out; o += kOutBlock) tasks.push_back({int64_t(k), int64_t(g), o});
  Y* yp = y.data_ptr<Y>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [k, g, o] = tasks[t];
      const Segment& run = runs[g];
      const Module<T>& m = modules[k];
      const int64_t last = std::min(o + kOutBlock, m.out);
      for (int64_t p = run.begin; p < run.end; p += kTileRows) {
        const int n = static_cast<int>(std::min<int64_t>(kTileRows, run.end - p));
        Y* ys[kTileRows];
        for (int j = 0; j < n; ++j) ys[j] = yp + rows[p + j] * y.stride(0) + m.column;
        expand(h.data() + (k * count + p) * width, width, ranks[run.slot], m, run.slot, o, last, ys, n);
      }
    }
  });
}

}  // namespace

namespace TANDEM_OPS {

// y fp32 or bf16 [T, columns] (rows contiguous) += each module's LoRA term for the rows in `order`
// (int64, grouped by slot) of each `segments` row (int64 [G, 3]: slot, begin, end into order); x [T, in]
// and every module's A [in, slots, width] and B [slots, width, out] (contiguous) of one dtype, fp32 or
// bf16; `columns`: each module's first column of y; `ranks`: each slot's rank (0: empty, skipped).
void lora_add_(at::Tensor y, const at::Tensor& x, at::TensorList a, at::TensorList b, at::IntArrayRef columns,
               const at::Tensor& order, const at::Tensor& segments, at::IntArrayRef ranks) {
  TORCH_CHECK(!a.empty() && a.size() == b.size() && a.size() == columns.size(), "one A, B and column per module");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && x.dim() == 2 && x.stride(1) == 1 && x.size(0) == y.size(0),
              "x and y must be [T, n] with contiguous rows");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16, "y must be float32 or bfloat16");
  TORCH_CHECK(order.scalar_type() == at::kLong && segments.scalar_type() == at::kLong && segments.dim() == 2 &&
                  segments.size(1) == 3 && order.is_contiguous() && segments.is_contiguous(),
              "order must be int64 [n] and segments int64 [G, 3]");
  const int64_t slots = a[0].size(1), width = a[0].size(2);
  TORCH_CHECK(width % 8 == 0 && static_cast<int64_t>(ranks.size()) == slots, "width a multiple of 8, a rank per slot");
  for (size_t k = 0; k < a.size(); ++k) {
    TORCH_CHECK(a[k].scalar_type() == x.scalar_type() && b[k].scalar_type() == x.scalar_type() &&
                    a[k].is_contiguous() && b[k].is_contiguous() && a[k].dim() == 3 && b[k].dim() == 3 &&
                    a[k].size(1) == slots && a[k].size(2) == width && b[k].size(0) == slots &&
                    b[k].size(1) == width && a[k].size(0) == x.size(1) && columns[k] >= 0 &&
                    columns[k] + b[k].size(2) <= y.size(1),
                "module ", k, ": A [in, slots, width] and B [slots, width, out] in x's dtype, within x and y");
  }
  for (int64_t rank : ranks) TORCH_CHECK(rank >= 0 && rank <= width, "a slot's rank is between 0 and the width");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
  if (y.scalar_type() == at::kFloat) {
    bf16 ? lora_add<c10::BFloat16, float>(y, x, a, b, columns, order, segments, ranks)
         : lora_add<float, float>(y, x, a, b, columns, order, segments, ranks);
  } else {
    bf16 ? lora_add<c10::BFloat16, c10::BFloat16>(y, x, a, b, columns, order, segments, ranks)
         : lora_add<float, c10::BFloat16>(y, x, a, b, columns, order, segments, ranks);
  }
}

}  // namespace TANDEM_OPS

#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, int[] columns, Tensor order, Tensor segments, "
        "int[] ranks) -> ()",
        &TANDEM_OPS::lora_add_);
}
