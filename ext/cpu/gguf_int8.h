// y = x W^T with integer dot products: each row of x is quantized on the fly to
// int8 blocks of 32 (one float32 scale per block, as llama.cpp's Q8 activations),
// and W stays in the GGUF file's Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K blocks, in the regrouped
// layout that aiolm::gguf_linear reads (see the top of gguf_linear.h: groups of
// 8 output rows, block b of the 8 rows side by side). A block's dot product is then
// 32 int8 x int8 multiply-adds summed exactly in int32, and one float FMA scales it
// by d_w * d_x: with VNNI (vpdpbusd) four products per int32 lane per instruction,
// against one converted weight per float lane for gguf_linear.
//
// Per block, with x = d_x * xq and isum = sum_j u_j xq_j over the stored codes u:
//   Q4_1: w = d_w u + m    -> d_w d_x isum + m * (d_x sum xq)      (the min term is
//         sum_b m_b s_b with s_b = d_x sum xq, computed 8 rows at a time)
//   Q4_0: w = d_w (u - 8)  -> d_w d_x (isum - 8 sum xq)
//   Q5_0: w = d_w (u - 16) -> d_w d_x (isum - 16 sum xq), u a nibble and a fifth bit
//   Q8_0: w = d_w q        -> d_w d_x sum q_j xq_j
//   Q6_K: w = d_k q (d_k per 16 weights) -> d_x (d_0 isum_0 + d_1 isum_1), an exact
//         integer for each half of the block (VNNI's offset correction uses the halves' sums)
// (Q4_K and Q4_1F are Q4_1 blocks whose scales and mins are exact in float32 (Q4_K's made from
// the file's codes as they are read), Q6_K Q8_0 codes with two scales: gguf_blocks.h.)
// The corrections of Q4_0 (and of Q8_0 on VNNI, which multiplies unsigned by signed
// bytes and so reads q + 128) are integers subtracted before the conversion. Every type on
// VNNI, for steps of 3 rows or more, sums a row's whole block (Q6_K: each half) in one int32
// lane (pair_vnni), so it converts the same exact integer per block as the scalar path; the
// other vector paths convert a block in parts of 4 or 8 products, each exact. Paths differ
// only in the order of the float sums. The quantization of x is the same arithmetic on
// every path (round to nearest even of x * (1 / d)), so its codes are identical bit for bit.
//
// Paths: AVX-512 VNNI, AVX2 (vpmaddubsw + vpmaddwd) and scalar, compiled in as the
// build's flags allow (-march=native) and picked at run time: the best one by
// default, or the one asked for (tests run every compiled path on one machine).
//
// The pieces of aiolm::gguf_int8_linear (gguf_int8.cpp) that other kernels reuse: x's
// quantization and the group kernels over 8 output rows (aiolm::gguf_moe, fused_moe.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "gguf_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AIOLM_I8_AVX2 1
#endif
#if defined(AIOLM_I8_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define AIOLM_I8_VNNI 1
#endif

namespace aiolm_gguf_int8 {

using namespace aiolm_gguf;  // QK, the type ids, what they are (has_min, Scale, ...), quant_bytes
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512_VNNI = 2 };

inline int64_t best_isa() {
#if defined(AIOLM_I8_VNNI)
  return AVX512_VNNI;
#elif defined(AIOLM_I8_AVX2)
  return AVX2;
#else
  return SCALAR;
#endif
}

// x's rows as int8 blocks: q [M, K], and per block its scale d, the sum of its codes
// (integer corrections) and d * that sum (Q4_1's min term); for Q6_K on VNNI also the
// sums of each 16 codes (half) [M, nblocks * 2].
struct QRows {
  const int8_t* q;
  const float* d;
  const int32_t* sum;
  const float* s;
  int64_t K, nblocks;
  const int32_t* half;
  // pair_vnni's starting values, broadcast from memory: -OFF * sum per block (Q4_0: 8, Q8_0:
  // 128), or for Q6_K -32 * each half's sum [M, nblocks * 2]
  const int32_t* corr;

  QRows from_row(int64_t r) const {  // rows [r, ..)
    const int64_t i = r * nblocks;
    return QRows{q + r * K, d + i, sum + i, s + i, K, nblocks, half ? half + 2 * i : nullptr,
                 corr ? corr + (half ? 2 * i : i) : nullptr};
  }
};

constexpr int64_t PASS = 64;  // rows of x per pass over W (gguf_int8_linear)

// One block of 32 floats: its scale (the same scalar arithmetic on every path) and 1/d.
inline void block_scale(float amax, float& d, float& id) {
  d = amax / 127.f;
  id = d != 0.f ? 1.f / d : 0.f;
}

inline void quantize_block_scalar(const float* x, int8_t* q, float& d, int32_t& sum) {
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  float id;
  block_scale(amax, d, id);
  sum = 0;
  for (int j = 0; j < QK; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));  // nearest even, as cvtps_epi32
    sum += q[j];
  }
}

#ifdef AIOLM_I8_AVX2
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline void quantize_block_avx2(const float* x, int8_t* q, float& d, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float id;
  block_scale(_mm_cvtss_f32(h), d, id);
  const __m256 idv = _mm256_set1_ps(id);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], idv));
  sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
  // The packs interleave 128-bit lanes: 4-byte chunks come out as 0,2,4,6,1,3,5,7.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

#ifdef AIOLM_I8_VNNI
inline void quantize_block_avx512(const float* x, int8_t* q, float& d, int32_t& sum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  float id;
  block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))), d, id);
  const __m512 idv = _mm512_set1_ps(id);
  const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, idv)), ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, idv));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(ia));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(ib));
}
#endif

// Quantizes rows [M, K] of x into the buffers of one call.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t isa, int8_t* q, float* d, int32_t* sum,
                          float* s) {
  const int64_t nb = K / QK;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = r * nb + b;
      const float* xb = x + r * K + b * QK;
      int8_t* qb = q + r * K + b * QK;
#ifdef AIOLM_I8_VNNI
      if (isa == AVX512_VNNI) quantize_block_avx512(xb, qb, d[i], sum[i]); else
#endif
#ifdef AIOLM_I8_AVX2
      if (isa == AVX2) quantize_block_avx2(xb, qb, d[i], sum[i]); else
#endif
      quantize_block_scalar(xb, qb, d[i], sum[i]);
      s[i] = d[i] * static_cast<float>(sum[i]);
    }
}

// Q4_1's min term of a group's 8 rows for one row of x: sum_b m_b s_b (mins stored 8 wide).
template <int64_t T>
void min_term(const Scale<T>* mg, const float* s, int64_t nblocks, int64_t isa, float out[8]) {
#ifdef AIOLM_I8_AVX2
  if (isa != SCALAR) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) a = _mm256_fmadd_ps(scales8<T>(mg, nblocks, b), _mm256_set1_ps(s[b]), a);
    _mm256_storeu_ps(out, a);
    return;
  }
#endif
  for (int i = 0; i < 8; ++i) {
    out[i] = 0.f;
    for (int64_t b = 0; b < nblocks; ++b) out[i] += scale_at<T>(mg, nblocks, b, i) * s[b];
  }
}

// The exact integer dot product of row i's block b (group base qg) with a block of codes.
template <int64_t T>
int32_t block_dot_scalar(const uint8_t* qg, int64_t b, int i, const int8_t* xq, int32_t xsum) {
  int32_t acc = 0;
  if constexpr (int8_codes(T)) {
    const int8_t* w = reinterpret_cast<const int8_t*>(qg + (b * 8 + i) * 32);
    for (int j = 0; j < QK; ++j) acc += static_cast<int32_t>(w[j]) * xq[j];
  } else if constexpr (T == Q5_0) {
    const uint8_t* w = block_row<T>(qg, b, i);
    const uint32_t h = row_high_bits(qg, b, i);
    for (int j = 0; j < 16; ++j) acc += q5_0_code(w, h, j) * xq[j] + q5_0_code(w, h, j + 16) * xq[j + 16];
    acc -= 16 * xsum;
  } else {
    const uint8_t* w = qg + (b * 8 + i) * 16;
    for (int j = 0; j < 16; ++j) acc += (w[j] & 0xf) * xq[j] + (w[j] >> 4) * xq[j + 16];
    if constexpr (T == Q4_0) acc -= 8 * xsum;
  }
  return acc;
}

template <int64_t T>
void group_scalar(const uint8_t* qg, const Scale<T>* sg, const QRows& x, int64_t r, float out[8]) {
  for (int i = 0; i < 8; ++i) {
    float acc = 0.f;
    for (int64_t b = 0; b < x.nblocks; ++b) {
      const int64_t xb = r * x.nblocks + b;
      const int8_t* xq = x.q + r * x.K + b * QK;
      if constexpr (T == Q6_K) {
        const int8_t* w = reinterpret_cast<const int8_t*>(qg + (b * 8 + i) * 32);
        int32_t h[2] = {0, 0};
        for (int j = 0; j < QK; ++j) h[j / 16] += static_cast<int32_t>(w[j]) * xq[j];
        const float d0 = scale_at<T>(sg, x.nblocks, b, i, 0), d1 = scale_at<T>(sg, x.nblocks, b, i, 1);
        acc += (d0 * static_cast<float>(h[0]) + d1 * static_cast<float>(h[1])) * x.d[xb];
        continue;
      }
      const int32_t dot = block_dot_scalar<T>(qg, b, i, xq, x.sum[xb]);
      acc += scale_at<T>(sg, x.nblocks, b, i) * x.d[xb] * static_cast<float>(dot);
    }
    out[i] = acc;
  }
}

#ifdef AIOLM_I8_AVX2
// Row i's block b of the group qg as 32 bytes in x's order (codes 0-15 in the low lane,
// 16-31 in the high lane): u for the 4-bit types and Q5_0 (Q4_0's u - 8 and Q5_0's u - 16 are
// taken care of in tile_avx2), q for Q8_0 (and Q6_K).
template <int64_t T>
inline __m256i weights_avx2(const uint8_t* qg, int64_t b, int64_t i) {
  const uint8_t* p = block_row<T>(qg, b, i);
  if constexpr (int8_codes(T)) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i u = _mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), _mm256_set1_epi8(0x0f));
    if constexpr (T != Q5_0) return u;
    return _mm256_or_si256(u, fifth_bits(row_high_bits(qg, b, i)));
  }
}

// NR rows of a group (from row i0) against MR rows of x (from r0). vpmaddubsw multiplies
// unsigned by signed bytes: Q8_0's signed weights go in as |w| with x's sign flipped where
// w < 0 (|w| <= 128 and |xq| <= 127, so its pairwise int16 sums cannot saturate). Q4_0's
// codes go in as u, and each int32 lane then subtracts 8 times the sum of its 4 codes of x
// (made once per block of x, for all the rows): the same lanes as (u - 8) . x, two sign
// flips and a subtraction fewer per block and row. Q5_0's as Q4_0's, with 16 (u <= 31: the
// pairs' sums stay below 2^13).
template <int64_t T, int NR, int MR>
void tile_avx2(const uint8_t* qg, const Scale<T>* sg, int i0, const QRows& x, int64_t r0, float out[NR][MR]) {
  constexpr int64_t QB = quant_bytes(T);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = _mm256_setzero_ps();
  // One row of x against a whole group: the 8 rows' scales times x's convert and multiply as
  // one vector per block, and each row's is a broadcast load.
  constexpr bool whole_group = NR == 8 && MR == 1 && T != Q6_K;
  constexpr int OFF = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;  // unsigned codes' offset
  for (int64_t b = 0; b < x.nblocks; ++b) {
    if (i0 == 0 && r0 == 0) prefetch_ahead(qg, b, 8 * QB);  // the group's first tile: from memory
    __m256i xv[MR];
    __m256 dx[MR];
    __m256i x8[MR];  // Q4_0, Q5_0: OFF * the sum of each int32 lane's 4 codes of x
    for (int r = 0; r < MR; ++r) {
      xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (r0 + r) * x.K + b * QK));
      dx[r] = _mm256_set1_ps(x.d[(r0 + r) * x.nblocks + b]);
      if constexpr (OFF != 0) x8[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(OFF), xv[r]), ones);
    }
    alignas(32) float dd[8];
    if constexpr (whole_group) _mm256_store_ps(dd, _mm256_mul_ps(scales8<T>(sg, x.nblocks, b), dx[0]));
    for (int i = 0; i < NR; ++i) {
      const __m256i w = weights_avx2<T>(qg, b, i0 + i);
      // An int32 lane sums 4 products in order, so lanes 0-3 are weights 0-15: Q6_K's
      // two scales go to the two 128-bit halves.
      __m256 dw = _mm256_setzero_ps();  // the row's scale (in dd where whole_group)
      if constexpr (T == Q6_K)
        dw = _mm256_setr_m128(_mm_set1_ps(scale_at<T>(sg, x.nblocks, b, i0 + i, 0)),
                              _mm_set1_ps(scale_at<T>(sg, x.nblocks, b, i0 + i, 1)));
      else if constexpr (!whole_group)
        dw = _mm256_set1_ps(scale_at<T>(sg, x.nblocks, b, i0 + i));
      constexpr bool unsigned_codes = !int8_codes(T);
      const __m256i aw = unsigned_codes ? w : _mm256_sign_epi8(w, w);
      for (int r = 0; r < MR; ++r) {
        const __m256i xs = unsigned_codes ? xv[r] : _mm256_sign_epi8(xv[r], w);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones);
        if constexpr (OFF != 0) dot = _mm256_sub_epi32(dot, x8[r]);
        __m256 d;
        if constexpr (whole_group)
          d = _mm256_broadcast_ss(dd + i);
        else
          d = _mm256_mul_ps(dw, dx[r]);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) out[i][r] = hsum_ps(acc[i][r]);
}

// The 8 rows of a group against rows [r, r + MR) of x, written as out[i][r].
template <int64_t T, int MR>
void group_avx2(const uint8_t* qg, const Scale<T>* sg, const QRows& x, int64_t r0, float out[8][MR]) {
  if constexpr (MR == 1) {
    tile_avx2<T, 8, 1>(qg, sg, 0, x, r0, out);
  } else {
    for (int h = 0; h < 8; h += 4) tile_avx2<T, 4, MR>(qg, sg, h, x, r0, out + h);
  }
}
#endif

#ifdef AIOLM_I8_VNNI
// All 8 rows of a group against MR rows of x, for steps of 1 or 2 rows, where pair_vnni's
// transposes cost more than they save
// (benchmarks/bench_linear.py, section 1d). A zmm vector holds 4 rows' blocks (Q4:
// 16 bytes each, one per 128-bit lane, low nibbles then high nibbles against x's
// broadcast halves) or 2 rows' (Q8_0: 32 bytes each); each int32 lane sums 4 products,
// so a row's block is 4 (Q4) or 8 (Q8_0) lanes, scaled by its d_w * d_x in float.
// vpdpbusd reads the weights as unsigned bytes: Q8_0 codes go in as q + 128 (xor 0x80)
// and, like Q4_0's - 8, the offset times sum(xq) is the accumulator's starting value.
// Q6_K is Q8_0 with a scale per 16 weights (lanes 0-3 and 4-7 of a row): each lane gets its
// own scale, and each half's correction starts its own 4 lanes, from that half's sum. Its
// codes in [-32, 31] go in as q + 32, not q + 128: smaller lane values, smaller float rounding.
// Q4_1's and Q4_K's min terms (mins mg) are summed in the same pass, 8 rows to a ymm vector, in
// min_term's order: each block's mins decode once for the MR rows.
template <int64_t T, int MR>
void group_vnni(const uint8_t* qg, const Scale<T>* sg, const Scale<T>* mg, const QRows& x, int64_t r0,
                float out[8][MR]) {
  constexpr int NV = int8_codes(T) ? 4 : 2;     // vectors per block of the group's 8 rows
  constexpr int LANES = int8_codes(T) ? 8 : 4;  // int32 lanes per row in a vector
  constexpr int OFF = T == Q6_K ? 32 : int8_codes(T) ? 128 : T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;
  constexpr int64_t QB = quant_bytes(T);
  __m512i idx[NV];  // spreads the 8 rows' d_w over their lanes (Q6_K: their 16 d_w)
  for (int v = 0; v < NV; ++v) {
    alignas(64) int32_t k[16];
    for (int l = 0; l < 16; ++l) k[l] = T == Q6_K ? 4 * v + l / 4 : v * (16 / LANES) + l / LANES;
    idx[v] = _mm512_load_si512(k);
  }
  const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(static_cast<char>(0x80)),
                off6 = _mm512_set1_epi8(32), sixteen = _mm512_set1_epi8(16);
  __m512 acc[NV][MR];
  __m256 accm[MR];  // the min terms: lane i, row i
  for (int r = 0; r < MR; ++r) accm[r] = _mm256_setzero_ps();
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < MR; ++r) acc[v][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nblocks; ++b) {
    if (r0 == 0) prefetch_ahead(qg, b, 8 * QB);  // the group's first tile: from memory
    if constexpr (has_min(T)) {
      const __m256 m8 = scales8<T>(mg, x.nblocks, b);
      for (int r = 0; r < MR; ++r)
        accm[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(x.s[(r0 + r) * x.nblocks + b]), accm[r]);
    }
    __m512i xa[MR], xb[MR], init[MR];
    __m512 dx[MR];
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = x.q + (r0 + r) * x.K + b * QK;
      const int64_t xi = (r0 + r) * x.nblocks + b;
      if constexpr (int8_codes(T)) {
        xa[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
      } else {
        xa[r] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
        xb[r] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
      }
      if constexpr (T == Q6_K)  // lanes 4-7 and 12-15 hold the second halves
        init[r] = _mm512_mask_blend_epi32(0xF0F0, _mm512_set1_epi32(-(OFF / 4) * x.half[2 * xi]),
                                          _mm512_set1_epi32(-(OFF / 4) * x.half[2 * xi + 1]));
      else
        init[r] = _mm512_set1_epi32(-(OFF / LANES) * x.sum[xi]);
      dx[r] = _mm512_set1_ps(x.d[xi]);
    }
    __m512 d8;
    if constexpr (T == Q6_K)
      d8 = _mm512_loadu_ps(sg + b * 16);
    else
      d8 = _mm512_castps256_ps512(scales8<T>(sg, x.nblocks, b));
    for (int v = 0; v < NV; ++v) {
      const __m512 dw = _mm512_permutexvar_ps(idx[v], d8);
      const __m512i raw = _mm512_loadu_si512(qg + b * 8 * QB + v * 64);
      if constexpr (int8_codes(T)) {
        const __m512i w = T == Q6_K ? _mm512_add_epi8(raw, off6) : _mm512_xor_si512(raw, flip);
        for (int r = 0; r < MR; ++r) {
          const __m512i dot = _mm512_dpbusd_epi32(init[r], w, xa[r]);
          acc[v][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[r]), acc[v][r]);
        }
      } else {
        __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
        if constexpr (T == Q5_0) {  // rows 4v..4v+3's fifth bits: a 64-bit mask for each half
          const uint64_t* h = reinterpret_cast<const uint64_t*>(high_bits(qg, b));
          lo = _mm512_mask_add_epi8(lo, h[v], lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, h[2 + v], hi, sixteen);
        }
        for (int r = 0; r < MR; ++r) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init[r], lo, xa[r]), hi, xb[r]);
          acc[v][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[r]), acc[v][r]);
        }
      }
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < MR; ++r) {
      alignas(64) float lanes[16];
      alignas(32) float mins[8];
      _mm512_store_ps(lanes, acc[v][r]);
      _mm256_store_ps(mins, accm[r]);
      for (int j = 0; j < 16 / LANES; ++j) {
        float t = 0.f;
        for (int l = 0; l < LANES; ++l) t += lanes[j * LANES + l];
        const int i = v * (16 / LANES) + j;
        out[i][r] = has_min(T) ? t + mins[i] : t;
      }
    }
}
#endif

#ifdef AIOLM_I8_VNNI
// Block k's scales (or mins) of two groups' 16 rows as float32 lanes (the groups' arrays a
// and b), b's zero when null.
template <int64_t T>
inline __m512 load16(const Scale<T>* a, const Scale<T>* b, int64_t nblocks, int64_t k) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(scales8<T>(a, nblocks, k)),
                            b ? scales8<T>(b, nblocks, k) : _mm256_setzero_ps(), 1);
}

// Dword c of four vectors whose 128-bit lanes hold 16 rows' 16 bytes (lane l of v[m]: row
// 4m + l) as t[c], whose int32 lane 4l + m is row 4m + l: a 4x4 transpose within the lanes.
inline void transpose4(const __m512i v[4], __m512i t[4]) {
  const __m512i a = _mm512_unpacklo_epi32(v[0], v[1]), b = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i c = _mm512_unpacklo_epi32(v[2], v[3]), d = _mm512_unpackhi_epi32(v[2], v[3]);
  t[0] = _mm512_unpacklo_epi64(a, c);
  t[1] = _mm512_unpackhi_epi64(a, c);
  t[2] = _mm512_unpacklo_epi64(b, d);
  t[3] = _mm512_unpackhi_epi64(b, d);
}

// Block b of two groups' 16 rows as w[c], c = 0..7: int32 lane 4l + m holds row 4m + l's
// codes 4c..4c+3 in x's order, as unsigned bytes. Q4: a row's block is 16 bytes (4 dwords,
// 4 rows a vector), low nibbles codes 0-15, high ones 16-31. Q8_0: 32 bytes, 2 rows a
// vector; its halves of 16 bytes are gathered 4 rows a vector first, then transposed as Q4's,
// and its signed codes go in as q + 128 (the correction -128 sum xq starts the sum; Q6_K's, in
// [-32, 31], as q + 32, each half's -32 sum xq starting its own chain: w[0..3] are codes 0-15,
// w[4..7] codes 16-31). qb null:
// no second group, its lanes compute zeros (or Q8_0's offset) that nobody reads.
template <int64_t T>
inline void pair_block(const uint8_t* qa, const uint8_t* qb, int64_t b, __m512i w[8]) {
  constexpr int64_t BYTES = quant_bytes(T) * 8;  // a group's block b: its 8 rows side by side
  const uint8_t* p[2] = {qa + b * BYTES, qb ? qb + b * BYTES : nullptr};
  auto load = [&](int g, int64_t o) { return p[g] ? _mm512_loadu_si512(p[g] + o) : _mm512_setzero_si512(); };
  if constexpr (int8_codes(T)) {
    __m512i h0[4], h1[4];
    for (int m = 0; m < 4; ++m) {  // rows 4m..4m+3: group m / 2, its vectors 2 (m % 2), + 1
      const __m512i z0 = load(m / 2, 128 * (m % 2)), z1 = load(m / 2, 128 * (m % 2) + 64);
      h0[m] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(2, 0, 2, 0));  // [r0, r1 | r2, r3] first halves
      h1[m] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(3, 1, 3, 1));
    }
    transpose4(h0, w);
    transpose4(h1, w + 4);
    if constexpr (T == Q6_K) {
      const __m512i off6 = _mm512_set1_epi8(32);
      for (int c = 0; c < 8; ++c) w[c] = _mm512_add_epi8(w[c], off6);
    } else {
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int c = 0; c < 8; ++c) w[c] = _mm512_xor_si512(w[c], flip);
    }
  } else if constexpr (T == Q5_0) {
    // The fifth bits go in before the transposes, while a vector's 4 rows are one 64-bit mask
    // (the transposes only move dwords, so the two halves transpose apart).
    const __m512i nib = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    __m512i lo[4], hi[4];
    for (int m = 0; m < 4; ++m) {  // rows 4m..4m+3: group m / 2's rows 4 (m % 2) on
      const int g = m / 2, h = m % 2;
      const __m512i v = load(g, 64 * h);
      lo[m] = _mm512_and_si512(v, nib);
      hi[m] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      if (p[g]) {
        const uint64_t* bits = reinterpret_cast<const uint64_t*>(p[g] + 8 * row_bytes(T));
        lo[m] = _mm512_mask_add_epi8(lo[m], bits[h], lo[m], sixteen);
        hi[m] = _mm512_mask_add_epi8(hi[m], bits[2 + h], hi[m], sixteen);
      }
    }
    transpose4(lo, w);
    transpose4(hi, w + 4);
  } else {
    const __m512i v[4] = {load(0, 0), load(0, 64), load(1, 0), load(1, 64)};
    __m512i t[4];
    transpose4(v, t);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
      w[c] = _mm512_and_si512(t[c], nib);
      w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(t[c], 4), nib);
    }
  }
}

// Every type on VNNI, two groups (16 output rows) at a time with one int32 lane per output
// row (pair_block). Against x's dwords c broadcast to every lane, 8 vpdpbusd sum all 32
// products of each row's block in its lane (Q6_K: 4 for each half, in two lanes' worth of
// chains), and one conversion and one FMA (Q6_K: two) scale 16 rows' blocks: a quarter
// (Q8_0 and Q6_K: an eighth) of group_vnni's float work per product. The
// transposes are shared by the MR rows of x. Q4_1's and Q4_K's min term m * s_b is one more
// FMA per block, with the mins spread as the scales are. qb, sb and mb are the second
// group's (null: none).
using Dword = int32_t __attribute__((may_alias, aligned(1)));  // 4 codes of x, read in place
constexpr int64_t AHEAD = 8;  // blocks between a prefetch and its use (4 and 16 measured no better)

template <int64_t T, int MR>
void pair_vnni(const uint8_t* qa, const uint8_t* qb, const Scale<T>* sa, const Scale<T>* sb, const Scale<T>* ma,
               const Scale<T>* mb, const QRows& x, int64_t r0, float* y, int64_t ldy, int64_t valid) {
  constexpr bool CORR = T == Q4_0 || T == Q5_0 || T == Q8_0 || T == Q6_K;  // codes with an offset: x.corr starts the sum
  constexpr int64_t BYTES = quant_bytes(T) * 8;
  const __m512i rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  // Q6_K's two scales a block: row n's half h is float 2n + h of the two groups' 32 (a's rows
  // 0-7, then b's 8-15), so lane l of half h takes float 2 rows[l] + h.
  const __m512i halves[2] = {_mm512_slli_epi32(rows, 1), _mm512_add_epi32(_mm512_slli_epi32(rows, 1), _mm512_set1_epi32(1))};
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nblocks; ++b) {
    // The first tile of a pair reads its blocks from memory: ask for them ahead, so that the
    // loads overlap the arithmetic of the blocks before (the later tiles find them in cache).
    // Past the pair's last block, the next pair's: groups g + 2 and g + 3 follow qb's blocks,
    // and both are asked for (asking for qa's and qb's blocks past their ends had warmed only
    // the first; the LM head at 11 rows took a quarter less time with both). Prefetches past
    // the end of the weight are harmless.
    const int64_t j = b + AHEAD, nb = x.nblocks;
    const uint8_t* pa = j < nb ? qa + j * BYTES : qa + (nb + j) * BYTES;
    const uint8_t* pb = j >= nb ? qa + (2 * nb + j) * BYTES : qb ? qb + j * BYTES : nullptr;
    for (int64_t l = 0; l < BYTES; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(pa + l), _MM_HINT_T0);
      if (pb) _mm_prefetch(reinterpret_cast<const char*>(pb + l), _MM_HINT_T0);
    }
    __m512i w[8];
    pair_block<T>(qa, qb, b, w);
    __m512 dw, dw1 = _mm512_setzero_ps();  // Q6_K: the scales of codes 0-15 and 16-31
    if constexpr (T == Q6_K) {
      const __m512 s0 = _mm512_loadu_ps(sa + b * 16), s1 = sb ? _mm512_loadu_ps(sb + b * 16) : _mm512_setzero_ps();
      dw = _mm512_permutex2var_ps(s0, halves[0], s1);
      dw1 = _mm512_permutex2var_ps(s0, halves[1], s1);
    } else {
      dw = _mm512_permutexvar_ps(rows, load16<T>(sa, sb, nb, b));
    }
    __m512 mw = _mm512_setzero_ps();
    if constexpr (has_min(T)) mw = _mm512_permutexvar_ps(rows, load16<T>(ma, mb, nb, b));
    // The rows' sums are independent chains of 8 vpdpbusd (4 cycles each): issued row after
    // row, the core needs several rows' code in flight to keep its pipes busy, so the chains
    // go interleaved, in runs of up to 6 rows (7-11 rows: two runs; runs of 8 ran 6-8% slower
    // on a Zen 4, out of general registers for the rows' addresses). Runs of up to 4 rows
    // would leave too few chains: there codes 0-15 and 16-31 are two chains per row (Q6_K's
    // always, each with its own scale, in runs of up to 4 rows for the registers).
    auto run = [&](auto count, int s0) {
      constexpr int R = decltype(count)::value, CH = R <= 4 || T == Q6_K ? 2 : 1;
      __m512i d[R][CH];
      const Dword* xw[R];
      for (int i = 0; i < R; ++i) {
        const int64_t xi = (r0 + s0 + i) * x.nblocks + b;
        // x's dwords and the correction are broadcast straight from memory (a load, no vector
        // ALU work): through a general register each broadcast cost as much as a vpdpbusd.
        xw[i] = reinterpret_cast<const Dword*>(x.q + (r0 + s0 + i) * x.K + b * QK);
        if constexpr (T == Q6_K) {
          d[i][0] = _mm512_set1_epi32(x.corr[2 * xi]);
          d[i][1] = _mm512_set1_epi32(x.corr[2 * xi + 1]);
        } else {
          d[i][0] = CORR ? _mm512_set1_epi32(x.corr[xi]) : _mm512_setzero_si512();
          if constexpr (CH == 2) d[i][CH - 1] = _mm512_setzero_si512();
        }
      }
      for (int k = 0; k < 8; ++k) {
        const int c = CH == 2 ? k / 2 + 4 * (k % 2) : k, h = CH == 2 ? k % 2 : 0;  // 0, 4, 1, 5, ...
        for (int i = 0; i < R; ++i) d[i][h] = _mm512_dpbusd_epi32(d[i][h], w[c], _mm512_set1_epi32(xw[i][c]));
      }
      for (int i = 0; i < R; ++i) {
        const int r = s0 + i;
        const int64_t xi = (r0 + r) * x.nblocks + b;
        const __m512 dx = _mm512_set1_ps(x.d[xi]);
        if constexpr (T == Q6_K) {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i][0]), _mm512_mul_ps(dw, dx), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i][1]), _mm512_mul_ps(dw1, dx), acc[r]);
          continue;
        }
        const __m512 dot = _mm512_cvtepi32_ps(CH == 2 ? _mm512_add_epi32(d[i][0], d[i][CH - 1]) : d[i][0]);
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, dx), acc[r]);
        if constexpr (has_min(T)) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[xi]), acc[r]);
      }
    };
    if constexpr (T == Q6_K) {  // runs of 4, 4 and the rest
      constexpr int A = MR < 4 ? MR : 4, B = MR - A < 4 ? MR - A : 4, C = MR - A - B;
      run(std::integral_constant<int, A>{}, 0);
      if constexpr (B > 0) run(std::integral_constant<int, B>{}, A);
      if constexpr (C > 0) run(std::integral_constant<int, C>{}, A + B);
    } else {
      constexpr int SUB = MR <= 6 ? MR : (MR + 1) / 2;
      run(std::integral_constant<int, SUB>{}, 0);
      if constexpr (MR > SUB) run(std::integral_constant<int, MR - SUB>{}, SUB);
    }
  }
  // The same permutation puts the lanes back in row order (a 4x4 transpose is its own
  // inverse): each row of x gets its 16 outputs with one store.
  const __mmask16 keep = valid >= 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_permutexvar_ps(rows, acc[r]));
}
#endif

// f(std::integral_constant<int, mr>{}, r) for a tile of mr <= MR rows.
template <int MR, typename F>
inline void tile_of(int64_t mr, F& f, int64_t r) {
  if constexpr (MR > 1) {
    if (mr < MR) return tile_of<MR - 1>(mr, f, r);
  }
  f(std::integral_constant<int, MR>{}, r);
}

// Calls f(std::integral_constant<int, MR>{}, r) for tiles covering [0, M) of at most 11 rows, as
// even as the count allows (20 rows: 10 and 10), so that every tile shares its weights' unpacking
// among as many rows as it can. (Tiles of 12 ran about 5% slower on a Zen 4: 12 accumulators, 8
// vectors of codes and a run's 6 sums crowd the 32 vector registers.)
template <typename F>
void even_tiles(int64_t M, F&& f) {
  const int64_t n = (M + 10) / 11;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t r = t * M / n;
    tile_of<11>((t + 1) * M / n - r, f, r);
  }
}

// Groups [g0, g1) of 8 output rows against the M rows of x (g0 even: pairs of groups start there).
template <int64_t T>
void run_groups(const uint8_t* qs, const Scale<T>* scale, const Scale<T>* mins, const QRows& x, int64_t M, float* y,
                int64_t N, int64_t isa, int64_t g0, int64_t g1) {
  constexpr int64_t QB = quant_bytes(T);
  const int64_t nb = x.nblocks;
  auto qg_of = [&](int64_t g) { return qs + g * nb * 8 * QB; };
  auto sg_of = [&](int64_t g) { return scale + g * group_scales(T, nb); };
  auto mg_of = [&](int64_t g) { return has_min(T) ? mins + g * group_scales(T, nb) : nullptr; };
  // v[i]: row 8g + i of y's row r, its min term added unless the kernel added it (mins_in)
  auto put = [&](int64_t g, int64_t r, const float* v, bool mins_in) {
    const int64_t n0 = g * 8, nn = std::min<int64_t>(8, N - n0);
    float mterm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (has_min(T) && !mins_in) min_term<T>(mg_of(g), x.s + r * nb, nb, isa, mterm);
    for (int64_t i = 0; i < nn; ++i) y[r * N + n0 + i] = v[i] + mterm[i];
  };
#ifdef AIOLM_I8_VNNI
  if (isa == AVX512_VNNI && M > 2) {
    for (int64_t g = g0; g < g1; g += 2) {
      const bool two = g + 1 < g1;
      even_tiles(M, [&](auto mr, int64_t r) {
        constexpr int MR = decltype(mr)::value;
        pair_vnni<T, MR>(qg_of(g), two ? qg_of(g + 1) : nullptr, sg_of(g), two ? sg_of(g + 1) : nullptr,
                         mg_of(g), two ? mg_of(g + 1) : nullptr, x, r, y + r * N + g * 8, N,
                         std::min<int64_t>(two ? 16 : 8, N - g * 8));  // the min terms are in already
      });
    }
    return;
  }
#endif
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* qg = qg_of(g);
    const Scale<T>* sg = sg_of(g);
    // Tiles of MR rows of x; each tile reads the group's blocks once (they stay in L1).
    auto tile = [&](auto mr, auto group_fn, int64_t r, bool mins_in) {
      constexpr int MR = decltype(mr)::value;
      float o[8][MR];
      group_fn(r, o);
      for (int k = 0; k < MR; ++k) {
        float v[8];
        for (int i = 0; i < 8; ++i) v[i] = o[i][k];
        put(g, r + k, v, mins_in);
      }
    };
    auto tiles = [&](auto group_fn_2, auto group_fn_1, bool mins_in) {
      int64_t r = 0;
      for (; r + 2 <= M; r += 2) tile(std::integral_constant<int, 2>{}, group_fn_2, r, mins_in);
      if (r < M) tile(std::integral_constant<int, 1>{}, group_fn_1, r, mins_in);
    };
#ifdef AIOLM_I8_VNNI
    if (isa == AVX512_VNNI) {
      const Scale<T>* mg = mg_of(g);
      tiles([&](int64_t r, float o[8][2]) { group_vnni<T, 2>(qg, sg, mg, x, r, o); },
            [&](int64_t r, float o[8][1]) { group_vnni<T, 1>(qg, sg, mg, x, r, o); }, true);
      continue;
    }
#endif
#ifdef AIOLM_I8_AVX2
    if (isa == AVX2) {
      tiles([&](int64_t r, float o[8][2]) { group_avx2<T, 2>(qg, sg, x, r, o); },
            [&](int64_t r, float o[8][1]) { group_avx2<T, 1>(qg, sg, x, r, o); }, false);
      continue;
    }
#endif
    for (int64_t r = 0; r < M; ++r) {
      float v[8];
      group_scalar<T>(qg, sg, x, r, v);
      put(g, r, v, false);
    }
  }
}

inline int64_t pick_isa(int64_t isa) {
  TORCH_CHECK(isa >= -1 && isa <= best_isa(), "aiolm::gguf_int8_linear: isa ", isa,
              " is not built here (0 scalar, 1 AVX2, 2 AVX-512 VNNI; this build has up to ", best_isa(), ")");
  return isa < 0 ? best_isa() : isa;
}

// The call's buffers: x's codes, scales, code sums and d * sums, reused across calls
// (an allocation per call would cost as much as a small layer's dot products).
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum, half, corr;
  QRows rows(const float* x, int64_t M, int64_t K, int64_t isa, int64_t qtype) {
    const int64_t nb = K / QK;
    q.resize(M * K);
    d.resize(M * nb);
    s.resize(M * nb);
    sum.resize(M * nb);
    // A prompt's rows are quantized on every thread (on one, a long prompt's quantization
    // would stall the others for a share of the matmul).
    at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
      quantize_rows(x + r0 * K, r1 - r0, K, isa, q.data() + r0 * K, d.data() + r0 * nb, sum.data() + r0 * nb,
                    s.data() + r0 * nb);
    });
    const bool halves = qtype == Q6_K && isa == AVX512_VNNI;
    // pair_vnni's starting values: only its path reads them.
    const int32_t off = isa != AVX512_VNNI ? 0
                        : qtype == Q4_0   ? 8
                        : qtype == Q5_0   ? 16
                        : qtype == Q8_0   ? 128
                        : qtype == Q6_K   ? 32
                                          : 0;
    if (halves) {
      half.assign(M * nb * 2, 0);
      for (int64_t i = 0; i < M * K; ++i) half[i / 16] += q[i];
      corr.resize(M * nb * 2);
      for (int64_t i = 0; i < M * nb * 2; ++i) corr[i] = -off * half[i];
    } else if (off) {
      corr.resize(M * nb);
      for (int64_t i = 0; i < M * nb; ++i) corr[i] = -off * sum[i];
    }
    return QRows{q.data(), d.data(), sum.data(), s.data(), K, nb, halves ? half.data() : nullptr,
                 off ? corr.data() : nullptr};
  }
};
}  // namespace aiolm_gguf_int8
