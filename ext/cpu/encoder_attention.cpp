// Bidirectional attention for an encoder's step on the CPU: every request of a flat batch
// (a sentence to embed, an image's patches) attends to all of its own tokens, no mask, no
// KV cache.
//
// Why not torch: a batch of a few hundred short sentences is a few hundred pairs of tiny
// batched matmuls with a softmax between, where each op's dispatch and each slice's view
// cost more than its arithmetic; bfloat16 q, k, v would also be cast to float32 first.
// Here one call runs them all, reading q, k, v where the QKV projection wrote them.
//
// Work items are (request, kv head, tile of query rows), split over torch's intra-op
// threads. An item converts its request's keys for that head to float32 once, transposed
// ([head_dim][keys], so four query rows' scores for 16 keys are plain FMAs) and its values
// ([keys][head_dim], padded to whole vectors), then for each query head of the kv head's
// group takes four rows at a time: scores, softmax, then the values weighted. Everything
// is in float32; the output is rounded once to q's dtype.
//
//   encoder_attention(out, q, k, v, query_start_loc, scale)
//   q [T, H, D], k, v [T, Hk, D] (H a multiple of Hk), float32 or bfloat16 alike, each
//   head's D values dense; out [T, H, D] dense, in q's dtype; query_start_loc int64 [R + 1].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "bf16.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
#if defined(__AVX512F__)
// Query rows whose scores share each key vector loaded, and value vectors a pass holds:
// 8 x 2 sums, 16 of the 32 zmm registers (with 4 rows a tail vector of keys left its FMAs
// waiting on their latency).
constexpr int64_t kRows = 8;
constexpr int kValueVectors = 2;
#else
constexpr int64_t kRows = 4;
constexpr int kValueVectors = 4;
#endif

inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }

using aiolm_bf16::widen;

inline void store(float f, float* out) { *out = f; }
inline void store(float f, uint16_t* out) { *out = aiolm_bf16::narrow(f); }

// exp on 16 lanes: vec.h's exp16, or its exp8 on each half (the same arithmetic), or libm.
inline v16f vexp(v16f x) {
#if defined(__AVX512F__)
  return (v16f)aiolm_vec::exp16((__m512)x);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 h[2];
  __builtin_memcpy(h, &x, sizeof(x));
  h[0] = aiolm_vec::exp8(h[0]);
  h[1] = aiolm_vec::exp8(h[1]);
  __builtin_memcpy(&x, h, sizeof(x));
  return x;
#else
  for (int i = 0; i < kLanes; ++i) x[i] = std::exp(x[i]);
  return x;
#endif
}

// A row of scores s[0:n] (n16 of them, the rest padding) becomes exp(s - max(s)), the
// padding 0; returns 1 / their sum.
inline float softmax_row(float* s, int64_t n, int64_t n16) {
  // the padding masked in registers: scalar stores into the row just before its vector
  // loads would stall them (no store forwarding from a narrower store)
  typedef int32_t v16i __attribute__((vector_size(64)));
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16f neg_inf = v16f{} - std::numeric_limits<float>::infinity();
  v16f mv = neg_inf;
  for (int64_t j = 0; j < n16; j += kLanes) {
    v16f x = load16(s + j);
    if (j + kLanes > n) x = lane < static_cast<int32_t>(n - j) ? x : neg_inf;
    mv = x > mv ? x : mv;
  }
#if defined(__AVX512F__)
  const float m = _mm512_reduce_max_ps((__m512)mv);
#else
  float m = mv[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, mv[i]);
#endif
  v16f acc = {};
  for (int64_t j = 0; j < n16; j += kLanes) {
    v16f e = vexp(load16(s + j) - m);
    if (j + kLanes > n) e = lane < static_cast<int32_t>(n - j) ? e : v16f{};  // exp clamps: not quite 0
    store16(s + j, e);
    acc += e;
  }
#if defined(__AVX512F__)
  const float sum = _mm512_reduce_add_ps((__m512)acc);  // a tree of adds: 4 steps, not 15
#else
  float sum = 0.f;
  for (int i = 0; i < kLanes; ++i) sum += acc[i];
#endif
  return 1.f / sum;
}

// Four query rows' scaled scores against every key: s[r][j] = scale * sum_c q[r][c] kt[c][j],
// the sums over c in order. Two vectors of keys a step where there are two, so eight
// independent chains keep the FMA units busy.
inline void scores(const float* q, const float* kt, int64_t n16, int64_t D, float scale, float* s) {
  int64_t j = 0;
  for (; j + 2 * kLanes <= n16; j += 2 * kLanes) {
    v16f a[kRows][2] = {};
    for (int64_t c = 0; c < D; ++c) {
      const v16f k0 = load16(kt + c * n16 + j), k1 = load16(kt + c * n16 + j + kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        a[r][0] += q[r * D + c] * k0;
        a[r][1] += q[r * D + c] * k1;
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      store16(s + r * n16 + j, a[r][0] * scale);
      store16(s + r * n16 + j + kLanes, a[r][1] * scale);
    }
  }
  if (j < n16) {
    v16f a[kRows] = {};
    for (int64_t c = 0; c < D; ++c) {
      const v16f k0 = load16(kt + c * n16 + j);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) a[r] += q[r * D + c] * k0;
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) store16(s + r * n16 + j, a[r] * scale);
  }
}

// o[r][0:16 NV] = inv[r] * sum_j p[r][j] v[j][0:16 NV] for four rows: each key's values
// read once for the four rows, the 4 x NV sums held in registers.
template <int NV>
inline void weigh(const float* p, int64_t n16, int64_t n, const float* v, int64_t d16, const float* inv, float* o) {
  v16f acc[kRows][NV] = {};
  for (int64_t j = 0; j < n; ++j) {
    v16f x[NV];
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) x[u] = load16(v + j * d16 + u * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float pr = p[r * n16 + j];
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) acc[r][u] += pr * x[u];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) store16(o + r * d16 + u * kLanes, acc[r][u] * inv[r]);
}

#if defined(__AVX512F__)
// 16 of a row's values as float32, and 16 results stored in the output's dtype.
inline __m512 row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 row16(const uint16_t* p) { return aiolm_bf16::widen16(p); }
inline void put16(const float* src, float* dst) { _mm512_storeu_ps(dst, _mm512_loadu_ps(src)); }
inline void put16(const float* src, uint16_t* dst) { aiolm_bf16::narrow16(_mm512_loadu_ps(src), dst); }
#endif

struct Buffers {
  std::vector<float> kt, v, q, s, o;
};

// One item: request rows [r0, r0 + n), kv head h, query rows [i0, i1) of the request.
template <typename T>
void attend(const T* q, int64_t qs0, int64_t qs1, const T* k, int64_t ks0, int64_t ks1, const T* v, int64_t vs0,
            int64_t vs1, T* out, int64_t H, int64_t group, int64_t D, float scale, int64_t r0, int64_t n, int64_t h,
            int64_t i0, int64_t i1, Buffers& b) {
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes, d16 = (D + kLanes - 1) / kLanes * kLanes;
  // the padding is never read into a result: keys past n get no weight, value lanes past
  // D are never written out
  b.kt.resize(D * n16);
  b.v.resize(n * d16);
  b.q.resize(kRows * D);
  b.s.resize(kRows * n16);
  b.o.resize(kRows * d16);
  // With AVX-512 and whole vectors of D, 16 keys at a time transposed in registers: one key
  // value at a time, these copies took as long as the item's arithmetic at a sentence's length.
#if defined(__AVX512F__)
  const bool whole = D % kLanes == 0;
#else
  const bool whole = false;
#endif
  if (whole) {
#if defined(__AVX512F__)
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
      const int64_t keys = std::min(kLanes, n - j0);
      for (int64_t c0 = 0; c0 < D; c0 += kLanes) {
        __m512 r[kLanes], t[kLanes];
        for (int64_t j = 0; j < kLanes; ++j)
          r[j] = j < keys ? row16(k + (r0 + j0 + j) * ks0 + h * ks1 + c0) : _mm512_setzero_ps();
        aiolm_vec::transpose16(r, t);
        for (int64_t c = 0; c < kLanes; ++c) _mm512_storeu_ps(&b.kt[(c0 + c) * n16 + j0], t[c]);
      }
      for (int64_t j = j0; j < j0 + keys; ++j)
        for (int64_t c0 = 0; c0 < D; c0 += kLanes)
          _mm512_storeu_ps(&b.v[j * d16 + c0], row16(v + (r0 + j) * vs0 + h * vs1 + c0));
    }
#endif
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const T* kj = k + (r0 + j) * ks0 + h * ks1;
      const T* vj = v + (r0 + j) * vs0 + h * vs1;
      for (int64_t c = 0; c < D; ++c) b.kt[c * n16 + j] = widen(kj[c]);
      for (int64_t c = 0; c < D; ++c) b.v[j * d16 + c] = widen(vj[c]);
    }
  }
  const float* kt = b.kt.data();
  const float* vv = b.v.data();
  for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
    for (int64_t i = i0; i < i1; i += kRows) {
      const int64_t rows = std::min(kRows, i1 - i);
      for (int64_t r = 0; r < rows; ++r) {
        const T* qr = q + (r0 + i + r) * qs0 + hq * qs1;
#if defined(__AVX512F__)
        if (whole) {
          for (int64_t c0 = 0; c0 < D; c0 += kLanes) _mm512_storeu_ps(&b.q[r * D + c0], row16(qr + c0));
          continue;
        }
#endif
        for (int64_t c = 0; c < D; ++c) b.q[r * D + c] = widen(qr[c]);
      }
      for (int64_t r = rows; r < kRows; ++r) std::memcpy(&b.q[r * D], &b.q[0], D * sizeof(float));
      scores(b.q.data(), kt, n16, D, scale, b.s.data());
      float inv[kRows];
      for (int64_t r = 0; r < kRows; ++r) inv[r] = softmax_row(&b.s[r * n16], n, n16);
      for (int64_t c0 = 0; c0 < d16; c0 += kValueVectors * kLanes) {
        float* o = &b.o[c0];
        switch (std::min<int64_t>(kValueVectors, (d16 - c0) / kLanes)) {
          case 4: weigh<4>(b.s.data(), n16, n, vv + c0, d16, inv, o); break;
          case 3: weigh<3>(b.s.data(), n16, n, vv + c0, d16, inv, o); break;
          case 2: weigh<2>(b.s.data(), n16, n, vv + c0, d16, inv, o); break;
          default: weigh<1>(b.s.data(), n16, n, vv + c0, d16, inv, o); break;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* orow = out + ((r0 + i + r) * H + hq) * D;
#if defined(__AVX512F__)
        if (whole) {
          for (int64_t c0 = 0; c0 < D; c0 += kLanes) put16(&b.o[r * d16 + c0], orow + c0);
          continue;
        }
#endif
        for (int64_t c = 0; c < D; ++c) store(b.o[r * d16 + c], orow + c);
      }
    }
  }
}

void encoder_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "aiolm::encoder_attention: q must be float32 or bfloat16");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "aiolm::encoder_attention: q, k, v and out must share a dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2),
              "aiolm::encoder_attention: q [T, H, D], k and v [T, Hk, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "aiolm::encoder_attention: each head's values must be dense");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "aiolm::encoder_attention: out must be a dense [T, H, D]");
  const int64_t T = q.size(0), H = q.size(1), Hk = k.size(1), D = q.size(2);
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "aiolm::encoder_attention: ", H, " query heads over ", Hk, " kv heads");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous() &&
                  query_start_loc.dim() == 1 && query_start_loc.numel() >= 1,
              "aiolm::encoder_attention: query_start_loc must be int64 [requests + 1]");
  const int64_t R = query_start_loc.numel() - 1;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[R] == T, "aiolm::encoder_attention: query_start_loc must run from 0 to ", T);
  struct Item {
    int64_t r0, n, h, i0, i1;
  };
  std::vector<Item> items;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = qsl[r + 1] - qsl[r];
    TORCH_CHECK(n >= 0, "aiolm::encoder_attention: query_start_loc must not decrease");
    // each item converts its keys and values once, which should stay small beside its rows'
    // arithmetic: a short request (a sentence) is one item a head, a long one (an image's
    // patches) tiles of 128 rows
    const int64_t tile = 128;
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t i0 = 0; i0 < n; i0 += tile) items.push_back({qsl[r], n, h, i0, std::min(n, i0 + tile)});
  }
  const float sc = static_cast<float>(scale);
  const int64_t group = H / Hk;
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t a, int64_t z) {
      Buffers b;
      for (int64_t x = a; x < z; ++x) {
        const Item& it = items[x];
        attend(qp, q.stride(0), q.stride(1), kp, k.stride(0), k.stride(1), vp, v.stride(0), v.stride(1), op, H, group,
               D, sc, it.r0, it.n, it.h, it.i0, it.i1, b);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>());
  } else {
    run(reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(k.data_ptr()),
        reinterpret_cast<const uint16_t*>(v.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def(
      "encoder_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor query_start_loc, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("encoder_attention", &encoder_attention); }
