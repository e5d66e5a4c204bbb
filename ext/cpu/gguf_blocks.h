// The GGUF block types aiolm's block matmuls read, and the checks of their regrouped
// arrays (laid out by aiolm/quant/gguf_blocks.py; see the top of gguf_linear.h),
// shared by aiolm::gguf_linear, aiolm::gguf_int8_linear and aiolm::gguf_moe.
//
// The k-quants arrive already unpacked into the 32-weight layouts at load time:
//   Q4_K: Q4_1 blocks (a 256-weight super-block's 8 sub-blocks) whose scales and mins keep
//         the file's codes: per group of 8 rows, a byte per block and row (sc_j, or m_j for
//         the mins) in the order of the float16 scales' [b * 8 + i], then a float32 factor
//         per super-block and row [(b / 8) * 8 + i] (d, or -dmin). A scale is factor * code
//         (scale_at, scales8): an f16 times a 6-bit integer, exact in float32 (not in
//         float16), so the kernels multiply by the values gguf dequantizes with. A block of 32
//         is 19 bytes, against 24 with the products stored as float32.
//   Q4_1F: not a ggml type: Q4_1 blocks with float32 scales and mins, which a checkpoint's
//         4-bit codes and scales keep exact (GGUFWeight.from_codes).
//   Q6_K: Q8_0 blocks of the signed codes q - 32 (in [-32, 31]), with two float32 scales
//         per block, d * sc_k for weights 0-15 and for 16-31 (exact in float32), stored
//         side by side: row i's block b has scales [(b * 8 + i) * 2 + h].
//
// Q5_0 (w = d * (u - 16), u = a 4-bit code plus a fifth bit) keeps the file's 5.5 bits a weight:
// a group's block b is 160 bytes, the 8 rows' 16 bytes of nibbles as Q4_0's (weight j low,
// j + 16 high), then 16 words of fifth bits: word i (i < 8) row i's bits of weights 0-15 (bit j:
// weight j), word 8 + i its bits of weights 16-31. So 4 rows' bits of one half are one 64-bit
// mask (the VNNI kernels' 4 rows a vector), and row i's are words i and 8 + i (high_bits).
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
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, Q4_1F = 112 };  // ggml's ids, and Q4_1F

// What a type's regrouped blocks are, in the terms of the three 32-weight layouts.
constexpr bool has_min(int64_t t) { return t == Q4_1 || t == Q4_K || t == Q4_1F; }  // w = d * u + m
constexpr bool int8_codes(int64_t t) { return t == Q8_0 || t == Q6_K; }             // 32 signed bytes
constexpr bool float_scales(int64_t t) { return t == Q4_1F || t == Q6_K; }
constexpr bool coded_scales(int64_t t) { return t == Q4_K; }  // the file's codes and factors
constexpr int64_t scales_per_block(int64_t t) { return t == Q6_K ? 2 : 1; }  // Q6_K: one per 16
// The element type of a type's scale (and min) arrays: float16 bits, float32 or codes.
template <int64_t T>
using Scale = std::conditional_t<float_scales(T), float, std::conditional_t<coded_scales(T), uint8_t, uint16_t>>;
// Elements of a scale (or min) array per group of 8 rows: Q4_K's 8 codes a block and 8 float32
// factors (32 bytes) a super-block of 8 blocks.
constexpr int64_t group_scales(int64_t qtype, int64_t nblocks) {
  return coded_scales(qtype) ? nblocks * 12 : nblocks * 8 * scales_per_block(qtype);
}

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

// Row i's scale (or min) of block b (h: its half, Q6_K's), from its group's array sg.
template <int64_t T>
inline float scale_at(const Scale<T>* sg, int64_t nblocks, int64_t b, int64_t i, int64_t h = 0) {
  if constexpr (coded_scales(T)) {
    const float* f = reinterpret_cast<const float*>(sg + nblocks * 8);  // the factors follow the codes
    return f[(b / 8) * 8 + i] * static_cast<float>(sg[b * 8 + i]);
  } else {
    return to_float(sg[(b * 8 + i) * scales_per_block(T) + h]);
  }
}

#if defined(__F16C__)
// The scales (or mins) of one block's 8 rows of a group, as 8 float32 lanes.
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif

#if defined(__F16C__) && defined(__AVX2__)
// Block b's scales (or mins) of a group's 8 rows as 8 float32 lanes, from the group's array sg
// (one scale a block: not Q6_K). Q4_K's codes times their factors: two operations more than
// a load, for a fifth fewer bytes a block.
template <int64_t T>
inline __m256 scales8(const Scale<T>* sg, int64_t nblocks, int64_t b) {
  if constexpr (coded_scales(T)) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg + b * 8));
    const float* f = reinterpret_cast<const float*>(sg + nblocks * 8);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)), _mm256_loadu_ps(f + (b / 8) * 8));
  } else {
    return load8(sg + b * 8);
  }
}
#endif

#if defined(__F16C__) && defined(__AVX2__)
// Q5_0: a row's 32 fifth bits (bit j: weight j) as 32 bytes in x's order, 16 where the bit is
// set: each byte takes its bit's byte by a shuffle, then its own bit, compared.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}
#endif

// Calls f(std::integral_constant<int64_t, T>{}) for qtype (checked by check_type), so
// that each kernel instantiates its templates for every type from one switch.
template <typename F>
inline void with_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); break;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); break;
    case Q5_0: f(std::integral_constant<int64_t, Q5_0>{}); break;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q4_1F: f(std::integral_constant<int64_t, Q4_1F>{}); break;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); break;
    default: f(std::integral_constant<int64_t, Q8_0>{}); break;
  }
}

// Bytes of quants per block (the scale and min are kept apart).
constexpr int64_t quant_bytes(int64_t qtype) { return int8_codes(qtype) ? 32 : qtype == Q5_0 ? 20 : 16; }
// Bytes of one row's codes in a block: Q5_0's nibbles, without the fifth bits that follow the 8 rows'.
constexpr int64_t row_bytes(int64_t qtype) { return int8_codes(qtype) ? 32 : 16; }

// Row i's codes of block b in its group's array qg (all 8 rows' block b lie side by side).
template <int64_t T>
inline const uint8_t* block_row(const uint8_t* qg, int64_t b, int64_t i) {
  return qg + b * 8 * quant_bytes(T) + i * row_bytes(T);
}

// Q5_0: the 16 words of fifth bits of block b of a group (see the top of this file).
inline const uint16_t* high_bits(const uint8_t* qg, int64_t b) {
  return reinterpret_cast<const uint16_t*>(qg + b * 8 * quant_bytes(Q5_0) + 8 * row_bytes(Q5_0));
}

// Q5_0: row i's 32 fifth bits of block b, bit j for weight j.
inline uint32_t row_high_bits(const uint8_t* qg, int64_t b, int64_t i) {
  const uint16_t* h = high_bits(qg, b);
  return static_cast<uint32_t>(h[i]) | static_cast<uint32_t>(h[8 + i]) << 16;
}

// Q5_0: the code u (0-31) of weight j of a row's block, from its nibbles q and fifth bits h.
inline int32_t q5_0_code(const uint8_t* q, uint32_t h, int j) {
  return ((j < 16 ? q[j] : q[j - 16] >> 4) & 0xf) | static_cast<int32_t>((h >> j) & 1) << 4;
}

// The AVX2 group tiles ask for a group's codes this many blocks ahead of their use: with the
// hardware prefetcher alone, a one-row decode step read its blocks well under the read
// bandwidth on an AVX2-only CPU (the A/B and the distances tried: docs/benchmarks.md, issue
// 43, point 2, and docs/benchmarks/log.md). Past the group's last block come the next
// group's, the thread's next work. The AVX-512 float tile and the int8 group_vnni ask the
// same way (their A/Bs on AMX Xeons: docs/benchmarks.md, issue 43, point 2, and issue 35);
// pair_vnni asks on its own.
constexpr int64_t PREFETCH_AHEAD = 32;

// Asks for block b + PREFETCH_AHEAD of the group whose block-b codes (all 8 rows') start
// at qg + b * step, step = 8 * quant_bytes: one request per cache line.
inline void prefetch_ahead(const uint8_t* qg, int64_t b, int64_t step) {
  const uint8_t* p = qg + (b + PREFETCH_AHEAD) * step;
  for (int64_t l = 0; l < step; l += 64) __builtin_prefetch(p + l, 0, 2);
}

inline void check_type(const char* op, int64_t qtype) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0 || qtype == Q4_K || qtype == Q6_K ||
                  qtype == Q4_1F,
              op, ": unsupported GGUF type id ", qtype, " (Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q6_K=14, Q4_1F=112)");
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
  const auto st = float_scales(qtype) ? at::kFloat : coded_scales(qtype) ? at::kByte : at::kHalf;
  const char* sname = float_scales(qtype) ? "float32" : coded_scales(qtype) ? "uint8" : "float16";
  const char* shape = coded_scales(qtype) ? " [N/8, nblocks * 12]" : scales_per_block(qtype) == 2 ? " [N/8, nblocks * 8 * 2]"
                                                                                                  : " [N/8, nblocks * 8]";
  TORCH_CHECK(!coded_scales(qtype) || nblocks % 8 == 0, op, ": type ", qtype,
              " codes its scales a super-block of 256 weights at a time; a row of ", nblocks, " blocks of 32 is not");
  TORCH_CHECK(scale.scalar_type() == st && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == groups &&
                  scale.size(1) == group_scales(qtype, nblocks),
              op, ": scale must be ", sname, shape, " for type ", qtype);
  if (has_min(qtype))
    TORCH_CHECK(mins.scalar_type() == st && mins.is_contiguous() && mins.sizes() == scale.sizes(), op, ": ",
                qtype == Q4_1 ? "Q4_1" : qtype == Q4_K ? "Q4_K" : "Q4_1F", " needs ", sname, " mins", shape);
  TORCH_CHECK(x.size(-1) == nblocks * QK, op, ": x has ", x.size(-1), " features, W has ", nblocks * QK);
  return nblocks;
}

}  // namespace aiolm_gguf
