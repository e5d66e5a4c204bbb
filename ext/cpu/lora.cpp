// Batched LoRA for one linear layer on the CPU: every row adds its own adapter's low-rank
// update to the layer's output, in one call (aiolm/kernels/lora_reference.py defines it):
//
//   y[t, c] += sum_r (x[t] . A[s, i R + r]) * B[s, c, r],   s = slot[t] (-1: the row is skipped),
//   i the slice of output column c (c_i <= c < c_{i+1}).
//
// Steps:
//   1. a counting sort groups the rows by slot, in row order; rows of slot -1 are dropped, so
//      they cost nothing and their rows of y are never touched;
//   2. shrink: items (slot group, block of NA rows of A) over the threads; each writes its
//      group's rows of h = x A[s]^T ([rows, L R], float32) for its rows of A: dot products
//      along K in register tiles of MR x rows by NA rows of A, one vector accumulator each,
//      summed across lanes at the end;
//   3. expand: items (slot group, block of CB output columns inside one slice) over the threads;
//      each adds its group's h[:, i R : (i + 1) R] B[s, block]^T into y's block. A group of a
//      few rows takes dot products along R; a larger one first transposes its block of B into
//      [R][CB], so that a register tile broadcasts h and multiplies whole vectors of columns
//      (the transpose costs about what the dot products of one or two rows do).
// The items of each step write disjoint parts of h and of y: no reduction, and the result does
// not depend on the thread count. Each step splits its items into one contiguous range per
// thread of about equal cost (a slot with many rows shares its items out), and a step with
// little work runs on the calling thread alone (a fork and join would cost more than it).
//
// Paths (compiled as -march=native allows, picked at run time, best by default so the tests
// can run each compiled one): scalar, AVX2 (ymm) and AVX-512 (zmm), the same templates over
// a vector type. Sums are float32; each is taken in another order than a plain loop's only.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AIOLM_LORA_AVX2 1
#endif
#if defined(AIOLM_LORA_AVX2) && defined(__AVX512F__)
#define AIOLM_LORA_AVX512 1
#endif

namespace {

enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

int64_t best_isa() {
#if defined(AIOLM_LORA_AVX512)
  return AVX512;
#elif defined(AIOLM_LORA_AVX2)
  return AVX2;
#else
  return SCALAR;
#endif
}

constexpr int64_t DOT_ROWS = 2;         // groups of up to this many rows expand by dot products
// In multiply-adds: below MIN_PART_COST a thread is not worth its fork; items are cut to about
// ITEM_COST at most; BLOCK_COST stands for a block's fixed work (pointers, y's loads and stores).
constexpr int64_t MIN_PART_COST = 1 << 15, ITEM_COST = 1 << 13, BLOCK_COST = 64;

// The vector types: W float32 lanes. loadn/storen touch only the first n < W lanes (the rest
// read as zero), so no row is read or written past its end. Each also names its tile shapes:
// shrink MR x NA accumulators, expand EX_ROWS x CB columns (as CB / W vectors).
struct Scalar {
  using V = float;
  static constexpr int W = 1, MR = 2, NA = 4, EX_ROWS = 4, CB = 8;
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  static V loadn(const float* p, int n) { return n > 0 ? *p : 0.f; }
  static void store(float* p, V v) { *p = v; }
  static void storen(float* p, V v, int n) {
    if (n > 0) *p = v;
  }
  static V set1(float f) { return f; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static float hsum(V v) { return v; }
  static void add4(const V* a, float* y) {  // y[j] += sum of a[j]'s lanes, j < 4
    for (int j = 0; j < 4; ++j) y[j] += a[j];
  }
};

#if defined(AIOLM_LORA_AVX2)
struct Avx2 {
  using V = __m256;
  static constexpr int W = 8, MR = 3, NA = 4, EX_ROWS = 3, CB = 32;  // 12 accumulators of 16 ymm
  static __m256i mask(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V loadn(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void storen(float* p, V v, int n) { _mm256_maskstore_ps(p, mask(n), v); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static void add4(const V* a, float* y) {
    // pairwise sums within 128-bit lanes, then the two lanes: [sum a0, sum a1, sum a2, sum a3]
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(y, _mm_add_ps(_mm_loadu_ps(y), s));
  }
};
#endif

#if defined(AIOLM_LORA_AVX512)
struct Avx512 {
  using V = __m512;
  static constexpr int W = 16, MR = 4, NA = 4, EX_ROWS = 6, CB = 64;  // 16 and 24 accumulators of 32 zmm
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V loadn(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void storen(float* p, V v, int n) { _mm512_mask_storeu_ps(p, mask(n), v); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static __m256 halves(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static void add4(const V* a, float* y) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves(a[0]), halves(a[1])),
                                    _mm256_hadd_ps(halves(a[2]), halves(a[3])));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(y, _mm_add_ps(_mm_loadu_ps(y), s));
  }
};
#endif

// out[m * NA + j] = x_m . a_j over K, for MR rows x_m (at xr[m]) and NA rows a_j of A (at ar[j]).
template <class Vt, int MR, int NA>
inline void shrink_tile(const float* const* xr, const float* const* ar, int64_t K, float* out) {
  using V = typename Vt::V;
  V acc[MR][NA];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NA; ++j) acc[m][j] = Vt::zero();
  int64_t k = 0;
  for (; k + Vt::W <= K; k += Vt::W) {
    V xv[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) xv[m] = Vt::load(xr[m] + k);
#pragma GCC unroll 4
    for (int j = 0; j < NA; ++j) {
      const V a = Vt::load(ar[j] + k);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m][j] = Vt::fma(xv[m], a, acc[m][j]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    V xv[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) xv[m] = Vt::loadn(xr[m] + k, n);
#pragma GCC unroll 4
    for (int j = 0; j < NA; ++j) {
      const V a = Vt::loadn(ar[j] + k, n);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m][j] = Vt::fma(xv[m], a, acc[m][j]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NA; ++j) out[m * NA + j] = Vt::hsum(acc[m][j]);
}

// shrink_tile for `rows` <= MR rows, the tile's height picked at run time.
template <class Vt, int MR, int NA>
inline void shrink_rows(int rows, const float* const* xr, const float* const* ar, int64_t K, float* out) {
  if constexpr (MR > 1) {
    if (rows < MR) return shrink_rows<Vt, MR - 1, NA>(rows, xr, ar, K, out);
  }
  shrink_tile<Vt, MR, NA>(xr, ar, K, out);
}

// y_m[0 : cols] += sum_r h_m[r] * bt[r][0 : cols] for MR rows (h_m at hr[m], y_m at yr[m]);
// bt is [R][CB] with zeros past column `cols`.
template <class Vt, int MR>
inline void expand_tile(const float* const* hr, const float* bt, int64_t R, float* const* yr, int cols) {
  using V = typename Vt::V;
  constexpr int NV = Vt::CB / Vt::W;
  V acc[MR][NV];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[m][v] = Vt::zero();
  for (int64_t r = 0; r < R; ++r) {
    V b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = Vt::load(bt + r * Vt::CB + v * Vt::W);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const V a = Vt::set1(hr[m][r]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[m][v] = Vt::fma(a, b[v], acc[m][v]);
    }
  }
  // the delta is summed apart and added to y once, as the reference adds it
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      float* p = yr[m] + v * Vt::W;
      const int n = cols - v * Vt::W;
      if (n >= Vt::W)
        Vt::store(p, Vt::add(Vt::load(p), acc[m][v]));
      else if (n > 0)
        Vt::storen(p, Vt::add(Vt::loadn(p, n), acc[m][v]), n);
    }
}

template <class Vt, int MR>
inline void expand_rows(int rows, const float* const* hr, const float* bt, int64_t R, float* const* yr, int cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return expand_rows<Vt, MR - 1>(rows, hr, bt, R, yr, cols);
  }
  expand_tile<Vt, MR>(hr, bt, R, yr, cols);
}

// y[c] += h . b_c over R for c < cols, b_c at b + c * ldb: four columns at a time.
template <class Vt>
inline void expand_dot(const float* h, const float* b, int64_t ldb, int64_t R, float* y, int cols) {
  using V = typename Vt::V;
  const int64_t whole = R / Vt::W * Vt::W;
  const int tail = static_cast<int>(R - whole);
  int c = 0;
  for (; c + 4 <= cols; c += 4) {
    V acc[4] = {Vt::zero(), Vt::zero(), Vt::zero(), Vt::zero()};
    for (int64_t r = 0; r < whole; r += Vt::W) {
      const V hv = Vt::load(h + r);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[j] = Vt::fma(hv, Vt::load(b + (c + j) * ldb + r), acc[j]);
    }
    if (tail) {
      const V hv = Vt::loadn(h + whole, tail);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[j] = Vt::fma(hv, Vt::loadn(b + (c + j) * ldb + whole, tail), acc[j]);
    }
    Vt::add4(acc, y + c);
  }
  for (; c < cols; ++c) {
    V acc = Vt::zero();
    for (int64_t r = 0; r < whole; r += Vt::W) acc = Vt::fma(Vt::load(h + r), Vt::load(b + c * ldb + r), acc);
    if (tail) acc = Vt::fma(Vt::loadn(h + whole, tail), Vt::loadn(b + c * ldb + whole, tail), acc);
    y[c] += Vt::hsum(acc);
  }
}

#if defined(AIOLM_LORA_AVX2)
// dst[j * ldd + i] = src[i * lds + j] for i, j < 8.
inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {  // interleave row pairs: t[i] = a0 b0 a1 b1 | a4 b4 a5 b5
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {  // then pairs of pairs: a0 b0 c0 d0 | a4 b4 c4 d4, ...
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // and the 128-bit halves of rows 0-3 with those of rows 4-7
    _mm256_storeu_ps(dst + j * ldd, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ldd, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}
#endif

// bt[r][c] = b[c * ldb + r] for r < R, c < cols, and zero for cols <= c < CB: the block of
// B the broadcast tile reads, whole 8 x 8 squares by shuffles where the path has AVX2.
template <class Vt>
inline void transpose_block(const float* b, int64_t ldb, int64_t R, int cols, float* bt) {
  int c8 = 0;
#if defined(AIOLM_LORA_AVX2)
  if constexpr (Vt::W > 1) {
    const int64_t r8 = R / 8 * 8;
    for (; c8 + 8 <= cols; c8 += 8) {
      for (int64_t r = 0; r < r8; r += 8) transpose8x8(b + c8 * ldb + r, ldb, bt + r * Vt::CB + c8, Vt::CB);
      for (int c = c8; c < c8 + 8; ++c)
        for (int64_t r = r8; r < R; ++r) bt[r * Vt::CB + c] = b[c * ldb + r];
    }
  }
#endif
  for (int c = c8; c < cols; ++c)
    for (int64_t r = 0; r < R; ++r) bt[r * Vt::CB + c] = b[c * ldb + r];
  for (int64_t r = 0; r < R; ++r)
    for (int c = cols; c < Vt::CB; ++c) bt[r * Vt::CB + c] = 0.f;
}

// An item of work: blocks [b0, b1) of slot group g (blocks of A's rows for the shrink, of
// output columns for the expand).
struct Item {
  int64_t g, b0, b1, cost;
};

// Cuts each of G groups' nb blocks (a block of group g costing unit(g) multiply-adds) into
// items of about the same cost: small enough that every thread gets several, large enough
// that a lone row's items outweigh the loop that runs them.
template <typename Unit>
void make_items(std::vector<Item>& items, int64_t G, int64_t nb, const Unit& unit) {
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) total += unit(g) * nb;
  const int64_t target = std::clamp<int64_t>(total / (4 * at::get_num_threads()), 1, ITEM_COST);
  items.clear();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t u = unit(g), per = std::max<int64_t>(1, target / u);
    for (int64_t b = 0; b < nb; b += per) items.push_back({g, b, std::min(nb, b + per), u * (std::min(nb, b + per) - b)});
  }
}

// f(item) for every item, the items split into one contiguous range per thread of about equal
// total cost; on the calling thread alone when the work would not pay for a fork. `start` is
// scratch.
template <typename F>
void run_items(const std::vector<Item>& items, std::vector<int64_t>& start, const F& f) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  start.resize(n + 1);
  start[0] = 0;
  for (int64_t i = 0; i < n; ++i) start[i + 1] = start[i] + items[i].cost;
  const int64_t total = start[n];
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({at::get_num_threads(), n, total / MIN_PART_COST}));
  if (parts == 1) {
    for (const Item& it : items) f(it);
    return;
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    // part p takes the items whose cost starts in [total * p / parts, total * (p + 1) / parts)
    const auto first = [&](int64_t p) {
      return p == parts ? n : std::lower_bound(start.begin(), start.begin() + n, total * p / parts) - start.begin();
    };
    for (int64_t i = first(p0), end = first(p1); i < end; ++i) f(items[i]);
  });
}

struct Block {  // output columns [c0, c0 + cols) of slice i
  int64_t i, c0, cols;
};

// Reused between calls (per calling thread): a decode step allocates nothing.
struct Scratch {
  std::vector<int64_t> off, next, order, groups, start;
  std::vector<float> h;
  std::vector<Block> blocks;
  std::vector<Item> items;
};

struct Problem {
  float* y;
  const float* x;
  const float* a;
  const float* b;
  int64_t ldy, ldx, as0, as1, bs0, bs1;  // A[s][j][k] at a + s as0 + j as1 + k; B[s][c][r] at b + s bs0 + c bs1 + r
  int64_t K, R, LR;
};

// Steps 2 and 3 for the groups the sort made, on path Vt.
template <class Vt>
void run(const Problem& p, Scratch& s) {
  constexpr int MR = Vt::MR, NA = Vt::NA;
  const int64_t G = static_cast<int64_t>(s.groups.size()), LR = p.LR, K = p.K, R = p.R;
  const auto rows_of = [&](int64_t g) { return s.off[s.groups[g] + 1] - s.off[s.groups[g]]; };
  float* h = s.h.data();

  // 2. shrink: blocks of NA rows of A; a block past L R repeats its last row
  const int64_t nb1 = (LR + NA - 1) / NA;
  make_items(s.items, G, nb1, [&](int64_t g) { return rows_of(g) * NA * K + BLOCK_COST; });
  run_items(s.items, s.start, [&](const Item& it) {
    const float* xr[MR];
    const float* ar[NA];
    float out[MR * NA];
    const int64_t slot = s.groups[it.g], q0 = s.off[slot], q1 = s.off[slot + 1];
    for (int64_t bl = it.b0; bl < it.b1; ++bl) {
      const int64_t j0 = bl * NA, na = std::min<int64_t>(NA, LR - j0);
      for (int j = 0; j < NA; ++j) ar[j] = p.a + slot * p.as0 + (j0 + std::min<int64_t>(j, na - 1)) * p.as1;
      for (int64_t q = q0, rows; q < q1; q += rows) {
        rows = std::min<int64_t>(MR, q1 - q);
        for (int m = 0; m < rows; ++m) xr[m] = p.x + s.order[q + m] * p.ldx;
        shrink_rows<Vt, MR, NA>(static_cast<int>(rows), xr, ar, K, out);
        for (int m = 0; m < rows; ++m)
          for (int64_t j = 0; j < na; ++j) h[(q + m) * LR + j0 + j] = out[m * NA + j];
      }
    }
  });

  // 3. expand: blocks of output columns (s.blocks)
  const int64_t nb2 = static_cast<int64_t>(s.blocks.size());
  make_items(s.items, G, nb2, [&](int64_t g) {
    const int64_t n = rows_of(g);
    return (n + (n > DOT_ROWS)) * Vt::CB * R + BLOCK_COST;  // a transpose costs about a row
  });
  run_items(s.items, s.start, [&](const Item& it) {
    thread_local std::vector<float> bt_buf;  // the thread's transposed block of B
    bt_buf.resize(R * Vt::CB);
    float* bt = bt_buf.data();
    const float* hr[Vt::EX_ROWS];
    float* yr[Vt::EX_ROWS];
    const int64_t slot = s.groups[it.g], q0 = s.off[slot], q1 = s.off[slot + 1];
    for (int64_t bl = it.b0; bl < it.b1; ++bl) {
      const Block& blk = s.blocks[bl];
      const int cols = static_cast<int>(blk.cols);
      const float* bb = p.b + slot * p.bs0 + blk.c0 * p.bs1;
      if (q1 - q0 <= DOT_ROWS) {
        for (int64_t q = q0; q < q1; ++q)
          expand_dot<Vt>(h + q * LR + blk.i * R, bb, p.bs1, R, p.y + s.order[q] * p.ldy + blk.c0, cols);
        continue;
      }
      transpose_block<Vt>(bb, p.bs1, R, cols, bt);
      for (int64_t q = q0, rows; q < q1; q += rows) {
        rows = std::min<int64_t>(Vt::EX_ROWS, q1 - q);
        for (int m = 0; m < rows; ++m) {
          hr[m] = h + (q + m) * LR + blk.i * R;
          yr[m] = p.y + s.order[q + m] * p.ldy + blk.c0;
        }
        expand_rows<Vt, Vt::EX_ROWS>(static_cast<int>(rows), hr, bt, R, yr, cols);
      }
    }
  });
}

// Whether dim d of t steps by one element (or has at most one, whose stride is never used).
bool unit_stride(const at::Tensor& t, int64_t d) { return t.size(d) <= 1 || t.stride(d) == 1; }

void lora_apply_(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                 const at::Tensor& slot_ids, at::IntArrayRef slice_starts, int64_t isa) {
  const char* op = "aiolm::lora_apply_";
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&y, &x, &lora_a, &lora_b})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), op,
                ": y, x, lora_a and lora_b must be float32 CPU tensors, got ", t->scalar_type(), " on ", t->device());
  TORCH_CHECK(x.dim() == 2 && unit_stride(x, 1), op, ": x must be [T, K] with contiguous rows, got ", x.sizes());
  TORCH_CHECK(y.dim() == 2 && unit_stride(y, 1) && y.size(0) == x.size(0), op,
              ": y must be [T, N] with contiguous rows and x's T = ", x.size(0), " rows, got ", y.sizes());
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.size(2) == K && unit_stride(lora_a, 2), op,
              ": lora_a must be [S, L*R, K] with K = ", K, " (x's features) and contiguous rows, got ", lora_a.sizes());
  const int64_t S = lora_a.size(0);
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.size(0) == S && lora_b.size(1) == N && unit_stride(lora_b, 2), op,
              ": lora_b must be [S, N, R] with S = ", S, " (lora_a's slots), N = ", N,
              " (y's columns) and contiguous rows, got ", lora_b.sizes());
  const int64_t R = lora_b.size(2), L = static_cast<int64_t>(slice_starts.size()) - 1;
  TORCH_CHECK(L >= 1 && slice_starts.front() == 0 && slice_starts.back() == N, op,
              ": slice_starts must be L + 1 column offsets from 0 to N = ", N, ", got ", slice_starts);
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(slice_starts[i] < slice_starts[i + 1], op, ": slice_starts must increase, got ", slice_starts);
  TORCH_CHECK(lora_a.size(1) == L * R, op, ": lora_a has ", lora_a.size(1), " rows per slot, ", L, " slices of rank ",
              R, " need ", L * R);
  TORCH_CHECK(slot_ids.dim() == 1 && slot_ids.numel() >= T &&
                  (slot_ids.scalar_type() == at::kLong || slot_ids.scalar_type() == at::kInt) &&
                  slot_ids.device().is_cpu(),
              op, ": slot_ids must be an int32 or int64 CPU vector of at least T = ", T, " entries, got ",
              slot_ids.scalar_type(), " ", slot_ids.sizes());
  TORCH_CHECK(isa >= -1 && isa <= best_isa(), op, ": isa ", isa,
              " is not built here (0 scalar, 1 AVX2, 2 AVX-512; this build has up to ", best_isa(), ")");
  if (isa < 0) isa = best_isa();

  // 1. rows grouped by slot (checked before anything is written)
  thread_local Scratch scratch;
  Scratch& s = scratch;  // the calling thread's, named so the workers' lambdas reach it
  s.off.assign(S + 1, 0);
  const auto sort = [&](const auto* ids) {
    const int64_t st = slot_ids.stride(0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = static_cast<int64_t>(ids[t * st]);
      TORCH_CHECK(slot >= -1 && slot < S, op, ": slot id ", slot, " of row ", t, " outside [-1, ", S, ")");
      if (slot >= 0) ++s.off[slot + 1];
    }
    for (int64_t g = 0; g < S; ++g) s.off[g + 1] += s.off[g];
    s.order.resize(s.off[S]);
    s.next.assign(s.off.begin(), s.off.end() - 1);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = static_cast<int64_t>(ids[t * st]);
      if (slot >= 0) s.order[s.next[slot]++] = t;
    }
  };
  if (slot_ids.scalar_type() == at::kLong)
    sort(slot_ids.data_ptr<int64_t>());
  else
    sort(slot_ids.data_ptr<int32_t>());
  const int64_t rows = s.off[S];
  if (rows == 0 || R == 0) return;
  s.groups.clear();
  for (int64_t g = 0; g < S; ++g)
    if (s.off[g + 1] > s.off[g]) s.groups.push_back(g);
  s.h.resize(rows * L * R);

  const auto go = [&](auto vt) {
    using Vt = decltype(vt);
    s.blocks.clear();
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c = slice_starts[i]; c < slice_starts[i + 1]; c += Vt::CB)
        s.blocks.push_back({i, c, std::min<int64_t>(Vt::CB, slice_starts[i + 1] - c)});
    const Problem p{y.data_ptr<float>(),
                    x.data_ptr<float>(),
                    lora_a.data_ptr<float>(),
                    lora_b.data_ptr<float>(),
                    y.stride(0),
                    x.stride(0),
                    lora_a.stride(0),
                    lora_a.stride(1),
                    lora_b.stride(0),
                    lora_b.stride(1),
                    K,
                    R,
                    L * R};
    run<Vt>(p, s);
  };
  switch (isa) {
#if defined(AIOLM_LORA_AVX512)
    case AVX512: go(Avx512{}); break;
#endif
#if defined(AIOLM_LORA_AVX2)
    case AVX2: go(Avx2{}); break;
#endif
    default: go(Scalar{}); break;
  }
}

int64_t lora_best_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def(
      "lora_apply_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor slot_ids, int[] slice_starts, "
      "int isa=-1) -> ()");
  m.def("lora_best_isa() -> int", &lora_best_isa);
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("lora_apply_", &lora_apply_); }
