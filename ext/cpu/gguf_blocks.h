// The GGUF block types aiolm's block matmuls read, and the checks of their regrouped
// arrays (laid out by aiolm/quant/gguf_blocks.py; see the top of gguf_linear.h),
// shared by aiolm::gguf_linear, aiolm::gguf_int8_linear and aiolm::gguf_moe.
//
// The k-quants arrive already unpacked into the 32-weight layouts at load time:
//   Q4_K: Q4_1 blocks (a 256-weight super-block's 8 sub-blocks), with float32 scales
//         and mins: d * sc_j and -dmin * m_j are exact in float32 but not in float16.
//   Q6_K: Q8_0 blocks of the signed codes q - 32 (in [-32, 31]), with two float32 scales
//         per block, d * sc_k for weights 0-15 and for 16-31 (exact in float32), stored
//         side by side: row i's block b has scales [(b * 8 + i) * 2 + h].
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace aiolm_gguf {

constexpr int64_t QK = 32;  // weights per block
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  // ggml's type ids

// What a type's regrouped blocks are, in the terms of the three 32-weight layouts.
constexpr bool has_min(int64_t t) { return t == Q4_1 || t == Q4_K; }      // w = d * u + m
constexpr bool int8_codes(int64_t t) { return t == Q8_0 || t == Q6_K; }   // 32 signed bytes
constexpr bool float_scales(int64_t t) { return t == Q4_K || t == Q6_K; }
constexpr int64_t scales_per_block(int64_t t) { return t == Q6_K ? 2 : 1; }  // Q6_K: one per 16
// The element type of a type's scale (and min) arrays: float16 bits or float32.
template <int64_t T>
using Scale = std::conditional_t<float_scales(T), float, uint16_t>;

// A block's scale or min as the file stores it (float16 bits), as float32: exact.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline float to_float(uint16_t h) { return half_to_float(h); }
inline float to_float(float f) { return f; }

#if defined(__F16C__)
// The scales (or mins) of one block's 8 rows of a group, as 8 float32 lanes.
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif

// Calls f(std::integral_constant<int64_t, T>{}) for qtype (checked by check_type), so
// that each kernel instantiates its templates for every type from one switch.
template <typename F>
inline void with_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); break;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); break;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); break;
    default: f(std::integral_constant<int64_t, Q8_0>{}); break;
  }
}

// Bytes of quants per block (the scale and min are kept apart).
constexpr int64_t quant_bytes(int64_t qtype) { return int8_codes(qtype) ? 32 : 16; }

// The AVX2 group tiles ask for a group's codes this many blocks ahead of their use: with the
// hardware prefetcher alone, a one-row decode step read its blocks well under the read
// bandwidth on an AVX2-only CPU (the A/B and the distances tried: docs/benchmarks.md, issue
// 43, point 2, and docs/benchmarks/log.md). Past the group's last block come the next
// group's, the thread's next work. (The AVX-512 float tile does not ask: untimed there;
// pair_vnni asks on its own.)
constexpr int64_t PREFETCH_AHEAD = 32;

// Asks for block b + PREFETCH_AHEAD of the group whose block-b codes (all 8 rows') start
// at qg + b * step, step = 8 * quant_bytes: one request per cache line.
inline void prefetch_ahead(const uint8_t* qg, int64_t b, int64_t step) {
  const uint8_t* p = qg + (b + PREFETCH_AHEAD) * step;
  for (int64_t l = 0; l < step; l += 64) __builtin_prefetch(p + l, 0, 2);
}

inline void check_type(const char* op, int64_t qtype) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == Q4_K || qtype == Q6_K, op,
              ": unsupported GGUF type id ", qtype, " (Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)");
}

// Checks x [.., K] and a weight's arrays for N output rows; returns its blocks per row.
inline int64_t check_blocks(const char* op, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                            const at::Tensor& mins, int64_t qtype, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32");
  check_type(op, qtype);
  const int64_t qb = quant_bytes(qtype);
  TORCH_CHECK((qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar) && qs.dim() == 2 &&
                  qs.is_contiguous(),
              op, ": qs must be a contiguous 8-bit [N/8, nblocks * 8 * bytes] tensor");
  const int64_t groups = qs.size(0), group_bytes = qs.size(1);
  TORCH_CHECK(N > (groups - 1) * 8 && N <= groups * 8, op, ": ", N, " output rows do not fill ", groups,
              " groups of 8");
  TORCH_CHECK(group_bytes % (8 * qb) == 0, op, ": a group of ", group_bytes, " bytes is not whole blocks");
  const int64_t nblocks = group_bytes / (8 * qb);
  const auto st = float_scales(qtype) ? at::kFloat : at::kHalf;
  const char* sname = float_scales(qtype) ? "float32" : "float16";
  const int64_t spb = scales_per_block(qtype);
  TORCH_CHECK(scale.scalar_type() == st && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == groups &&
                  scale.size(1) == nblocks * 8 * spb,
              op, ": scale must be ", sname, " [N/8, nblocks * 8", spb == 2 ? " * 2]" : "]", " for type ", qtype);
  if (has_min(qtype))
    TORCH_CHECK(mins.scalar_type() == st && mins.is_contiguous() && mins.sizes() == scale.sizes(), op,
                qtype == Q4_1 ? ": Q4_1" : ": Q4_K", " needs ", sname, " mins [N/8, nblocks * 8]");
  TORCH_CHECK(x.size(-1) == nblocks * QK, op, ": x has ", x.size(-1), " features, W has ", nblocks * QK);
  return nblocks;
}

}  // namespace aiolm_gguf
