// The native kernels' entry points, as bindings.cpp exposes them to Python and decoder_stack.cpp calls them.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, int64_t sliding_window);
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up);
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
void write_kv(at::Tensor kv, int64_t layer, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
              const at::Tensor& k, const at::Tensor& v);
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits);
void weight_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales);
bool prefill_attention_supported(const at::Tensor& kv, int64_t n_heads);
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                             const at::Tensor& starts, const at::Tensor& q_lens, const at::Tensor& context_lens,
                             const at::Tensor& block_tables, double scale, int64_t sliding_window);
void moe_experts(at::Tensor out, const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                 const at::Tensor& w13, const c10::optional<at::Tensor>& s13, const at::Tensor& w2,
                 const c10::optional<at::Tensor>& s2, int64_t first);
void moe_route(at::Tensor weights, at::Tensor chosen, const at::Tensor& x, const at::Tensor& router,
               const c10::optional<at::Tensor>& routed, bool norm_topk_prob, bool round_weights);
void moe_combine(at::Tensor out, const at::Tensor& y, const at::Tensor& pos, const at::Tensor& weights);
