// y = x W^T in float32 with W stored as panels of 16 output columns:
// panels[p][k][j] = W[16 p + j][k] (zero rows pad the last panel).
//
// Why not oneDNN: in a real decode step (30 layers, four shapes each, 16-128
// rows) oneDNN's float32 GEMM reaches ~75-90 GFLOP/s on this AVX2 machine,
// while a plain register-blocked kernel over this layout keeps ~115-140,
// close to what the two cores can do (benchmarks/bench_linear.py).
//
// The micro-kernel holds a 6 x 16 block of y in twelve AVX registers: per k
// it loads one panel row (two vectors) and broadcasts six x values, i.e. 12
// FMAs for 8 loads. Each thread takes a contiguous range of panels and runs
// each of them over all rows: up to PACK_ROWS rows read in place (they stay in
// L2), above that packed into 6-row tiles, CHUNK_ROWS rows at a time. Sums run
// over k in order, one accumulator per output: only the order differs from a
// naive dot product.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "linear_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AIOLM_AVX2 1
#endif

namespace {

constexpr int64_t NR = 16;  // columns per panel
constexpr int64_t MR = 6;   // rows per micro-kernel call
constexpr int64_t PACK_ROWS = 128;   // above this many rows x is packed first
constexpr int64_t CHUNK_ROWS = 252;  // rows packed and run at a time (a multiple of MR)

#ifdef AIOLM_AVX2
// y[r][0:16] = sum_k x[r * ldx + k * KS] * panel[k][0:16] for R <= 6 rows: KS = 1 reads
// rows of x in place, KS = 6 a tile packed k-major; ldy is y's row stride. The rows are
// spelled out one by one: written as arrays and loops, GCC 12 spilled the accumulators
// to the stack and the kernel ran at half speed.
template <int R, int KS>
inline __attribute__((always_inline)) void micro(const float* x, int64_t ldx, const float* panel,
                                                  int64_t K, float* y, int64_t ldy) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
              *x5 = x + 5 * ldx;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * NR), b1 = _mm256_load_ps(panel + k * NR + 8);
    __m256 a = _mm256_broadcast_ss(x0 + k * KS);
    c00 = _mm256_fmadd_ps(a, b0, c00);
    c01 = _mm256_fmadd_ps(a, b1, c01);
    if constexpr (R > 1) {
      a = _mm256_broadcast_ss(x1 + k * KS);
      c10 = _mm256_fmadd_ps(a, b0, c10);
      c11 = _mm256_fmadd_ps(a, b1, c11);
    }
    if constexpr (R > 2) {
      a = _mm256_broadcast_ss(x2 + k * KS);
      c20 = _mm256_fmadd_ps(a, b0, c20);
      c21 = _mm256_fmadd_ps(a, b1, c21);
    }
    if constexpr (R > 3) {
      a = _mm256_broadcast_ss(x3 + k * KS);
      c30 = _mm256_fmadd_ps(a, b0, c30);
      c31 = _mm256_fmadd_ps(a, b1, c31);
    }
    if constexpr (R > 4) {
      a = _mm256_broadcast_ss(x4 + k * KS);
      c40 = _mm256_fmadd_ps(a, b0, c40);
      c41 = _mm256_fmadd_ps(a, b1, c41);
    }
    if constexpr (R > 5) {
      a = _mm256_broadcast_ss(x5 + k * KS);
      c50 = _mm256_fmadd_ps(a, b0, c50);
      c51 = _mm256_fmadd_ps(a, b1, c51);
    }
  }
  _mm256_storeu_ps(y, c00);
  _mm256_storeu_ps(y + 8, c01);
  if constexpr (R > 1) { _mm256_storeu_ps(y + ldy, c10); _mm256_storeu_ps(y + ldy + 8, c11); }
  if constexpr (R > 2) { _mm256_storeu_ps(y + 2 * ldy, c20); _mm256_storeu_ps(y + 2 * ldy + 8, c21); }
  if constexpr (R > 3) { _mm256_storeu_ps(y + 3 * ldy, c30); _mm256_storeu_ps(y + 3 * ldy + 8, c31); }
  if constexpr (R > 4) { _mm256_storeu_ps(y + 4 * ldy, c40); _mm256_storeu_ps(y + 4 * ldy + 8, c41); }
  if constexpr (R > 5) { _mm256_storeu_ps(y + 5 * ldy, c50); _mm256_storeu_ps(y + 5 * ldy + 8, c51); }
}
#else
template <int R, int KS>
inline void micro(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy) {
  float acc[R][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] += x[r * ldx + k * KS] * panel[k * NR + j];
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(acc[r]));
}
#endif

template <int KS>
inline void micro_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t K, float* y,
                       int64_t ldy) {
  switch (rows) {
    case 6: micro<6, KS>(x, ldx, panel, K, y, ldy); break;
    case 5: micro<5, KS>(x, ldx, panel, K, y, ldy); break;
    case 4: micro<4, KS>(x, ldx, panel, K, y, ldy); break;
    case 3: micro<3, KS>(x, ldx, panel, K, y, ldy); break;
    case 2: micro<2, KS>(x, ldx, panel, K, y, ldy); break;
    default: micro<1, KS>(x, ldx, panel, K, y, ldy); break;
  }
}

// All M rows against panels [p0, p1). With PACKED, x is in tiles of 6 rows laid
// out k-major (tile t, k, r at [(t * K + k) * 6 + r]), so a micro-kernel call
// streams one contiguous block instead of six rows.
template <bool PACKED>
void panels_range(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, float* y, int64_t p0,
                  int64_t p1) {
  alignas(32) float tail[MR * NR];
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = panels + p * K * NR;
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    for (int64_t m = 0; m < M; m += MR) {
      const int64_t rows = std::min(MR, M - m);
      const float* xt = x + m * K;  // tile m / 6 starts at (m / 6) * K * 6 when packed
      constexpr int KS = PACKED ? MR : 1;
      const int64_t ldx = PACKED ? 1 : K;
      if (cols == NR) {
        micro_rows<KS>(rows, xt, ldx, panel, K, y + m * N + n0, N);
      } else {
        micro_rows<KS>(rows, xt, ldx, panel, K, tail, NR);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m + r) * N + n0, tail + r * NR, cols * sizeof(float));
      }
    }
  }
}

at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "aiolm::panel_linear: float32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.is_contiguous(),
              "aiolm::panel_linear: panels must be a contiguous float32 [P, K, 16] tensor");
  const int64_t P = panels.size(0), K = panels.size(1);
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "aiolm::panel_linear: ", P, " panels cannot hold ", N, " columns");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 32 == 0, "aiolm::panel_linear: panels not 32-byte aligned");
  TORCH_CHECK(x_in.size(-1) == K, "aiolm::panel_linear: x has ", x_in.size(-1), " features, W has ", K);
  const aiolm_linear::Rows io(x_in, K, N);
  const at::Tensor& x = io.x;
  const int64_t M = io.m();
  if (M == 0 || N == 0) return io.result();
  const float* wp = panels.data_ptr<float>();
  float* yp = io.y.data_ptr<float>();
  // Threads split the panels and run each over every row. Up to PACK_ROWS rows,
  // x stays in L2 as it is; above, it is first packed into 6-row tiles so the
  // stream a micro-kernel reads from L3 is contiguous.
  if (M <= PACK_ROWS) {
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { panels_range<false>(xp, M, K, wp, N, yp, p0, p1); });
  } else {
    // In chunks of rows, so a chunk's packed x (CHUNK_ROWS * K floats) stays in L3
    // next to the panels: 30 layers at 2048 rows took ~10% longer as one chunk.
    at::Tensor packed = at::empty({std::min(M, CHUNK_ROWS) * K + MR * K}, x.options());
    float* xp = packed.data_ptr<float>();
    for (int64_t c0 = 0; c0 < M; c0 += CHUNK_ROWS) {
      const int64_t rows_c = std::min(CHUNK_ROWS, M - c0), tiles = (rows_c + MR - 1) / MR;
      const float* xs = x.data_ptr<float>() + c0 * K;
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          float* dst = xp + t * K * MR;
          const int64_t rows = std::min(MR, rows_c - t * MR);
          for (int64_t r = 0; r < MR; ++r) {
            const float* src = xs + (t * MR + std::min(r, rows - 1)) * K;  // pad with a copy of the last row
            for (int64_t k = 0; k < K; ++k) dst[k * MR + r] = src[k];
          }
        }
      });
      float* yc = yp + c0 * N;
      at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { panels_range<true>(xp, rows_c, K, wp, N, yc, p0, p1); });
    }
  }
  return io.result();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) { m.def("panel_linear(Tensor x, Tensor panels, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("panel_linear", &panel_linear); }
