// Per-row argmax and log-sum-exp of fp32 logits in one kernel: what a greedy step needs (the token, and its raw
// log-probability for the cumulative logprob). torch spends five passes on it (amax, sub, exp, sum, log, plus an
// argmax); here each row is read twice, the second time from cache.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <tuple>
#include "simd.h"

namespace {


void row_stats(const float* row, int64_t n, int64_t* arg, float* lse) {
  // Pass 1: the maximum and its lowest index (torch.argmax's tie-break).
  float mx = row[0];
  int64_t best = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(row);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(row + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strictly greater: earlier index wins ties
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    alignas(64) float m[16];
    alignas(64) int32_t ix[16];
    _mm512_store_ps(m, vmax);
    _mm512_store_epi32(ix, vidx);
    mx = m[0];
    best = ix[0];
    for (int l = 1; l < 16; ++l)
      if (m[l] > mx || (m[l] == mx && ix[l] < best)) { mx = m[l]; best = ix[l]; }
  } else {
    i = 1;
  }
#elif defined(PDSERVE_AVX2)
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(row);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = _mm256_loadu_ps(row + i);
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);  // strictly greater: earlier index wins ties
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
    }
    alignas(32) float m[8];
    alignas(32) int32_t ix[8];
    _mm256_store_ps(m, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ix), vidx);
    mx = m[0];
    best = ix[0];
    for (int l = 1; l < 8; ++l)
      if (m[l] > mx || (m[l] == mx && ix[l] < best)) { mx = m[l]; best = ix[l]; }
  } else {
    i = 1;
  }
#else
  i = 1;
#endif
  for (; i < n; ++i)
    if (row[i] > mx) { mx = row[i]; best = i; }
  *arg = best;
  if (!std::isfinite(mx)) {  // all -inf (or +inf/NaN present): let the generic formula decide
    float s = 0.f;
    for (int64_t j = 0; j < n; ++j) s += std::exp(row[j] - mx);
    *lse = mx + std::log(s);
    return;
  }
  // Pass 2: sum of exp(x - max), from cache.
  float sum = 0.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, pdserve::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), vm)));
  sum = _mm512_reduce_add_ps(acc);
#elif defined(PDSERVE_AVX2)
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, pdserve::exp_ps8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vm)));
  sum = pdserve::reduce_add8(acc);
#endif
  for (; i < n; ++i) sum += std::exp(row[i] - mx);
  *lse = mx + std::log(sum);
}

}  // namespace

// (argmax [B] int64, logsumexp [B] fp32) of contiguous fp32 logits [B, V].
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty vocabulary");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor arg = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({rows}, logits.options());
  const float* p = logits.data_ptr<float>();
  int64_t* a = arg.data_ptr<int64_t>();
  float* l = lse.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) row_stats(p + r * n, n, a + r, l + r);
  });
  return {arg, lse};
}
