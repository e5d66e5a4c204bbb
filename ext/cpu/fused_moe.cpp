// One mixture-of-experts layer's experts in one call, on the CPU:
//
//   y[t] = sum_j w[t, j] * W2[e] (silu(Wg[e] x[t]) * (Wu[e] x[t])),  e = ids[t, j]  (-1: skipped)
//
// Steps, per chunk of up to CHUNK_TOKENS tokens:
//   1. a counting sort groups the chunk's (token, slot) pairs by expert, tokens in order;
//   2. gate/up: for every routed expert and every panel of 16 intermediate columns, its tokens'
//      gate and up columns in one register tile, then act = silu(gate) * up * w (the routing
//      weight folded in here: I products a pair instead of H), a row per pair;
//   3. down: each thread owns a range of output-column panels and, for every routed expert in
//      id order, adds that expert's rows into y's columns of its panels. No two threads write
//      the same element (no reduction buffer), and each y element sums its experts in id order
//      whatever the thread count, so the result does not depend on it.
// Both steps split their work (experts x panels, then panels) over the threads, so a decode
// step's few experts and a prompt's many keep every core busy; only routed experts' weights
// are read.
//
// Weight layouts (aiolm/kernels/cpu_moe.py packs them), with Kp the reduced dimension:
//   float32:  w13 [E, P13, 2, Kp * 16]: panel p's gate rows 16p..16p+15 as [k][16], then its
//             up rows; w2 [E, P2, Ip * 16]. Kp = H, Ip = 16 * P13, P2 even (zero panels pad).
//   bfloat16: the same with k in pairs, [k / 2][16][2] per panel, as AVX512-BF16's vdpbf16ps
//             and AMX's tdpbf16ps read them (32 k of a panel are one 16 x 64-byte tile); other
//             ISAs widen a pair with a shift and a mask (bfloat16 is float32's upper half), so
//             the layout is the same everywhere. Kp = H and Ip rounded up to 32: whole tiles.
// Zero rows and columns pad every panel: padded intermediate columns come out silu(0) * 0 = 0.
//
// Paths (compiled in as -march=native allows, picked at run time, best by default so tests
// can run each compiled one): scalar; AVX2 (ymm tiles of 3 rows x 32 columns for gate/up,
// 6 x 16 for down); AVX-512 (12 x 32 zmm tiles); AVX512-BF16 for bfloat16 weights, which
// rounds x and act to bfloat16 and multiplies pairs with vdpbf16ps (the other paths keep x and
// act in float32 and widen the weights); AMX for bfloat16 weights, the same roundings with
// tdpbf16ps on 16 x 16 tiles (run_chunk_amx). Sums are float32, over k in order per
// accumulator (AMX: in whole tiles of 32 k, whose inner order the hardware fixes).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "gguf_linear.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AIOLM_MOE_AVX2 1
#endif
#if defined(AIOLM_MOE_AVX2) && defined(__AVX512F__)
#define AIOLM_MOE_AVX512 1
#endif
#if defined(AIOLM_MOE_AVX512) && defined(__AVX512BF16__)
#define AIOLM_MOE_BF16 1
#endif
#if defined(AIOLM_MOE_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AIOLM_MOE_AMX 1
#endif

namespace {

enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3, AMX_BF16 = 4 };

constexpr int64_t NR = 16;             // columns per panel
constexpr int64_t CHUNK_TOKENS = 1024;  // tokens per pass: bounds act's buffer for long prompts
constexpr int64_t MAX_ROWS = 12;       // the tallest tile of any path

#if defined(AIOLM_MOE_AMX)
// Linux gives a process the 8 KiB of tile registers only once it asks (arch_prctl); a kernel
// or container that refuses leaves the AVX512-BF16 path.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
#endif

int64_t best_isa() {
#if defined(AIOLM_MOE_AMX)
  return amx_permitted() ? AMX_BF16 : AVX512_BF16;
#elif defined(AIOLM_MOE_BF16)
  return AVX512_BF16;
#elif defined(AIOLM_MOE_AVX512)
  return AVX512;
#elif defined(AIOLM_MOE_AVX2)
  return AVX2;
#else
  return SCALAR;
#endif
}

using bf16 = uint16_t;  // bfloat16 bits
template <typename T>
struct Type {
  using type = T;
};

using aiolm_bf16::narrow;
using aiolm_bf16::widen;

// Weight element (k, c) of a panel: [k][16] for float32, [k / 2][16][2] for bfloat16.
inline float weight_at(const float* p, int64_t k, int64_t c) { return p[k * NR + c]; }
inline float weight_at(const bf16* p, int64_t k, int64_t c) { return widen(p[(k / 2) * 2 * NR + 2 * c + (k & 1)]); }

// The tiles: y[r][0 : 16 NPC] = sum_k x_r[k] * panel_j[k][0 : 16] for R rows, whose addresses
// are xr[0..R), against NPC panels (panel j at w + j * pstride), into y with 16 NPC per row.
template <int R, int NPC, typename W, typename A>
void tile_scalar(const A* const* xr, const W* w, int64_t pstride, int64_t K, float* y) {
  float acc[R][NPC * NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < NPC; ++j)
      for (int64_t c = 0; c < NR; ++c) {
        const float b = weight_at(w + j * pstride, k, c);
        for (int r = 0; r < R; ++r) acc[r][j * NR + c] += widen(xr[r][k]) * b;
      }
  std::memcpy(y, acc, sizeof(acc));
}

#if defined(AIOLM_MOE_AVX2)
// float32 x. bfloat16 weights go k by pairs: the even k's weight is a 32-bit lane shifted up
// 16, the odd one's the lane with its low half masked off.
template <int R, int NPC, typename W>
void tile_avx2(const float* const* xr, const W* w, int64_t pstride, int64_t K, float* y) {
  __m256 c[R][2 * NPC];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 2 * NPC; ++v) c[r][v] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<W, float>) {
    for (int64_t k = 0; k < K; ++k) {
      __m256 b[2 * NPC];
#pragma GCC unroll 4
      for (int v = 0; v < 2 * NPC; ++v) b[v] = _mm256_loadu_ps(w + (v / 2) * pstride + k * NR + (v % 2) * 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(xr[r] + k);
#pragma GCC unroll 4
        for (int v = 0; v < 2 * NPC; ++v) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
      }
    }
  } else {
    const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    for (int64_t k = 0; k < K; k += 2) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // h = 0: even k, 1: odd k
        __m256 b[2 * NPC];
#pragma GCC unroll 4
        for (int v = 0; v < 2 * NPC; ++v) {
          const __m256i raw = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w + (v / 2) * pstride + k * NR + (v % 2) * NR));
          b[v] = _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(raw, 16) : _mm256_and_si256(raw, hi));
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(xr[r] + k + h);
#pragma GCC unroll 4
          for (int v = 0; v < 2 * NPC; ++v) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
        }
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 2 * NPC; ++v) _mm256_storeu_ps(y + r * NPC * NR + v * 8, c[r][v]);
}
#endif

#if defined(AIOLM_MOE_AVX512)
template <int R, int NPC, typename W>
void tile_avx512(const float* const* xr, const W* w, int64_t pstride, int64_t K, float* y) {
  __m512 c[R][NPC];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NPC; ++j) c[r][j] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<W, float>) {
    for (int64_t k = 0; k < K; ++k) {
      __m512 b[NPC];
#pragma GCC unroll 2
      for (int j = 0; j < NPC; ++j) b[j] = _mm512_loadu_ps(w + j * pstride + k * NR);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(xr[r][k]);
#pragma GCC unroll 2
        for (int j = 0; j < NPC; ++j) c[r][j] = _mm512_fmadd_ps(a, b[j], c[r][j]);
      }
    }
  } else {
    const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    for (int64_t k = 0; k < K; k += 2) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512 b[NPC];
#pragma GCC unroll 2
        for (int j = 0; j < NPC; ++j) {
          const __m512i raw = _mm512_loadu_si512(w + j * pstride + k * NR);
          b[j] = _mm512_castsi512_ps(h == 0 ? _mm512_slli_epi32(raw, 16) : _mm512_and_si512(raw, hi));
        }
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512 a = _mm512_set1_ps(xr[r][k + h]);
#pragma GCC unroll 2
          for (int j = 0; j < NPC; ++j) c[r][j] = _mm512_fmadd_ps(a, b[j], c[r][j]);
        }
      }
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NPC; ++j) _mm512_storeu_ps(y + r * NPC * NR + j * NR, c[r][j]);
}
#endif

#if defined(AIOLM_MOE_BF16)
// bfloat16 x (in pairs, one 32-bit broadcast) against bfloat16 pair panels: vdpbf16ps adds
// both products of a pair into a float32 lane.
template <int R, int NPC>
void tile_bf16(const bf16* const* xr, const bf16* w, int64_t pstride, int64_t K, float* y) {
  __m512 c[R][NPC];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NPC; ++j) c[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh b[NPC];
#pragma GCC unroll 2
    for (int j = 0; j < NPC; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * pstride + k * NR);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr[r] + k, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 2
      for (int j = 0; j < NPC; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], a, b[j]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NPC; ++j) _mm512_storeu_ps(y + r * NPC * NR + j * NR, c[r][j]);
}
#endif

// The tile shapes of a path: gate/up always two panels (the gate's and the up's), down NPC
// panels of y's columns; rows as many as the registers hold.
template <int64_t I>
struct Shape;
template <>
struct Shape<SCALAR> {
  static constexpr int UP_ROWS = 4, DOWN_ROWS = 4, DOWN_NPC = 1;
};
template <>
struct Shape<AVX2> {  // 16 ymm: 12 accumulators
  static constexpr int UP_ROWS = 3, DOWN_ROWS = 6, DOWN_NPC = 1;
};
template <>
struct Shape<AVX512> {  // 32 zmm: 24 accumulators
  static constexpr int UP_ROWS = 12, DOWN_ROWS = 12, DOWN_NPC = 2;
};
template <>
struct Shape<AVX512_BF16> : Shape<AVX512> {};

// One tile of `rows` <= RMAX rows on path I, R picked at run time.
template <int64_t I, int NPC, int RMAX, typename W, typename A>
inline void tile(int rows, const A* const* xr, const W* w, int64_t pstride, int64_t K, float* y) {
  if constexpr (RMAX > 1) {
    if (rows < RMAX) return tile<I, NPC, RMAX - 1>(rows, xr, w, pstride, K, y);
  }
#if defined(AIOLM_MOE_BF16)
  if constexpr (I == AVX512_BF16) {
    if constexpr (std::is_same_v<W, bf16> && std::is_same_v<A, bf16>) return tile_bf16<RMAX, NPC>(xr, w, pstride, K, y);
  }
#endif
#if defined(AIOLM_MOE_AVX512)
  if constexpr (I == AVX512 && std::is_same_v<A, float>) return tile_avx512<RMAX, NPC>(xr, w, pstride, K, y);
#endif
#if defined(AIOLM_MOE_AVX2)
  if constexpr (I == AVX2 && std::is_same_v<A, float>) return tile_avx2<RMAX, NPC>(xr, w, pstride, K, y);
#endif
  if constexpr (I == SCALAR) return tile_scalar<RMAX, NPC>(xr, w, pstride, K, y);
}

// act[0:16] = silu(g) * u * scale, in float32 or rounded to bfloat16.
template <typename A>
inline void silu_mul(const float* g, const float* u, float scale, A* act) {
  float o[NR];
  int64_t i = 0;
#if defined(AIOLM_MOE_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), s = _mm256_set1_ps(scale);
  for (; i < NR; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = aiolm_vec::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(silu, _mm256_loadu_ps(u + i)), s));
  }
#endif
  for (; i < NR; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i] * scale;
  if constexpr (std::is_same_v<A, float>) {
    std::memcpy(act, o, sizeof(o));
  } else {
    for (int64_t c = 0; c < NR; ++c) act[c] = narrow(o[c]);
  }
}

// The (token, slot) pairs of a chunk grouped by expert: expert e's are [off[e], off[e + 1]),
// in token order; `active` lists the experts with any.
struct Routing {
  std::vector<int64_t> off, token, active;
  std::vector<float> weight;

  template <typename Id>
  void build(const Id* ids, const float* w, int64_t t0, int64_t t1, int64_t k, int64_t E) {
    off.assign(E + 1, 0);
    for (int64_t i = t0 * k; i < t1 * k; ++i)
      if (ids[i] >= 0) ++off[ids[i] + 1];
    for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
    token.resize(off[E]);
    weight.resize(off[E]);
    std::vector<int64_t> next(off.begin(), off.end() - 1);
    for (int64_t i = t0 * k; i < t1 * k; ++i)
      if (ids[i] >= 0) {
        const int64_t p = next[ids[i]]++;
        token[p] = i / k - t0;
        weight[p] = w[i];
      }
    active.clear();
    for (int64_t e = 0; e < E; ++e)
      if (off[e + 1] > off[e]) active.push_back(e);
  }
};

// Reused between calls: a prompt's act buffer is megabytes, faulted in afresh if allocated.
struct Scratch {
  Routing route;
  std::vector<float> xf, actf;
  std::vector<bf16> xb, actb, xh;
};

// f(i0, i1) over [0, n) split into one contiguous range per thread of about equal total cost.
template <typename Cost, typename F>
void parallel_by_cost(int64_t n, const Cost& cost, const F& f) {
  std::vector<int64_t> start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) start[i + 1] = start[i] + cost(i);
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      // items whose cost starts in [total * p / parts, total * (p + 1) / parts)
      const auto at_cost = [&](int64_t part) {
        const int64_t c = start[n] * part / parts;
        return std::lower_bound(start.begin(), start.end() - 1, c) - start.begin();
      };
      const int64_t i0 = at_cost(p), i1 = p + 1 == parts ? n : at_cost(p + 1);
      if (i0 < i1) f(i0, i1);
    }
  });
}

struct Dims {
  int64_t T, H, k, E, P13, Kp, Ip, P2;
};

// The steps of one chunk of tokens on path I. x: the chunk's rows (stride Kp), of A.
template <int64_t I, typename W, typename A>
void run_chunk(const Dims& d, const Routing& rt, const A* x, const W* w13, const W* w2, A* act, float* y) {
  using S = Shape<I>;
  const int64_t na = static_cast<int64_t>(rt.active.size());
  const int64_t ps13 = d.Kp * NR, ps2 = d.Ip * NR;
  // Gate/up: items are (routed expert, intermediate panel), expert by expert so that a thread
  // reuses an expert's x rows from cache across its panels; each writes its own act columns.
  // The threads split them by rows, not by count: one busy expert's panels are shared out.
  const auto cost = [&](int64_t it) { return rt.off[rt.active[it / d.P13] + 1] - rt.off[rt.active[it / d.P13]] + 4; };
  parallel_by_cost(na * d.P13, cost, [&](int64_t i0, int64_t i1) {
    float t[S::UP_ROWS * 2 * NR];
    const A* xr[S::UP_ROWS];
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t e = rt.active[it / d.P13], p = it % d.P13;
      const W* wp = w13 + (e * d.P13 + p) * 2 * ps13;
      for (int64_t r0 = rt.off[e]; r0 < rt.off[e + 1]; r0 += S::UP_ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(S::UP_ROWS, rt.off[e + 1] - r0));
        for (int r = 0; r < rows; ++r) xr[r] = x + rt.token[r0 + r] * d.Kp;
        tile<I, 2, S::UP_ROWS>(rows, xr, wp, ps13, d.Kp, t);
        for (int r = 0; r < rows; ++r)
          silu_mul(t + r * 2 * NR, t + r * 2 * NR + NR, rt.weight[r0 + r], act + (r0 + r) * d.Ip + p * NR);
      }
    }
  });
  // Down: items are groups of DOWN_NPC output panels; each adds every routed expert's rows into
  // its own columns of y, expert after expert.
  constexpr int NPC = S::DOWN_NPC;
  at::parallel_for(0, d.P2 / NPC, 1, [&](int64_t g0, int64_t g1) {
    float t[S::DOWN_ROWS * NPC * NR];
    const A* xr[S::DOWN_ROWS];
    for (const int64_t e : rt.active) {
      for (int64_t g = g0; g < g1; ++g) {
        const W* wp = w2 + (e * d.P2 + g * NPC) * ps2;
        const int64_t c0 = g * NPC * NR, cols = std::min<int64_t>(NPC * NR, d.H - c0);
        if (cols <= 0) continue;  // a zero panel padding P2 to even
        for (int64_t r0 = rt.off[e]; r0 < rt.off[e + 1]; r0 += S::DOWN_ROWS) {
          const int rows = static_cast<int>(std::min<int64_t>(S::DOWN_ROWS, rt.off[e + 1] - r0));
          for (int r = 0; r < rows; ++r) xr[r] = act + (r0 + r) * d.Ip;
          tile<I, NPC, S::DOWN_ROWS>(rows, xr, wp, ps2, d.Ip, t);
          for (int r = 0; r < rows; ++r) {
            float* yr = y + rt.token[r0 + r] * d.H + c0;
            const float* tr = t + r * NPC * NR;
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) yr[c] += tr[c];
          }
        }
      }
    }
  });
}

#if defined(AIOLM_MOE_AMX)
// AMX: tiles 0-3 hold C (16 rows x 16 float32), 4-5 A (16 rows x 32 bfloat16), 6-7 B (16
// k-pairs x 16 columns, a panel's 32 k as they lie). A block is up to 32 rows (A in 4 and 5)
// against two panels (B in 6 and 7); a block of up to 16 rows leaves tiles 2, 3 and 5 unused.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile state is per thread: each parallel task configures its own and releases it after.
struct AmxTiles {
  AmxTiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
  }
  ~AmxTiles() { _tile_release(); }
};

// y[r][0:16] (b0's columns) and y[r][16:32] (b1's) for the 16 or 32 rows of a (row stride
// lda) over K (a multiple of 32): rows past the block's real ones read whatever lies there and
// are discarded by the caller, as each row of C depends on its own row of A alone.
template <bool TWO>
void amx_block(const bf16* a, int64_t lda, const bf16* b0, const bf16* b1, int64_t K, float* y) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, a + k, lda * 2);
    _tile_loadd(6, b0 + k * NR, 64);
    _tile_loadd(7, b1 + k * NR, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, a + 16 * lda + k, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, y, 2 * NR * 4);
  _tile_stored(1, y + NR, 2 * NR * 4);
  if constexpr (TWO) {
    _tile_stored(2, y + 16 * 2 * NR, 2 * NR * 4);
    _tile_stored(3, y + 16 * 2 * NR + NR, 2 * NR * 4);
  }
}

inline void amx_rows(int rows, const bf16* a, int64_t lda, const bf16* b0, const bf16* b1, int64_t K, float* y) {
  if (rows > 16)
    amx_block<true>(a, lda, b0, b1, K, y);
  else
    amx_block<false>(a, lda, b0, b1, K, y);
}

constexpr int64_t AMX_ROWS = 32, AMX_PAD = 32;  // rows a block; spare rows after a buffer's last

// The steps of one chunk on AMX. xg: the chunk's (token, slot) pairs' x rows in pair order
// (stride Kp, AMX_PAD zero rows after), so that an expert's rows are one strided tile source;
// act likewise, stride Ip.
void run_chunk_amx(const Dims& d, const Routing& rt, const bf16* xg, const bf16* w13, const bf16* w2, bf16* act,
                   float* y) {
  const int64_t na = static_cast<int64_t>(rt.active.size());
  const int64_t ps13 = d.Kp * NR, ps2 = d.Ip * NR;
  const auto cost = [&](int64_t it) { return rt.off[rt.active[it / d.P13] + 1] - rt.off[rt.active[it / d.P13]] + 4; };
  parallel_by_cost(na * d.P13, cost, [&](int64_t i0, int64_t i1) {
    AmxTiles tiles;
    alignas(64) float t[AMX_ROWS * 2 * NR];
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t e = rt.active[it / d.P13], p = it % d.P13;
      const bf16* wp = w13 + (e * d.P13 + p) * 2 * ps13;
      for (int64_t r0 = rt.off[e]; r0 < rt.off[e + 1]; r0 += AMX_ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(AMX_ROWS, rt.off[e + 1] - r0));
        amx_rows(rows, xg + r0 * d.Kp, d.Kp, wp, wp + ps13, d.Kp, t);
        for (int r = 0; r < rows; ++r)
          silu_mul(t + r * 2 * NR, t + r * 2 * NR + NR, rt.weight[r0 + r], act + (r0 + r) * d.Ip + p * NR);
      }
    }
  });
  // Down: as run_chunk's, a thread owning pairs of output panels and adding the experts in id order.
  at::parallel_for(0, d.P2 / 2, 1, [&](int64_t g0, int64_t g1) {
    AmxTiles tiles;
    alignas(64) float t[AMX_ROWS * 2 * NR];
    for (const int64_t e : rt.active) {
      for (int64_t g = g0; g < g1; ++g) {
        const bf16* wp = w2 + (e * d.P2 + 2 * g) * ps2;
        const int64_t c0 = g * 2 * NR, cols = std::min<int64_t>(2 * NR, d.H - c0);
        if (cols <= 0) continue;
        for (int64_t r0 = rt.off[e]; r0 < rt.off[e + 1]; r0 += AMX_ROWS) {
          const int rows = static_cast<int>(std::min<int64_t>(AMX_ROWS, rt.off[e + 1] - r0));
          amx_rows(rows, act + r0 * d.Ip, d.Ip, wp, wp + ps2, d.Ip, t);
          for (int r = 0; r < rows; ++r) {
            float* yr = y + rt.token[r0 + r] * d.H + c0;
            const float* tr = t + r * 2 * NR;
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) yr[c] += tr[c];
          }
        }
      }
    }
  });
}

// dst[0:n] = src[0:n] rounded to bfloat16, as narrow() rounds (vcvtneps2bf16 flushes
// subnormals to zero, as tdpbf16ps reads them anyway).
void to_bf16(const float* src, bf16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = narrow(src[i]);
}

// A chunk's tokens [t0, t0 + tc) of x through run_chunk_amx: x in bfloat16, then its rows
// gathered in pair order with AMX_PAD zero rows after.
void run_amx(const Dims& d, Scratch& s, const at::Tensor& x, int64_t t0, int64_t tc, const bf16* w13, const bf16* w2,
             float* y) {
  const Routing& rt = s.route;
  const int64_t pairs = rt.off[d.E], H = d.H, Kp = d.Kp;
  const bf16* xs;
  if (x.scalar_type() == at::kBFloat16) {
    xs = reinterpret_cast<const bf16*>(x.data_ptr()) + t0 * H;
  } else {
    s.xh.resize(tc * H);
    bf16* dst = s.xh.data();
    const float* src = x.data_ptr<float>() + t0 * H;
    at::parallel_for(0, tc, 16, [&](int64_t a, int64_t b) { to_bf16(src + a * H, dst + a * H, (b - a) * H); });
    xs = dst;
  }
  s.xb.resize((pairs + AMX_PAD) * Kp);
  s.actb.resize((pairs + AMX_PAD) * d.Ip);
  bf16* xg = s.xb.data();
  at::parallel_for(0, pairs + AMX_PAD, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      bf16* row = xg + p * Kp;
      const int64_t filled = p < pairs ? H : 0;
      if (filled) std::memcpy(row, xs + rt.token[p] * H, H * sizeof(bf16));
      std::fill(row + filled, row + Kp, bf16{0});
    }
  });
  std::fill(s.actb.begin() + pairs * d.Ip, s.actb.end(), bf16{0});
  run_chunk_amx(d, rt, xg, w13, w2, s.actb.data(), y);
}
#endif

at::Tensor fused_moe(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t isa) {
  const char* op = "aiolm::fused_moe";
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16), op,
              ": x must be float32 or bfloat16 [T, H]");
  const bool wb = w13.scalar_type() == at::kBFloat16;
  TORCH_CHECK((w13.scalar_type() == at::kFloat || wb) && w2.scalar_type() == w13.scalar_type(), op,
              ": w13 and w2 must both be float32 or both bfloat16");
  TORCH_CHECK(w13.dim() == 4 && w13.size(2) == 2 && w13.size(3) % NR == 0 && w13.is_contiguous(), op,
              ": w13 must be contiguous [E, P13, 2, Kp * 16]");
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == w13.size(0) && w2.size(1) % 2 == 0 && w2.is_contiguous(), op,
              ": w2 must be contiguous [E, P2, Ip * 16] with P2 even");
  Dims d{x_in.size(0), x_in.size(1), topk_ids.dim() == 2 ? topk_ids.size(1) : 0, w13.size(0), w13.size(1),
         w13.size(3) / NR, w13.size(1) * NR, w2.size(1)};
  TORCH_CHECK(d.Kp == (wb ? (d.H + 31) / 32 * 32 : d.H), op, ": x has ", d.H, " features, w13 is packed for ", d.Kp);
  TORCH_CHECK(!wb || d.Ip % 32 == 0, op, ": bfloat16 w13 must have whole tiles of 32 intermediate columns, not ", d.Ip);
  TORCH_CHECK(w2.size(2) == d.Ip * NR, op, ": w2 reduces over ", w2.size(2) / NR, " columns, w13 makes ", d.Ip);
  TORCH_CHECK(d.H > (d.P2 - 2) * NR && d.H <= d.P2 * NR, op, ": ", d.P2, " panels of w2 do not fit ", d.H,
              " output columns");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == d.T &&
                  (topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt),
              op, ": topk_ids must be int32 or int64 [T, k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_weights must be float32 [T, k] like topk_ids");
  TORCH_CHECK(isa >= -1 && isa <= best_isa(), op, ": isa ", isa,
              " is not built here (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX512-BF16, 4 AMX; this build has up to ", best_isa(),
              ")");
  if (isa < 0) isa = best_isa();
  if ((isa == AVX512_BF16 || isa == AMX_BF16) && !wb) isa = AVX512;  // for bfloat16 weights only
  at::Tensor y = at::zeros({d.T, d.H}, x_in.options().dtype(at::kFloat));
  if (d.T == 0 || d.k == 0) return y;
  const at::Tensor ids = topk_ids.contiguous(), tw = topk_weights.contiguous();
  const at::Tensor xc = x_in.contiguous();
  {
    const auto check = [&](auto* p) {
      for (int64_t i = 0; i < d.T * d.k; ++i)
        TORCH_CHECK(p[i] >= -1 && p[i] < d.E, op, ": expert id ", static_cast<int64_t>(p[i]), " outside [-1, ",
                    d.E, ")");
    };
    if (ids.scalar_type() == at::kLong) check(ids.data_ptr<int64_t>()); else check(ids.data_ptr<int32_t>());
  }
  thread_local Scratch s;
  const bool act_bf16 = isa == AVX512_BF16;
  float* yp = y.data_ptr<float>();
  for (int64_t t0 = 0; t0 < d.T; t0 += CHUNK_TOKENS) {
    const int64_t t1 = std::min(d.T, t0 + CHUNK_TOKENS), tc = t1 - t0;
    if (ids.scalar_type() == at::kLong)
      s.route.build(ids.data_ptr<int64_t>(), tw.data_ptr<float>(), t0, t1, d.k, d.E);
    else
      s.route.build(ids.data_ptr<int32_t>(), tw.data_ptr<float>(), t0, t1, d.k, d.E);
    const int64_t pairs = s.route.off[d.E];
    if (pairs == 0) continue;
#if defined(AIOLM_MOE_AMX)
    if (isa == AMX_BF16) {
      run_amx(d, s, xc, t0, tc, static_cast<const bf16*>(w13.data_ptr()), static_cast<const bf16*>(w2.data_ptr()),
              yp + t0 * d.H);
      continue;
    }
#endif
    // x's chunk as the path reads it: rows of Kp (zero features pad bfloat16 rows to 32), in
    // float32 or, for vdpbf16ps, bfloat16; in place when it already is.
    const void* xp = nullptr;
    const bool x_bf16 = x_in.scalar_type() == at::kBFloat16;
    if (act_bf16 ? (x_bf16 && d.Kp == d.H) : (!x_bf16 && d.Kp == d.H)) {
      xp = static_cast<const char*>(xc.data_ptr()) + t0 * d.H * xc.element_size();
    } else if (act_bf16) {
      s.xb.assign(tc * d.Kp, 0);
      for (int64_t t = 0; t < tc; ++t)
        for (int64_t h = 0; h < d.H; ++h)
          s.xb[t * d.Kp + h] = x_bf16 ? reinterpret_cast<const bf16*>(xc.data_ptr())[(t0 + t) * d.H + h]
                                      : narrow(xc.data_ptr<float>()[(t0 + t) * d.H + h]);
      xp = s.xb.data();
    } else {
      s.xf.assign(tc * d.Kp, 0.f);
      for (int64_t t = 0; t < tc; ++t)
        for (int64_t h = 0; h < d.H; ++h)
          s.xf[t * d.Kp + h] = x_bf16 ? widen(reinterpret_cast<const bf16*>(xc.data_ptr())[(t0 + t) * d.H + h])
                                      : xc.data_ptr<float>()[(t0 + t) * d.H + h];
      xp = s.xf.data();
    }
    float* yc = yp + t0 * d.H;
    auto go = [&](auto isa_c, auto w_type) {
      constexpr int64_t I = decltype(isa_c)::value;
      using W = typename decltype(w_type)::type;
      const W* a = static_cast<const W*>(w13.data_ptr());
      const W* b = static_cast<const W*>(w2.data_ptr());
      if constexpr (I == AVX512_BF16) {
        s.actb.resize(pairs * d.Ip);
        run_chunk<I, W, bf16>(d, s.route, static_cast<const bf16*>(xp), a, b, s.actb.data(), yc);
      } else {
        s.actf.resize(pairs * d.Ip);
        run_chunk<I, W, float>(d, s.route, static_cast<const float*>(xp), a, b, s.actf.data(), yc);
      }
    };
    auto with_w = [&](auto isa_c) {
      if (wb)
        go(isa_c, Type<bf16>{});
      else
        go(isa_c, Type<float>{});
    };
    switch (isa) {
#if defined(AIOLM_MOE_BF16)
      case AVX512_BF16: go(std::integral_constant<int64_t, AVX512_BF16>{}, Type<bf16>{}); break;
#endif
#if defined(AIOLM_MOE_AVX512)
      case AVX512: with_w(std::integral_constant<int64_t, AVX512>{}); break;
#endif
#if defined(AIOLM_MOE_AVX2)
      case AVX2: with_w(std::integral_constant<int64_t, AVX2>{}); break;
#endif
      default: with_w(std::integral_constant<int64_t, SCALAR>{}); break;
    }
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// aiolm::gguf_moe: the same sum with the experts kept as a GGUF file's blocks (Q4_0, Q4_1,
// Q8_0, Q4_K, Q6_K; each of gate, up and down may have its own type), for the steps of few
// rows that reading the weights bounds. Each expert's projections are regrouped as
// aiolm::gguf_linear reads a weight (gguf_linear.h: groups of 8 output rows; an expert's rows,
// the other projection's features, are whole blocks of 32, so whole groups), stacked over the
// experts: qs [E, G, bytes], scale [E, G, n], mins the same or empty.
// The routing is fused_moe's (a counting sort of a chunk's pairs by expert); then:
//   1. x's rows gathered per pair, in expert order, so that each expert's rows are contiguous
//      (and, for int8, quantized per block of 32 as gguf_int8_linear does);
//   2. gate/up: items (routed expert, 16 intermediate rows) over the threads, each running the
//      dense kernels' group routine (gguf_linear.h's or gguf_int8.h's run_groups) over the
//      expert's rows for its gate and up rows, then act = silu(gate) * up * w in place;
//   3. down: items (routed expert, 16 output rows), the same routine over act's rows, into a
//      row per pair;
//   4. each token's pairs added in expert order (the sort's order), one token per thread.
// Every item writes its own rows and columns, so there are no races, the sums do not depend
// on the thread count, and only the routed experts' blocks are read.

// One projection of every expert: expert e's arrays start at e * qstride bytes of qs and
// e * sstride elements of scale (and mins).
struct ExpertBlocks {
  const uint8_t* qs;
  const void* scale;
  const void* mins;
  int64_t qtype, rows, groups, nblocks, qstride, sstride;

  template <int64_t T>
  const aiolm_gguf::Scale<T>* s(int64_t e) const {
    return static_cast<const aiolm_gguf::Scale<T>*>(scale) + e * sstride;
  }
  template <int64_t T>
  const aiolm_gguf::Scale<T>* m(int64_t e) const {
    return aiolm_gguf::has_min(T) ? static_cast<const aiolm_gguf::Scale<T>*>(mins) + e * sstride : nullptr;
  }
  const uint8_t* q(int64_t e) const { return qs + e * qstride; }
};

// Checks one projection's arrays ([E, G, ..] for `rows` output rows of `features` inputs).
ExpertBlocks expert_blocks(const char* op, const char* what, const at::Tensor& qs, const at::Tensor& scale,
                           const at::Tensor& mins, int64_t qtype, int64_t E, int64_t rows, int64_t features) {
  aiolm_gguf::check_type(op, qtype);
  const bool with_min = aiolm_gguf::has_min(qtype);
  TORCH_CHECK(qs.dim() == 3 && qs.size(0) == E && qs.is_contiguous() && scale.dim() == 3 && scale.size(0) == E &&
                  scale.is_contiguous() && (!with_min || (mins.dim() == 3 && mins.is_contiguous())),
              op, ": ", what, "'s qs, scale (and mins) must be contiguous [E, G, ..] over ", E, " experts");
  const at::Tensor probe = at::empty({0, features}, qs.options().dtype(at::kFloat));
  const int64_t nb = aiolm_gguf::check_blocks(op, probe, qs[0], scale[0], with_min ? mins[0] : mins, qtype, rows);
  return ExpertBlocks{static_cast<const uint8_t*>(qs.data_ptr()), scale.data_ptr(),
                      with_min ? mins.data_ptr() : nullptr, qtype, rows, qs.size(1), nb,
                      qs.size(1) * qs.size(2), scale.size(1) * scale.size(2)};
}

// Rows [r0, r0 + M) of x (contiguous, `features` wide) through groups [g0, g1) of expert e's
// projection w, into y's rows (stride w.rows): float or int8 arithmetic, as the dense kernels.
struct Projection {
  const ExpertBlocks& w;
  const float* x;         // float: the rows, as the kernels read them (aiolm_gguf_float::kernel_x)
  float unscale;          // float: the results' factor, as kernel_x gives it
  const float* xsum;      // float: their block sums (where aiolm_gguf_float::needs_block_sums)
  aiolm_gguf_int8::QRows xq;  // int8: their codes
  bool int8;
  int64_t isa;

  void run(int64_t e, int64_t r0, int64_t M, int64_t g0, int64_t g1, float* y) const {
    aiolm_gguf::with_type(w.qtype, [&](auto type) {
      constexpr int64_t T = decltype(type)::value;
      const int64_t K = w.nblocks * aiolm_gguf::QK;
      if (int8)
        aiolm_gguf_int8::run_groups<T>(w.q(e), w.s<T>(e), w.m<T>(e), xq.from_row(r0), M, y + r0 * w.rows, w.rows,
                                       isa, g0, g1);
      else
        aiolm_gguf_float::run_groups<T>(w.q(e), w.s<T>(e), w.m<T>(e), xsum ? xsum + r0 * w.nblocks : nullptr,
                                        w.nblocks, x + r0 * K, unscale, K, M, y + r0 * w.rows, w.rows, g0, g1);
    });
  }
};

struct GGUFScratch {
  Routing route;
  std::vector<float> xe, xsum, gate, up, asum, ye, xk_gate, xk_up, xk_down;
  std::vector<int64_t> tok_off, tok_pairs;
  aiolm_gguf_int8::Scratch qgate, qup, qdown;
};

// What a projection reads of its input rows: the rows in the kernels' order and their block
// sums (float path) or int8 codes (int8 path), made once for all the routed experts' rows.
Projection prepare(const ExpertBlocks& w, const float* x, int64_t rows, std::vector<float>& xsum,
                   std::vector<float>& xk, aiolm_gguf_int8::Scratch& q, bool int8, int64_t isa) {
  Projection p{w, x, 0.f, nullptr, {}, int8, isa};
  const int64_t K = w.nblocks * aiolm_gguf::QK;
  if (int8) {
    p.xq = q.rows(x, rows, K, isa, w.qtype);
    return p;
  }
  const aiolm_gguf_float::KernelX k = aiolm_gguf_float::kernel_x(w.qtype, x, rows, K, xk);
  p.x = k.x;
  p.unscale = k.unscale;
  p.xsum = aiolm_gguf_float::block_sums(w.qtype, x, rows, K, xsum);
  return p;
}

at::Tensor gguf_moe(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes,
                    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t intermediate, bool int8,
                    int64_t isa) {
  const char* op = "aiolm::gguf_moe";
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, op, ": x must be float32 [T, H]");
  TORCH_CHECK(blocks.size() == 9 && qtypes.size() == 3, op,
              ": blocks are (qs, scale, mins) of gate, up and down, and qtypes their 3 types");
  const int64_t T = x_in.size(0), H = x_in.size(1), I = intermediate, E = blocks[0].dim() == 3 ? blocks[0].size(0) : 0;
  TORCH_CHECK(I > 0 && I % aiolm_gguf::QK == 0, op, ": the intermediate size ", I, " is not whole blocks of 32");
  const ExpertBlocks wg = expert_blocks(op, "gate", blocks[0], blocks[1], blocks[2], qtypes[0], E, I, H);
  const ExpertBlocks wu = expert_blocks(op, "up", blocks[3], blocks[4], blocks[5], qtypes[1], E, I, H);
  const ExpertBlocks wd = expert_blocks(op, "down", blocks[6], blocks[7], blocks[8], qtypes[2], E, H, I);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  (topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt),
              op, ": topk_ids must be int32 or int64 [T, k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_weights must be float32 [T, k] like topk_ids");
  const int64_t best = aiolm_gguf_int8::best_isa();
  TORCH_CHECK(isa >= -1 && isa <= best, op, ": isa ", isa,
              " is not built here (int8: 0 scalar, 1 AVX2, 2 AVX-512 VNNI; this build has up to ", best, ")");
  if (isa < 0) isa = best;
  const int64_t k = topk_ids.size(1);
  at::Tensor y = at::zeros({T, H}, x_in.options());
  if (T == 0 || k == 0) return y;
  const at::Tensor ids = topk_ids.contiguous(), tw = topk_weights.contiguous(), x = x_in.contiguous();
  {
    const auto check = [&](auto* p) {
      for (int64_t i = 0; i < T * k; ++i)
        TORCH_CHECK(p[i] >= -1 && p[i] < E, op, ": expert id ", static_cast<int64_t>(p[i]), " outside [-1, ", E, ")");
    };
    if (ids.scalar_type() == at::kLong) check(ids.data_ptr<int64_t>()); else check(ids.data_ptr<int32_t>());
  }
  thread_local GGUFScratch scratch;
  GGUFScratch& s = scratch;  // the calling thread's, named so that the workers' lambdas reach it too
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t units13 = (wg.groups + 1) / 2, units2 = (wd.groups + 1) / 2;  // items of 2 groups: 16 rows
  for (int64_t t0 = 0; t0 < T; t0 += CHUNK_TOKENS) {
    const int64_t t1 = std::min(T, t0 + CHUNK_TOKENS), tc = t1 - t0;
    Routing& rt = s.route;
    if (ids.scalar_type() == at::kLong)
      rt.build(ids.data_ptr<int64_t>(), tw.data_ptr<float>(), t0, t1, k, E);
    else
      rt.build(ids.data_ptr<int32_t>(), tw.data_ptr<float>(), t0, t1, k, E);
    const int64_t pairs = rt.off[E], na = static_cast<int64_t>(rt.active.size());
    if (pairs == 0) continue;
    // 1. x's rows in pair order
    s.xe.resize(pairs * H);
    at::parallel_for(0, pairs, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) std::memcpy(&s.xe[p * H], xp + (t0 + rt.token[p]) * H, H * sizeof(float));
    });
    const Projection pg = prepare(wg, s.xe.data(), pairs, s.xsum, s.xk_gate, s.qgate, int8, isa);
    // up reads the same rows: its own codes only where its type needs other corrections
    const Projection pu = qtypes[1] == qtypes[0] ? Projection{wu, pg.x, pg.unscale, pg.xsum, pg.xq, int8, isa}
                                                 : prepare(wu, s.xe.data(), pairs, s.xsum, s.xk_up, s.qup, int8, isa);
    // 2. gate/up and the activation, act in s.gate. (s.xsum is shared when both have a min:
    // the same rows' sums.)
    s.gate.resize(pairs * I);
    s.up.resize(pairs * I);
    const auto cost13 = [&](int64_t it) {
      const int64_t e = rt.active[it / units13];
      return rt.off[e + 1] - rt.off[e] + 4;
    };
    parallel_by_cost(na * units13, cost13, [&](int64_t i0, int64_t i1) {
      for (int64_t it = i0; it < i1; ++it) {
        const int64_t e = rt.active[it / units13], g0 = 2 * (it % units13), g1 = std::min(g0 + 2, wg.groups);
        const int64_t r0 = rt.off[e], M = rt.off[e + 1] - r0;
        pg.run(e, r0, M, g0, g1, s.gate.data());
        pu.run(e, r0, M, g0, g1, s.up.data());
        const int64_t c0 = g0 * 8, c1 = std::min(g1 * 8, I);
        for (int64_t r = r0; r < r0 + M; ++r) {
          float* g = &s.gate[r * I];
          const float* u = &s.up[r * I];
          int64_t c = c0;
          for (; c + NR <= c1; c += NR) silu_mul(g + c, u + c, rt.weight[r], g + c);
          for (; c < c1; ++c) g[c] = g[c] / (1.f + std::exp(-g[c])) * u[c] * rt.weight[r];
        }
      }
    });
    // 3. down, a row of H per pair
    const Projection pd = prepare(wd, s.gate.data(), pairs, s.asum, s.xk_down, s.qdown, int8, isa);
    s.ye.resize(pairs * H);
    const auto cost2 = [&](int64_t it) {
      const int64_t e = rt.active[it / units2];
      return rt.off[e + 1] - rt.off[e] + 4;
    };
    parallel_by_cost(na * units2, cost2, [&](int64_t i0, int64_t i1) {
      for (int64_t it = i0; it < i1; ++it) {
        const int64_t e = rt.active[it / units2], g0 = 2 * (it % units2), g1 = std::min(g0 + 2, wd.groups);
        pd.run(e, rt.off[e], rt.off[e + 1] - rt.off[e], g0, g1, s.ye.data());
      }
    });
    // 4. each token's pairs in pair order (experts ascending), one token per thread
    s.tok_off.assign(tc + 1, 0);
    for (int64_t p = 0; p < pairs; ++p) ++s.tok_off[rt.token[p] + 1];
    for (int64_t t = 0; t < tc; ++t) s.tok_off[t + 1] += s.tok_off[t];
    s.tok_pairs.resize(pairs);
    {
      std::vector<int64_t> next(s.tok_off.begin(), s.tok_off.end() - 1);
      for (int64_t p = 0; p < pairs; ++p) s.tok_pairs[next[rt.token[p]]++] = p;
    }
    at::parallel_for(0, tc, 1, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) {
        float* yr = yp + (t0 + t) * H;
        for (int64_t j = s.tok_off[t]; j < s.tok_off[t + 1]; ++j) {
          const float* src = &s.ye[s.tok_pairs[j] * H];
#pragma omp simd
          for (int64_t h = 0; h < H; ++h) yr[h] += src[h];
        }
      }
    });
  }
  return y;
}

int64_t fused_moe_best_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int isa=-1) -> Tensor");
  m.def("fused_moe_best_isa() -> int", &fused_moe_best_isa);
  m.def(
      "gguf_moe(Tensor x, Tensor[] blocks, int[] qtypes, Tensor topk_weights, Tensor topk_ids, int intermediate, "
      "bool int8=False, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("gguf_moe", &gguf_moe);
}
