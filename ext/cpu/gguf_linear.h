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

// n floats of buf from a cache line's start (buf grows to hold them), for aligned vector loads.
inline float* line_aligned(std::vector<float>& buf, int64_t n) {
  buf.resize(n + 16);
  return buf.data() + (16 - reinterpret_cast<uintptr_t>(buf.data()) / 4 % 16) % 16;
}

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

// Steps of many rows convert a group's codes once into float32 weights and run all of x's
// rows over them (wide_tile), where the group tiles above convert them again for every three
// rows. The weights go to L1 a chunk of WIDE_K at a time: a group's 8 rows of it are 8 KiB.
constexpr int64_t WIDE_K = 256;

// Blocks [b0, b1) of a group's 8 rows as float32 weights, w[i * WIDE_K + (b - b0) * 32 + lane], in
// unpack16's lane order (kernel_x puts x in it): d * u, plus m where the type has mins. For the
// GGUF types d * u is exact (an 11-bit scale, or Q4_K's factor times its code, times a code of
// at most 8 bits), but for Q6_K's, which rounds once as gguf's own product does; so one FMA with
// m gives the weights gguf dequantizes to: the float32 path's.
template <int64_t T>
inline void unpack_chunk(const uint8_t* qg, const Scale<T>* sg, const Scale<T>* mg, int64_t nblocks, int64_t b0,
                         int64_t b1, float* w) {
  for (int64_t b = b0; b < b1; ++b) {
    alignas(32) float d8[8], m8[8];
    if constexpr (T != Q6_K) _mm256_store_ps(d8, scales8<T>(sg, nblocks, b));
    if constexpr (has_min(T)) _mm256_store_ps(m8, scales8<T>(mg, nblocks, b));
    for (int i = 0; i < 8; ++i) {
      __m512 f[2];
      unpack16<T>(qg, b, i, f);
      if constexpr (T == Q6_K) {
        f[0] = _mm512_mul_ps(f[0], _mm512_set1_ps(sg[(b * 8 + i) * 2]));
        f[1] = _mm512_mul_ps(f[1], _mm512_set1_ps(sg[(b * 8 + i) * 2 + 1]));
      } else if constexpr (has_min(T)) {
        const __m512 d = _mm512_set1_ps(d8[i]), m = _mm512_set1_ps(m8[i]);
        f[0] = _mm512_fmadd_ps(f[0], d, m);
        f[1] = _mm512_fmadd_ps(f[1], d, m);
      } else {
        const __m512 d = _mm512_set1_ps(d8[i]);
        f[0] = _mm512_mul_ps(f[0], d);
        f[1] = _mm512_mul_ps(f[1], d);
      }
      float* wb = w + i * WIDE_K + (b - b0) * QK;
      _mm512_store_ps(wb, f[0]);
      _mm512_store_ps(wb + 16, f[1]);
    }
  }
}

// The sums of 8 vectors' lanes, as 8 floats: pairs of vectors fold their halves together, and
// so on down, so the 8 results take 15 shuffles and 8 adds rather than 8 whole reductions.
inline void reduce8(const __m512 v[8], float out[8]) {
  __m512 a[4];
  for (int j = 0; j < 4; ++j)  // 256-bit halves: lanes 0-7 of v[2j], then of v[2j + 1]
    a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xee));
  __m512 b[2];
  for (int j = 0; j < 2; ++j)  // 128-bit quarters: 4 lanes each of v[4j .. 4j + 3]
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xdd));
  // each 128-bit lane of b[j] holds 4 partial sums of one vector: fold them to 2, then 1
  const __m512 c = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
  const __m512 e = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4e));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, e);
  // lane 4q of e is the sum of v[q], lane 4q + 1 that of v[4 + q]
  for (int q = 0; q < 4; ++q) {
    out[q] = lanes[4 * q];
    out[4 + q] = lanes[4 * q + 1];
  }
}

// From this many rows of x on, the float path takes a group wide (unpack_chunk, wide_tile)
// on Intel's cores, where one conversion for all rows beats the tiles' one for every three
// (benchmarks/ab_kernel.py model-float; docs/benchmarks.md, issue 43). AMD's AVX-512 cores
// were not measured, and keep the tiles.
constexpr int64_t WIDE_ROWS = 4;

// MR rows of x (row stride ldx) against one chunk (kc weights) of a group's 8 rows w
// (unpack_chunk's): the sums run over k in 16 lanes, in `acc` between chunks (the first
// starts from zero), and the last chunk reduces them into out[r][i]. pf: the next group's
// codes, pf_lines cache lines for each 16 k, asked for while this tile runs (nullptr: none).
template <int MR>
inline void wide_tile(const float* w, const float* x, int64_t ldx, int64_t kc, __m512* acc_mem, bool first,
                      bool last, float out[][8], const uint8_t* pf, int64_t pf_lines) {
  __m512 acc[MR][8];
#pragma GCC unroll 3
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[r][i] = first ? _mm512_setzero_ps() : _mm512_load_ps(&acc_mem[r * 8 + i]);
  for (int64_t k = 0; k < kc; k += 16) {
    if (pf != nullptr)
      for (int64_t l = 0; l < pf_lines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(pf + (k / 16 * pf_lines + l) * 64), _MM_HINT_T1);
    __m512 xv[MR];
#pragma GCC unroll 3
    for (int r = 0; r < MR; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512 wv = _mm512_load_ps(w + i * WIDE_K + k);
      // One load a weight vector, kept in a register for its MR FMAs: left to itself GCC folds
      // the load into each FMA, MR loads where one does, and the tile becomes load-bound.
      asm("" : "+v"(wv));
#pragma GCC unroll 3
      for (int r = 0; r < MR; ++r) acc[r][i] = _mm512_fmadd_ps(wv, xv[r], acc[r][i]);
    }
  }
  if (last) {
    for (int r = 0; r < MR; ++r) reduce8(acc[r], out[r]);
  } else {
#pragma GCC unroll 3
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) _mm512_store_ps(&acc_mem[r * 8 + i], acc[r][i]);
  }
}

// A group's 8 output rows for all M rows of x, wide: chunk by chunk of k, the chunk's weights
// converted once and every three rows of x run over them (24 accumulators). Its first tile
// asks for the next group's codes (next: nullptr where there is none), which the conversion
// would otherwise read from memory in a burst; the scales and mins, a few lines, are asked
// for at once.
template <int64_t T>
inline void wide_group(const uint8_t* qg, const Scale<T>* sg, const Scale<T>* mg, int64_t nblocks, const float* x,
                       int64_t M, float* y, int64_t N, int64_t nn, const uint8_t* next) {
  constexpr int64_t QB = quant_bytes(T);
  const int64_t K = nblocks * QK, tiles = (M + 2) / 3, pf_lines = (QB + 15) / 16;
  thread_local std::vector<float> wbuf;
  thread_local std::vector<__m512> accs;
  float* wp = line_aligned(wbuf, 8 * WIDE_K);
  if (static_cast<int64_t>(accs.size()) < tiles * 24) accs.resize(tiles * 24);
  if (next != nullptr) {
    const int64_t gs = group_scales(T, nblocks), bytes = gs * static_cast<int64_t>(sizeof(Scale<T>));
    for (int64_t l = 0; l < bytes; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(sg + gs) + l, _MM_HINT_T1);
      if (mg != nullptr) _mm_prefetch(reinterpret_cast<const char*>(mg + gs) + l, _MM_HINT_T1);
    }
  }
  for (int64_t k0 = 0; k0 < K; k0 += WIDE_K) {
    const int64_t kc = std::min(WIDE_K, K - k0);
    unpack_chunk<T>(qg, sg, mg, nblocks, k0 / QK, (k0 + kc) / QK, wp);
    const bool first = k0 == 0, last = k0 + kc == K;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = 3 * t, rows = std::min<int64_t>(3, M - r0);
      const uint8_t* pf = t == 0 && next != nullptr ? next + k0 / 16 * pf_lines * 64 : nullptr;
      const float* xt = x + r0 * K + k0;
      __m512* acc = accs.data() + t * 24;
      float out[3][8];
      if (rows == 3)
        wide_tile<3>(wp, xt, K, kc, acc, first, last, out, pf, pf_lines);
      else if (rows == 2)
        wide_tile<2>(wp, xt, K, kc, acc, first, last, out, pf, pf_lines);
      else
        wide_tile<1>(wp, xt, K, kc, acc, first, last, out, pf, pf_lines);
      if (last)
        for (int64_t r = 0; r < rows; ++r) std::copy(out[r], out[r] + nn, y + (r0 + r) * N);
    }
  }
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

// Whether run_groups takes a step of M rows wide (wide_group), which needs no block sums.
inline bool takes_wide(int64_t M) {
#if defined(AIOLM_AVX512)
  return M >= WIDE_ROWS && !aiolm_cpu::amd();
#else
  (void)M;
  return false;
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
  const __m512i lo = _mm512_loadu_si512(order.weight), hi = _mm512_loadu_si512(order.weight + 16);
  float* out = line_aligned(buf, M * K);  // rows on cache lines
  for (int64_t i = 0; i < M * K; i += QK) {  // each block's 32 values, two lookups into both halves
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    _mm512_store_ps(out + i, _mm512_permutex2var_ps(a, lo, b));
    _mm512_store_ps(out + i + 16, _mm512_permutex2var_ps(a, hi, b));
  }
  return {out, 0.f};
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
    if (takes_wide(M)) {  // the mins are in the weights: no mterm
      const Scale<T>* mg = has_min(T) ? mins + g * group_scales(T, nblocks) : nullptr;
      wide_group<T>(qg, sg, mg, nblocks, x, M, y + n0, N, nn, g + 1 < g1 ? qg + nblocks * 8 * QB : nullptr);
      continue;
    }
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
