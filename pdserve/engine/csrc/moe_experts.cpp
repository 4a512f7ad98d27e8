// A sparse MoE layer's routed experts for a decode-sized batch, in one call: for every token and each of its top-k
// experts, the fused gate/up GEMV, silu(gate) * up, the down GEMV and the routing-weighted sum (engine/moe.py).
//
// The torch path runs the experts one after another (a gather, two GEMMs, a scatter-add each): at a decode step
// of a few tokens that is ~10 small ops per expert hit, and a Qwen3-MoE layer hits top_k (8) or more. Here the
// (token, expert) pairs are grouped by expert, every hit expert's weight rows are spread over the threads at once
// (each weight row read once for all the tokens that chose it, as weight_gemv.cpp reads a projection), and the
// activation and the weighted sum are single passes. The experts' weights are held stacked: gate/up [E, 2I, H],
// down [E, H, I], in bf16 / fp32, or int8 with per-row fp32 scales [E, 2I] and [E, H].
//
// Rounding follows torch's bf16 path where the model is bf16 (the projections' outputs, silu, the product and the
// down output each rounded to bf16); the weighted sum over a token's experts is accumulated in fp32 and rounded
// once (torch adds each expert's share in bf16: the difference is within a bf16 unit).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "gemv_dot.h"

namespace {

using namespace pdserve::gemv;

constexpr int64_t kMaxTokens = 256;  // rows one expert can have here: the size of a task's dot buffer

struct Hit {  // an expert chosen by at least one token: its rows are pairs [first, first + rows)
  int64_t expert, first, rows;
};

// dots[r] = x[r] . w for `rows` activation rows (stride k), kRowGroup at a time.
template <typename W>
inline void dots_for(float* dots, const float* x, const W* w, int64_t k, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const float* xr = x + r0 * k;
    switch (std::min(kRowGroup, rows - r0)) {
      case 1: dot_rows<W, 1>(dots + r0, xr, w, k); break;
      case 2: dot_rows<W, 2>(dots + r0, xr, w, k); break;
      case 3: dot_rows<W, 3>(dots + r0, xr, w, k); break;
      default: dot_rows<W, 4>(dots + r0, xr, w, k); break;
    }
  }
}

#if defined(__AVX512BF16__)
inline void dots_for(float* dots, const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const c10::BFloat16* xr = x + r0 * k;
    switch (std::min(kRowGroup, rows - r0)) {
      case 1: dot_rows_dp<1>(dots + r0, xr, w, k); break;
      case 2: dot_rows_dp<2>(dots + r0, xr, w, k); break;
      case 3: dot_rows_dp<3>(dots + r0, xr, w, k); break;
      default: dot_rows_dp<4>(dots + r0, xr, w, k); break;
    }
  }
}
#endif

// out[p, j] = scale[e, j] * x[p] . w[e, j] for every hit expert e, its pairs p and its n weight rows j (row
// length k): all hits' rows in one parallel loop, ~64 KiB of weights a task.
template <typename W, typename X>
void experts_gemv(float* out, const X* x, const W* w, const float* scales, const std::vector<Hit>& hits, int64_t n,
                  int64_t k) {
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(k * int64_t(sizeof(W)), 1));
  at::parallel_for(0, int64_t(hits.size()) * n, grain, [&](int64_t b, int64_t e) {
    float dots[kMaxTokens];
    for (int64_t j = b; j < e; ++j) {
      const Hit& h = hits[j / n];
      const int64_t row = h.expert * n + j % n;
      dots_for(dots, x + h.first * k, w + row * k, k, h.rows);
      const float s = scales ? scales[row] : 1.f;
      for (int64_t r = 0; r < h.rows; ++r) out[(h.first + r) * n + j % n] = dots[r] * s;
    }
  });
}

inline float round_bf16(float v) { return static_cast<float>(static_cast<c10::BFloat16>(v)); }

// act[p, i] = silu(gate[p, i]) * up[p, i] over gate_up [P, 2I] = [gate | up]; `bf16`: each step rounded as torch's
// bf16 kernels round (the projection's output, silu, the product).
void activate(float* act, const float* gate_up, int64_t pairs, int64_t inter, bool bf16) {
  at::parallel_for(0, pairs, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const float* g = gate_up + p * 2 * inter;
      const float* u = g + inter;
      float* a = act + p * inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= inter; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
        if (bf16) gv = pdserve::round_bf16(gv), uv = pdserve::round_bf16(uv);
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, pdserve::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        if (bf16) s = pdserve::round_bf16(s);
        __m512 o = _mm512_mul_ps(s, uv);
        _mm512_storeu_ps(a + i, bf16 ? pdserve::round_bf16(o) : o);
      }
#elif defined(PDSERVE_AVX2)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= inter; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
        if (bf16) gv = pdserve::round_bf16_8(gv), uv = pdserve::round_bf16_8(uv);
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, pdserve::exp_ps8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        if (bf16) s = pdserve::round_bf16_8(s);
        __m256 o = _mm256_mul_ps(s, uv);
        _mm256_storeu_ps(a + i, bf16 ? pdserve::round_bf16_8(o) : o);
      }
#endif
      for (; i < inter; ++i) {
        float gv = g[i], uv = u[i];
        if (bf16) gv = round_bf16(gv), uv = round_bf16(uv);
        float s = gv / (1.f + std::exp(-gv));
        if (bf16) s = round_bf16(s);
        a[i] = bf16 ? round_bf16(s * uv) : s * uv;
      }
    }
  });
}

struct Routing {  // the (token, expert) pairs this rank holds, grouped by expert in ascending order
  std::vector<int64_t> token;
  std::vector<float> weight;
  std::vector<Hit> hits;
};

Routing group_pairs(const int64_t* chosen, const float* weights, int64_t tokens, int64_t top_k, int64_t first,
                    int64_t held) {
  std::vector<int64_t> count(held, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = chosen[i] - first;
    if (e >= 0 && e < held) ++count[e];
  }
  Routing r;
  std::vector<int64_t> at(held, 0);
  int64_t pairs = 0;
  for (int64_t e = 0; e < held; ++e) {
    if (count[e] == 0) continue;
    r.hits.push_back({e, pairs, count[e]});
    at[e] = pairs;
    pairs += count[e];
  }
  r.token.resize(pairs);
  r.weight.resize(pairs);
  for (int64_t i = 0; i < tokens * top_k; ++i) {  // token order within an expert, as torch's loop gathers them
    const int64_t e = chosen[i] - first;
    if (e < 0 || e >= held) continue;
    r.token[at[e]] = i / top_k;
    r.weight[at[e]++] = weights[i];
  }
  return r;
}

// The experts' part for W-stored weights, activations X (fp32, or bf16 for vdpbf16ps): acc [T, H] fp32.
template <typename W, typename X>
void run_experts(float* acc, const at::Tensor& x, const Routing& r, const W* w13, const float* s13, const W* w2,
                 const float* s2, int64_t inter, bool bf16) {
  const int64_t h = x.size(1), pairs = int64_t(r.token.size());
  std::vector<X> xg(pairs * h);  // each pair's token row, grouped by expert
  const float* xf = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;
  const c10::BFloat16* xb = xf ? nullptr : x.data_ptr<c10::BFloat16>();
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t t = r.token[p];
    X* dst = xg.data() + p * h;
    if (xf) {
      for (int64_t i = 0; i < h; ++i) dst[i] = static_cast<X>(xf[t * h + i]);
    } else {
      for (int64_t i = 0; i < h; ++i) dst[i] = static_cast<X>(xb[t * h + i]);
    }
  }
  std::vector<float> gate_up(pairs * 2 * inter), act(pairs * inter), y(pairs * h);
  experts_gemv(gate_up.data(), xg.data(), w13, s13, r.hits, 2 * inter, h);
  activate(act.data(), gate_up.data(), pairs, inter, bf16);
  if constexpr (std::is_same_v<X, float>) {
    experts_gemv(y.data(), act.data(), w2, s2, r.hits, h, inter);
  } else {
    std::vector<X> act_x(act.begin(), act.end());  // exact: already rounded to bf16
    experts_gemv(y.data(), act_x.data(), w2, s2, r.hits, h, inter);
  }
  for (int64_t p = 0; p < pairs; ++p) {  // serial: P * H multiply-adds, small next to the GEMVs
    float* o = acc + r.token[p] * h;
    const float* yp = y.data() + p * h;
    const float wp = r.weight[p];
    for (int64_t i = 0; i < h; ++i) o[i] += wp * (bf16 ? round_bf16(yp[i]) : yp[i]);
  }
}

template <typename W>
void dispatch_x(float* acc, const at::Tensor& x, const Routing& r, const at::Tensor& w13, const float* s13,
                const at::Tensor& w2, const float* s2, int64_t inter, bool bf16) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    if (x.scalar_type() == at::kBFloat16) {  // bf16 x bf16 as stored: vdpbf16ps
      run_experts<W, c10::BFloat16>(acc, x, r, w13.data_ptr<W>(), s13, w2.data_ptr<W>(), s2, inter, bf16);
      return;
    }
  }
#endif
  run_experts<W, float>(acc, x, r, w13.data_ptr<W>(), s13, w2.data_ptr<W>(), s2, inter, bf16);
}

const float* scales_of(const c10::optional<at::Tensor>& s, bool int8, int64_t experts, int64_t rows,
                       const char* name) {
  if (!int8) {
    if (s && s->defined()) throw std::invalid_argument(std::string("moe_experts: ") + name + ": only int8 takes scales");
    return nullptr;
  }
  if (!s || !s->defined() || s->scalar_type() != at::kFloat || !s->is_contiguous() || s->dim() != 2 ||
      s->size(0) != experts || s->size(1) != rows)
    throw std::invalid_argument(std::string("moe_experts: int8 weights need contiguous fp32 ") + name);
  return s->data_ptr<float>();
}

}  // namespace

// out [T, H] (x's dtype) = sum over each token's chosen experts e held here (first <= e < first + E) of
// weights[t, j] * down_e(silu(gate_e(x)) * up_e(x)). x [T, H] fp32 / bf16; chosen [T, k] int64 (global ids);
// weights [T, k] fp32; w13 [E, 2I, H] and w2 [E, H, I], both int8 (with s13 [E, 2I], s2 [E, H] fp32), bf16 or fp32.
void moe_experts(at::Tensor out, const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                 const at::Tensor& w13, const c10::optional<at::Tensor>& s13, const at::Tensor& w2,
                 const c10::optional<at::Tensor>& s2, int64_t first) {
  if (x.dim() != 2 || out.sizes() != x.sizes() || chosen.dim() != 2 || chosen.size(0) != x.size(0) ||
      weights.sizes() != chosen.sizes() || w13.dim() != 3 || w2.dim() != 3 || w13.size(2) != x.size(1) ||
      w2.size(0) != w13.size(0) || w2.size(1) != x.size(1) || w13.size(1) != 2 * w2.size(2))
    throw std::invalid_argument("moe_experts: want x, out [T, H], chosen, weights [T, k], w13 [E, 2I, H], w2 [E, H, I]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &x, &chosen, &weights, &w13, &w2})
    if (!t->is_contiguous()) throw std::invalid_argument("moe_experts: tensors must be contiguous");
  if (chosen.scalar_type() != at::kLong || weights.scalar_type() != at::kFloat)
    throw std::invalid_argument("moe_experts: chosen must be int64 and weights float32");
  if (out.scalar_type() != x.scalar_type() || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16))
    throw std::invalid_argument("moe_experts: x must be float32 or bfloat16, and out of x's dtype");
  if (w13.scalar_type() != w2.scalar_type())
    throw std::invalid_argument("moe_experts: w13 and w2 must share a dtype");
  if (x.size(0) > kMaxTokens) throw std::invalid_argument("moe_experts: at most 256 tokens a call");
  const int64_t tokens = x.size(0), h = x.size(1), held = w13.size(0), inter = w2.size(2);
  const bool int8 = w13.scalar_type() == at::kChar;
  const float* a = scales_of(s13, int8, held, 2 * inter, "s13 [E, 2I]");
  const float* b = scales_of(s2, int8, held, h, "s2 [E, H]");
  const Routing r = group_pairs(chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), tokens, chosen.size(1),
                                first, held);
  std::vector<float> acc(tokens * h, 0.f);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (!r.hits.empty()) {
    switch (w13.scalar_type()) {
      case at::kChar: dispatch_x<int8_t>(acc.data(), x, r, w13, a, w2, b, inter, bf16); break;
      case at::kBFloat16: dispatch_x<c10::BFloat16>(acc.data(), x, r, w13, a, w2, b, inter, bf16); break;
      case at::kFloat: dispatch_x<float>(acc.data(), x, r, w13, a, w2, b, inter, bf16); break;
      default: throw std::invalid_argument("moe_experts: weights must be int8, bfloat16 or float32");
    }
  }
  if (bf16) {
    c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < tokens * h; ++i) o[i] = static_cast<c10::BFloat16>(acc[i]);
  } else {
    std::copy(acc.begin(), acc.end(), out.data_ptr<float>());
  }
}

// A softmax top-k router (Qwen3-MoE, Mixtral; moe.SparseMoE's native path and the decoder stack's sparse layers)
// for a few tokens, in one call: per token the logits x . router[e] accumulated in fp32 and rounded to x's dtype
// (as F.linear's output is), their softmax in fp32, the top k (descending; ties: the lower expert), renormalised to
// sum to 1 (`norm_topk_prob`), rounded to x's dtype (`round_weights`); and routed[e] += 1 per choice. In torch that
// is ~10 ops a layer, and torch's matmul of [1, 768] by a [768, 32] router costs ~50x its 49 KB (docs/engine.md).
// A token's result does not depend on the others in the call (each row is the same serial computation).
// weights [T, k] fp32 and chosen [T, k] int64 are written; x [T, H] and router [E, H] fp32 or bf16 (one dtype);
// routed: int64 [E] or undefined.
void moe_route(at::Tensor weights, at::Tensor chosen, const at::Tensor& x, const at::Tensor& router,
               const c10::optional<at::Tensor>& routed, bool norm_topk_prob, bool round_weights) {
  if (x.dim() != 2 || router.dim() != 2 || router.size(1) != x.size(1) || weights.dim() != 2 ||
      weights.size(0) != x.size(0) || chosen.sizes() != weights.sizes() || weights.size(1) > router.size(0) ||
      weights.size(1) < 1)
    throw std::invalid_argument("moe_route: want x [T, H], router [E, H], weights and chosen [T, k] with k <= E");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&weights, &chosen, &x, &router})
    if (!t->is_contiguous()) throw std::invalid_argument("moe_route: tensors must be contiguous");
  if (weights.scalar_type() != at::kFloat || chosen.scalar_type() != at::kLong)
    throw std::invalid_argument("moe_route: weights must be float32 and chosen int64");
  if (router.scalar_type() != x.scalar_type() || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16))
    throw std::invalid_argument("moe_route: x and router must both be float32 or both bfloat16");
  const int64_t tokens = x.size(0), h = x.size(1), experts = router.size(0), k = weights.size(1);
  int64_t* counts = nullptr;
  if (routed && routed->defined()) {
    if (routed->scalar_type() != at::kLong || routed->dim() != 1 || routed->size(0) != experts ||
        !routed->is_contiguous())
      throw std::invalid_argument("moe_route: routed must be contiguous int64 [E]");
    counts = routed->data_ptr<int64_t>();
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  float* wout = weights.data_ptr<float>();
  int64_t* cout = chosen.data_ptr<int64_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
    std::vector<float> xf(h), p(experts);
    std::vector<char> taken(experts);
    for (int64_t t = b; t < e; ++t) {
      if (bf16) {
        const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>() + t * h;
        for (int64_t i = 0; i < h; ++i) xf[i] = static_cast<float>(xb[i]);
      } else {
        std::copy_n(x.data_ptr<float>() + t * h, h, xf.data());
      }
      float top = -INFINITY;
      for (int64_t j = 0; j < experts; ++j) {
        float d;
        if (bf16) {
          dot_rows<c10::BFloat16, 1>(&d, xf.data(), router.data_ptr<c10::BFloat16>() + j * h, h);
          d = round_bf16(d);
        } else {
          dot_rows<float, 1>(&d, xf.data(), router.data_ptr<float>() + j * h, h);
        }
        p[j] = d;
        top = std::max(top, d);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < experts; ++j) sum += (p[j] = std::exp(p[j] - top));
      for (int64_t j = 0; j < experts; ++j) p[j] /= sum;
      std::fill(taken.begin(), taken.end(), 0);
      float* w = wout + t * k;
      int64_t* c = cout + t * k;
      float picked = 0.f;
      for (int64_t i = 0; i < k; ++i) {
        int64_t best = -1;
        for (int64_t j = 0; j < experts; ++j)
          if (!taken[j] && (best < 0 || p[j] > p[best])) best = j;
        taken[best] = 1;
        c[i] = best;
        w[i] = p[best];
        picked += p[best];
      }
      for (int64_t i = 0; i < k; ++i) {
        if (norm_topk_prob) w[i] /= picked;
        if (round_weights && bf16) w[i] = round_bf16(w[i]);
      }
    }
  });
  if (counts)
    for (int64_t i = 0; i < tokens * k; ++i) ++counts[cout[i]];
}
