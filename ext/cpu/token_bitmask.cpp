// apply_token_bitmask_(logits, bitmask, indices): structured outputs' mask. Bit j of a
// row's int32 bitmask words (word j / 32, bit j % 32) says whether token j may come
// next; every token whose bit is 0 gets -inf, in place. Rows listed in ``indices``
// (all rows when it is empty) are masked, bitmask row i against logits row i; columns
// past the bitmask's bits are left alone, as xgrammar's own kernel leaves them. That
// kernel tests one bit per element; here a word whose bits are all set is skipped and
// any other is written with two masked 16-lane stores (AVX-512), or a loop the
// compiler vectorises without it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

void mask_row(float* x, const int32_t* words, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t w = 0;
#if defined(__AVX512F__)
  const __m512 v = _mm512_set1_ps(ninf);
  for (; (w + 1) * 32 <= n; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xffffffffu) continue;
    _mm512_mask_storeu_ps(x + w * 32, static_cast<__mmask16>(~bits & 0xffffu), v);
    _mm512_mask_storeu_ps(x + w * 32 + 16, static_cast<__mmask16>(~bits >> 16), v);
  }
#else
  for (; (w + 1) * 32 <= n; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xffffffffu) continue;
    float* p = x + w * 32;
    for (int b = 0; b < 32; ++b) p[b] = (bits >> b) & 1u ? p[b] : ninf;
  }
#endif
  for (int64_t j = w * 32; j < n; ++j)
    if (!((static_cast<uint32_t>(words[j >> 5]) >> (j & 31)) & 1u)) x[j] = ninf;
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef indices) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "aiolm::apply_token_bitmask_: logits must be float32 [rows, vocab] with dense rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "aiolm::apply_token_bitmask_: bitmask must be contiguous int32 [rows, words]");
  TORCH_CHECK(bitmask.size(0) == logits.size(0), "aiolm::apply_token_bitmask_: one bitmask row per logits row");
  const int64_t rows = logits.size(0), ls = logits.stride(0), ws = bitmask.size(1);
  const int64_t n = std::min(logits.size(1), ws * 32);
  std::vector<int64_t> todo(indices.begin(), indices.end());
  if (todo.empty()) {
    todo.resize(rows);
    for (int64_t r = 0; r < rows; ++r) todo[r] = r;
  }
  for (int64_t r : todo) TORCH_CHECK(r >= 0 && r < rows, "aiolm::apply_token_bitmask_: row index out of range");
  float* xp = logits.data_ptr<float>();
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, static_cast<int64_t>(todo.size()), std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)),
                   [&](int64_t i0, int64_t i1) {
                     for (int64_t i = i0; i < i1; ++i) mask_row(xp + todo[i] * ls, mp + todo[i] * ws, n);
                   });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, int[] indices) -> ()");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("apply_token_bitmask_", &apply_token_bitmask_); }
