// Input and output of a linear kernel: x's leading dims flattened into contiguous
// rows [M, K], y allocated as [M, N], and handed back in x's shape with its last
// dim N. Shared by the kernels that compute y = x W^T.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <vector>

namespace aiolm_linear {

struct Rows {
  at::Tensor x, y;  // [M, K] contiguous, [M, N] to fill
  std::vector<int64_t> out_sizes;

  Rows(const at::Tensor& x_in, int64_t K, int64_t N)
      : x(x_in.reshape({-1, K}).contiguous()), y(at::empty({x.size(0), N}, x.options())),
        out_sizes(x_in.sizes().vec()) {
    out_sizes.back() = N;
  }

  int64_t m() const { return x.size(0); }
  at::Tensor result() const { return y.view(out_sizes); }
};

}  // namespace aiolm_linear
