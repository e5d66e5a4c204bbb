// Paged attention for the CPU: every request of a flat, variable-length batch
// (decode rows and prefill chunks alike) attends to its KV pages where they
// lie, with no gather into contiguous buffers and no padding to the longest
// sequence.
//
// Work items are (request, tile of query rows), split over torch's own intra-op
// threads with at::parallel_for. The softmax is computed online, one page at a
// time, so nothing of size seq_len is ever materialised. A decode row reads each
// page from memory once and uses it for every head while it is in cache. A
// prefill tile of several rows (pages of 16 keys, head_dim 64 or 128) meets each
// page once per kv head with all its rows and query heads together, the keys
// transposed so that their scores are plain FMAs (~1.4x the row-by-row speed on
// a 2048-token prefill: benchmarks/bench_attention.py).
//
// Layout: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], float32,
// float16 or float8 e4m3 (the values as they are: a cache's scales are the caller's);
// q [num_tokens, num_heads, head_dim] float32; out the same shape as q.
//
// Two optional arguments, both 0 when unused: `window`, a sliding window (a query at
// position p sees keys j with p - window < j <= p, as Hugging Face masks them; the pages
// before a row's window are never read), and `softcap`, tanh soft-capping of the scaled
// scores (s -> softcap * tanh(s / softcap)). Without them every path runs as before, with
// one compare per page: the window's first key is 0.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vendor.h"
#include "paged_attention.h"
#include "row_ops.h"
#include "vec.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));

constexpr int64_t kTile = 16;      // query rows per work item in prefill chunks

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

// The KV cache holds float32, or float16 (CPU bfloat16 matmuls: half the bytes a decode
// step reads, and 8x finer than bfloat16). Reads of K and V go through these overloads.
using half = c10::Half;

inline float to_float(float x) { return x; }
inline float to_float(half x) { return static_cast<float>(x); }

inline v8f load8(const half* p) {
#if defined(__F16C__)
  return v8f(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// An fp8 cache (float8 e4m3, --kv-cache-dtype fp8) holds each value's byte. Its bits moved
// into a float16's, sign to sign and exponent and mantissa to the low ones, are a float16
// worth the e4m3 value / 256 exactly (the exponent biases differ by 8, subnormals included),
// so a byte converts with two shifts and the F16C conversion, then one multiply.
struct fp8 {
  uint8_t bits;
};

inline uint16_t fp8_as_half_bits(uint8_t b) { return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }
inline float to_float(fp8 x) {
  return static_cast<float>(c10::Half(fp8_as_half_bits(x.bits), c10::Half::from_bits())) * 256.f;
}

#if defined(__F16C__)
inline __m128i fp8_half_bits8(__m128i w) {  // 8 bytes widened to 16-bit lanes
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
}
#endif

inline v8f load8(const fp8* p) {
#if defined(__F16C__)
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return v8f(_mm256_mul_ps(_mm256_cvtph_ps(fp8_half_bits8(w)), _mm256_set1_ps(256.f)));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = to_float(p[i]);
  return v;
#endif
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const fp8* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
#endif

inline float hsum(v8f v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

template <typename KV>
inline float dot(const float* a, const KV* b, int64_t d) {
  if (d % 8 == 0) {
    v8f acc0 = {0, 0, 0, 0, 0, 0, 0, 0};
    v8f acc1 = acc0;
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      acc0 += load8(a + i) * load8(b + i);
      acc1 += load8(a + i + 8) * load8(b + i + 8);
    }
    for (; i < d; i += 8) acc0 += load8(a + i) * load8(b + i);
    return hsum(acc0 + acc1);
  }
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * to_float(b[i]);
  return s;
}

template <typename KV>
inline void axpy(float* y, float a, const KV* x, int64_t d) {
  if (d % 8 == 0) {
    v8f av = {a, a, a, a, a, a, a, a};
    for (int64_t i = 0; i < d; i += 8) store8(y + i, load8(y + i) + av * load8(x + i));
    return;
  }
  for (int64_t i = 0; i < d; ++i) y[i] += a * to_float(x[i]);
}


// scores[t] = exp(scores[t] - m) for t < n; returns their sum (16 or 8 lanes at a time).
inline float exp_shifted(float* scores, int64_t n, float m) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 mv16 = _mm512_set1_ps(m);
  __m512 acc16 = _mm512_setzero_ps();
  for (; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 p = aiolm_vec::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores + t), mv16));
    _mm512_mask_storeu_ps(scores + t, k, p);
    acc16 = _mm512_add_ps(acc16, _mm512_maskz_mov_ps(k, p));
  }
  sum = _mm512_reduce_add_ps(acc16);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 p = aiolm_vec::exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
    _mm256_storeu_ps(scores + t, p);
    acc = _mm256_add_ps(acc, p);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - m);
    sum += scores[t];
  }
  return sum;
}

// One page of the online softmax for one query vector: folds the page's n scores
// (their max bmax) into the running max m and sum l, turns the scores into exp(s - m)
// in place, and returns the factor the running output must be scaled by first.
inline float softmax_page(float* scores, int64_t n, float bmax, float& m, float& l) {
  const float new_m = std::max(m, bmax);
  const float correction = std::exp(m - new_m);  // exp(-inf) = 0 on the first page
  l = l * correction + exp_shifted(scores, n, new_m);
  m = new_m;
  return correction;
}

// Soft-caps n scores in place; returns the capped page max (tanh is monotonic, so it is
// the cap of the max). Only called when a cap is set.
inline float softcap_page(float* scores, int64_t n, float bmax, float cap) {
  const float inv = 1.f / cap;
  for (int64_t t = 0; t < n; ++t) scores[t] = cap * std::tanh(scores[t] * inv);
  return cap * std::tanh(bmax * inv);
}

// The first key a query at position `pos` sees: 0 without a window.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

inline void scale_inplace(float* y, float a, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] *= a;
}

// Scores of one query head against `rows` keys, head_dim = 8 * ND: q is held in
// registers. Eight keys are in flight at once, each with its own accumulator, and
// their eight horizontal sums come out of one hadd tree as a vector (a horizontal
// sum per key, done alone, cost more than the key's FMAs).
template <int ND, typename KV>
inline float scores_fixed(const float* q, const KV* k, int64_t stride, int64_t rows, float scale,
                          float* out) {
  v8f qv[ND];
  for (int i = 0; i < ND; ++i) qv[i] = load8(q + 8 * i);
  float bmax = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(bmax);
  for (; t + 8 <= rows; t += 8) {
    const KV* kt = k + t * stride;
    v8f a[8];
    for (int j = 0; j < 8; ++j) a[j] = qv[0] * load8(kt + j * stride);
    for (int i = 1; i < ND; ++i)
      for (int j = 0; j < 8; ++j) a[j] += qv[i] * load8(kt + j * stride + 8 * i);
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(a[0]), __m256(a[1])),
                                     _mm256_hadd_ps(__m256(a[2]), __m256(a[3])));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(a[4]), __m256(a[5])),
                                     _mm256_hadd_ps(__m256(a[6]), __m256(a[7])));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    const __m256 x = _mm256_mul_ps(sums, sv);
    _mm256_storeu_ps(out + t, x);
    mv = _mm256_max_ps(mv, x);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  for (int j = 0; j < 8; ++j) bmax = std::max(bmax, lanes[j]);
#endif
  for (; t < rows; ++t) {
    const KV* k0 = k + t * stride;
    v8f a0 = qv[0] * load8(k0);
    for (int i = 1; i < ND; ++i) a0 += qv[i] * load8(k0 + 8 * i);
    out[t] = hsum(a0) * scale;
    bmax = std::max(bmax, out[t]);
  }
  return bmax;
}

// acc = acc * correction + sum_t p[t] v[t], head_dim = 8 * ND, the accumulator in registers.
template <int ND, typename KV>
inline void accumulate_fixed(float* acc, float correction, const float* p, const KV* v, int64_t stride,
                             int64_t rows) {
  const v8f c = {correction, correction, correction, correction, correction, correction, correction, correction};
  v8f a[ND];
  for (int i = 0; i < ND; ++i) a[i] = load8(acc + 8 * i) * c;
  for (int64_t t = 0; t < rows; ++t) {
    const float pt = p[t];
    const v8f pv = {pt, pt, pt, pt, pt, pt, pt, pt};
    const KV* vr = v + t * stride;
    for (int i = 0; i < ND; ++i) a[i] += pv * load8(vr + 8 * i);
  }
  for (int i = 0; i < ND; ++i) store8(acc + 8 * i, a[i]);
}

struct Shapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group, table_width;
  int64_t q_tok_stride, q_head_stride;    // strides of q
  int64_t o_tok_stride, o_head_stride;    // strides of out
  int64_t kv_block_stride, kv_row_stride;  // strides of the caches
  int64_t window;                          // sliding window in keys; 0: none
  float softcap;                           // tanh cap of the scaled scores; 0: none
};

// One query row's online-softmax state for every head, laid out in the worker's scratch:
// the output accumulators, a page of scores, the running max and sum, and the page's
// correction of them.
struct RowState {
  float *acc, *scores, *m, *l, *c;  // [H, d], [H, block_size], [H], [H], [H]

  RowState(const Shapes& s, std::vector<float>& scratch)
      : acc(scratch.data()), scores(acc + s.num_heads * s.head_dim), m(scores + s.num_heads * s.block_size),
        l(m + s.num_heads), c(l + s.num_heads) {
    std::fill(m, m + s.num_heads, -std::numeric_limits<float>::infinity());
    std::fill(l, l + s.num_heads, 0.f);
    std::fill(acc, acc + s.num_heads * s.head_dim, 0.f);
  }

  // out = acc / l, head by head, for query heads [h0, h1).
  void write(const Shapes& s, float* out_row, int64_t h0, int64_t h1) const {
    for (int64_t h = h0; h < h1; ++h) {
      const float inv = 1.f / l[h];
      float* oh = out_row + h * s.o_head_stride;
      const float* ah = acc + h * s.head_dim;
      for (int64_t i = 0; i < s.head_dim; ++i) oh[i] = ah[i] * inv;
    }
  }
};

// Pages lie anywhere: fetch page b + 1 of a row's n_keys keys while page b is used, a cache
// line at a time. On AMD's cores with plain loads of a byte per line: a core may drop a
// prefetch, but it must finish a load, and on a Zen 4 the loads took 0.73x the time of
// prefetch instructions, which did nothing there. On Intel's with prefetcht0: a load that
// misses holds up retirement where a prefetch does not, and on an AMX Xeon the prefetches
// take 0.93-0.94x the loads' time. benchmarks/ab_kernel.py decode-attn compares them
// (docs/benchmarks/log.md has the figures).
// Only kv heads [kh0, kh1) of each key are fetched: a row's heads may be split over threads.
template <typename KV>
inline void prefetch_next_page(const Shapes& s, const int64_t* table, int64_t b, int64_t n_keys, const KV* kc,
                               const KV* vc, int64_t kh0, int64_t kh1) {
  static const bool loads = aiolm_cpu::amd();
  const int64_t bs = s.block_size;
  if ((b + 1) * bs >= n_keys) return;
  const char* kn = reinterpret_cast<const char*>(kc + table[b + 1] * s.kv_block_stride);
  const char* vn = reinterpret_cast<const char*>(vc + table[b + 1] * s.kv_block_stride);
  const int64_t keys = std::min(bs, n_keys - (b + 1) * bs), row = s.kv_row_stride * int64_t(sizeof(KV));
  const int64_t first = kh0 * s.head_dim * int64_t(sizeof(KV)), last = kh1 * s.head_dim * int64_t(sizeof(KV));
  int sum = 0;
  auto fetch = [&](int64_t off) {
    if (loads) {
      sum += kn[off] + vn[off];
    } else {
      __builtin_prefetch(kn + off, 0, 3);
      __builtin_prefetch(vn + off, 0, 3);
    }
  };
  if (kh0 == 0 && kh1 == s.num_kv_heads) {  // whole keys: the page is one stretch
    for (int64_t off = 0; off < keys * row; off += 64) fetch(off);
  } else {
    for (int64_t t = 0; t < keys; ++t)
      for (int64_t off = t * row + first; off < t * row + last; off += 64) fetch(off);
  }
  asm volatile("" : : "r"(sum));  // keeps the loads: nothing else reads their sum
}

// One query row, query heads [h0, h1) (whole kv heads or not): softmax(q K^T * scale) V over keys
// [key0, n_keys), reading the pages listed in the block table. Every head is done page by
// page so that a page (its kv heads of block_size tokens) comes from memory once and is then
// reused from cache by every query head. A head's arithmetic does not depend on the range,
// so splitting a row's heads over threads gives the same bits. key0 > 0 only under a sliding
// window: the row's first page is then read from key0's offset.
template <typename KV>
void attend_row(const Shapes& s, const float* q_row, float* out_row, const int64_t* table, int64_t key0,
                int64_t n_keys, const KV* kc, const KV* vc, float scale, std::vector<float>& scratch, int64_t h0,
                int64_t h1) {
  const int64_t d = s.head_dim, bs = s.block_size, G = s.group;
  RowState st(s, scratch);
  float *acc = st.acc, *scores = st.scores, *m = st.m, *l = st.l;
  const int64_t n_blocks = (n_keys + bs - 1) / bs;
  const int64_t kh0 = h0 / G, kh1 = (h1 + G - 1) / G;  // the kv heads of those query heads
  for (int64_t b = key0 / bs; b < n_blocks; ++b) {
    const int64_t block = table[b];
    const int64_t skip = std::max<int64_t>(0, key0 - b * bs);  // keys of this page before the window
    const int64_t rows = std::min(bs, n_keys - b * bs) - skip;
    prefetch_next_page(s, table, b, n_keys, kc, vc, kh0, kh1);
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const int64_t g0 = std::max(h0 - kh * G, int64_t(0)), g1 = std::min(h1 - kh * G, G);  // its heads here
      const KV* kb = kc + block * s.kv_block_stride + skip * s.kv_row_stride + kh * d;
      const KV* vb = vc + block * s.kv_block_stride + skip * s.kv_row_stride + kh * d;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t h = kh * G + g;
        const float* qh = q_row + h * s.q_head_stride;
        float* sh = scores + h * bs;
        float bmax;
        if (d == 64) {
          bmax = scores_fixed<8>(qh, kb, s.kv_row_stride, rows, scale, sh);
        } else if (d == 128) {
          bmax = scores_fixed<16>(qh, kb, s.kv_row_stride, rows, scale, sh);
        } else {
          bmax = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < rows; ++t) {
            const float x = dot(qh, kb + t * s.kv_row_stride, d) * scale;
            sh[t] = x;
            bmax = std::max(bmax, x);
          }
        }
        if (s.softcap > 0.f) bmax = softcap_page(sh, rows, bmax, s.softcap);
        const float correction = softmax_page(sh, rows, bmax, m[h], l[h]);
        float* ah = acc + h * d;
        if (d == 64) {
          accumulate_fixed<8>(ah, correction, sh, vb, s.kv_row_stride, rows);
        } else if (d == 128) {
          accumulate_fixed<16>(ah, correction, sh, vb, s.kv_row_stride, rows);
        } else {
          if (correction != 1.f) scale_inplace(ah, correction, d);
          for (int64_t t = 0; t < rows; ++t) axpy(ah, sh[t], vb + t * s.kv_row_stride, d);
        }
      }
    }
  }
  st.write(s, out_row, h0, h1);
}

#if defined(__AVX512F__)
// Lane t of the result = the sum of a[t]'s 16 lanes: four rounds of pairwise shuffles
// and adds (46 instructions for 16 keys; a horizontal sum per key costs more).
inline __m512 reduce16(__m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 128-bit chunks: [key i: 2 chunks | key i + 8: 2 chunks]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // chunks: keys i, i + 8, i + 4, i + 12 (4 partial sums each)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // per chunk: [c[i]'s key, c[i + 2]'s key] interleaved, 2 partials each
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // e's lanes hold keys 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, e);
}

// Scaled scores of one query head (NZ zmm in registers) against n <= 16 keys; returns their max.
template <int NZ, typename KV>
inline float scores16(const __m512 qv[NZ], const KV* k, int64_t stride, int64_t n, float scale, float* out) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    a[t] = _mm512_setzero_ps();
    if (t < n) {
      const KV* kt = k + t * stride;
#pragma GCC unroll 8
      for (int i = 0; i < NZ; ++i) a[t] = _mm512_fmadd_ps(qv[i], load16(kt + 16 * i), a[t]);
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  const __m512 x = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, valid, x);
  return _mm512_mask_reduce_max_ps(valid, x);
}

// acc[g] = acc[g] * c[g] + sum_t p[g][t] v[t] for GC query heads at once (p rows `pstride`
// apart, acc rows d apart): each row of V is loaded once for all of them.
template <int NZ, int GC, typename KV>
inline void accumulate_heads(float* acc, const float* c, const float* p, int64_t pstride, const KV* v,
                             int64_t stride, int64_t rows) {
  constexpr int64_t d = 16 * NZ;
  __m512 a[GC][NZ];
#pragma GCC unroll 4
  for (int g = 0; g < GC; ++g) {
    const __m512 cg = _mm512_set1_ps(c[g]);
#pragma GCC unroll 8
    for (int i = 0; i < NZ; ++i) a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + 16 * i), cg);
  }
  for (int64_t t = 0; t < rows; ++t) {
    __m512 vv[NZ];
#pragma GCC unroll 8
    for (int i = 0; i < NZ; ++i) vv[i] = load16(v + t * stride + 16 * i);
#pragma GCC unroll 4
    for (int g = 0; g < GC; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * pstride + t]);
#pragma GCC unroll 8
      for (int i = 0; i < NZ; ++i) a[g][i] = _mm512_fmadd_ps(pg, vv[i], a[g][i]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GC; ++g)
#pragma GCC unroll 8
    for (int i = 0; i < NZ; ++i) _mm512_storeu_ps(acc + g * d + 16 * i, a[g][i]);
}

// One query row (a decode step), query heads [h0, h1) (whole kv heads or not), head_dim = 16 * NZ:
// page by page as attend_row does, with the scores of 16 keys reduced together and each V
// row loaded once for the query heads that share it (up to 12 accumulators in zmm registers).
template <int NZ, typename KV>
void attend_row_z(const Shapes& s, const float* q_row, float* out_row, const int64_t* table, int64_t key0,
                  int64_t n_keys, const KV* kc, const KV* vc, float scale, std::vector<float>& scratch, int64_t h0,
                  int64_t h1) {
  constexpr int64_t d = 16 * NZ;
  constexpr int GC = NZ == 4 ? 3 : 1;  // query heads per V pass
  const int64_t bs = s.block_size, G = s.group;
  RowState st(s, scratch);
  float *acc = st.acc, *scores = st.scores, *m = st.m, *l = st.l, *c = st.c;
  const int64_t n_blocks = (n_keys + bs - 1) / bs;
  // Head h's scaled scores of n keys k (rows `stride` apart), into its scores from key t0; their max.
  auto head_scores = [&](int64_t h, const auto* k, int64_t stride, int64_t n, int64_t t0) {
    __m512 qv[NZ];
    for (int i = 0; i < NZ; ++i) qv[i] = _mm512_loadu_ps(q_row + h * s.q_head_stride + 16 * i);
    return scores16<NZ>(qv, k, stride, n, scale, scores + h * bs + t0);
  };
  for (int64_t b = key0 / bs; b < n_blocks; ++b) {
    const int64_t block = table[b];
    const int64_t skip = std::max<int64_t>(0, key0 - b * bs);  // keys of this page before the window
    const int64_t rows = std::min(bs, n_keys - b * bs) - skip;
    for (int64_t kh = h0 / G; kh < (h1 + G - 1) / G; ++kh) {  // the kv heads of those query heads
      const int64_t g0 = std::max(h0 - kh * G, int64_t(0)), g1 = std::min(h1 - kh * G, G);  // its heads here
      // Each kv head asks for its part of the next page before its own pass: a float32 page's
      // K and V at once (24 KB with 3 kv heads of 64) held up the first head's pass.
      prefetch_next_page(s, table, b, n_keys, kc, vc, kh, kh + 1);
      const KV* kb = kc + block * s.kv_block_stride + skip * s.kv_row_stride + kh * d;
      const KV* vb = vc + block * s.kv_block_stride + skip * s.kv_row_stride + kh * d;
      // The scores of the kv head's query heads, 16 keys at a time: a narrower cache's 16 keys
      // convert once, into float32 in L1, for all of those heads (each would convert them again).
      float* bmax = c + kh * G;  // the heads' score maxima, until their corrections take the place
      std::fill(bmax, bmax + G, -std::numeric_limits<float>::infinity());
      for (int64_t t0 = 0; t0 < rows; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, rows - t0);
        const KV* kt = kb + t0 * s.kv_row_stride;
        if constexpr (!std::is_same_v<KV, float>) {
          alignas(64) float keys[16 * d];
          for (int64_t t = 0; t < n; ++t)
#pragma GCC unroll 8
            for (int i = 0; i < NZ; ++i)
              _mm512_store_ps(keys + t * d + 16 * i, load16(kt + t * s.kv_row_stride + 16 * i));
          for (int64_t g = g0; g < g1; ++g) bmax[g] = std::max(bmax[g], head_scores(kh * G + g, keys, d, n, t0));
        } else {
          for (int64_t g = g0; g < g1; ++g)
            bmax[g] = std::max(bmax[g], head_scores(kh * G + g, kt, s.kv_row_stride, n, t0));
        }
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t h = kh * G + g;
        float* sh = scores + h * bs;
        const float hmax = s.softcap > 0.f ? softcap_page(sh, rows, bmax[g], s.softcap) : bmax[g];
        c[h] = softmax_page(sh, rows, hmax, m[h], l[h]);
      }
      int64_t g = g0;
      for (; g + GC <= g1; g += GC) {
        const int64_t h = kh * G + g;
        accumulate_heads<NZ, GC>(acc + h * d, c + h, scores + h * bs, bs, vb, s.kv_row_stride, rows);
      }
      for (; g < g1; ++g) {
        const int64_t h = kh * G + g;
        accumulate_heads<NZ, 1>(acc + h * d, c + h, scores + h * bs, bs, vb, s.kv_row_stride, rows);
      }
    }
  }
  st.write(s, out_row, h0, h1);
}
#endif

// Scores of J query vectors (rows of qb, d floats each) against one page of 16 keys
// held transposed (kt[dd * 16 + t]): each k vector serves J queries, with no
// horizontal sums. sb gets J rows of 16 scaled scores.
#if defined(__AVX512F__)
template <int J>
inline void scores_tile16(const float* qb, int64_t d, const float* kt, float scale, float* sb) {
  __m512 a[J];
#pragma GCC unroll 12
  for (int j = 0; j < J; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t dd = 0; dd < d; ++dd) {
    const __m512 k = _mm512_loadu_ps(kt + dd * 16);
#pragma GCC unroll 12
    for (int j = 0; j < J; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(qb[j * d + dd]), k, a[j]);
  }
  const __m512 sv = _mm512_set1_ps(scale);
#pragma GCC unroll 12
  for (int j = 0; j < J; ++j) _mm512_storeu_ps(sb + j * 16, _mm512_mul_ps(a[j], sv));
}
#else
template <int J>
inline void scores_tile16(const float* qb, int64_t d, const float* kt, float scale, float* sb) {
  v8f a[J][2];
#pragma GCC unroll 6
  for (int j = 0; j < J; ++j) a[j][0] = a[j][1] = v8f{0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t dd = 0; dd < d; ++dd) {
    const v8f k0 = load8(kt + dd * 16), k1 = load8(kt + dd * 16 + 8);
#pragma GCC unroll 6
    for (int j = 0; j < J; ++j) {
      const float x = qb[j * d + dd];
      const v8f b = {x, x, x, x, x, x, x, x};
      a[j][0] += b * k0;
      a[j][1] += b * k1;
    }
  }
  const v8f sv = {scale, scale, scale, scale, scale, scale, scale, scale};
#pragma GCC unroll 6
  for (int j = 0; j < J; ++j) {
    store8(sb + j * 16, a[j][0] * sv);
    store8(sb + j * 16 + 8, a[j][1] * sv);
  }
}
#endif

inline void scores_rows16(int64_t n, const float* qb, int64_t d, const float* kt, float scale, float* sb) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 12 <= n; j += 12) scores_tile16<12>(qb + j * d, d, kt, scale, sb + j * 16);
  if (n - j >= 6) {
    scores_tile16<6>(qb + j * d, d, kt, scale, sb + j * 16);
    j += 6;
  }
#else
  for (; j + 6 <= n; j += 6) scores_tile16<6>(qb + j * d, d, kt, scale, sb + j * 16);
#endif
  switch (n - j) {
    case 5: scores_tile16<5>(qb + j * d, d, kt, scale, sb + j * 16); break;
    case 4: scores_tile16<4>(qb + j * d, d, kt, scale, sb + j * 16); break;
    case 3: scores_tile16<3>(qb + j * d, d, kt, scale, sb + j * 16); break;
    case 2: scores_tile16<2>(qb + j * d, d, kt, scale, sb + j * 16); break;
    case 1: scores_tile16<1>(qb + j * d, d, kt, scale, sb + j * 16); break;
    default: break;
  }
}

// ob[j] = ob[j] * c[j] + sum_t p[j][t] v[t] for n query vectors (rows of p, 16 apart) over
// `rows` keys of a page. With AVX-512, four query vectors at a time share each v load
// (per lane the same FMAs in the same order as accumulate_fixed, which does the rest).
template <int ND, typename KV>
inline void accumulate_rows(int64_t n, float* ob, const float* c, const float* p, const KV* v, int64_t stride,
                            int64_t rows) {
  constexpr int64_t d = 8 * ND;
  int64_t j = 0;
#if defined(__AVX512F__)
  constexpr int NZ = ND / 2;
  for (; j + 4 <= n; j += 4) {
    __m512 a[4][NZ];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512 cr = _mm512_set1_ps(c[j + r]);
#pragma GCC unroll 8
      for (int i = 0; i < NZ; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(ob + (j + r) * d + 16 * i), cr);
    }
    for (int64_t t = 0; t < rows; ++t) {
      __m512 vv[NZ];
#pragma GCC unroll 8
      for (int i = 0; i < NZ; ++i) vv[i] = load16(v + t * stride + 16 * i);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m512 pr = _mm512_set1_ps(p[(j + r) * 16 + t]);
#pragma GCC unroll 8
        for (int i = 0; i < NZ; ++i) a[r][i] = _mm512_fmadd_ps(pr, vv[i], a[r][i]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < NZ; ++i) _mm512_storeu_ps(ob + (j + r) * d + 16 * i, a[r][i]);
  }
#endif
  for (; j < n; ++j) accumulate_fixed<ND>(ob + j * d, c[j], p + j * 16, v, stride, rows);
}

// A page's keys (rows < 16 of them, `stride` apart, head_dim 8 * ND) transposed into kt
// [d, 16], the keys past `rows` zero. With AVX-512, 16 x 16 blocks are transposed in
// registers (64 shuffles and 16 stores a block; the other paths store each value alone).
template <int ND, typename KV>
inline void transpose_page(const KV* kb, int64_t stride, int64_t rows, float* kt) {
  constexpr int64_t d = 8 * ND, bs = 16;
#if defined(__AVX512F__)
  for (int64_t c = 0; c < d; c += 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? load16(kb + i * stride + c) : _mm512_setzero_ps();
    aiolm_vec::transpose16(r, t);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (c + i) * bs, t[i]);
  }
#else
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t dd = 0; dd < d; dd += 8) {
      const v8f r = load8(kb + t * stride + dd);
      for (int j = 0; j < 8; ++j) kt[(dd + j) * bs + t] = r[j];
    }
  for (int64_t t = rows; t < bs; ++t)
    for (int64_t dd = 0; dd < d; ++dd) kt[dd * bs + t] = 0.f;
#endif
}

#if defined(__AVX512F__)
// One query vector's page of scores sh[16] as softmax_page folds it, for the keys [beg, end)
// it sees, in one vector: the page max, the exp of each score less the new running max,
// zeros for the keys it does not see. The running sums' correction exp(m - new m) is 1
// where the max stands, so the call is skipped there (exp(0) is 1 exactly). The same values
// as softmax_page gives (its sum adds the lanes in another order only for a row whose window
// starts inside the page).
inline void softmax_row16(float* sh, int64_t beg, int64_t end, float& m, float& l, float& c) {
  const __mmask16 k = static_cast<__mmask16>(((1u << end) - 1) & ~((1u << beg) - 1));
  const __m512 x = _mm512_maskz_loadu_ps(k, sh);
  const float new_m = std::max(m, _mm512_mask_reduce_max_ps(k, x));
  c = new_m == m ? 1.f : std::exp(m - new_m);
  const __m512 p = _mm512_maskz_mov_ps(k, aiolm_vec::exp16(_mm512_sub_ps(x, _mm512_set1_ps(new_m))));
  _mm512_storeu_ps(sh, p);
  l = l * c + _mm512_reduce_add_ps(p);
  m = new_m;
}
#endif

// Query rows [i0, i1) of one request (a prefill tile), all heads, for pages of 16
// keys and head_dim = 8 * ND: per kv head, the tile's rows times the group's query
// heads form a block of query vectors that meets each page once, K transposed so
// the scores come from plain FMAs. Rows see keys up to their own position (causal) and,
// under a sliding window, from their window's first key: pages before the first row's
// window are not read, and rows whose window has passed a page skip it.
template <int ND, typename KV>
void attend_tile(const Shapes& s, const float* q_tile, float* out_tile, const int64_t* table, int64_t ctx,
                 int64_t i0, int64_t i1, const KV* kc, const KV* vc, float scale, std::vector<float>& scratch) {
  constexpr int64_t d = 8 * ND, bs = 16;
  const int64_t G = s.group, R = (i1 - i0) * G;
  float* qb = scratch.data();  // [R, d] query vectors, row-major by (row, head in group)
  float* ob = qb + R * d;      // [R, d] unnormalised outputs
  float* sb = ob + R * d;      // [R, 16] scores, then probabilities
  float* mb = sb + R * bs;     // [R] running max
  float* lb = mb + R;          // [R] running sum of exp
  float* cb = lb + R;          // [R] this page's correction of the running sums
  float* kt = cb + R;          // [d, 16] the page's keys, transposed
  const int64_t n_keys = ctx + i1, n_blocks = (n_keys + bs - 1) / bs;
  const int64_t b_first = window_start(ctx + i0, s.window) / bs;
  for (int64_t kh = 0; kh < s.num_kv_heads; ++kh) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(qb + ((i - i0) * G + g) * d, q_tile + (i - i0) * s.q_tok_stride + (kh * G + g) * s.q_head_stride,
                    d * sizeof(float));
    std::fill(ob, ob + R * d, 0.f);
    std::fill(mb, mb + R, -std::numeric_limits<float>::infinity());
    std::fill(lb, lb + R, 0.f);
    for (int64_t b = b_first; b < n_blocks; ++b) {
      const int64_t key0 = b * bs, rows = std::min(bs, n_keys - key0);
      // rows [first, last) of the tile see keys of this page: the first ones see none yet
      // (causal), the last ones none any more (their window starts after it)
      const int64_t first = std::max<int64_t>(i0, key0 - ctx);
      const int64_t last = s.window > 0 ? std::min<int64_t>(i1, key0 + rows + s.window - 1 - ctx) : i1;
      if (last <= first) continue;
      const int64_t j0 = (first - i0) * G, j1 = (last - i0) * G;
      const KV* kb = kc + table[b] * s.kv_block_stride + kh * d;
      const KV* vb = vc + table[b] * s.kv_block_stride + kh * d;
      transpose_page<ND>(kb, s.kv_row_stride, rows, kt);
      scores_rows16(j1 - j0, qb + j0 * d, d, kt, scale, sb + j0 * bs);
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t pos = ctx + i0 + j / G;  // row j's position; it sees keys [beg, end) of this page
        const int64_t end = std::min(rows, pos + 1 - key0);
        const int64_t beg = std::max<int64_t>(0, window_start(pos, s.window) - key0);
        float* sh = sb + j * bs;
#if defined(__AVX512F__)
        if (s.softcap == 0.f) {
          softmax_row16(sh, beg, end, mb[j], lb[j], cb[j]);
          continue;
        }
#endif
        float bmax = -std::numeric_limits<float>::infinity();
        for (int64_t t = beg; t < end; ++t) bmax = std::max(bmax, sh[t]);
        if (s.softcap > 0.f) bmax = softcap_page(sh + beg, end - beg, bmax, s.softcap);
        cb[j] = softmax_page(sh + beg, end - beg, bmax, mb[j], lb[j]);
        for (int64_t t = 0; t < beg; ++t) sh[t] = 0.f;  // keys before row j's window: weight 0
        for (int64_t t = end; t < rows; ++t) sh[t] = 0.f;  // keys after row j's own: weight 0
      }
      accumulate_rows<ND>(j1 - j0, ob + j0 * d, cb + j0, sb + j0 * bs, vb, s.kv_row_stride, rows);
    }
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = (i - i0) * G + g;
        const float inv = 1.f / lb[j];
        float* oh = out_tile + (i - i0) * s.o_tok_stride + (kh * G + g) * s.o_head_stride;
        for (int64_t dd = 0; dd < d; ++dd) oh[dd] = ob[j * d + dd] * inv;
      }
  }
}

// Every work item, on torch's threads: K and V of element type KV. With `team` (a thread of
// a team that runs this call on each of its `threads` threads, aiolm_attention::share), this
// thread takes units from the team's counter instead.
template <typename KV>
void run_items(const Shapes& s, const std::vector<int64_t>& item_req, const std::vector<int64_t>& item_row0,
               const int64_t* qsl, const int64_t* slen, const int64_t* table, const float* qp, float* op,
               const KV* kc, const KV* vc, float fscale, std::atomic<int64_t>* team = nullptr,
               int64_t team_threads = 0) {
  const int64_t n_items = static_cast<int64_t>(item_req.size());
  const int64_t threads = team ? team_threads : at::get_num_threads();
  // Fewer items than threads (a step of one or a few decode rows): each item's query heads are
  // split into `parts` even ranges, so that every thread has as much. A range may end inside a
  // kv head's group (9 heads over two threads: 4 and 5, where whole kv heads gave 3 and 6):
  // both ranges then read that kv head's pages. A head's sums do not depend on its range. A
  // prefill tile stays whole (its part 0 runs it).
  const int64_t parts =
      n_items > 0 && n_items < threads ? std::min(s.num_heads, (threads + n_items - 1) / n_items) : 1;
  const int64_t n_units = n_items * parts;
  // Items differ in cost (a decode row vs. a prefill tile), so threads take them
  // one at a time from a shared counter rather than in fixed, equal ranges.
  std::atomic<int64_t> own{0};
  std::atomic<int64_t>& next = team ? *team : own;
  const int64_t n_workers = std::max<int64_t>(1, std::min<int64_t>(threads, n_units));
  // Prefill tiles of several rows take attend_tile where it has a kernel for the shape.
  const bool tiles = s.block_size == 16 && (s.head_dim == 64 || s.head_dim == 128);
  auto work = [&] {
    const int64_t R = kTile * s.group;
    std::vector<float> scratch(std::max(s.num_heads * (s.head_dim + s.block_size + 3),
                                        R * (2 * s.head_dim + s.block_size + 3) + s.head_dim * s.block_size));
    for (int64_t u = next.fetch_add(1); u < n_units; u = next.fetch_add(1)) {
      const int64_t w = u / parts, part = u % parts;
      const int64_t h0 = part * s.num_heads / parts, h1 = (part + 1) * s.num_heads / parts;  // query heads
      const int64_t r = item_req[w];
      const int64_t n = qsl[r + 1] - qsl[r];
      const int64_t ctx = slen[r] - n;
      const int64_t row_end = std::min(n, item_row0[w] + kTile);
      if (tiles && row_end - item_row0[w] > 1) {
        if (part != 0) continue;
        const int64_t tok = qsl[r] + item_row0[w];
        const float* qt = qp + tok * s.q_tok_stride;
        float* ot = op + tok * s.o_tok_stride;
        const int64_t* tr = table + r * s.table_width;
        if (s.head_dim == 64) {
          attend_tile<8>(s, qt, ot, tr, ctx, item_row0[w], row_end, kc, vc, fscale, scratch);
        } else {
          attend_tile<16>(s, qt, ot, tr, ctx, item_row0[w], row_end, kc, vc, fscale, scratch);
        }
        continue;
      }
      for (int64_t i = item_row0[w]; i < row_end; ++i) {
        const int64_t tok = qsl[r] + i;
        const float* qr = qp + tok * s.q_tok_stride;
        float* orow = op + tok * s.o_tok_stride;
        const int64_t* tr = table + r * s.table_width;
        const int64_t key0 = window_start(ctx + i, s.window);
#if defined(__AVX512F__)
        if (s.head_dim == 64) {
          attend_row_z<4>(s, qr, orow, tr, key0, ctx + i + 1, kc, vc, fscale, scratch, h0, h1);
          continue;
        }
        if (s.head_dim == 128) {
          attend_row_z<8>(s, qr, orow, tr, key0, ctx + i + 1, kc, vc, fscale, scratch, h0, h1);
          continue;
        }
#endif
        attend_row(s, qr, orow, tr, key0, ctx + i + 1, kc, vc, fscale, scratch, h0, h1);
      }
    }
  };
  if (team)
    work();
  else
    at::parallel_for(0, n_workers, 1, [&](int64_t, int64_t) { work(); });
}

void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                    double scale, int64_t window, double softcap, std::atomic<int64_t>* team,
                    int64_t team_threads) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "aiolm::paged_attention: float32 q and out expected");
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf ||
               k_cache.scalar_type() == at::kFloat8_e4m3fn) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "aiolm::paged_attention: float32, float16 or float8 e4m3 caches expected, both alike");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong,
              "aiolm::paged_attention: int64 block_table, query_start_loc and seq_lens expected");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must be [blocks, block_size, kv_heads, head_dim] alike");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == k_cache.size(3) && k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "head_dim must be contiguous and each page dense");
  TORCH_CHECK(block_table.is_contiguous() && query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "metadata tensors must be contiguous");
  TORCH_CHECK(window >= 0, "aiolm::paged_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "aiolm::paged_attention: softcap must be >= 0 (0: none), got ", softcap);

  Shapes s;
  s.num_heads = q.size(1);
  s.num_kv_heads = k_cache.size(2);
  s.head_dim = q.size(2);
  s.block_size = k_cache.size(1);
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  s.group = s.num_heads / s.num_kv_heads;
  TORCH_CHECK(k_cache.size(3) == s.head_dim, "head_dim of q and the caches differ");
  s.table_width = block_table.size(1);
  s.q_tok_stride = q.stride(0);
  s.q_head_stride = q.stride(1);
  s.o_tok_stride = out.stride(0);
  s.o_head_stride = out.stride(1);
  s.kv_block_stride = k_cache.stride(0);
  s.kv_row_stride = k_cache.stride(1);
  s.window = window;
  s.softcap = static_cast<float>(softcap);

  const int64_t num_reqs = seq_lens.size(0);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* slen = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();

  // Work items: (request, tile of query rows), times kv heads.
  std::vector<int64_t> item_req, item_row0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = qsl[r + 1] - qsl[r];
    TORCH_CHECK(n >= 0 && n <= slen[r], "request ", r, ": more query tokens than sequence tokens");
    TORCH_CHECK((slen[r] + s.block_size - 1) / s.block_size <= s.table_width,
                "request ", r, ": block table too narrow for its sequence");
    for (int64_t i = 0; i < n; i += kTile) {
      item_req.push_back(r);
      item_row0.push_back(i);
    }
  }
  const int64_t n_items = static_cast<int64_t>(item_req.size());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  if (k_cache.scalar_type() == at::kHalf) {
    run_items(s, item_req, item_row0, qsl, slen, table, qp, op, reinterpret_cast<const half*>(k_cache.data_ptr()),
              reinterpret_cast<const half*>(v_cache.data_ptr()), fscale, team, team_threads);
  } else if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    run_items(s, item_req, item_row0, qsl, slen, table, qp, op, reinterpret_cast<const fp8*>(k_cache.data_ptr()),
              reinterpret_cast<const fp8*>(v_cache.data_ptr()), fscale, team, team_threads);
  } else {
    run_items(s, item_req, item_row0, qsl, slen, table, qp, op, k_cache.data_ptr<float>(),
              v_cache.data_ptr<float>(), fscale, team, team_threads);
  }
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t window, double softcap) {
  attention_impl(out, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, window, softcap, nullptr, 0);
}

// The new tokens' K and V into their cache slots: k, v [tokens, kv_heads, head_dim]
// float32 (views of the QKV projection: any token stride, dense heads), into a cache
// [2, blocks, block_size, kv_heads, head_dim] of float32 or float16 (rounded to nearest
// even, as Tensor.to does). One call for both, where index_copy_ took two dispatches each.
// A negative slot is a padding row: nothing is written for it.
void write_kv_(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "aiolm::write_kv_: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf,
              "aiolm::write_kv_: a float32 or float16 cache expected");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "aiolm::write_kv_: float32 k and v expected");
  const int64_t hk = kv_cache.size(3), d = kv_cache.size(4), slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == hk && k.size(2) == d,
              "aiolm::write_kv_: k and v must be [tokens, kv_heads, head_dim] matching the cache");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d,
              "aiolm::write_kv_: each token's heads must be dense");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0),
              "aiolm::write_kv_: slot_mapping must be int64 [tokens]");
  const int64_t* sl = slot_mapping.data_ptr<int64_t>();
  const int64_t row = hk * d, n = k.size(0);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sl[t] < slots, "aiolm::write_kv_: slot ", sl[t], " is past the cache's ", slots, " slots");
  auto run = [&](auto* cache) {
    using KV = std::remove_pointer_t<decltype(cache)>;
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    at::parallel_for(0, n, 256, [&](int64_t t0, int64_t t1) {  // a prompt's tokens on every thread
      for (int64_t t = t0; t < t1; ++t)
        aiolm_rows::write_slot(cache, slots, row, sl[t], kp + t * k.stride(0), vp + t * v.stride(0));
    });
  };
  if (kv_cache.scalar_type() == at::kHalf) {
    run(kv_cache.data_ptr<at::Half>());
  } else {
    run(kv_cache.data_ptr<float>());
  }
}

}  // namespace

namespace aiolm_attention {

void share(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
           const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
           int64_t window, double softcap, std::atomic<int64_t>& next, int64_t threads) {
  attention_impl(out, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, window, softcap, &next,
                 threads);
}

}  // namespace aiolm_attention

TORCH_LIBRARY(aiolm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int window=0, float softcap=0.) -> ()");
  m.def("write_kv_(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_", &write_kv_);
}
