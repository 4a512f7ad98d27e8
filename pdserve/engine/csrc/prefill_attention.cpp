// Causal (chunked-)prefill attention read from the paged KV pool, for bf16 pools on AVX512-BF16 CPUs.
//
// torch's CPU SDPA reached ~10-35 GFLOP/s on this workload's prompt lengths (20% of a prefill step), and a chunk
// after cached context first gathers the whole context and builds a mask. Here a work item is (span, KV head, a
// chunk of 32 queries): the item's keys are repacked once into K^T and V pair tiles, so a score vector is 16 keys
// with no horizontal sums, and the G query heads that share the KV head reuse every load. Measured: ~10% faster
// than SDPA per call at 256-512 tokens, ~3% of the mixed workload's prefill time; modest, kept because it also
// removes the gather and mask of chunked spans. Query i of a span sits at position context_len - q_len + i and sees
// keys up to its own position (and, with a sliding window, the last `window` of them).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kQueryChunk = 32;

struct Item {
  int64_t span, head, q0, q1;  // queries [q0, q1) of the span
};

#if defined(__AVX512BF16__)
// Scores and P.V for queries [it.q0, it.q1) of one span and KV head; keys repacked once per item. The products
// run as bf16 pairs (vdpbf16ps: two dims' or two keys' products per lane and instruction, fp32 accumulation):
// K^T is kept as (dim 2e, 2e+1) pairs per key, V as (key 2j, 2j+1) pairs per dim, the query unscaled (it is bf16
// already; the scale multiplies the fp32 scores) and the probabilities rounded to bf16 for P.V, as a bf16 SDPA
// does. (The same loops in fp32 FMAs were slower than SDPA: the kernel exists only where AVX512-BF16 does.)
template <int G>
void attend_chunk(const Item& it, const at::Tensor& q, at::Tensor& out, const c10::BFloat16* layer_base,
                  const int64_t* table, int64_t start, int64_t q_len, int64_t ctx, int64_t window, float scale,
                  int64_t d, int64_t block_size, int64_t row_stride, int64_t kv_stride, int64_t block_stride,
                  std::vector<float>& kt, std::vector<float>& vf, std::vector<float>& sc) {
  const int64_t base_pos = ctx - q_len;
  const int64_t last = base_pos + it.q1 - 1;  // the chunk's last query position = its last key
  const int64_t kfirst = window > 0 ? std::max<int64_t>(0, base_pos + it.q0 - window + 1) : 0;
  const int64_t nk = last - kfirst + 1, nkp = (nk + 31) / 32 * 32;  // keys padded to whole vectors / pairs
  auto row_of = [&](int64_t k) {
    const int64_t p = kfirst + k;
    return layer_base + table[p / block_size] * block_stride + (p % block_size) * row_stride + it.head * d;
  };
  const c10::BFloat16* qp = q.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  sc.resize(G * nkp);
  // K^T pairs: ktp[e2 * nkp + k] = (k[2 e2], k[2 e2 + 1]); V pairs: vp[(j * d + e) ] = (v_2j[e], v_2j+1[e]).
  const int64_t half = d / 2;
  kt.assign(half * nkp, 0.f);
  auto* ktp = reinterpret_cast<uint32_t*>(kt.data());
  vf.assign(nkp / 2 * d, 0.f);
  auto* vp = reinterpret_cast<uint32_t*>(vf.data());
  for (int64_t k = 0; k < nk; ++k) {
    const c10::BFloat16* row = row_of(k);
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(row);
    for (int64_t e2 = 0; e2 < half; ++e2) ktp[e2 * nkp + k] = kr[e2];
    const uint16_t* vr = reinterpret_cast<const uint16_t*>(row + kv_stride);
    const int shift = (k & 1) ? 16 : 0;
    uint32_t* dst = vp + (k / 2) * d;
    for (int64_t e = 0; e < d; ++e) dst[e] |= static_cast<uint32_t>(vr[e]) << shift;
  }
  std::vector<uint32_t> pp(G * (nkp / 2));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = it.q0; i < it.q1; ++i) {
    const int64_t pos = base_pos + i;
    const int64_t a = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - kfirst, b = pos - kfirst;
    const int64_t n = b - a + 1;
    const int64_t r = start + i;
    const uint32_t* qh[G];
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
      qh[g] = reinterpret_cast<const uint32_t*>(qp + r * q.stride(0) + (it.head * G + g) * q.stride(1));
    for (int64_t t = a / 16 * 16; t <= b; t += 16) {
      __m512 acc[G];
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t e2 = 0; e2 < half; ++e2) {
        const __m512bh kv16 = (__m512bh)_mm512_loadu_si512(ktp + e2 * nkp + t);
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32(static_cast<int>(qh[g][e2])), kv16);
      }
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(&sc[g * nkp + t], _mm512_mul_ps(acc[g], vscale));
    }
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) pdserve::softmax_inplace(&sc[g * nkp + a], n);
    // probabilities as bf16 pairs over keys (zero outside [a, b])
    const int64_t j0 = a / 2, j1 = b / 2;
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float* s = &sc[g * nkp];
      for (int64_t j = j0; j <= j1; ++j) {
        const int64_t k0 = 2 * j, k1 = 2 * j + 1;
        const float p0 = (k0 >= a && k0 <= b) ? s[k0] : 0.f, p1 = (k1 >= a && k1 <= b) ? s[k1] : 0.f;
        pp[g * (nkp / 2) + j] = static_cast<uint32_t>(c10::BFloat16(p0).x) |
                                (static_cast<uint32_t>(c10::BFloat16(p1).x) << 16);
      }
    }
    for (int64_t c = 0; c < d; c += 16) {
      __m512 acc[G];
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t j = j0; j <= j1; ++j) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + j * d + c);
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g * (nkp / 2) + j])), v);
      }
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
        pdserve::store_bf16(op + r * out.stride(0) + (it.head * G + g) * out.stride(1) + c, acc[g]);
    }
  }
}
#endif

}  // namespace

bool prefill_attention_supported(const at::Tensor& kv, int64_t n_heads) {
#if defined(__AVX512BF16__)
  const int64_t group = kv.size(4) > 0 ? n_heads / kv.size(4) : 0;
  return kv.scalar_type() == at::kBFloat16 && kv.size(5) % 16 == 0 && group >= 1 && group <= 8 &&
         n_heads % kv.size(4) == 0;
#else
  return false;
#endif
}

// out[starts[s] + i] = causal attention of query i of span s over its context, read through block_tables[s]
// (the span's own K/V must already be written to the pool). bf16 pool, head_dim % 16 == 0, group <= 8.
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                             const at::Tensor& starts, const at::Tensor& q_lens, const at::Tensor& context_lens,
                             const at::Tensor& block_tables, double scale, int64_t sliding_window) {
  TORCH_CHECK(prefill_attention_supported(kv, q.size(1)), "prefill attention: unsupported dtype/shape/CPU");
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 6, "kv pool must be a contiguous 6-d tensor");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [T, H, D] with unit stride on D");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && out.scalar_type() == kv.scalar_type(),
              "q, out and kv must share a dtype");
  TORCH_CHECK(q.size(2) == kv.size(5), "head_dim of q and kv disagree");
  TORCH_CHECK(layer >= 0 && layer < kv.size(1), "layer out of range");
  for (const at::Tensor* t : {&starts, &q_lens, &context_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be contiguous int64");
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [spans, max_blocks]");
  const int64_t n_spans = starts.size(0), max_blocks = block_tables.size(1), bs = kv.size(3);
  TORCH_CHECK(q_lens.size(0) == n_spans && context_lens.size(0) == n_spans && block_tables.size(0) == n_spans,
              "starts, q_lens, context_lens and block_tables disagree on the number of spans");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const int64_t* tb = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(tb[i] >= 0 && tb[i] < kv.size(0), "block id out of range");
  std::vector<Item> items;
  for (int64_t s = 0; s < n_spans; ++s) {
    TORCH_CHECK(ql[s] >= 1 && ql[s] <= cl[s] && cl[s] <= max_blocks * bs, "context length out of range");
    TORCH_CHECK(st[s] >= 0 && st[s] + ql[s] <= q.size(0), "span rows out of range");
    for (int64_t h = 0; h < kv.size(4); ++h)
      for (int64_t q0 = 0; q0 < ql[s]; q0 += kQueryChunk) items.push_back({s, h, q0, std::min(ql[s], q0 + kQueryChunk)});
  }
#if defined(__AVX512BF16__)
  const int64_t d = q.size(2), n_kv = kv.size(4), group = q.size(1) / n_kv;
  const int64_t row_stride = n_kv * d, kv_stride = bs * row_stride, block_stride = kv.size(1) * 2 * kv_stride;
  const c10::BFloat16* layer_base = kv.data_ptr<c10::BFloat16>() + layer * 2 * kv_stride;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    std::vector<float> kt, vf, sc;
    for (int64_t j = b; j < e; ++j) {
      const Item& it = items[j];
      const int64_t* table = tb + it.span * max_blocks;
#define PDSERVE_CHUNK(G)                                                                                       \
  attend_chunk<G>(it, q, out, layer_base, table, st[it.span], ql[it.span], cl[it.span], sliding_window, fscale, d, \
                  bs, row_stride, kv_stride, block_stride, kt, vf, sc)
      switch (group) {
        case 1: PDSERVE_CHUNK(1); break;
        case 2: PDSERVE_CHUNK(2); break;
        case 3: PDSERVE_CHUNK(3); break;
        case 4: PDSERVE_CHUNK(4); break;
        case 5: PDSERVE_CHUNK(5); break;
        case 6: PDSERVE_CHUNK(6); break;
        case 7: PDSERVE_CHUNK(7); break;
        default: PDSERVE_CHUNK(8); break;
      }
#undef PDSERVE_CHUNK
    }
  });
#endif
}
