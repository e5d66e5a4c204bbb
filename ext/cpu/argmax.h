// The index of a float32 row's largest value as torch.argmax gives it (the first of equal
// maxima; the first NaN if there is one): argmax.cpp's op, and the greedy token of
// decode_layer.cpp's whole-step call.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace aiolm_argmax {

inline int64_t argmax_row(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  nan = unordered != 0;
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == m) return j;
  return 0;  // every value is -inf
}

}  // namespace aiolm_argmax
