// y = x W^T with W kept as a GGUF file's quantized blocks (Q4_0, Q4_1, Q8_0),
// for the small batches of decoding. A decode step with a few rows is bound by
// reading the weights; these formats are 3.5-7x smaller than float32, and the
// values they hold are exactly the ones the float32 path uses (it dequantizes
// the same blocks), so only the order of the sums differs.
//
// The blocks are split at load time (aiolm/model/gguf_blocks.py) into
//   qs:    uint8 [N, nblocks * 16] (4-bit: weight j in the low nibble of byte j,
//          weight j + 16 in its high nibble) or int8 [N, nblocks * 32] (Q8_0)
//   scale: float32 [N, nblocks]   (d)
//   min:   float32 [N, nblocks]   (m, Q4_1 only; empty otherwise)
// so that w = d * q + m (Q4_1), d * (q - 8) (Q4_0) or d * q (Q8_0), and the
// block's dot product is d * sum(q_j x_j) + m * sum(x_j): the block sums of x
// are computed once per call and the m terms become one dot product per row.
//
// Each block's accumulation is a loop-carried FMA; several output rows are
// processed together so that those chains run side by side.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "linear_rows.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AIOLM_AVX2 1
#endif
#if defined(__AVX512F__)
#define AIOLM_AVX512 1
#endif

namespace {

constexpr int64_t QK = 32;
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

int64_t qs_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0:
    case Q4_1: return 16;
    case Q8_0: return 32;
  }
  TORCH_CHECK(false, "aiolm::gguf_linear: unsupported GGUF type id ", qtype, " (Q4_0=2, Q4_1=3, Q8_0=8)");
}

#ifdef AIOLM_AVX512
// AVX-512: a block's 32 weights are two vectors of 16 (its low nibbles are weights
// 0-15, its high nibbles 16-31), half the conversions and FMAs of the AVX2 tile.
template <int64_t T>
inline void unpack16(const uint8_t* qs, __m512 f[2]) {
  if constexpr (T == Q8_0) {
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    if constexpr (T == Q4_0) {
      const __m128i eight = _mm_set1_epi8(8);
      f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(lo, eight)));
      f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(hi, eight)));
    } else {
      f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
      f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
    }
  }
}

template <int64_t T, int NR, int MR>
inline void tile(const uint8_t* qs, const float* scale, int64_t qs_row, int64_t nblocks, const float* x,
                 int64_t K, float out[NR][MR]) {
  constexpr int64_t QB = T == Q8_0 ? 32 : 16;
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int i = 0; i < NR; ++i) {
      __m512 f[2];
      unpack16<T>(qs + i * qs_row + b * QB, f);
      const __m512 d = _mm512_set1_ps(scale[i * nblocks + b]);
      for (int r = 0; r < MR; ++r) {
        const float* xb = x + r * K + b * QK;
        const __m512 t = _mm512_fmadd_ps(f[1], _mm512_loadu_ps(xb + 16), _mm512_mul_ps(f[0], _mm512_loadu_ps(xb)));
        acc[i][r] = _mm512_fmadd_ps(d, t, acc[i][r]);
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

// The 32 weights of one block as four vectors of 8 floats: q (Q4_1, Q8_0) or q - 8 (Q4_0).
template <int64_t T>
inline void unpack(const uint8_t* qs, __m256 f[4]) {
  if constexpr (T == Q8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    if constexpr (T == Q4_0) {
      const __m128i eight = _mm_set1_epi8(8);
      lo = _mm_sub_epi8(lo, eight);
      hi = _mm_sub_epi8(hi, eight);
      f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
      f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
      f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
      f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
    } else {
      f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
      f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
    }
  }
}

// NR weight rows against MR rows of x: NR * MR independent accumulator chains.
template <int64_t T, int NR, int MR>
inline void tile(const uint8_t* qs, const float* scale, int64_t qs_row, int64_t nblocks, const float* x,
                 int64_t K, float out[NR][MR]) {
  constexpr int64_t QB = T == Q8_0 ? 32 : 16;
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int i = 0; i < NR; ++i) {
      __m256 f[4];
      unpack<T>(qs + i * qs_row + b * QB, f);
      const __m256 d = _mm256_broadcast_ss(scale + i * nblocks + b);
      for (int r = 0; r < MR; ++r) {
        const float* xb = x + r * K + b * QK;  // L1-resident: reloading beats spilling registers
        __m256 t = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
        t = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), t);
        t = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), t);
        t = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), t);
        acc[i][r] = _mm256_fmadd_ps(d, t, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) out[i][r] = hsum256(acc[i][r]);
}
#endif

// sum_i a_i b_i in vector lanes: a scalar loop is one chain of dependent adds, and it
// runs once per output feature (the Q4_1 mins term, the block sums of x).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(AIOLM_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    i = n;
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(AIOLM_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum256(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Scalar reference for CPUs without AVX2/FMA, one output feature and one row of x.
float dot_scalar(int64_t qtype, const uint8_t* qs, const float* scale, int64_t nblocks, const float* x) {
  float acc = 0.f;
  for (int64_t b = 0; b < nblocks; ++b) {
    float t = 0.f;
    if (qtype == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs + b * 32);
      for (int j = 0; j < 32; ++j) t += static_cast<float>(q[j]) * x[b * QK + j];
    } else {
      const uint8_t* q = qs + b * 16;
      const float off = qtype == Q4_0 ? 8.f : 0.f;
      for (int j = 0; j < 16; ++j) {
        t += (static_cast<float>(q[j] & 0xf) - off) * x[b * QK + j];
        t += (static_cast<float>(q[j] >> 4) - off) * x[b * QK + j + 16];
      }
    }
    acc += scale[b] * t;
  }
  return acc;
}

template <int64_t T>
void run_rows(const uint8_t* qs, const float* scale, const float* mins, const float* xsum, int64_t qs_row,
              int64_t nblocks, const float* x, int64_t K, int64_t M, float* y, int64_t N, int64_t n0,
              int64_t n1) {
  auto finish = [&](int64_t n, int64_t r, float v) {
    if (mins != nullptr) v += dot(mins + n * nblocks, xsum + r * nblocks, nblocks);  // + sum_b m_b sum(x_b)
    y[r * N + n] = v;
  };
#ifdef AIOLM_AVX2
  int64_t r0 = 0;
  // Eight x rows share each unpacked block; then pairs against 4 weight rows; a last
  // single row against 8 weight rows (every tile keeps <= 8 accumulators in registers).
  for (; r0 + 8 <= M; r0 += 8) {
    for (int64_t n = n0; n < n1; ++n) {
      float out[1][8];
      tile<T, 1, 8>(qs + n * qs_row, scale + n * nblocks, qs_row, nblocks, x + r0 * K, K, out);
      for (int r = 0; r < 8; ++r) finish(n, r0 + r, out[0][r]);
    }
  }
  for (; r0 + 2 <= M; r0 += 2) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      float out[4][2];
      tile<T, 4, 2>(qs + n * qs_row, scale + n * nblocks, qs_row, nblocks, x + r0 * K, K, out);
      for (int i = 0; i < 4; ++i)
        for (int r = 0; r < 2; ++r) finish(n + i, r0 + r, out[i][r]);
    }
    for (; n < n1; ++n) {
      float out[1][2];
      tile<T, 1, 2>(qs + n * qs_row, scale + n * nblocks, qs_row, nblocks, x + r0 * K, K, out);
      for (int r = 0; r < 2; ++r) finish(n, r0 + r, out[0][r]);
    }
  }
  if (r0 < M) {
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) {
      float out[8][1];
      tile<T, 8, 1>(qs + n * qs_row, scale + n * nblocks, qs_row, nblocks, x + r0 * K, K, out);
      for (int i = 0; i < 8; ++i) finish(n + i, r0, out[i][0]);
    }
    for (; n < n1; ++n) {
      float out[1][1];
      tile<T, 1, 1>(qs + n * qs_row, scale + n * nblocks, qs_row, nblocks, x + r0 * K, K, out);
      finish(n, r0, out[0][0]);
    }
  }
#else
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n0; n < n1; ++n)
      finish(n, r, dot_scalar(T, qs + n * qs_row, scale + n * nblocks, nblocks, x + r * K));
#endif
}

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "aiolm::gguf_linear: x must be float32");
  const int64_t qb = qs_bytes(qtype);
  TORCH_CHECK((qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar) && qs.dim() == 2 &&
                  qs.is_contiguous(),
              "aiolm::gguf_linear: qs must be a contiguous 8-bit [N, nblocks * bytes] tensor");
  const int64_t N = qs.size(0), qs_row = qs.size(1);
  TORCH_CHECK(qs_row % qb == 0, "aiolm::gguf_linear: a row of ", qs_row, " bytes is not whole blocks");
  const int64_t nblocks = qs_row / qb, K = nblocks * QK;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == N && scale.size(1) == nblocks,
              "aiolm::gguf_linear: scale must be float32 [N, nblocks]");
  const bool has_min = qtype == Q4_1;
  if (has_min)
    TORCH_CHECK(mins.scalar_type() == at::kFloat && mins.is_contiguous() && mins.sizes() == scale.sizes(),
                "aiolm::gguf_linear: Q4_1 needs float32 mins [N, nblocks]");
  TORCH_CHECK(x_in.size(-1) == K, "aiolm::gguf_linear: x has ", x_in.size(-1), " features, W has ", K);
  const aiolm_linear::Rows io(x_in, K, N);
  const at::Tensor& x = io.x;
  const int64_t M = io.m();
  if (M == 0 || N == 0) return io.result();
  const float* xp = x.data_ptr<float>();
  at::Tensor xsum_t;
  const float* xs = nullptr;
  if (has_min) {
    xsum_t = at::empty({M, nblocks}, x.options());
    float* w = xsum_t.data_ptr<float>();
    static const float ones[QK] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f,
                                   1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nblocks; ++b) w[r * nblocks + b] = dot(xp + r * K + b * QK, ones, QK);
    xs = w;
  }
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* mp = has_min ? mins.data_ptr<float>() : nullptr;
  float* yp = io.y.data_ptr<float>();
  at::parallel_for(0, N / 8 + (N % 8 != 0), 4, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 8, n1 = std::min(N, g1 * 8);
    switch (qtype) {
      case Q4_0: run_rows<Q4_0>(qp, sp, mp, xs, qs_row, nblocks, xp, K, M, yp, N, n0, n1); break;
      case Q4_1: run_rows<Q4_1>(qp, sp, mp, xs, qs_row, nblocks, xp, K, M, yp, N, n0, n1); break;
      default: run_rows<Q8_0>(qp, sp, mp, xs, qs_row, nblocks, xp, K, M, yp, N, n0, n1); break;
    }
  });
  return io.result();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor scale, Tensor mins, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
