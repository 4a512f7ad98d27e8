// The routing-weighted sum that closes a many-token MoE step's grouped experts (engine/moe_grouped.py): each
// expert's GEMMs have written their rows' outputs to y, grouped by expert; here every token sums its top-k rows of
// y, each times its routing weight, in one pass over y.
//
// torch's form is a gather of the (token, expert) rows, a widening to fp32, a multiply and an index_add_ into an
// fp32 buffer, then a rounding copy: five passes over T * k rows. As in moe_experts.cpp, the sum runs in fp32 in
// slot order and is rounded once to the output's dtype.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <stdexcept>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// acc[0, h) += w * row[0, h)
template <typename T>
inline void add_scaled(float* acc, const T* row, float w, int64_t h) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= h; i += 16) {
    __m512 v;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      v = pdserve::load_bf16(row + i);
    } else {
      v = _mm512_loadu_ps(row + i);
    }
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, v, _mm512_loadu_ps(acc + i)));
  }
#endif
  for (; i < h; ++i) acc[i] += w * static_cast<float>(row[i]);
}

// row[0, h) = acc rounded to T (round-to-nearest-even for bf16, as torch converts)
template <typename T>
inline void store_row(T* row, const float* acc, int64_t h) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 16 <= h; i += 16) pdserve::store_bf16(row + i, _mm512_loadu_ps(acc + i));
  }
#endif
  for (; i < h; ++i) row[i] = static_cast<T>(acc[i]);
}

template <typename T>
void combine(T* out, const T* y, const int64_t* pos, const float* weights, int64_t tokens, int64_t k, int64_t h) {
  at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
    std::vector<float> acc(h);
    for (int64_t t = b; t < e; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = pos[t * k + j];
        if (p >= 0) add_scaled(acc.data(), y + p * h, weights[t * k + j], h);
      }
      store_row(out + t * h, acc.data(), h);
    }
  });
}

}  // namespace

// out [T, H] = sum over j with pos[t, j] >= 0 of weights[t, j] * y[pos[t, j]]; y [P, H] of out's dtype (fp32 or
// bf16), pos [T, k] int64 (-1: an expert not held here, no share), weights [T, k] fp32; all contiguous.
void moe_combine(at::Tensor out, const at::Tensor& y, const at::Tensor& pos, const at::Tensor& weights) {
  if (out.dim() != 2 || y.dim() != 2 || y.size(1) != out.size(1) || pos.dim() != 2 || pos.size(0) != out.size(0) ||
      weights.sizes() != pos.sizes())
    throw std::invalid_argument("moe_combine: want out [T, H], y [P, H], pos and weights [T, k]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &y, &pos, &weights})
    if (!t->is_contiguous()) throw std::invalid_argument("moe_combine: tensors must be contiguous");
  if (pos.scalar_type() != at::kLong || weights.scalar_type() != at::kFloat)
    throw std::invalid_argument("moe_combine: pos must be int64 and weights float32");
  if (out.scalar_type() != y.scalar_type() || (y.scalar_type() != at::kFloat && y.scalar_type() != at::kBFloat16))
    throw std::invalid_argument("moe_combine: y must be float32 or bfloat16, and out of y's dtype");
  const int64_t tokens = out.size(0), k = pos.size(1), h = out.size(1), rows = y.size(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens * k; ++i)
    if (p[i] < -1 || p[i] >= rows) throw std::invalid_argument("moe_combine: pos out of range");
  if (y.scalar_type() == at::kBFloat16) {
    combine(out.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), p, weights.data_ptr<float>(), tokens, k, h);
  } else {
    combine(out.data_ptr<float>(), y.data_ptr<float>(), p, weights.data_ptr<float>(), tokens, k, h);
  }
}
