// aiolm::gguf_int8_linear: y = x W^T with x quantized to int8 blocks of 32 and integer dot
// products against a GGUF weight's regrouped blocks. The arithmetic, the paths and the
// kernels are in gguf_int8.h (aiolm::gguf_moe runs the same ones over experts).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "linear_rows.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using namespace aiolm_gguf;       // QK, the type ids, what they are (has_min, Scale, ...), quant_bytes
using namespace aiolm_gguf_int8;  // the quantization, the group kernels, Scratch

at::Tensor gguf_int8_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& scale,
                            const at::Tensor& mins, int64_t qtype, int64_t N, int64_t isa) {
  const int64_t nblocks = aiolm_gguf::check_blocks("aiolm::gguf_int8_linear", x_in, qs, scale, mins, qtype, N);
  const int64_t groups = qs.size(0), K = nblocks * QK;
  isa = pick_isa(isa);
  const aiolm_linear::Rows io(x_in, K, N);
  const int64_t M = io.m();
  if (M == 0 || N == 0) return io.result();
  thread_local Scratch scratch;
  const QRows x = scratch.rows(io.x.data_ptr<float>(), M, K, isa, qtype);
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  float* yp = io.y.data_ptr<float>();
  auto run = [&](auto type) {
    constexpr int64_t T = decltype(type)::value;
    const auto* sp = static_cast<const Scale<T>*>(scale.data_ptr());
    const auto* mp = has_min(T) ? static_cast<const Scale<T>*>(mins.data_ptr()) : nullptr;
    // Each thread takes a share of the groups, in pairs (so that it starts on an even group),
    // and goes over it in passes of at most PASS rows of x, so that a pass's codes stay in
    // cache while the share's groups go by (a prompt's thousand rows would not). The passes
    // run inside the share: one fork and join a call, not one a pass, so that a thread held
    // up in one pass need not hold up the other in every pass (a 2048-row prompt layer on a
    // Zen 4: 1-5% faster than a join after every pass).
    at::parallel_for(0, (groups + 1) / 2, 2, [&](int64_t p0, int64_t p1) {
      for (int64_t m0 = 0; m0 < M; m0 += PASS)
        run_groups<T>(qp, sp, mp, x.from_row(m0), std::min(PASS, M - m0), yp + m0 * N, N, isa, 2 * p0,
                      std::min(2 * p1, groups));
    });
  };
  with_type(qtype, run);
  return io.result();
}

// x's int8 blocks as the kernel makes them: codes [.., K] and scales [.., K / 32].
std::tuple<at::Tensor, at::Tensor> gguf_int8_quantize(const at::Tensor& x_in, int64_t isa) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "aiolm::gguf_int8_quantize: x must be float32");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(K % QK == 0, "aiolm::gguf_int8_quantize: ", K, " features are not whole blocks of 32");
  isa = pick_isa(isa);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), nb = K / QK;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, nb}, x.options());
  std::vector<int32_t> sum(M * nb);
  std::vector<float> s(M * nb);
  quantize_rows(x.data_ptr<float>(), M, K, isa, q.data_ptr<int8_t>(), d.data_ptr<float>(), sum.data(), s.data());
  std::vector<int64_t> qsize = x_in.sizes().vec(), dsize = qsize;
  dsize.back() = nb;
  return {q.view(qsize), d.view(dsize)};
}

int64_t gguf_int8_best_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def("gguf_int8_linear(Tensor x, Tensor qs, Tensor scale, Tensor mins, int qtype, int n, int isa=-1) -> Tensor");
  m.def("gguf_int8_quantize(Tensor x, int isa=-1) -> (Tensor, Tensor)");
  m.def("gguf_int8_best_isa() -> int", &gguf_int8_best_isa);
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) {
  m.impl("gguf_int8_linear", &gguf_int8_linear);
  m.impl("gguf_int8_quantize", &gguf_int8_quantize);
}
