// bfloat16 as its bits (uint16_t, float32's upper half), to and from float32, for the
// kernels that read or write bfloat16 activations (fused_ops.cpp, fused_moe.cpp,
// encoder_attention.cpp). widen(float) is the identity, so a kernel templated on its
// input's element type reads float32 and bfloat16 alike.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace aiolm_bf16
