// One token drawn from a float32 row of logits with temperature, top-k, top-p and min-p,
// given the row's uniform number u in [0, 1): the sampler's random rows on the CPU
// (sample_rows.cpp's op) and the whole-step call's (decode_layer.cpp), the one function both
// take, so a step's token does not depend on which of them ran it.
//
// The distribution is the sampler's torch path's (aiolm/sample/sampler.py), in vLLM's order:
// the logits over the temperature; min-p drops tokens below min_p times the most likely
// one's probability; top-k keeps exactly k tokens (of equal values, the lower index first);
// what is kept is renormalised, and top-p then keeps the most likely tokens until the mass
// before the next one reaches p (the first always stays); the draw is the first token whose
// cumulative mass exceeds u times the kept total. The bits are this file's own: sums run in a fixed order here, not
// torch's, so a token may differ from the torch path's where u falls within rounding of a
// boundary between two tokens.
//
// Top-k rows, and top-p rows whose nucleus is within the 256 most likely tokens, draw over
// their candidates in order of likelihood; plain rows and wider nuclei over the vocabulary in
// index order. Where the cost goes on a 50k vocabulary: every random row reads its logits
// twice (max, then exp and block sums), with vector exps (vec.h); the candidates come from
// one pass that keeps the best 256 seen, rejecting a vector of values at once against the
// worst one kept; a wider nucleus from buckets of distance below the top (one pass for their
// mass), sorting only the tokens of the bucket where the mass reaches p.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "argmax.h"
#include "vec.h"

namespace aiolm_sample {

// A random row's settings: top_k <= 0 or >= the vocabulary, top_p >= 1 and min_p <= 0 turn
// each off. temperature > 0.
struct Knobs {
  float temperature = 1.f;
  int64_t top_k = 0;
  float top_p = 1.f;
  float min_p = 0.f;
};

// Per-thread buffers, grown once and reused row after row.
struct Scratch {
  std::vector<float> s;                        // the row over the temperature
  std::vector<float> e;                        // exps
  std::vector<float> blocks;                   // per 16 values: their sum, then the prefix
  std::vector<float> cand;                     // candidates' values, then their probabilities
  std::vector<float> tmp;                      // the row's values, partly ordered (best)
  std::vector<std::pair<float, int32_t>> top;  // candidates, best first
};

constexpr int64_t BLOCK = 16;
constexpr int64_t FIRST_WIDTH = 256;  // top-p's first candidates

// y[i] = exp(s[i] - m), 0 where s[i] is -inf; n a multiple of BLOCK (callers pad with -inf).
inline void exp_shifted(const float* s, int64_t n, float m, float* y) {
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(s + i);
    const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    _mm512_storeu_ps(y + i, _mm512_maskz_mov_ps(live, aiolm_vec::exp16(_mm512_sub_ps(v, mv))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    const __m256 live = _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ);
    _mm256_storeu_ps(y + i, _mm256_and_ps(live, aiolm_vec::exp8(_mm256_sub_ps(v, mv))));
  }
#else
  for (int64_t i = 0; i < n; ++i) y[i] = std::isinf(s[i]) && s[i] < 0 ? 0.f : std::exp(s[i] - m);
#endif
}

// s[i] = x[i] / temperature, -inf where that is NaN (a NaN logit is never drawn); returns
// the largest.
inline float scaled(const float* x, int64_t n, float temperature, float* s) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float m = ninf;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(temperature);
  __m512 mv = _mm512_set1_ps(ninf);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), t);
    const __m512 c = _mm512_mask_mov_ps(_mm512_set1_ps(ninf), _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
    _mm512_storeu_ps(s + i, c);
    mv = _mm512_max_ps(mv, c);
  }
  m = _mm512_reduce_max_ps(mv);
#elif defined(__AVX2__)
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 mv = _mm256_set1_ps(ninf);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), t);
    const __m256 c = _mm256_blendv_ps(_mm256_set1_ps(ninf), v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
    _mm256_storeu_ps(s + i, c);
    mv = _mm256_max_ps(mv, c);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float l : lanes) m = l > m ? l : m;
#endif
  for (; i < n; ++i) {
    const float v = x[i] / temperature;
    s[i] = std::isnan(v) ? ninf : v;
    m = s[i] > m ? s[i] : m;
  }
  return m;
}

// The first index j in [0, n) whose cumulative sum of p exceeds t (p >= 0, and the whole
// sum > t): the inverse CDF over a short list, summed in order.
inline int64_t first_above(const float* p, int64_t n, float t) {
  float c = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    c += p[j];
    if (c > t) return j;
  }
  for (int64_t j = n - 1; j > 0; --j)  // not reached when the caller's total is this sum
    if (p[j] > 0.f) return j;
  return 0;
}

// The target of a draw: u times the total, strictly below the total (u < 1, but rounding
// could reach it).
inline float target(double u, float total) {
  const float t = static_cast<float>(u * static_cast<double>(total));
  return std::min(t, std::nextafter(total, 0.f));
}

// Candidates' order: higher values first, and of equal values the lower index.
inline bool better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The best `width` values of s[0, n) (no NaN) as (value, index), best first: higher values,
// and of equal values the lower index. A narrow set comes from one pass that keeps a heap of
// the best seen, skipping at once a vector of values none of which beats the worst kept; a
// wide one from the width-th largest value (nth_element on a copy), then one pass.
inline void best(const float* s, int64_t n, int64_t width, std::vector<std::pair<float, int32_t>>& top,
                 std::vector<float>& tmp) {
  top.clear();
  width = std::min(width, n);
  if (width > FIRST_WIDTH) {
    float tau = -std::numeric_limits<float>::infinity();
    if (width < n) {
      tmp.assign(s, s + n);
      std::nth_element(tmp.begin(), tmp.begin() + (width - 1), tmp.end(), std::greater<float>());
      tau = tmp[width - 1];
    }
    for (int64_t i = 0; i < n; ++i)  // fewer than width values lie above tau
      if (s[i] > tau) top.emplace_back(s[i], static_cast<int32_t>(i));
    for (int64_t i = 0; i < n && static_cast<int64_t>(top.size()) < width; ++i)
      if (s[i] == tau) top.emplace_back(s[i], static_cast<int32_t>(i));
    std::sort(top.begin(), top.end(), better);
    return;
  }
  // heap order: the worst kept on top
  int64_t i = 0;
  for (; i < width; ++i) top.emplace_back(s[i], static_cast<int32_t>(i));
  std::make_heap(top.begin(), top.end(), better);
  auto offer = [&](int64_t j) {
    if (s[j] > top.front().first) {  // a later equal value loses to the kept one
      std::pop_heap(top.begin(), top.end(), better);
      top.back() = {s[j], static_cast<int32_t>(j)};
      std::push_heap(top.begin(), top.end(), better);
    }
  };
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __mmask16 over = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), _mm512_set1_ps(top.front().first), _CMP_GT_OQ);
    while (over) {
      offer(i + __builtin_ctz(over));
      over &= over - 1;
    }
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    int over = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(top.front().first), _CMP_GT_OQ));
    while (over) {
      offer(i + __builtin_ctz(over));
      over &= over - 1;
    }
  }
#endif
  for (; i < n; ++i) offer(i);
  std::sort(top.begin(), top.end(), better);
}

// Top-p over candidates (best first) whose probabilities are p[0, n), min-p's drops already
// 0: a dropped candidate's probability becomes 0.
inline void filter(float* p, int64_t n, float top_p) {
  if (top_p < 1.f) {
    float before = 0.f;  // mass of the candidates ahead of j
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[j];
      if (j > 0 && before >= top_p) p[j] = 0.f;
      before += pj;
    }
  }
}

// The draw over candidates, after filter: the candidate's position.
inline int64_t draw_candidates(float* p, int64_t n, float top_p, double u) {
  filter(p, n, top_p);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += p[j];
  return first_above(p, n, target(u, total));
}

// Per block of 16 exps, their sum in order.
inline void block_sums(const float* e, int64_t nb, float* b) {
  for (int64_t i = 0; i < nb; ++i) {
    float a = 0.f;
    for (int64_t j = 0; j < BLOCK; ++j) a += e[i * BLOCK + j];
    b[i] = a;
  }
}

// The row's token. x: the logits (n of them); u: the row's uniform number in [0, 1).
inline int64_t sample_row(const float* x, int64_t n, double u, const Knobs& k, Scratch& w) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t padded = (n + BLOCK - 1) / BLOCK * BLOCK;
  w.s.resize(padded);
  w.e.resize(padded);
  float* s = w.s.data();
  const float m = scaled(x, n, k.temperature, s);
  for (int64_t i = n; i < padded; ++i) s[i] = ninf;
  if (m == ninf) return 0;  // nothing to draw from: as the argmax of such a row
  if (m == -ninf) return std::find(s, s + n, m) - s;  // an infinite logit takes all the mass
  const bool has_k = k.top_k > 0 && k.top_k < n;

  if (has_k) {  // exactly k candidates, renormalised among themselves
    best(s, n, k.top_k, w.top, w.cand);
    const int64_t c = static_cast<int64_t>(w.top.size());
    const int64_t cp = (c + BLOCK - 1) / BLOCK * BLOCK;
    w.blocks.assign(cp, ninf);
    for (int64_t j = 0; j < c; ++j) w.blocks[j] = w.top[j].first;
    float* p = w.e.data();
    exp_shifted(w.blocks.data(), cp, m, p);  // the best's exp is 1
    if (k.min_p > 0.f)
      for (int64_t j = 1; j < c; ++j) p[j] = p[j] < k.min_p ? 0.f : p[j];
    float z = 0.f;
    for (int64_t j = 0; j < c; ++j) z += p[j];
    for (int64_t j = 0; j < c; ++j) p[j] /= z;
    return w.top[draw_candidates(p, c, k.top_p, u)].second;
  }

  // The whole row's exps, with a sum per block of 16 (in order within the block).
  float* e = w.e.data();
  exp_shifted(s, padded, m, e);
  const int64_t nb = padded / BLOCK;
  w.blocks.resize(nb + 1);
  if (k.min_p > 0.f)  // first: top-p's mass is of what min-p keeps (the most likely token's exp is 1)
    for (int64_t i = 0; i < padded; ++i) e[i] = e[i] < k.min_p ? 0.f : e[i];
  block_sums(e, nb, w.blocks.data());
  bool narrowed = false;  // exps zeroed outside a top-p nucleus: the block sums are stale

  if (k.top_p < 1.f) {  // the nucleus: among the best 256, else among the tokens near enough the top
    float z = 0.f;
    for (int64_t i = 0; i < nb; ++i) z += w.blocks[i];
    std::vector<float>& q = w.cand;
    auto nucleus = [&]() -> int64_t {  // the candidates' probabilities; -1 where they miss mass
      const int64_t c = static_cast<int64_t>(w.top.size());
      q.resize(c);
      float mass = 0.f;
      for (int64_t j = 0; j < c; ++j) {
        q[j] = e[w.top[j].second] / z;
        mass += q[j];
      }
      return mass >= k.top_p || c == n ? c : -1;
    };
    best(s, n, FIRST_WIDTH, w.top, w.tmp);
    const int64_t c = nucleus();
    if (c >= 0) return w.top[draw_candidates(q.data(), c, k.top_p, u)].second;
    // A nucleus wider than the candidates: each token's distance below the top, in buckets of
    // 1/32 (the last: all from 32 on). The buckets above the one where their mass reaches p
    // are kept whole; that bucket's tokens, in order of likelihood, while the mass before them
    // is short of p. Then the draw over the kept tokens in index order, as a plain row's.
    constexpr int NB = 1025;
    constexpr float PER = 32.f;
    auto bucket = [&](int64_t i) {
      const float d = (m - s[i]) * PER;
      return d < NB - 1 ? static_cast<int>(d) : NB - 1;
    };
    float mass[NB] = {};
    for (int64_t i = 0; i < n; ++i) mass[bucket(i)] += e[i];
    const float pz = k.top_p * z;
    float before = 0.f;
    int cross = NB - 1;
    for (int b = 0; b < NB; ++b) {
      if (b == NB - 1 || before + mass[b] >= pz) {  // the last bucket takes what rounding left
        cross = b;
        break;
      }
      before += mass[b];
    }
    w.top.clear();
    for (int64_t i = 0; i < n; ++i) {
      const int b = bucket(i);
      if (b == cross) w.top.emplace_back(s[i], static_cast<int32_t>(i));
      if (b > cross) e[i] = 0.f;
    }
    std::sort(w.top.begin(), w.top.end(), better);
    for (const auto& t : w.top) {  // the most likely token is in bucket 0, with 0 before it
      if (before >= pz)
        e[t.second] = 0.f;
      else
        before += e[t.second];
    }
    narrowed = true;
  }

  // The whole vocabulary in index order. The most likely token's exp is 1.
  float* b = w.blocks.data();
  if (narrowed) block_sums(e, nb, b);
  // prefix sums over the blocks; a block's own values are summed in the same order as its
  // sum, so the cumulative value at a block's end is the next block's start, exactly
  float c = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const float next = c + b[i];
    b[i] = c;
    c = next;
  }
  b[nb] = c;
  if (!(c > 0.f)) return aiolm_argmax::argmax_row(x, n);  // min_p over 1 dropped every token
  const float t = target(u, c);
  const int64_t blk = std::upper_bound(b + 1, b + nb + 1, t) - (b + 1);  // first block ending above t
  float a = 0.f;
  for (int64_t j = 0; j < BLOCK; ++j) {
    a += e[blk * BLOCK + j];
    if (b[blk] + a > t) return blk * BLOCK + j;
  }
  return std::min(blk * BLOCK + BLOCK - 1, n - 1);  // not reached: the block ends above t
}

// A row's token from its knobs as the ops take them (temperature, top_k, top_p, min_p as
// doubles; temperature 0: greedy, the argmax).
inline int64_t token(const float* x, int64_t n, double u, const double* knobs, Scratch& w) {
  if (knobs[0] == 0.0) return aiolm_argmax::argmax_row(x, n);
  const Knobs k{static_cast<float>(knobs[0]), static_cast<int64_t>(knobs[1]), static_cast<float>(knobs[2]),
                static_cast<float>(knobs[3])};
  return sample_row(x, n, u, k, w);
}

}  // namespace aiolm_sample
