// Which vendor made this CPU, for the few kernel choices that were measured to go opposite
// ways on AMD's and Intel's cores (each use says what was measured where).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace aiolm_cpu {

inline bool amd() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool is_amd = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid(0, a, b, c, d);
    return b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "Auth" "enti" "cAMD"
  }();
  return is_amd;
#else
  return false;
#endif
}

}  // namespace aiolm_cpu
