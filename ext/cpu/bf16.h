// bfloat16 as its bits (uint16_t, float32's upper half), to and from float32, for the
// kernels that read or write bfloat16 activations (fused_ops.cpp, fused_moe.cpp,
// encoder_attention.cpp). widen(float) is the identity, so a kernel templated on its
// input's element type reads float32 and bfloat16 alike.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace aiolm_bf16 {

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 cast does; NaN stays NaN.
inline uint16_t narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
// widen and narrow on 16 lanes: the same bits as the scalar forms (narrow's rounding exactly,
// subnormals kept, where vcvtneps2bf16 would flush them).
inline __m512 widen16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void narrow16(__m512 f, uint16_t* dst) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}
#endif

}  // namespace aiolm_bf16
