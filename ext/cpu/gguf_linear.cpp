// aiolm::gguf_linear: y = x W^T with W kept as a GGUF file's quantized blocks, in float
// arithmetic. The layout, the arithmetic and the kernels are in gguf_linear.h
// (aiolm::gguf_moe runs the same ones over experts).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "linear_rows.h"

#include <cstdint>
#include <vector>

namespace {

using namespace aiolm_gguf;        // QK, the type ids, what they are (has_min, Scale, ...), quant_bytes
using namespace aiolm_gguf_float;  // the group kernels, block_sums, kernel_x

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& mins, int64_t qtype, int64_t N) {
  const int64_t nblocks = aiolm_gguf::check_blocks("aiolm::gguf_linear", x_in, qs, scale, mins, qtype, N);
  const int64_t groups = qs.size(0), K = nblocks * QK;
  const aiolm_linear::Rows io(x_in, K, N);
  const at::Tensor& x = io.x;
  const int64_t M = io.m();
  if (M == 0 || N == 0) return io.result();
  const float* xp = x.data_ptr<float>();
  std::vector<float> sums, reordered;
  const float* xs = takes_wide(M) ? nullptr : block_sums(qtype, xp, M, K, sums);
  const KernelX xk = kernel_x(qtype, xp, M, K, reordered);
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  float* yp = io.y.data_ptr<float>();
  auto run = [&](auto type) {
    constexpr int64_t T = decltype(type)::value;
    const auto* sp = static_cast<const Scale<T>*>(scale.data_ptr());
    const auto* mp = has_min(T) ? static_cast<const Scale<T>*>(mins.data_ptr()) : nullptr;
    at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
      run_groups<T>(qp, sp, mp, xs, nblocks, xk.x, xk.unscale, K, M, yp, N, g0, g1);
    });
  };
  with_type(qtype, run);
  return io.result();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor scale, Tensor mins, int qtype, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
