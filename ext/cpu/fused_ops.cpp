// Fused element-wise steps of a decoder layer, for float32 on the CPU.
//
// Each replaces a chain of small torch ops (RMSNorm is six, rotary eight,
// SiLU-and-mul three). On a batch of a few tokens each of those ops costs more
// in dispatch and a trip through memory than in arithmetic, and there are
// 30 layers of them per step.
//
//   rms_norm(x, w, eps)              -> w * x / sqrt(mean(x^2) + eps), per row
//   add_rms_norm_(x, residual, w, eps)  residual += x; x = rms_norm(residual) (x float32, or bfloat16)
//   add_layer_norm(x, residual, w, b, eps) -> layer_norm(x + residual): a post-norm encoder's
//                                    residual stream (x float32, or bfloat16)
//   rotary_(q, k, positions, cos, sin)  rotate-half RoPE, in place on q and k
//   silu_and_mul(x)                  -> silu(x[:, :n]) * x[:, n:] (x float32, or bfloat16 in and out)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "row_ops.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "aiolm: ", name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "aiolm: ", name, " must be [rows, features] with dense rows");
}

int64_t grain_for(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

using aiolm_rows::norm_row;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "aiolm::rms_norm: weight must be float32 [features]");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain_for(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * xs, op + r * n, wp, n, static_cast<float>(eps));
  });
  return out;
}

using aiolm_bf16::narrow;
using aiolm_bf16::widen;

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "aiolm::add_rms_norm_: x must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "aiolm: x must be [rows, features] with dense rows");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "aiolm::add_rms_norm_: x and residual differ in shape");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "aiolm::add_rms_norm_: weight must be float32 [features]");
  const int64_t n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    // A bfloat16 matmul's output in, the next bfloat16 matmul's input out (layers/cpu_linear.py):
    // the sum and the norm in float32, the result rounded as that matmul would round it.
    uint16_t* xp = reinterpret_cast<uint16_t*>(x.data_ptr());
    at::parallel_for(0, x.size(0), grain_for(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> h(n);
      for (int64_t r = r0; r < r1; ++r) {
        uint16_t* xr = xp + r * xs;
        float* rr = rp + r * rs;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) rr[i] += widen(xr[i]);
        norm_row(rr, h.data(), wp, n, static_cast<float>(eps));
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) xr[i] = narrow(h[i]);
      }
    });
    return;
  }
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain_for(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      aiolm_rows::add_norm_row(xp + r * xs, rp + r * rs, wp, n, static_cast<float>(eps));
    }
  });
}

// out = (s - mean(s)) / sqrt(var(s) + eps) * w + b for s = x + residual, all in float32:
// two passes over the row's sum (mean, then the centred squares) as torch's own float32
// LayerNorm keeps its variance from cancelling.
template <typename X>
void add_norm_rows(const X* xp, int64_t xs, const float* rp, int64_t rs, const float* w, const float* b, float* op,
                   int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const X* xr = xp + r * xs;
      const float* rr = rp + r * rs;
      float* orow = op + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        const float v = widen(xr[i]) + rr[i];
        orow[i] = v;
        sum += v;
      }
      const float mean = sum / static_cast<float>(n);
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += (orow[i] - mean) * (orow[i] - mean);
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = (orow[i] - mean) * rstd * w[i] + b[i];
    }
  });
}

at::Tensor add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, const at::Tensor& b,
                          double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "aiolm::add_layer_norm: x must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "aiolm: x must be [rows, features] with dense rows");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "aiolm::add_layer_norm: x and residual differ in shape");
  const int64_t n = x.size(1);
  for (const at::Tensor* t : {&w, &b})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n,
                "aiolm::add_layer_norm: weight and bias must be float32 [features]");
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  const float eps_f = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    add_norm_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), residual.data_ptr<float>(),
                  residual.stride(0), w.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), x.size(0), n,
                  eps_f);
  } else {
    add_norm_rows(x.data_ptr<float>(), x.stride(0), residual.data_ptr<float>(), residual.stride(0),
                  w.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), x.size(0), n, eps_f);
  }
  return out;
}

using aiolm_rows::rotate;

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "aiolm::rotary_: float32 q, k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2),
              "aiolm::rotary_: q, k must be [tokens, heads, head_dim] with dense head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0),
              "aiolm::rotary_: positions must be int64 [tokens]");
  const int64_t d = q.size(2), half = d / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == d,
              "aiolm::rotary_: cos, sin must be float32 [positions, head_dim]");
  const int64_t T = q.size(0), hq = q.size(1), hk = k.size(1), max_pos = cos.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "aiolm::rotary_: position ", pp[t], " outside [0, ", max_pos, ")");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, grain_for((hq + hk) * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pp[t] * d;
      const float* s = sp + pp[t] * d;
      for (int64_t h = 0; h < hq; ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s, half);
      for (int64_t h = 0; h < hk; ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), c, s, half);
    }
  });
}

using aiolm_rows::silu_mul_row;

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "aiolm: x must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "aiolm: x must be [rows, features] with dense rows");
  TORCH_CHECK(x.size(1) % 2 == 0, "aiolm::silu_and_mul: an even number of features is needed");
  const int64_t n = x.size(1) / 2, xs = x.stride(0);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    // bfloat16 matmuls on both sides (layers/cpu_linear.py): in and out as bfloat16, the
    // arithmetic in float32, so the gate/up output and the down input skip two casts.
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    at::parallel_for(0, x.size(0), grain_for(2 * n), [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(3 * n);
      float *g = buf.data(), *u = g + n, *o = u + n;
      for (int64_t r = r0; r < r1; ++r) {
        const uint16_t* xr = xp + r * xs;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          g[i] = widen(xr[i]);
          u[i] = widen(xr[n + i]);
        }
        silu_mul_row(g, u, o, n);
        uint16_t* orow = op + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) orow[i] = narrow(o[i]);
      }
    });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain_for(2 * n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(xp + r * xs, xp + r * xs + n, op + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
}
