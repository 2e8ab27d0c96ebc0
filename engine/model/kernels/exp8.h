// exp of eight floats at a time for the AVX2 build: Cody-Waite range reduction and a degree-5
// polynomial (Cephes' expf), a few ulp from expf over [-87.3, 88.3], the range it clamps to so that
// 2^n stays a normal float (beyond it softmax and silu are the same to float precision).
// The scalar build has no such function: its callers use std::exp. exp16 is the same arithmetic on
// sixteen lanes for the AVX-512 builds: lane for lane the same results as exp8.
#pragma once

#include "qmatmul_core.h"

namespace tandem_qmm {

#if TANDEM_SIMD
// The vector operations exp_lanes needs, on eight lanes (AVX2) or sixteen (AVX-512).
struct Lanes8 {
  using V = __m256;
  using I = __m256i;
  static V set(float f) { return _mm256_set1_ps(f); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for integral n in float range, built in the exponent field.
  static V pow2(V n) {
    const I e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
  }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  using I = __m512i;
  static V set(float f) { return _mm512_set1_ps(f); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    const I e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
  }
};
#endif

template <typename L>
inline typename L::V exp_lanes(typename L::V x) {
  x = L::min(L::max(x, L::set(-87.3f)), L::set(88.3f));
  const typename L::V n = L::round(L::mul(x, L::set(1.44269504088896341f)));
  // x − n·ln 2, with ln 2 split in two so the first product is exact.
  x = L::fnmadd(n, L::set(0.693359375f), x);
  x = L::fnmadd(n, L::set(-2.12194440e-4f), x);
  typename L::V p = L::set(1.9875691500e-4f);
  p = L::fmadd(p, x, L::set(1.3981999507e-3f));
  p = L::fmadd(p, x, L::set(8.3334519073e-3f));
  p = L::fmadd(p, x, L::set(4.1665795894e-2f));
  p = L::fmadd(p, x, L::set(1.6666665459e-1f));
  p = L::fmadd(p, x, L::set(5.0000001201e-1f));
  p = L::add(L::fmadd(p, L::mul(x, x), x), L::set(1.f));
  return L::mul(p, L::pow2(n));
}

inline __m256 exp8(__m256 x) { return exp_lanes<Lanes8>(x); }
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) { return exp_lanes<Lanes16>(x); }
#endif
#endif

}  // namespace tandem_qmm
