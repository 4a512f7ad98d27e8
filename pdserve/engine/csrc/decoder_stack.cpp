// Every decoder layer of a decode step in one call: the same kernels, in the same order, as model.DecoderLayer's
// Python forward, without its ~20 Python-level operations a layer. At batch 1 on a 2-core AMD EPYC (Zen 3) those
// operations were ~2.8 ms of an 18 ms step, the native kernels 14.9 ms (docs/engine.md, "The decoder stack in one
// call"). The call releases the GIL for its whole length, so a worker's event-loop threads run beside the step.
//
// Python (decoder_stack.py) decides, per step size, how each projection runs, exactly as its module's forward would
// at that size, and hands this class the resulting plan; a projection it cannot express keeps the Python loop.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

// How one projection runs (decoder_stack.GEMV / PACKED / DENSE): the native GEMV over a plain int8 / bf16 weight, oneDNN's
// prepacked linear, or torch's linear over a plain weight in the activations' dtype.
enum Kind : int64_t { GEMV = 0, PACKED = 1, DENSE = 2 };

struct Projection {
  int64_t kind;
  at::Tensor weight, scales, bias;  // scales / bias undefined where absent
  int64_t out_features;

  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == GEMV) {
      at::Tensor out = at::empty({x.size(0), out_features}, x.options());
      weight_gemv(out, x, weight, scales.defined() ? c10::optional<at::Tensor>(scales) : c10::nullopt);
      return bias.defined() ? out.add_(bias) : out;
    }
    if (kind == PACKED) return packed_linear(x);
    return at::linear(x, weight, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
  }

  at::Tensor packed_linear(const at::Tensor& x) const {
    // mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm),
    // called boxed: the op has no C++ header of its own, and the boxed form does not depend on how each torch
    // release spells its argument types.
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack;
    stack.reserve(6);
    stack.emplace_back(x);
    stack.emplace_back(weight);
    stack.emplace_back(bias.defined() ? c10::IValue(bias) : c10::IValue());
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
    stack.emplace_back(std::string(""));
    op.callBoxed(&stack);
    return stack.at(0).toTensor();
  }
};

at::Tensor optional_tensor(const at::Tensor& t) { return t.numel() ? t : at::Tensor(); }

// model.RMSNorm's forward over a q or k head slice: the native kernel where the view is contiguous (one row), else
// torch's, then written back into the fused qkv output, as DecoderLayer._attention does.
// Contiguous: normalised in place (each row's sum of squares is taken before any of it is written), the values
// the Python layer's out-of-place kernel and copy give.
void head_norm_(at::Tensor heads, const at::Tensor& weight, double eps) {
  if (heads.is_contiguous()) {
    rms_norm(heads, heads, weight, eps);
    return;
  }
  heads.copy_(at::rms_norm(heads, {weight.size(0)}, weight, eps));
}

// x += y over contiguous tensors of one dtype, each sum rounded once to it: torch's `x + y` (fp32 / bf16), without
// its dispatch and allocation (~6 us a call at batch 1, two a layer).
void residual_add_(at::Tensor& x, const at::Tensor& y) {
  if (!y.is_contiguous() || y.sizes() != x.sizes() || y.scalar_type() != x.scalar_type()) {
    x.add_(y);
    return;
  }
  const int64_t n = x.numel();
  if (x.scalar_type() == at::kBFloat16) {
    c10::BFloat16* a = x.data_ptr<c10::BFloat16>();
    const c10::BFloat16* b = y.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) a[i] = static_cast<c10::BFloat16>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  } else if (x.scalar_type() == at::kFloat) {
    float* a = x.data_ptr<float>();
    const float* b = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
  } else {
    x.add_(y);
  }
}

// A sparse layer's routed experts on the native kernels (moe.SparseMoE.forward's native path: _route_native, then
// _native), for the softmax top-k routers (Qwen3-MoE, Mixtral): the same calls in the same order.
struct SparseLayer {
  at::Tensor router, routed, w13, s13, w2, s2;
  int64_t first = 0, top_k = 0;
  bool norm_topk_prob = false, round_weights = false;

  at::Tensor operator()(const at::Tensor& h) const {
    at::Tensor weights = at::empty({h.size(0), top_k}, h.options().dtype(at::kFloat));
    at::Tensor chosen = at::empty({h.size(0), top_k}, h.options().dtype(at::kLong));
    moe_route(weights, chosen, h, router, routed, norm_topk_prob, round_weights);
    at::Tensor out = at::empty_like(h);
    moe_experts(out, h, chosen, weights, w13,
                s13.defined() ? c10::optional<at::Tensor>(s13) : c10::nullopt, w2,
                s2.defined() ? c10::optional<at::Tensor>(s2) : c10::nullopt, first);
    return out;
  }
};

}  // namespace

class DecoderStack {
 public:
  // norms: 2 per layer (input, post-attention); kinds / weights / scales / biases / out_features: 4 per layer in
  // the order qkv, o, gate_up, down. An empty tensor stands for "none" (scales, bias).
  DecoderStack(std::vector<at::Tensor> norms, std::vector<int64_t> kinds, std::vector<at::Tensor> weights,
               std::vector<at::Tensor> scales, std::vector<at::Tensor> biases, std::vector<int64_t> out_features,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : norms_(std::move(norms)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {
    const size_t n = kinds.size();
    if (n % 4 || weights.size() != n || scales.size() != n || biases.size() != n || out_features.size() != n ||
        norms_.size() * 2 != n)
      throw std::invalid_argument("DecoderStack: want 4 projections and 2 norms a layer");
    for (size_t i = 0; i < n; ++i) {
      if (kinds[i] < GEMV || kinds[i] > DENSE) throw std::invalid_argument("DecoderStack: unknown projection kind");
      projections_.push_back(
          {kinds[i], weights[i], optional_tensor(scales[i]), optional_tensor(biases[i]), out_features[i]});
    }
    const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
    for (size_t l = 0; l < n / 4; ++l)
      if (projections_[4 * l].out_features != q + 2 * kv)
        throw std::invalid_argument("DecoderStack: the qkv projection's width disagrees with the head shapes");
  }

  int64_t num_layers() const { return static_cast<int64_t>(projections_.size() / 4); }

  // Qwen3's q/k norms (one weight over head_dim each) on layer `layer`, before rope.
  void set_qk_norm(int64_t layer, at::Tensor q_weight, at::Tensor k_weight) {
    check_layer(layer);
    if (qk_norms_.empty()) qk_norms_.resize(2 * num_layers());
    qk_norms_[2 * layer] = std::move(q_weight);
    qk_norms_[2 * layer + 1] = std::move(k_weight);
  }

  // Layer `layer`'s MLP is sparse: routed experts held stacked (w13 [E, 2I, H], w2 [E, H, I], int8 scales or
  // empty), this rank's experts from `first`; `routed` [num_experts] int64 counts tokens per expert (in place).
  void set_moe(int64_t layer, at::Tensor router, at::Tensor routed, at::Tensor w13, at::Tensor s13, at::Tensor w2,
               at::Tensor s2, int64_t first, int64_t top_k, bool norm_topk_prob, bool round_weights) {
    check_layer(layer);
    if (routed.scalar_type() != at::kLong || routed.dim() != 1 || routed.size(0) != router.size(0))
      throw std::invalid_argument("DecoderStack: routed must be int64 [num_experts]");
    if (sparse_.empty()) sparse_.resize(num_layers());
    sparse_[layer] = SparseLayer{std::move(router), std::move(routed), std::move(w13), optional_tensor(s13),
                                 std::move(w2), optional_tensor(s2), first, top_k, norm_topk_prob, round_weights};
  }

  // x [T, hidden] (every row a single-token decode); cos / sin [T, 1, head_dim / 2] in x's dtype; the attention
  // arguments as paged_decode_attention and write_kv take them. Returns the last layer's output (x is not changed).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv,
                     const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, const at::Tensor& rows,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                     int64_t sliding_window) const {
    if (x.dim() != 2 || !x.is_contiguous()) throw std::invalid_argument("DecoderStack: x must be contiguous [T, hidden]");
    if (kv.dim() != 6 || kv.size(1) != num_layers())
      throw std::invalid_argument("DecoderStack: the KV pool's layer count disagrees with the model's");
    const int64_t t = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    x = x.clone();  // the residual stream, added to in place from here on (the caller's x is not changed)
    at::Tensor h = at::empty_like(x);  // each norm's output, consumed before the next norm writes it
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Projection* p = &projections_[4 * l];
      rms_norm(h, x, norms_[2 * l], eps_);
      at::Tensor qkv = p[0](h);
      if (!qk_norms_.empty() && qk_norms_[2 * l].defined()) {
        at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({t, heads_ + kv_heads_, head_dim_});
        head_norm_(qk.narrow(1, 0, heads_), qk_norms_[2 * l], eps_);
        head_norm_(qk.narrow(1, heads_, kv_heads_), qk_norms_[2 * l + 1], eps_);
      }
      rope_(qkv.narrow(1, 0, q_size + kv_size).view({t, heads_ + kv_heads_, head_dim_}), cos, sin);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads_, head_dim_});
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads_, head_dim_});
      write_kv(kv, l, slot_blocks, slot_offsets, k, v);
      at::Tensor attn = at::empty_like(q);
      paged_decode_attention(attn, q, kv, l, rows, block_tables, context_lens, scale, sliding_window);
      residual_add_(x, p[1](attn.reshape({t, q_size})));
      rms_norm(h, x, norms_[2 * l + 1], eps_);
      if (!sparse_.empty() && sparse_[l].router.defined()) {
        residual_add_(x, sparse_[l](h));
        continue;
      }
      at::Tensor gate_up = p[2](h);
      at::Tensor act = at::empty({t, gate_up.size(1) / 2}, gate_up.options());
      silu_and_mul(act, gate_up);
      residual_add_(x, p[3](act));
    }
    return x;
  }

 private:
  void check_layer(int64_t layer) const {
    if (layer < 0 || layer >= num_layers()) throw std::invalid_argument("DecoderStack: layer out of range");
  }

  std::vector<at::Tensor> norms_;
  std::vector<at::Tensor> qk_norms_;  // 2 a layer (q, k) where any layer has them; undefined: none
  std::vector<SparseLayer> sparse_;   // a layer's experts where any layer is sparse; undefined router: dense
  std::vector<Projection> projections_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
};

#include <torch/extension.h>

void bind_decoder_stack(py::module& m) {
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double>())
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_qk_norm", &DecoderStack::set_qk_norm)
      .def("set_moe", &DecoderStack::set_moe)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>(),
           "every decoder layer of an all-decode step (the GIL released throughout)");
}
