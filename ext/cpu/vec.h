// Small vector helpers shared by aiolm's CPU kernels.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace aiolm_vec {

// exp on 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, and p the degree-6
// Taylor polynomial (relative error ~1e-7, float32's own rounding). The softmax takes
// an exp per score; the scalar libm call cost more than the dot products.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp8's arithmetic on 16 lanes: the same operations in the same order, so the same bits.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

// Exact GELU, x * Phi(x) = x / 2 * (1 + erf(x / sqrt 2)), on 8 floats, with erf from
// Abramowitz and Stegun's 7.1.26 (|error| < 1.5e-7): for z >= 0, 1 - erf(z) = q =
// t (a1 + t (a2 + ... + t a5)) e^(-z^2) with t = 1 / (1 + p z). 1 + erf(z) is then 2 - q
// for z >= 0 and q(-z) below, never 1 plus a number near -1, so the negative tail keeps
// its relative precision.
inline __m256 gelu8(__m256 x) {
  const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));
  const __m256 az = _mm256_andnot_ps(_mm256_set1_ps(-0.f), z);
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), az, _mm256_set1_ps(1.f)));
  __m256 p = _mm256_set1_ps(1.061405429f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
  const __m256 q = _mm256_mul_ps(_mm256_mul_ps(p, t), exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), az), az)));
  const __m256 one_plus_erf = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.f), q), q, z);  // z's sign picks
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), one_plus_erf);
}

#if defined(__AVX512F__)
// gelu8's arithmetic on 16 lanes, in the same order: the same bits.
inline __m512 gelu16(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  const __m512 az = _mm512_abs_ps(z);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), az, _mm512_set1_ps(1.f)));
  __m512 p = _mm512_set1_ps(1.061405429f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  const __m512 q = _mm512_mul_ps(_mm512_mul_ps(p, t), exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), az), az)));
  const __mmask16 neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(z), _mm512_setzero_si512());  // z's sign bit
  const __m512 one_plus_erf = _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(2.f), q), q);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), one_plus_erf);
}
#endif

// gelu in place on n floats, a vector at a time; the last part vector through a padded
// copy, so every element gets the vector arithmetic's bits.
inline void gelu_inplace(float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, gelu16(_mm512_loadu_ps(y + i)));
#endif
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, gelu8(_mm256_loadu_ps(y + i)));
  if (i < n) {
    alignas(32) float buf[8] = {};
    for (int64_t j = i; j < n; ++j) buf[j - i] = y[j];
    _mm256_store_ps(buf, gelu8(_mm256_load_ps(buf)));
    for (int64_t j = i; j < n; ++j) y[j] = buf[j - i];
  }
}

#if defined(__AVX512F__)
// out[c] = column c of the 16 x 16 block whose rows are r[0..15]: 64 shuffles, no stores.
inline void transpose16(const __m512 r[16], __m512 out[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[4g + e]: lane L holds column 4L + e of rows 4g..4g+3
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int e = 0; e < 4; ++e) {  // column 4L + e: lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512 x0 = _mm512_shuffle_f32x4(u[e], u[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 x1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 x2 = _mm512_shuffle_f32x4(u[e], u[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 x3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
    out[e] = _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
    out[4 + e] = _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
    out[8 + e] = _mm512_shuffle_f32x4(x2, x3, _MM_SHUFFLE(2, 0, 2, 0));
    out[12 + e] = _mm512_shuffle_f32x4(x2, x3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
#endif

}  // namespace aiolm_vec
#endif
