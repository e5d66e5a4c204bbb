// sample_rows(x, uniforms, knobs) -> int64 [rows]: each row's token, drawn from its float32
// logits with its own uniform number and settings (sample.h). The sampler's random rows on
// the CPU come here in one call, where its torch path takes a dozen ops a step.
//
// uniforms: float64 [rows] in [0, 1); knobs: float64 [rows, 4], per row the temperature
// (0: greedy, the argmax), top_k (0: off), top_p and min_p.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "argmax.h"
#include "sample.h"

#include <cstdint>

namespace {

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& uniforms, const at::Tensor& knobs) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "aiolm::sample_rows: x must be float32 [rows, n] with dense, non-empty rows");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.dim() == 1 && uniforms.size(0) == rows,
              "aiolm::sample_rows: uniforms must be float64 [", rows, "]");
  TORCH_CHECK(knobs.scalar_type() == at::kDouble && knobs.dim() == 2 && knobs.size(0) == rows && knobs.size(1) == 4,
              "aiolm::sample_rows: knobs must be float64 [", rows, ", 4]");
  TORCH_CHECK(uniforms.device().is_cpu() && knobs.device().is_cpu(), "aiolm::sample_rows: uniforms and knobs must be on the CPU");
  const at::Tensor u = uniforms.contiguous(), kn = knobs.contiguous();
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  const double* kp = kn.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    thread_local aiolm_sample::Scratch w;  // row-sized buffers: fresh ones would fault in pages each call
    for (int64_t r = r0; r < r1; ++r) op[r] = aiolm_sample::token(xp + r * xs, n, up[r], kp + 4 * r, w);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) { m.def("sample_rows(Tensor x, Tensor uniforms, Tensor knobs) -> Tensor"); }

TORCH_LIBRARY_IMPL(aiolm, CPU, m) { m.impl("sample_rows", &sample_rows); }
