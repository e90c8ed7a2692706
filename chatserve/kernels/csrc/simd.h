// Small AVX-512 helpers shared by the CPU kernels (header-only, all inline).
#pragma once
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace chatserve_simd {

__attribute__((always_inline)) inline __m512 load16_bf16_as_fp32(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x for the x <= 0 of a max-subtracted softmax: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2,
// 2^f from a degree-6 Taylor series of e^(f ln 2) (relative error ~1e-7).
__attribute__((always_inline)) inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 z = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Sum each of 16 vectors: out[i] = sum of v[i]'s 16 lanes (a transpose-and-add tree: ~2 ops per
// output instead of ~8 for one _mm512_reduce_add_ps each).
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  __m512 s[8];
  _Pragma("GCC unroll 16") for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 u[4];
  _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(3, 1, 3, 1)));
}


// 16 floats -> 16 bf16 (round to nearest even), stored unaligned.
__attribute__((always_inline)) inline void store16_fp32_as_bf16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

}  // namespace chatserve_simd
