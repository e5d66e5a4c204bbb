// Input and output of a linear kernel: x's leading dims flattened into contiguous
// rows [M, K], y allocated as [M, N], and handed back in x's shape with its last
// dim N. Shared by the kernels that compute y = x W^T.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <vector>

namespace aiolm_linear {

// y's memory. Outputs of 32 to 256 MiB (a prompt step's MLP, the LM head over a few hundred
// rows) come from a few buffers kept per thread: glibc maps such an allocation afresh and
// unmaps it on free, so a fresh one is faulted in page by page on every call, a cost that
// docs/benchmarks/log.md measures beside the matmul's. A kept buffer is handed out again only
// when nothing else holds its storage (the last output was dropped, views included).
inline at::Tensor output(int64_t M, int64_t N, const at::TensorOptions& options) {
  constexpr int64_t MIN_BYTES = int64_t{32} << 20, MAX_BYTES = int64_t{256} << 20, KEEP = 4;
  const int64_t n = M * N, bytes = n * static_cast<int64_t>(options.dtype().itemsize());
  if (bytes < MIN_BYTES || bytes > MAX_BYTES) return at::empty({M, N}, options);
  thread_local std::vector<at::Tensor> kept;
  for (const at::Tensor& t : kept)
    if (t.storage().use_count() == 1 && t.numel() >= n && t.numel() <= 2 * n) return t.narrow(0, 0, n).view({M, N});
  if (static_cast<int64_t>(kept.size()) == KEEP) {  // make room: drop a buffer nobody holds
    for (auto it = kept.begin(); it != kept.end(); ++it)
      if (it->storage().use_count() == 1) {
        kept.erase(it);
        break;
      }
  }
  at::Tensor t = at::empty({n}, options);
  if (static_cast<int64_t>(kept.size()) < KEEP) kept.push_back(t);
  return t.view({M, N});
}

struct Rows {
  at::Tensor x, y;  // [M, K] contiguous, [M, N] to fill
  std::vector<int64_t> out_sizes;

  Rows(const at::Tensor& x_in, int64_t K, int64_t N)
      : x(x_in.reshape({-1, K}).contiguous()), y(output(x.size(0), N, x.options())), out_sizes(x_in.sizes().vec()) {
    out_sizes.back() = N;
  }

  int64_t m() const { return x.size(0); }
  at::Tensor result() const { return y.view(out_sizes); }
};

}  // namespace aiolm_linear
