// One Llama-family decoder layer for the small steps that read the GGUF blocks, as one
// call (decode_layers: a stage's layers, as one call): the layer's ops run in the order and
// with the kernels that the Python modules (aiolm/model/llama.py, aiolm/model/moe.py) call
// one by one, so the result is the same bit for bit; what goes is the interpreter between
// them (module calls, views, a dozen op dispatches from Python), which on a one-row decode
// step costs about as much as the layer's arithmetic. aiolm/quant/gguf_blocks.py gives a
// layer this step when its linears have blocks and its shape is the plain one (no o/MLP
// bias). A layer of experts runs its router and its experts' blocks in the call too (the
// router's float32 logits, softmax, top-k and renormalisation through the same ATen ops as
// the Router module); one the call does not take (a shared expert beside the routed ones)
// takes the attention half only: the call returns the post-attention norm's output, and
// the experts run after it. decode_layers runs a decode-sized step of dense layers in one
// parallel region of torch's threads (decode_team), with the same bits. decode_sample is
// decode_layers with the step's end in the call too: the model's final norm, its LM head's
// blocks and each row's token, its argmax or the sampler's draw (the same ops and the same
// row sampler, sample.h, as the sampler's CPU path).
//
// weights: the two norm weights, then (qs, scale, mins) of the six linear slots: qkv in up to
//          three parts (a Q4_K_M file keeps q and k in one block type, v in another: each run
//          of a type is a part, their outputs side by side, as GGUFParts computes them), o,
//          gate_up and down (a part not there, and gate_up and down for a layer of experts,
//          empty); then the QKV bias, the q and the k norm's weights (each an empty tensor
//          when none); a layer of experts (top-k > 0) then has 11 more: the router's weight
//          (float32 [E, H]), the per-expert token counts (int64 [E], updated in place, as
//          FusedMoE counts), and (qs, scale, mins) of the experts' gate, up and down
//          (GGUFExperts, as aiolm::gguf_moe takes them)
// ints:    (type, rows) of the six slots (rows 0: not there), num_heads, num_kv_heads,
//          head_dim, the sliding window (0: none), 1 to multiply with int8 activations; then
//          the experts' three block types, their intermediate size, the top-k (0: no experts
//          in the call) and 1 to renormalise the top-k weights
// floats:  the norms' eps, the attention scale, the logit soft-cap (0: none)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <tuple>
#include <vector>

#include "argmax.h"
#include "sample.h"
#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "gguf_linear.h"
#include "paged_attention.h"
#include "row_ops.h"

namespace {

using c10::TypedOperatorHandle;

template <typename Sig>
TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The kernels the layer's modules call, looked up once.
struct Ops {
  TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      find<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("aiolm::rms_norm");
  TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)> add_rms_norm =
      find<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>("aiolm::add_rms_norm_");
  TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      rotary = find<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "aiolm::rotary_");
  TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      find<at::Tensor(const at::Tensor&)>("aiolm::silu_and_mul");
  TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)> write_kv =
      find<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("aiolm::write_kv_");
  using Attn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, double, int64_t, double);
  TypedOperatorHandle<Attn> attention = find<Attn>("aiolm::paged_attention");
  using Int8 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                          int64_t, int64_t);
  TypedOperatorHandle<Int8> int8_linear = find<Int8>("aiolm::gguf_int8_linear");
  using Float = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                           int64_t);
  TypedOperatorHandle<Float> float_linear = find<Float>("aiolm::gguf_linear");
  using Moe = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, const at::Tensor&, const at::Tensor&,
                         int64_t, bool, int64_t);
  TypedOperatorHandle<Moe> gguf_moe = find<Moe>("aiolm::gguf_moe");
  TypedOperatorHandle<at::Tensor(const at::Tensor&)> argmax_rows =
      find<at::Tensor(const at::Tensor&)>("aiolm::argmax_rows");
  TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> sample_rows =
      find<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("aiolm::sample_rows");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

constexpr size_t WEIGHTS = 23, EXPERT_WEIGHTS = 11, INTS = 23;  // per layer (a layer of experts: 23 + 11)
enum Slot { QKV = 0, O = 3, GATE_UP = 4, DOWN = 5 };  // QKV's parts: slots 0-2
enum Weight { BIAS = 20, Q_NORM, K_NORM, ROUTER, COUNTS, EXPERTS };  // EXPERTS: 9, gate's (qs, scale, mins) first
enum Int { HEADS = 12, KV_HEADS, HEAD_DIM, WINDOW, INT8, EXPERT_TYPES, EXPERT_WIDTH = 20, TOP_K, RENORMALIZE };
constexpr int QKV_PARTS = 3;

// How many weights a layer with these ints has.
size_t weights_of(at::IntArrayRef ints) { return WEIGHTS + (ints[TOP_K] > 0 ? EXPERT_WEIGHTS : 0); }

// Linear slot `l` of the layer's weights.
at::Tensor linear(const Ops& o, const at::Tensor& x, at::TensorList w, at::IntArrayRef ints, int l, bool int8) {
  const at::Tensor &qs = w[2 + 3 * l], &scale = w[3 + 3 * l], &mins = w[4 + 3 * l];
  const int64_t qtype = ints[2 * l], n = ints[2 * l + 1];
  return int8 ? o.int8_linear.call(x, qs, scale, mins, qtype, n, -1) : o.float_linear.call(x, qs, scale, mins, qtype, n);
}

// The layer's routed experts on a, the post-attention norm's output, as SparseMoeBlock runs
// them without a shared expert: Router (float32 logits, softmax over all experts, the k
// largest, divided by their sum where asked), FusedMoE's counts, then the blocks' call.
at::Tensor experts(const Ops& o, const at::Tensor& a, at::TensorList w, at::IntArrayRef ints, bool int8) {
  auto [weights, ids] = at::topk(at::softmax(at::linear(a, w[ROUTER]), -1), ints[TOP_K], -1);
  if (ints[RENORMALIZE]) weights = at::div(weights, at::sum(weights, -1, true));
  ids = ids.contiguous();
  int64_t* counts = w[COUNTS].data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) ++counts[id[i]];
  return o.gguf_moe.call(a, w.slice(EXPERTS, 9), ints.slice(EXPERT_TYPES, 3), weights, ids, ints[EXPERT_WIDTH], int8,
                         -1);
}

// The layer's input norm, as the modules run it: with a residual stream, x is added to it
// and normed in place (and returned); without one (layer 0), x becomes the stream and its
// norm is a new tensor.
at::Tensor input_norm(const Ops& o, at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  if (residual.defined()) {
    o.add_rms_norm.call(x, residual, w, eps);
    return x;
  }
  residual = x;
  return o.rms_norm.call(x, w, eps);
}

// q, k and v from QKV's outputs (its parts side by side): the bias, Qwen3's per-head norms,
// rotary, and k and v written to the cache. Returns q [t, heads, head_dim].
at::Tensor rope_and_cache(const Ops& o, const std::vector<at::Tensor>& parts, at::TensorList w, at::IntArrayRef ints,
                          double eps, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  at::Tensor qkv = parts.size() > 1 ? at::cat(parts, -1) : parts[0];
  if (w[BIAS].numel() > 0) qkv = at::add(qkv, w[BIAS]);
  const int64_t t = qkv.size(0), H = ints[HEADS], Hk = ints[KV_HEADS], D = ints[HEAD_DIM];
  at::Tensor q = qkv.narrow(1, 0, H * D).view({t, H, D});
  at::Tensor k = qkv.narrow(1, H * D, Hk * D).view({t, Hk, D});
  const at::Tensor v = qkv.narrow(1, (H + Hk) * D, Hk * D).view({t, Hk, D});
  if (w[Q_NORM].numel() > 0) {  // per-head RMSNorm of q and k (Qwen3), as CpuKernelOps.rms_norm runs it
    q = o.rms_norm.call(q.reshape({t * H, D}), w[Q_NORM], eps).view({t, H, D});
    k = o.rms_norm.call(k.reshape({t * Hk, D}), w[K_NORM], eps).view({t, Hk, D});
  }
  o.rotary.call(q, k, positions, cos, sin);
  o.write_kv.call(kv_cache, k, v, slot_mapping);
  return q;
}

// x: the previous layer's output; residual: the stream before it (none at layer 0, when
// x is the stream). Returns this layer's output and the stream it is to be added to;
// x and the residual are updated in place on the way, as the modules update them.
std::tuple<at::Tensor, at::Tensor> decode_layer(at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                                const at::Tensor& positions, at::Tensor& kv_cache,
                                                const at::Tensor& k_pages, const at::Tensor& v_pages,
                                                const at::Tensor& block_table, const at::Tensor& query_start_loc,
                                                const at::Tensor& seq_lens, const at::Tensor& slot_mapping,
                                                const at::Tensor& cos, const at::Tensor& sin, at::TensorList w,
                                                at::IntArrayRef ints, at::ArrayRef<double> floats) {
  TORCH_CHECK(ints.size() == INTS && w.size() == weights_of(ints) && floats.size() == 3, "aiolm::decode_layer: ",
              INTS, " ints, ", WEIGHTS, " weights (", WEIGHTS + EXPERT_WEIGHTS,
              " with experts) and 3 floats expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "aiolm::decode_layer: x must be float32 [tokens, hidden]");
  const Ops& o = ops();
  const bool int8 = ints[INT8] != 0;
  const double eps = floats[0];
  at::Tensor residual = residual_in.value_or(at::Tensor());
  const at::Tensor h = input_norm(o, x, residual, w[0], eps);
  std::vector<at::Tensor> parts;
  for (int l = QKV; l < QKV + QKV_PARTS && (l == QKV || ints[2 * l + 1] > 0); ++l)
    parts.push_back(linear(o, h, w, ints, l, int8));
  const at::Tensor q = rope_and_cache(o, parts, w, ints, eps, positions, cos, sin, kv_cache, slot_mapping);
  const int64_t t = x.size(0), H = ints[HEADS], D = ints[HEAD_DIM];
  at::Tensor attn = at::empty({t, H, D}, x.options());
  o.attention.call(attn, q, k_pages, v_pages, block_table, query_start_loc, seq_lens, floats[1], ints[WINDOW], floats[2]);
  at::Tensor a = linear(o, attn.view({t, H * D}), w, ints, O, int8);
  o.add_rms_norm.call(a, residual, w[1], eps);
  if (ints[TOP_K] > 0) return {experts(o, a, w, ints, int8), residual};
  if (ints[2 * GATE_UP + 1] == 0) return {a, residual};  // the attention half: the experts come next
  const at::Tensor gate_up = linear(o, a, w, ints, GATE_UP, int8);
  return {linear(o, o.silu_and_mul.call(gate_up), w, ints, DOWN, int8), residual};
}

// One linear slot's product in a team (decode_team): thread 0 readies x as the slot's kernels
// read it and allocates y (prepare), then every thread of the team computes its share of
// y's groups of 8 rows (run). These are the functions and the data that aiolm::gguf_linear
// and aiolm::gguf_int8_linear hand their threads (gguf_linear.cpp, gguf_int8.cpp), and each
// group's sums do not depend on which thread makes them: the same bits.
struct TeamLinear {
  at::Tensor x, y, qs, scale, mins;
  int64_t qtype = 0, n = 0, groups = 0, m = 0, k = 0, isa = 0;
  bool int8 = false;
  std::vector<float> sums, reordered;
  const float* xsum = nullptr;
  aiolm_gguf_float::KernelX kx{nullptr, 0.f};
  aiolm_gguf_int8::Scratch scratch;
  aiolm_gguf_int8::QRows qx{};

  void prepare(const at::Tensor& x_in, at::TensorList w, at::IntArrayRef ints, int l, bool int8_) {
    prepare(x_in, w[2 + 3 * l], w[3 + 3 * l], w[4 + 3 * l], ints[2 * l], ints[2 * l + 1], int8_);
  }

  void prepare(const at::Tensor& x_in, const at::Tensor& qs_, const at::Tensor& scale_, const at::Tensor& mins_,
               int64_t qtype_, int64_t n_, bool int8_) {
    qs = qs_, scale = scale_, mins = mins_;
    qtype = qtype_, n = n_, int8 = int8_;
    groups = qs.size(0);
    k = aiolm_gguf::check_blocks("aiolm::decode_layers", x_in, qs, scale, mins, qtype, n) * aiolm_gguf::QK;
    x = x_in.dim() == 2 && x_in.is_contiguous() ? x_in : x_in.reshape({-1, k}).contiguous();
    m = x.size(0);
    // The slot's y of the layer before, if it has this shape: nothing reads it once this
    // layer's slot runs (the next layer's input is read by its QKV before its down runs).
    if (!(y.defined() && y.size(0) == m && y.size(1) == n)) y = at::empty({m, n}, x.options());
    const float* xp = x.data_ptr<float>();
    if (int8) {
      isa = aiolm_gguf_int8::pick_isa(-1);
      qx = scratch.rows(xp, m, k, isa, qtype);
    } else {
      xsum = aiolm_gguf_float::takes_wide(m) ? nullptr : aiolm_gguf_float::block_sums(qtype, xp, m, k, sums);
      kx = aiolm_gguf_float::kernel_x(qtype, xp, m, k, reordered);
    }
  }

  // Thread `tid` of `team`: an even share of the groups (of pairs of groups, with int8 x,
  // whose kernels start a pair on an even group).
  void run(int64_t tid, int64_t team) {
    const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
    float* yp = y.data_ptr<float>();
    aiolm_gguf::with_type(qtype, [&](auto type) {
      constexpr int64_t T = decltype(type)::value;
      using S = aiolm_gguf::Scale<T>;
      const auto* sp = static_cast<const S*>(scale.data_ptr());
      const auto* mp = aiolm_gguf::has_min(T) ? static_cast<const S*>(mins.data_ptr()) : nullptr;
      if (int8) {
        const int64_t pairs = (groups + 1) / 2, p0 = pairs * tid / team, p1 = pairs * (tid + 1) / team;
        if (p0 < p1) aiolm_gguf_int8::run_groups<T>(qp, sp, mp, qx, m, yp, n, isa, 2 * p0, std::min(2 * p1, groups));
      } else {
        const int64_t g0 = groups * tid / team, g1 = groups * (tid + 1) / team;
        if (g0 < g1)
          aiolm_gguf_float::run_groups<T>(qp, sp, mp, xsum, k / aiolm_gguf::QK, kx.x, kx.unscale, k, m, yp, n, g0, g1);
      }
    });
  }
};

// The row-wise steps between a team's linears (decode_team), on thread 0: the arithmetic of
// the ops decode_layer calls for them (row_ops.h: the same functions), on a decode step's few
// raw rows, without the ops' dispatch, their tensors and views, which cost more than the
// arithmetic. The buffers they fill are made once a step.
struct TeamRows {
  at::Tensor qkv, q, attn, attn_rows, act;  // q: qkv's queries [t, H, D]; attn_rows: attn as [t, H * D]

  // x's rows as the layer's input norm leaves them (input_norm): residual += x and x normed
  // from it, in place; at layer 0 (no residual yet) x becomes the stream and its norm a new
  // tensor.
  static at::Tensor input_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
    const int64_t t = x.size(0), n = x.size(1);
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                "aiolm::decode_layers: x must be float32 [tokens, hidden] with dense rows");
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n,
                "aiolm::decode_layers: a norm's weights must be float32, one per feature of the rows (", n,
                "), not ", w.numel());
    const float* wp = w.data_ptr<float>();
    const float e = static_cast<float>(eps);
    float* xp = x.data_ptr<float>();
    if (!residual.defined()) {
      residual = x;
      at::Tensor h = at::empty({t, n}, x.options());
      float* hp = h.data_ptr<float>();
      for (int64_t r = 0; r < t; ++r) aiolm_rows::norm_row(xp + r * x.stride(0), hp + r * n, wp, n, e);
      return h;
    }
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.sizes() == x.sizes() && residual.stride(1) == 1,
                "aiolm::decode_layers: the residual must be float32 like x, with dense rows");
    float* rp = residual.data_ptr<float>();
    for (int64_t r = 0; r < t; ++r)
      aiolm_rows::add_norm_row(xp + r * x.stride(0), rp + r * residual.stride(0), wp, n, e);
    return x;
  }

  // rope_and_cache on raw rows: QKV's parts side by side in qkv, then the bias, Qwen3's
  // per-head norms, rotary and k and v into the cache, in that order. Returns q [t, H, D], a
  // view of qkv.
  const at::Tensor& rope_and_cache(const std::vector<const at::Tensor*>& parts, at::TensorList w,
                                   at::IntArrayRef ints, double eps, const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
    const int64_t t = parts[0]->size(0), H = ints[HEADS], Hk = ints[KV_HEADS], D = ints[HEAD_DIM];
    const int64_t Q = H * D, K = Hk * D, W = Q + 2 * K, half = D / 2;
    int64_t cols = 0;
    for (const at::Tensor* p : parts) cols += p->size(1);
    TORCH_CHECK(cols == W, "aiolm::decode_layers: QKV gives ", cols, " columns for ", H, " + 2 x ", Hk, " heads of ",
                D);
    if (!(q.defined() && qkv.size(0) == t && qkv.size(1) == W && q.size(1) == H)) {
      qkv = at::empty({t, W}, parts[0]->options());
      q = qkv.narrow(1, 0, Q).view({t, H, D});
      attn = at::empty({t, H, D}, qkv.options());
      attn_rows = attn.view({t, Q});
    }
    float* base = qkv.data_ptr<float>();
    for (int64_t r = 0, c = 0; r < t; ++r, c = 0)
      for (const at::Tensor* p : parts) {
        std::memcpy(base + r * W + c, p->data_ptr<float>() + r * p->size(1), p->size(1) * sizeof(float));
        c += p->size(1);
      }
    if (w[BIAS].numel() > 0) {
      TORCH_CHECK(w[BIAS].scalar_type() == at::kFloat && w[BIAS].is_contiguous() && w[BIAS].numel() == W,
                  "aiolm::decode_layers: the QKV bias must be float32 [", W, "]");
      const float* b = w[BIAS].data_ptr<float>();
      for (int64_t r = 0; r < t; ++r) {
        float* row = base + r * W;
#pragma omp simd
        for (int64_t i = 0; i < W; ++i) row[i] = row[i] + b[i];
      }
    }
    if (w[Q_NORM].numel() > 0) {  // per-head RMSNorm of q and k (Qwen3)
      for (const at::Tensor* nw : {&w[Q_NORM], &w[K_NORM]})
        TORCH_CHECK(nw->scalar_type() == at::kFloat && nw->is_contiguous() && nw->numel() == D,
                    "aiolm::decode_layers: a q or k norm's weight must be float32 [", D, "]");
      const float *qn = w[Q_NORM].data_ptr<float>(), *kn = w[K_NORM].data_ptr<float>();
      const float e = static_cast<float>(eps);
      for (int64_t r = 0; r < t; ++r) {
        float* row = base + r * W;
        for (int64_t h = 0; h < H; ++h) aiolm_rows::norm_row(row + h * D, row + h * D, qn, D, e);
        for (int64_t h = 0; h < Hk; ++h) aiolm_rows::norm_row(row + Q + h * D, row + Q + h * D, kn, D, e);
      }
    }
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == t,
                "aiolm::decode_layers: positions must be int64 [tokens]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == D,
                "aiolm::decode_layers: cos, sin must be float32 [positions, head_dim]");
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < t; ++r) {
      TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "aiolm::decode_layers: position ", pos[r], " outside [0, ",
                  cos.size(0), ")");
      const float *c = cos.data_ptr<float>() + pos[r] * D, *sn = sin.data_ptr<float>() + pos[r] * D;
      float* row = base + r * W;
      for (int64_t h = 0; h < H + Hk; ++h) aiolm_rows::rotate(row + h * D, c, sn, half);
    }
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() && kv_cache.size(3) == Hk &&
                    kv_cache.size(4) == D &&
                    (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf),
                "aiolm::decode_layers: a float32 or float16 cache [2, blocks, block_size, ", Hk, ", ", D,
                "] expected");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == t,
                "aiolm::decode_layers: slot_mapping must be int64 [tokens]");
    const int64_t* slot = slot_mapping.data_ptr<int64_t>();
    const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
    auto write = [&](auto* cache) {
      for (int64_t r = 0; r < t; ++r) {
        TORCH_CHECK(slot[r] < slots, "aiolm::decode_layers: slot ", slot[r], " is past the cache's ", slots, " slots");
        aiolm_rows::write_slot(cache, slots, K, slot[r], base + r * W + Q, base + r * W + Q + K);
      }
    };
    if (kv_cache.scalar_type() == at::kHalf) {
      write(kv_cache.data_ptr<at::Half>());
    } else {
      write(kv_cache.data_ptr<float>());
    }
    return q;
  }

  // silu(gate) * up of each row of gate_up [t, 2I], into act [t, I].
  const at::Tensor& silu(const at::Tensor& gate_up) {
    const int64_t t = gate_up.size(0), I = gate_up.size(1) / 2;
    if (!(act.defined() && act.size(0) == t && act.size(1) == I)) act = at::empty({t, I}, gate_up.options());
    for (int64_t r = 0; r < t; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * 2 * I;
      aiolm_rows::silu_mul_row(g, g + I, act.data_ptr<float>() + r * I, I);
    }
    return act;
  }
};

// The step's end (decode_sample): the model's final norm weight, its LM head's blocks, and
// how they run: the head's block type and rows (n, the vocabulary maybe padded), the
// vocabulary the draw reads, and whether x goes in as int8; then each row's uniform number
// and knobs (sample_rows.cpp), or none where every row takes its argmax.
struct Head {
  at::Tensor norm, qs, scale, mins;
  int64_t qtype = 0, n = 0, vocab = 0;
  bool int8 = false;
  double eps = 0;
  c10::optional<at::Tensor> uniforms, knobs;
};

constexpr int64_t TEAM_ROWS = 8;  // the most rows (decode tokens) a step takes as a team

// Whether decode_layers runs these layers as one team: a decode-sized step, and every layer
// whole and dense (no experts, not the attention half).
bool team_fits(const at::Tensor& x, at::IntArrayRef ints, size_t n) {
  if (x.size(0) > TEAM_ROWS || at::in_parallel_region()) return false;
  for (size_t l = 0; l < n; ++l) {
    const at::IntArrayRef li = ints.slice(INTS * l, INTS);
    if (li[TOP_K] > 0 || li[2 * GATE_UP + 1] == 0) return false;
  }
  return true;
}

// decode_layers' layers in one parallel region of torch's threads, which stays up for the
// whole step: where a layer's kernels each forked and joined the threads (about a dozen
// times a layer, each a wake-up and a wait), a step now waits at barriers between its phases.
// The linears and the attention run on every thread (TeamLinear, aiolm_attention::share);
// the small row-wise steps between them run on thread 0 with the functions of the ops that
// decode_layer calls (TeamRows), in the same order, while the others wait at the next
// barrier. So the bits are decode_layer's. An exception on any thread ends the work of every
// thread (each still meets every barrier) and is raised after the region. With a head, the
// team ends the step too and puts each row's token in `tokens`.
std::tuple<at::Tensor, at::Tensor> decode_team(at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                               const at::Tensor& positions, at::TensorList kv_caches,
                                               at::TensorList k_pages, at::TensorList v_pages,
                                               const at::Tensor& block_table, const at::Tensor& query_start_loc,
                                               const at::Tensor& seq_lens, const at::Tensor& slot_mapping,
                                               const at::Tensor& cos, const at::Tensor& sin, at::TensorList w,
                                               at::IntArrayRef ints, at::ArrayRef<double> floats,
                                               const Head* head = nullptr, at::Tensor* tokens = nullptr) {
  const size_t n = kv_caches.size();
  const int64_t t = x.size(0);
  TeamLinear qkv_parts[QKV_PARTS], out, gate_up, down, logits;
  TeamRows rows;
  int parts = 0;
  at::Tensor h = x, residual = residual_in.has_value() ? *residual_in : at::Tensor();
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    // f on thread 0 (all: on every thread), then every thread waits for the others.
    auto phase = [&](bool all, auto&& f) {
      if ((all || tid == 0) && !failed.load()) {
        try {
          f();
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
          failed = true;
        }
      }
#pragma omp barrier
    };
    for (size_t l = 0; l < n; ++l) {
      const at::TensorList lw = w.slice(WEIGHTS * l, WEIGHTS);
      const at::IntArrayRef li = ints.slice(INTS * l, INTS);
      const double eps = floats[3 * l];
      const bool int8 = li[INT8] != 0;
      phase(false, [&] {  // the input norm; QKV's inputs
        if (l > 0) h = down.y;
        h = TeamRows::input_norm(h, residual, lw[0], eps);
        parts = 0;
        for (int p = QKV; p < QKV + QKV_PARTS && (p == QKV || li[2 * p + 1] > 0); ++p)
          qkv_parts[parts++].prepare(h, lw, li, p, int8);
      });
      phase(true, [&] {
        for (int p = 0; p < parts; ++p) qkv_parts[p].run(tid, team);
      });
      phase(false, [&] {  // q, k and v: bias, norms, rotary, the cache
        std::vector<const at::Tensor*> ys;
        for (int p = 0; p < parts; ++p) ys.push_back(&qkv_parts[p].y);
        rows.rope_and_cache(ys, lw, li, eps, positions, cos, sin, kv_caches[l], slot_mapping);
        next = 0;
      });
      phase(true, [&] {
        aiolm_attention::share(rows.attn, rows.q, k_pages[l], v_pages[l], block_table, query_start_loc, seq_lens,
                               floats[3 * l + 1], li[WINDOW], floats[3 * l + 2], next, team);
      });
      phase(false, [&] { out.prepare(rows.attn_rows, lw, li, O, int8); });
      phase(true, [&] { out.run(tid, team); });
      phase(false, [&] {
        TeamRows::input_norm(out.y, residual, lw[1], eps);
        gate_up.prepare(out.y, lw, li, GATE_UP, int8);
      });
      phase(true, [&] { gate_up.run(tid, team); });
      phase(false, [&] { down.prepare(rows.silu(gate_up.y), lw, li, DOWN, int8); });
      phase(true, [&] { down.run(tid, team); });
    }
    if (head != nullptr) {
      phase(false, [&] {  // the final norm, as the model's forward ends; the head's input
        h = down.y;
        h = TeamRows::input_norm(h, residual, head->norm, head->eps);
        logits.prepare(h, head->qs, head->scale, head->mins, head->qtype, head->n, head->int8);
        *tokens = at::empty({t}, x.options().dtype(at::kLong));
      });
      phase(true, [&] { logits.run(tid, team); });
      phase(true, [&] {
        const float* y = logits.y.data_ptr<float>();
        int64_t* tk = tokens->data_ptr<int64_t>();
        if (!head->knobs.has_value()) {
          for (int64_t r = tid; r < t; r += team) tk[r] = aiolm_argmax::argmax_row(y + r * head->n, head->vocab);
          return;
        }
        thread_local aiolm_sample::Scratch scratch;
        const double* u = head->uniforms->data_ptr<double>();
        const double* kn = head->knobs->data_ptr<double>();
        for (int64_t r = tid; r < t; r += team)
          tk[r] = aiolm_sample::token(y + r * head->n, head->vocab, u[r], kn + 4 * r, scratch);
      });
    }
  }
  if (error) std::rethrow_exception(error);
  return {head != nullptr ? h : down.y, residual};
}

// decode_layers' lists, checked: per layer a cache, its pages, its ints and floats, and its
// weights. Returns the number of layers.
size_t check_stack(at::TensorList kv_caches, at::TensorList k_pages, at::TensorList v_pages, at::TensorList w,
                   at::IntArrayRef ints, at::ArrayRef<double> floats) {
  const size_t n = kv_caches.size();
  TORCH_CHECK(n > 0 && k_pages.size() == n && v_pages.size() == n && ints.size() == INTS * n &&
                  floats.size() == 3 * n,
              "aiolm::decode_layers: per layer a cache, its pages, ", INTS, " ints and 3 floats expected");
  size_t nw = 0;
  for (size_t l = 0; l < n; ++l) nw += weights_of(ints.slice(INTS * l, INTS));
  TORCH_CHECK(w.size() == nw, "aiolm::decode_layers: ", nw, " weights expected (", WEIGHTS, " a layer, ",
              WEIGHTS + EXPERT_WEIGHTS, " a layer of experts), got ", w.size());
  return n;
}

// A stage's layers one after another, each exactly as decode_layer computes it: one call
// per step instead of one per layer. kv_caches, k_pages and v_pages hold one entry per
// layer; weights, ints and floats are the layers' own lists one after another (a layer of
// experts has more weights: weights_of).
std::tuple<at::Tensor, at::Tensor> decode_layers(at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                                 const at::Tensor& positions, at::TensorList kv_caches,
                                                 at::TensorList k_pages, at::TensorList v_pages,
                                                 const at::Tensor& block_table, const at::Tensor& query_start_loc,
                                                 const at::Tensor& seq_lens, const at::Tensor& slot_mapping,
                                                 const at::Tensor& cos, const at::Tensor& sin, at::TensorList w,
                                                 at::IntArrayRef ints, at::ArrayRef<double> floats) {
  const size_t n = check_stack(kv_caches, k_pages, v_pages, w, ints, floats);
  if (team_fits(x, ints, n))
    return decode_team(x, residual_in, positions, kv_caches, k_pages, v_pages, block_table, query_start_loc, seq_lens,
                       slot_mapping, cos, sin, w, ints, floats);
  at::Tensor h = x;
  c10::optional<at::Tensor> residual = residual_in;
  size_t w0 = 0;
  for (size_t l = 0; l < n; ++l) {
    at::Tensor cache = kv_caches[l];
    const at::IntArrayRef li = ints.slice(INTS * l, INTS);
    const size_t lw = weights_of(li);
    auto [out, res] = decode_layer(h, residual, positions, cache, k_pages[l], v_pages[l], block_table,
                                   query_start_loc, seq_lens, slot_mapping, cos, sin, w.slice(w0, lw), li,
                                   floats.slice(3 * l, 3));
    w0 += lw;
    h = out;
    residual = res;
  }
  return {h, *residual};
}

// decode_layers, then the model's final norm, its LM head and each row's token: the tokens
// [rows] of a decode step (one row a request) as LlamaForCausalLM's forward, compute_logits
// and the sampler give them where no logits processor runs: each row's argmax where knobs is
// None, else per row the sampler's draw with its uniform number (sample_rows.cpp: the argmax
// for a row of temperature 0). head: the final norm's weight and the head's (qs, scale,
// mins); head_ints: the head's block type, its rows, the vocabulary and 1 to multiply with
// int8 activations; uniforms float64 [rows], knobs float64 [rows, 4].
at::Tensor decode_sample(at::Tensor& x, const c10::optional<at::Tensor>& residual_in, const at::Tensor& positions,
                         at::TensorList kv_caches, at::TensorList k_pages, at::TensorList v_pages,
                         const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& slot_mapping, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList w, at::IntArrayRef ints, at::ArrayRef<double> floats, at::TensorList head_w,
                         at::IntArrayRef head_ints, double head_eps, const c10::optional<at::Tensor>& uniforms,
                         const c10::optional<at::Tensor>& knobs) {
  TORCH_CHECK(head_w.size() == 4 && head_ints.size() == 4,
              "aiolm::decode_sample: the head is (norm, qs, scale, mins) and (type, rows, vocabulary, int8)");
  const int64_t t = x.size(0);
  TORCH_CHECK(uniforms.has_value() == knobs.has_value(), "aiolm::decode_sample: uniforms and knobs go together");
  if (knobs.has_value())
    TORCH_CHECK(uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous() && uniforms->numel() == t &&
                    knobs->scalar_type() == at::kDouble && knobs->is_contiguous() && knobs->dim() == 2 &&
                    knobs->size(0) == t && knobs->size(1) == 4 && uniforms->device().is_cpu() &&
                    knobs->device().is_cpu(),
                "aiolm::decode_sample: uniforms must be float64 [", t, "] and knobs float64 [", t, ", 4], on the CPU");
  const Head head{head_w[0],    head_w[1],    head_w[2],          head_w[3], head_ints[0], head_ints[1],
                  head_ints[2], head_ints[3] != 0, head_eps, uniforms, knobs};
  TORCH_CHECK(head.vocab > 0 && head.vocab <= head.n, "aiolm::decode_sample: a vocabulary of ", head.vocab,
              " in a head of ", head.n, " rows");
  const size_t n = check_stack(kv_caches, k_pages, v_pages, w, ints, floats);
  if (team_fits(x, ints, n)) {
    at::Tensor tokens;
    decode_team(x, residual_in, positions, kv_caches, k_pages, v_pages, block_table, query_start_loc, seq_lens,
                slot_mapping, cos, sin, w, ints, floats, &head, &tokens);
    return tokens;
  }
  auto [h, residual] = decode_layers(x, residual_in, positions, kv_caches, k_pages, v_pages, block_table,
                                     query_start_loc, seq_lens, slot_mapping, cos, sin, w, ints, floats);
  const Ops& o = ops();
  const at::Tensor hn = input_norm(o, h, residual, head.norm, head.eps);
  const at::Tensor y = head.int8 ? o.int8_linear.call(hn, head.qs, head.scale, head.mins, head.qtype, head.n, -1)
                                 : o.float_linear.call(hn, head.qs, head.scale, head.mins, head.qtype, head.n);
  const at::Tensor vocab = y.narrow(1, 0, head.vocab);
  return knobs.has_value() ? o.sample_rows.call(vocab, *uniforms, *knobs) : o.argmax_rows.call(vocab);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiolm, m) {
  m.def(
      "decode_layer(Tensor(a!) x, Tensor(b!)? residual, Tensor positions, Tensor(c!) kv_cache, Tensor k_pages, "
      "Tensor v_pages, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, Tensor slot_mapping, "
      "Tensor cos, Tensor sin, Tensor[] weights, int[] ints, float[] floats) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor(a!) x, Tensor(b!)? residual, Tensor positions, Tensor(c!)[] kv_caches, "
      "Tensor[] k_pages, Tensor[] v_pages, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor slot_mapping, Tensor cos, Tensor sin, Tensor[] weights, int[] ints, float[] floats) -> (Tensor, Tensor)");
  m.def(
      "decode_sample(Tensor(a!) x, Tensor(b!)? residual, Tensor positions, Tensor(c!)[] kv_caches, "
      "Tensor[] k_pages, Tensor[] v_pages, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor slot_mapping, Tensor cos, Tensor sin, Tensor[] weights, int[] ints, float[] floats, "
      "Tensor[] head, int[] head_ints, float head_eps, Tensor? uniforms, Tensor? knobs) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiolm, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_sample", &decode_sample);
}
