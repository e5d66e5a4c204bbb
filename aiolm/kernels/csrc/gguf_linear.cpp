// y = x W^T with W kept in its GGUF block format (Q4_0, Q4_1, Q8_0), for the
// small batches of decoding. A decode step with a few rows is bound by reading
// the weights; these formats are 3.5-7x smaller than float32, and the values
// they hold are exactly the ones the float32 path uses (it dequantizes the same
// blocks), so only the order of the sums differs.
//
// W: uint8 [N, K / 32 * block_bytes], one row of blocks per output feature.
// Each block of 32 weights: Q4_0 {half d; u8 qs[16]} w = d * (q - 8);
// Q4_1 {half d; half m; u8 qs[16]} w = d * q + m; Q8_0 {half d; i8 qs[32]}
// w = d * q. In the 4-bit formats qs[j] holds weight j in its low nibble and
// weight j + 16 in its high nibble.
//
// Per block, the dot product is d * sum(q_j x_j) (+ m * sum(x_j) for Q4_1), so
// the block sums of x are computed once per call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AIOLM_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;
constexpr int kMaxRows = 8;  // rows of x handled per pass over the weights
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef AIOLM_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mant;
      do { ++e; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 2 + 16;
    case Q4_1: return 4 + 16;
    case Q8_0: return 2 + 32;
  }
  TORCH_CHECK(false, "aiolm::gguf_linear: unsupported GGUF type id ", qtype, " (Q4_0=2, Q4_1=3, Q8_0=8)");
}

// The 32 weights of one block as floats, before d and m are applied (q, or q - 8 for Q4_0).
inline void unpack(int64_t qtype, const uint8_t* blk, float* q) {
  if (qtype == Q8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) q[j] = static_cast<float>(qs[j]);
    return;
  }
  const uint8_t* qs = blk + (qtype == Q4_1 ? 4 : 2);
  const float off = qtype == Q4_0 ? 8.f : 0.f;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<float>(qs[j] & 0xf) - off;
    q[j + 16] = static_cast<float>(qs[j] >> 4) - off;
  }
}

#ifdef AIOLM_AVX2
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one block as four vectors of 8 floats (before d and m).
inline void unpack8x4(int64_t qtype, const uint8_t* blk, __m256 f[4]) {
  if (qtype == Q8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    return;
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qtype == Q4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  if (qtype == Q4_0) {
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 4; ++i) f[i] = _mm256_sub_ps(f[i], eight);
  }
}
#endif

// Output features [n0, n1) for rows [r0, r0 + nr) of x.
void rows_kernel(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t nblocks, const float* x,
                 int64_t K, const float* xsum, float* y, int64_t N, int64_t r0, int64_t nr, int64_t n0,
                 int64_t n1) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = w + n * row_bytes;
    float msum[kMaxRows] = {0};
#ifdef AIOLM_AVX2
    __m256 acc[kMaxRows];
    for (int64_t r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = wrow + b * bb;
      __m256 f[4];
      unpack8x4(qtype, blk, f);
      const __m256 d = _mm256_set1_ps(half_to_float(blk));
      const float m = qtype == Q4_1 ? half_to_float(blk + 2) : 0.f;
      for (int64_t r = 0; r < nr; ++r) {
        const float* xb = x + (r0 + r) * K + b * QK;
        __m256 t = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
        t = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), t);
        t = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), t);
        t = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), t);
        acc[r] = _mm256_fmadd_ps(d, t, acc[r]);
        msum[r] += m * xsum[(r0 + r) * nblocks + b];
      }
    }
    for (int64_t r = 0; r < nr; ++r) y[(r0 + r) * N + n] = hsum256(acc[r]) + msum[r];
#else
    float acc[kMaxRows] = {0};
    float q[QK];
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = wrow + b * bb;
      unpack(qtype, blk, q);
      const float d = half_to_float(blk);
      const float m = qtype == Q4_1 ? half_to_float(blk + 2) : 0.f;
      for (int64_t r = 0; r < nr; ++r) {
        const float* xb = x + (r0 + r) * K + b * QK;
        float t = 0.f;
        for (int j = 0; j < QK; ++j) t += q[j] * xb[j];
        acc[r] += d * t;
        msum[r] += m * xsum[(r0 + r) * nblocks + b];
      }
    }
    for (int64_t r = 0; r < nr; ++r) y[(r0 + r) * N + n] = acc[r] + msum[r];
#endif
  }
}

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "aiolm::gguf_linear: x must be float32");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "aiolm::gguf_linear: w must be a contiguous uint8 [N, row_bytes] tensor of GGUF blocks");
  const int64_t bb = block_bytes(qtype);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(row_bytes % bb == 0, "aiolm::gguf_linear: row of ", row_bytes, " bytes is not whole blocks");
  const int64_t nblocks = row_bytes / bb, K = nblocks * QK;
  TORCH_CHECK(x_in.size(-1) == K, "aiolm::gguf_linear: x has ", x_in.size(-1), " features, W has ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(out_sizes);
  at::Tensor xsum_t = at::empty({M, nblocks}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xs = xsum_t.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nblocks; ++b) {
      float s = 0.f;
      for (int j = 0; j < QK; ++j) s += xp[r * K + b * QK + j];
      xs[r * nblocks + b] = s;
    }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Output features are split across threads; every thread sweeps all rows of x
  // kMaxRows at a time, so each weight block is read once per kMaxRows rows.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      const int64_t nr = std::min<int64_t>(kMaxRows, M - r0);
      rows_kernel(qtype, wp, row_bytes, nblocks, xp, K, xs, yp, N, r0, nr, n0, n1);
    }
  });
  return y.view(out_sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) { m.def("gguf_linear(Tensor x, Tensor w, int qtype) -> Tensor"); }

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
