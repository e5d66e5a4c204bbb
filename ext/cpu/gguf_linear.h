// y = x W^T with W kept as a GGUF file's quantized blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K),
// for the small batches of decoding. A decode step with a few rows is bound by
// reading the weights; these formats are 3.5-7x smaller than float32, and the
// values they hold are exactly the ones the float32 path uses (it dequantizes
// the same blocks), so only the order of the sums differs.
//
// The blocks are regrouped at load time (aiolm/quant/gguf_blocks.py): output
// rows in groups of 8 (the last padded with zero blocks), and within a group
// block b of all 8 rows side by side, so that a tile of rows reads one stream:
//   qs:    uint8 [N/8, nblocks * 8 * 16] (4-bit: weight j in the low nibble of
//          byte j, weight j + 16 in its high nibble) or int8 [N/8, nblocks * 8 * 32] (Q8_0)
//   scale: float16 [N/8, nblocks * 8]   (d, as the file stores it)
//   min:   float16 [N/8, nblocks * 8]   (m, Q4_1 only; empty otherwise)
// (Q4_K: Q4_1 blocks whose scales and mins are the file's codes, each times its super-block's
// factor where a kernel reads it; Q4_1F: Q4_1 blocks with float32 scales and mins; Q6_K: Q8_0
// blocks with a float32 scale per 16 weights, which multiplies the converted codes into the
// exact weights; see gguf_blocks.h)
// (Q5_0: Q4_0's nibbles with a fifth bit each, kept after the group's block; gguf_blocks.h)
// so that w = d * q + m (Q4_1), d * (q - 8) (Q4_0), d * (q - 16) (Q5_0) or d * q (Q8_0), and the
// block's dot product is d * sum(q_j x_j) + m * sum(x_j): the block sums of x
// are computed once per call and the m terms of a group's 8 rows are one vector.
//
// Each block's accumulation is a loop-carried FMA; several output rows are
// processed together so that those chains run side by side.
//
// The pieces of aiolm::gguf_linear (gguf_linear.cpp) that other kernels reuse: the group
// kernels over 8 output rows and the block sums (aiolm::gguf_moe, fused_moe.cpp).
#pragma once

#include "cpu_vendor.h"
#include "gguf_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AIOLM_AVX2 1
#endif
#if defined(AIOLM_AVX2) && defined(__AVX512F__)
#define AIOLM_AVX512 1
#endif

namespace aiolm_gguf_float {

using namespace aiolm_gguf;  // QK, the type ids, what they are (has_min, Scale, ...), quant_bytes

#ifdef AIOLM_AVX2
// Q5_0: the 16 bytes of row i's block b as its signed codes u - 16, in x's order (lo: weights
// 0-15, hi: 16-31). A fifth bit adds 16 to its nibble: a masked add where AVX-512 has byte
// masks, else the bits spread to bytes (fifth_bits).
inline void q5_0_codes(const uint8_t* qg, int64_t b, int64_t i, __m128i& lo, __m128i& hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block_row<Q5_0>(qg, b, i)));
  const __m128i nib = _mm_set1_epi8(0x0f), sixteen = _mm_set1_epi8(16);
  lo = _mm_and_si128(raw, nib);
  hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
  const uint16_t* h = high_bits(qg, b);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  lo = _mm_mask_add_epi8(lo, h[i], lo, sixteen);
  hi = _mm_mask_add_epi8(hi, h[8 + i], hi, sixteen);
#else
  const __m256i f = fifth_bits(row_high_bits(qg, b, i));
  lo = _mm_or_si128(lo, _mm256_castsi256_si128(f));
  hi = _mm_or_si128(hi, _mm256_extracti128_si256(f, 1));
#endif
  lo = _mm_sub_epi8(lo, sixteen);
  hi = _mm_sub_epi8(hi, sixteen);
}
#endif

#ifdef AIOLM_AVX512
// AVX-512: a block's 32 weights are two vectors of 16 (its low nibbles are weights
// 0-15, its high nibbles 16-31), half the conversions and FMAs of the AVX2 tile. Row i's
// block b of the group qg.
template <int64_t T>
inline void unpack16(const uint8_t* qg, int64_t b, int64_t i, __m512 f[2]) {
  const uint8_t* qs = block_row<T>(qg, b, i);
  if constexpr (T == Q5_0) {
    __m128i lo, hi;
    q5_0_codes(qg, b, i, lo, hi);
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
  } else if constexpr (int8_codes(T)) {
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
  } else {
    // The 16 bytes in all four 128-bit lanes; lane 4k + w (dword w of copy k) shifted right
    // by 4k bits has nibble k of dword w in its low 4 bits, and by 4k + 16 nibble k + 4:
    // vpermps reads only those 4 bits, so it looks the code's weight value up in a table of
    // 16 floats (Q4_0's u - 8, else u). Two shifts and two lookups, where widening the bytes
    // and converting them took twice the vector-port work; kernel_x puts x in this order.
    const __m512i c = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m512i s0 = _mm512_srlv_epi32(c, _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    const __m512 table = T == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                   : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    f[0] = _mm512_permutexvar_ps(s0, table);
    f[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(s0, 16), table);
  }
}

// A whole group (qs and scale: the group's; i0 is 0) against MR rows of x. (Raw: x is never
// reordered here, so the codes always convert.) The group's first pass over x's rows reads
// its blocks from memory, so it asks for them ahead (lead), as the AVX2 tiles do.
template <int64_t T, int NR, int MR, bool Raw = false>
inline void tile(const uint8_t* qs, const Scale<T>* scale, int i0, int64_t nblocks, const float* x, int64_t K,
                 float out[NR][MR], bool lead = true) {
  (void)i0;
  constexpr int64_t QB = quant_bytes(T);
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = _mm512_setzero_ps();
  static_assert(NR == 8, "the AVX-512 tile takes a whole group: its 8 scales convert as one vector");
  for (int64_t b = 0; b < nblocks; ++b) {
    if (lead) prefetch_ahead(qs, b, 8 * QB);
    alignas(32) float d8[8];
    if constexpr (T != Q6_K) {
      _mm256_store_ps(d8, scales8<T>(scale, nblocks, b));
      // Each row's d is then a broadcast load (a load port's work): left to itself, the
      // compiler keeps the 8 scales in a register and spreads them with two shuffles a row,
      // on the port that the code lookups need.
      asm volatile("" : : "r"(d8) : "memory");
    }
    for (int i = 0; i < NR; ++i) {
      __m512 f[2];
      unpack16<T>(qs, b, i, f);
      __m512 d;
      if constexpr (T == Q6_K) {  // f[0] and f[1] are the two halves: scaled, they are the weights
        f[0] = _mm512_mul_ps(f[0], _mm512_set1_ps(scale[(b * 8 + i) * 2]));
        f[1] = _mm512_mul_ps(f[1], _mm512_set1_ps(scale[(b * 8 + i) * 2 + 1]));
      } else {
        d = _mm512_set1_ps(d8[i]);
      }
      for (int r = 0; r < MR; ++r) {
        const float* xb = x + r * K + b * QK;
        if constexpr (T == Q6_K) {  // the weights themselves: straight into the sum, two FMAs
          acc[i][r] = _mm512_fmadd_ps(f[1], _mm512_loadu_ps(xb + 16),
                                      _mm512_fmadd_ps(f[0], _mm512_loadu_ps(xb), acc[i][r]));
        } else {
          const __m512 t =
              _mm512_fmadd_ps(f[1], _mm512_loadu_ps(xb + 16), _mm512_mul_ps(f[0], _mm512_loadu_ps(xb)));
          acc[i][r] = _mm512_fmadd_ps(d, t, acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}
#elif defined(AIOLM_AVX2)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one block as four vectors of 8 floats: Q8_0's codes in x's own order;
// the 4-bit codes u (Q4_0's too: run_groups takes its - 8 d * sum(x) from the block sums)
// as u * 16^k, k = 0-3, in the order kernel_x puts x in.
//
// Why: the block's 16 bytes, loaded into both halves of a vector, are 8 32-bit lanes of 8
// codes each; ANDing the lanes with one nibble mask per half leaves a code (times a power of
// 16) alone in each lane, which vcvtdq2ps makes a float32 exactly. So the 32 codes are one
// broadcast load, one shift, four ANDs and four conversions. A one-row step is bound by this
// unpacking on an AVX2-only CPU, and this is the fastest of the three tried there (bytes
// widened to 32-bit lanes; float16 subnormals through vcvtph2ps; the A/Bs: docs/benchmarks.md,
// issue 43, point 2). Lane j of vector v holds code 2v + j / 4 of dword j % 4 (kernel_x says
// which weight that is). The powers of 16 go to x, so every product rounds as u * x does.
//
// Raw: the lanes are not converted at all. An integer below 2^23 read as float32 bits is the
// subnormal number int * 2^-149, so each lane already is the float u * 16^k * 2^-149, exactly;
// kernel_x scales x by 2^S to match (raw_codes says where this is used and why), and the
// products u * x * 2^(S - 149) round as u * x does while they stay normal.
template <int64_t T, bool Raw = false>
inline void unpack(const uint8_t* qg, int64_t b, int64_t i, __m256 f[4]) {
  const uint8_t* qs = block_row<T>(qg, b, i);
  if constexpr (T == Q5_0) {  // its codes signed, in x's order, as Q8_0's
    __m128i lo, hi;
    q5_0_codes(qg, b, i, lo, hi);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
  } else if constexpr (int8_codes(T)) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
  } else {
    const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m256i s = _mm256_srli_epi32(c, 16);
    const __m256i m01 = _mm256_setr_epi32(0xf, 0xf, 0xf, 0xf, 0xf0, 0xf0, 0xf0, 0xf0);
    const __m256i m23 = _mm256_slli_epi32(m01, 8);
    const __m256i u[4] = {_mm256_and_si256(c, m01), _mm256_and_si256(c, m23), _mm256_and_si256(s, m01),
                          _mm256_and_si256(s, m23)};
    for (int v = 0; v < 4; ++v) f[v] = Raw ? _mm256_castsi256_ps(u[v]) : _mm256_cvtepi32_ps(u[v]);
  }
}

// Rows [i0, i0 + NR) of a group (qs and scale: the group's) against MR rows of x: NR * MR
// independent accumulator chains. The tile of row 0 is the first to read the group's blocks,
// so it asks for them ahead (lead).
template <int64_t T, int NR, int MR, bool Raw = false>
inline void tile(const uint8_t* qs, const Scale<T>* scale, int i0, int64_t nblocks, const float* x, int64_t K,
                 float out[NR][MR], bool lead = true) {
  constexpr int64_t QB = quant_bytes(T);
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    if (lead) prefetch_ahead(qs, b, 8 * QB);
    // A whole group's 8 scales convert as one vector (then each is a broadcast load); a tile
    // of fewer rows converts its own.
    alignas(32) float d8[8];
    if constexpr (NR == 8 && T != Q6_K)
      _mm256_store_ps(d8, scales8<T>(scale, nblocks, b));
    for (int i = 0; i < NR; ++i) {
      __m256 f[4];
      unpack<T, Raw>(qs, b, i0 + i, f);
      __m256 d;
      if constexpr (NR == 8 && T != Q6_K)
        d = _mm256_broadcast_ss(d8 + i);
      else
        d = _mm256_set1_ps(scale_at<T>(scale, nblocks, b, i0 + i));
      if constexpr (T == Q6_K) {  // weights 0-15 and 16-31 scaled apart: the exact weights
        const __m256 d1 = _mm256_set1_ps(scale_at<T>(scale, nblocks, b, i0 + i, 1));
        f[0] = _mm256_mul_ps(f[0], d);
        f[1] = _mm256_mul_ps(f[1], d);
        f[2] = _mm256_mul_ps(f[2], d1);
        f[3] = _mm256_mul_ps(f[3], d1);
      }
      for (int r = 0; r < MR; ++r) {
        const float* xb = x + r * K + b * QK;  // L1-resident: reloading beats spilling registers
        // The block's dot product as two chains of two, added: half as deep as one chain of
        // four, so more blocks are in flight (the A/B: docs/benchmarks.md, issue 43, point 2).
        const __m256 t01 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
        const __m256 t23 =
            _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
        const __m256 t = _mm256_add_ps(t01, t23);
        if constexpr (T == Q6_K)
          acc[i][r] = _mm256_add_ps(t, acc[i][r]);
        else
          acc[i][r] = _mm256_fmadd_ps(d, t, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) out[i][r] = hsum256(acc[i][r]);
}
#endif

// The sum of one block's 32 values of x, in vector lanes (a scalar loop is one chain of
// dependent adds): Q4_1's m * sum(x) term needs it for every block of every row.
inline float block_sum(const float* x) {
#if defined(AIOLM_AVX512)
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)));
#elif defined(AIOLM_AVX2)
  __m256 acc = _mm256_loadu_ps(x);
  for (int i = 8; i < QK; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  return hsum256(acc);
#else
  float s = 0.f;
  for (int i = 0; i < QK; ++i) s += x[i];
  return s;
#endif
}

// Whether the group kernels read x reordered for blocks of type qtype (the 4-bit tiles: see
// unpack and unpack16; Q5_0's fifth bits would carry into the next lane's code).
constexpr bool reorders_x(int64_t qtype) {
#if defined(AIOLM_AVX2)
  return !int8_codes(qtype) && qtype != Q5_0;
#else
  (void)qtype;
  return false;
#endif
}

// Whether run_groups needs x's block sums for blocks of type qtype: the mins' m * sum(x)
// and, where its codes convert unsigned (AVX2's reordering tiles), Q4_0's -8 d * sum(x).
constexpr bool needs_block_sums(int64_t qtype) {
#if defined(AIOLM_AVX2) && !defined(AIOLM_AVX512)
  return has_min(qtype) || reorders_x(qtype);
#else
  return has_min(qtype);
#endif
}

// x's block sums (M rows of K / QK) in buf where run_groups needs them for blocks of type
// qtype (needs_block_sums), else nullptr. Made once per call, from x's own order.
inline const float* block_sums(int64_t qtype, const float* x, int64_t M, int64_t K, std::vector<float>& buf) {
  if (!needs_block_sums(qtype)) return nullptr;
  const int64_t nb = K / QK;
  buf.resize(M * nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) buf[r * nb + b] = block_sum(x + r * K + b * QK);
  return buf.data();
}

// Whether the AVX2 tiles read 4-bit codes raw, as float32 subnormals (unpack): on AMD's cores,
// where an FMA with a subnormal input costs what a normal one does (Zen 2 measured; the
// A/B is in docs/benchmarks.md, issue 43, point 2). Other vendors' cores are not measured;
// Intel's optimization manual describes microcode assists for subnormal operands, so there
// the codes convert.
inline bool raw_codes() {
#if defined(AIOLM_AVX2) && !defined(AIOLM_AVX512)
  return aiolm_cpu::amd();
#else
  return false;
#endif
}

// What run_groups reads of x: the rows themselves, or reordered and scaled (kernel_x).
struct KernelX {
  const float* x;
  float unscale;  // 0: the tiles convert the codes; else they read them raw, and each result is times this
};

// x's M rows of K as run_groups reads them for blocks of type qtype: x itself, or each block
// of 32 as unpack's lanes come out in buf. Lane j of vector v holds code n = 2v + j / 4 of the
// block's dword w = j % 4, times 16^(n % 4): code n is byte 4w + n / 2's low nibble (weight
// 4w + n / 2) for even n, its high nibble (weight 4w + n / 2 + 16) for odd n; its x is divided
// by the same power of 16 (exact). Made once per call, for every group and thread.
//
// Where the codes are read raw (u * 16^k * 2^-149), x is also times 2^S: S is the largest
// power that keeps the largest |x| below 2^127, so every product is as far above the
// subnormal range as it can be, and the results are times 2^(149 - S) after. S is kept within
// [22, 254], where 2^(149 - S) is a float. Powers of 2 are exact: the result has the bits the
// converting tiles give, but for products over 2^100 times smaller than the largest one
// (which fall below the normal range and round differently) and for x past 2^105 (too large
// to scale down far enough).
inline KernelX kernel_x(int64_t qtype, const float* x, int64_t M, int64_t K, std::vector<float>& buf) {
  if (!reorders_x(qtype)) return {x, 0.f};
#ifdef AIOLM_AVX512
  // unpack16's order: lane 4k + w of vector v holds nibble n = 4v + k of dword w, which is
  // byte 4w + n / 2's low nibble (weight 4w + n / 2) for even n, its high nibble (weight
  // 4w + n / 2 + 16) for odd n. The codes are the weights' own values: x is not scaled.
  struct Lanes512 {
    int weight[QK];
    Lanes512() {
      for (int lane = 0; lane < QK; ++lane) {
        const int n = 4 * (lane / 16) + (lane % 16) / 4, w = lane % 4;
        weight[lane] = 4 * w + n / 2 + (n % 2) * 16;
      }
    }
  };
  static const Lanes512 order;
  buf.resize(M * K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / QK; ++b) {
      const float* s = x + r * K + b * QK;
      float* d = buf.data() + r * K + b * QK;
      for (int lane = 0; lane < QK; ++lane) d[lane] = s[order.weight[lane]];
    }
  return {buf.data(), 0.f};
#else
  struct Lanes {
    int weight[QK];
    float factor[QK];
    Lanes() {
      for (int lane = 0; lane < QK; ++lane) {
        const int n = 2 * (lane / 8) + (lane % 8) / 4, w = lane % 4;
        weight[lane] = 4 * w + n / 2 + (n % 2) * 16;
        factor[lane] = 1.f / static_cast<float>(1 << (4 * (n % 4)));
      }
    }
  };
  static const Lanes lanes;
  float factor[QK];
  std::copy(lanes.factor, lanes.factor + QK, factor);
  float unscale = 0.f, extra = 1.f;
  if (raw_codes()) {
    float amax = 0.f;
#if defined(AIOLM_AVX2)
    __m256 a = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < M * K; i += 8) a = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), a);
    alignas(32) float lanes8[8];
    _mm256_store_ps(lanes8, a);
    amax = *std::max_element(lanes8, lanes8 + 8);
#endif
    int e = 200;  // an infinite x: the least S
    if (std::isfinite(amax)) std::frexp(amax, &e);  // amax < 2^e
    const int S = std::clamp(127 - e, 22, 254);
    for (float& f : factor) f = std::ldexp(f, std::min(S, 127));
    extra = std::ldexp(1.f, std::max(S - 127, 0));  // 2^S in two factors that are floats
    unscale = std::ldexp(1.f, 149 - S);
  }
  buf.resize(M * K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / QK; ++b) {
      const float* s = x + r * K + b * QK;
      float* d = buf.data() + r * K + b * QK;
      for (int lane = 0; lane < QK; ++lane) d[lane] = s[lanes.weight[lane]] * factor[lane] * extra;
    }
  return {buf.data(), unscale};
#endif
}

// Scalar reference for CPUs without AVX2/FMA: row i of a group against one row of x.
template <int64_t T>
float dot_scalar(const uint8_t* qs, const Scale<T>* scale, int64_t nblocks, int64_t i, const float* x) {
  float acc = 0.f;
  for (int64_t b = 0; b < nblocks; ++b) {
    float t = 0.f;
    if constexpr (T == Q6_K) {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs + (b * 8 + i) * 32);
      for (int j = 0; j < 32; ++j) acc += static_cast<float>(q[j]) * scale_at<T>(scale, nblocks, b, i, j / 16) * x[b * QK + j];
      continue;  // the scales are in the weights
    } else if constexpr (int8_codes(T)) {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs + (b * 8 + i) * 32);
      for (int j = 0; j < 32; ++j) t += static_cast<float>(q[j]) * x[b * QK + j];
    } else if constexpr (T == Q5_0) {
      const uint8_t* q = block_row<T>(qs, b, i);
      const uint32_t h = row_high_bits(qs, b, i);
      for (int j = 0; j < 16; ++j) {
        t += static_cast<float>(q5_0_code(q, h, j) - 16) * x[b * QK + j];
        t += static_cast<float>(q5_0_code(q, h, j + 16) - 16) * x[b * QK + j + 16];
      }
    } else {
      const uint8_t* q = qs + (b * 8 + i) * 16;
      const float off = T == Q4_0 ? 8.f : 0.f;
      for (int j = 0; j < 16; ++j) {
        t += (static_cast<float>(q[j] & 0xf) - off) * x[b * QK + j];
        t += (static_cast<float>(q[j] >> 4) - off) * x[b * QK + j + 16];
      }
    }
    acc += scale_at<T>(scale, nblocks, b, i) * t;
  }
  return acc;
}

// Groups [g0, g1) of 8 output rows against the M rows of x, as kernel_x gives them (Raw:
// the codes are read raw, and each result is times back).
template <int64_t T, bool Raw>
void run_groups_as(const uint8_t* qs, const Scale<T>* scale, const Scale<T>* mins, const float* xsum,
                   int64_t nblocks, const float* x, float back, int64_t K, int64_t M, float* y, int64_t N, int64_t g0,
                   int64_t g1) {
  constexpr int64_t QB = quant_bytes(T);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* qg = qs + g * nblocks * 8 * QB;
    const Scale<T>* sg = scale + g * group_scales(T, nblocks);
    const int64_t n0 = g * 8, nn = std::min<int64_t>(8, N - n0);
    // sum_b m_b sum(x_b) of the group's 8 rows for one row of x (the mins are stored 8 wide), or
    // Q4_0's -8 sum_b d_b sum(x_b) where its codes convert unsigned
    float mterm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    auto mins_for = [&](int64_t r) {
      if constexpr (!needs_block_sums(T)) return;
      const Scale<T>* mg = (has_min(T) ? mins : scale) + g * group_scales(T, nblocks);
      const float* xs = xsum + r * nblocks;
#ifdef AIOLM_AVX2
      __m256 a = _mm256_setzero_ps();
      for (int64_t b = 0; b < nblocks; ++b) a = _mm256_fmadd_ps(scales8<T>(mg, nblocks, b), _mm256_set1_ps(xs[b]), a);
      if constexpr (!has_min(T)) a = _mm256_mul_ps(a, _mm256_set1_ps(-8.f));
      _mm256_storeu_ps(mterm, a);
#else
      for (int i = 0; i < 8; ++i) {
        mterm[i] = 0.f;
        for (int64_t b = 0; b < nblocks; ++b) mterm[i] += scale_at<T>(mg, nblocks, b, i) * xs[b];
      }
#endif
    };
    auto put = [&](int64_t i, int64_t r, float v) {
      if (i < nn) y[r * N + n0 + i] = (Raw ? v * back : v) + mterm[i];
    };
#ifdef AIOLM_AVX2
    int64_t r0 = 0;
#ifdef AIOLM_AVX512
    // Threes, then pairs, of x rows against all 8 rows of the group (24 or 16 accumulators in
    // the 32 zmm registers): each pass converts the group's codes again, so the fewer passes
    // the better (4 rows go as two pairs: a three and a one convert as often, and were no
    // faster in ab_kernel.py).
    for (; r0 + 3 <= M && M - r0 != 4; r0 += 3) {
      float out[8][3];
      tile<T, 8, 3, Raw>(qg, sg, 0, nblocks, x + r0 * K, K, out, r0 == 0);
      for (int r = 0; r < 3; ++r) {
        mins_for(r0 + r);
        for (int i = 0; i < 8; ++i) put(i, r0 + r, out[i][r]);
      }
    }
    for (; r0 + 2 <= M; r0 += 2) {
      float out[8][2];
      tile<T, 8, 2, Raw>(qg, sg, 0, nblocks, x + r0 * K, K, out, r0 == 0);
      for (int r = 0; r < 2; ++r) {
        mins_for(r0 + r);
        for (int i = 0; i < 8; ++i) put(i, r0 + r, out[i][r]);
      }
    }
#else
    // Eight x rows share each unpacked block; then pairs against 4 weight rows (every
    // tile keeps <= 8 accumulators in the 16 ymm registers).
    for (; r0 + 8 <= M; r0 += 8) {
      float out[8][8];
      for (int i = 0; i < 8; ++i) {
        float o[1][8];
        tile<T, 1, 8, Raw>(qg, sg, i, nblocks, x + r0 * K, K, o, i == 0 && r0 == 0);
        for (int r = 0; r < 8; ++r) out[i][r] = o[0][r];
      }
      for (int r = 0; r < 8; ++r) {
        mins_for(r0 + r);
        for (int i = 0; i < 8; ++i) put(i, r0 + r, out[i][r]);
      }
    }
    for (; r0 + 2 <= M; r0 += 2) {
      float out[8][2];
      for (int h = 0; h < 8; h += 4) {
        float o[4][2];
        tile<T, 4, 2, Raw>(qg, sg, h, nblocks, x + r0 * K, K, o, h == 0 && r0 == 0);
        for (int i = 0; i < 4; ++i)
          for (int r = 0; r < 2; ++r) out[h + i][r] = o[i][r];
      }
      for (int r = 0; r < 2; ++r) {
        mins_for(r0 + r);
        for (int i = 0; i < 8; ++i) put(i, r0 + r, out[i][r]);
      }
    }
#endif
    if (r0 < M) {  // a last single row against all 8 rows of the group
      float out[8][1];
      tile<T, 8, 1, Raw>(qg, sg, 0, nblocks, x + r0 * K, K, out, r0 == 0);
      mins_for(r0);
      for (int i = 0; i < 8; ++i) put(i, r0, out[i][0]);
    }
#else
    for (int64_t r = 0; r < M; ++r) {
      mins_for(r);
      for (int64_t i = 0; i < nn; ++i) put(i, r, dot_scalar<T>(qg, sg, nblocks, i, x + r * K));
    }
#endif
  }
}

// Groups [g0, g1) of 8 output rows against the M rows of x, x and unscale as kernel_x gives
// them.
template <int64_t T>
void run_groups(const uint8_t* qs, const Scale<T>* scale, const Scale<T>* mins, const float* xsum, int64_t nblocks,
                const float* x, float unscale, int64_t K, int64_t M, float* y, int64_t N, int64_t g0, int64_t g1) {
  if (unscale == 0.f) return run_groups_as<T, false>(qs, scale, mins, xsum, nblocks, x, 1.f, K, M, y, N, g0, g1);
#ifdef AIOLM_AVX2
  // Raw codes are subnormals: a thread that treats them as zero (MXCSR's DAZ, which
  // torch.set_flush_denormal sets) would lose every weight, so this thread's flags are
  // cleared for the call (FTZ too: it would flush the smallest products) and then restored.
  const unsigned csr = _mm_getcsr(), flush = 0x8040;  // FTZ | DAZ
  if (csr & flush) _mm_setcsr(csr & ~flush);
  run_groups_as<T, true>(qs, scale, mins, xsum, nblocks, x, unscale, K, M, y, N, g0, g1);
  if (csr & flush) _mm_setcsr(csr);
#endif
}

}  // namespace aiolm_gguf_float
