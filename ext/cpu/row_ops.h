// A decoder layer's row-wise steps on raw rows: the arithmetic of aiolm::rms_norm,
// add_rms_norm_, rotary_, silu_and_mul (fused_ops.cpp) and write_kv_ (paged_attention.cpp),
// which those ops run on every row, and which decode_layers' team (decode_layer.cpp) runs
// on a decode step's few rows without the ops' dispatch, checks and tensors: the same
// functions, so the same bits.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace aiolm_rows {

// out = w * in / sqrt(mean(in^2) + eps); out may be in.
inline void norm_row(const float* in, float* out, const float* w, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += in[i] * in[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (in[i] * inv);
}

// residual += x, then x = norm(residual).
inline void add_norm_row(float* x, float* residual, const float* w, int64_t n, float eps) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) residual[i] += x[i];
  norm_row(residual, x, w, n, eps);
}

// Rotate-half RoPE of one head in place: c and s are the position's cos and sin rows.
inline void rotate(float* x, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i + half] + a * s[i + half];
  }
}

// silu(g) * u over n floats, sixteen or eight at a time (exp16 and exp8 give the same
// bits), the last n % 8 by the scalar formula.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one16 = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = aiolm_vec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one16, e)), _mm512_loadu_ps(u + i)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = aiolm_vec::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// One token's K or V row into a float32 or float16 cache slot (float16 rounded to nearest
// even, as Tensor.to rounds).
template <typename KV>
inline void write_row(KV* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<KV, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    // Eight at a time, rounded to nearest even as c10::Half rounds one at a time: the same
    // bits, where the scalar conversion took 2% of a prompt step.
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; ++i) dst[i] = static_cast<KV>(src[i]);
  }
}

// A token's K and V rows (`row` values each) into slot `slot` of a cache laid out as
// [2, slots, row], K's half first. A negative slot is a padding row: nothing is written.
template <typename KV>
inline void write_slot(KV* cache, int64_t slots, int64_t row, int64_t slot, const float* k, const float* v) {
  if (slot < 0) return;
  write_row(cache + slot * row, k, row);
  write_row(cache + (slots + slot) * row, v, row);
}

}  // namespace aiolm_rows
