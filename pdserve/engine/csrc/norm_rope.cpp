// RMSNorm and rotary embedding as single passes.
//
// Both are a handful of elementwise torch ops each (pow, mean, rsqrt, mul, casts; mul, sub, cat) whose per-op
// overhead dominates at decode batch sizes and whose extra passes cost at prefill sizes. Each kernel rounds where
// the torch path it replaces rounds, so bf16 results match it (tests/engine/test_kernels.py).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

namespace {

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* w, int64_t b, int64_t e, int64_t width, float eps) {
  for (int64_t r = b; r < e; ++r) {
    const T* xr = x + r * width;
    T* o = out + r * width;
    float ss = 0.f;
    for (int64_t i = 0; i < width; ++i) {
      const float v = static_cast<float>(xr[i]);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) o[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
  }
}

// x[t, h, :] rotated in place by position t's angles (HF's rotate-half convention):
//   x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin, each product and sum rounded to T as torch does.
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t b, int64_t e, int64_t heads, int64_t half,
               int64_t row_stride, int64_t head_stride) {
  for (int64_t t = b; t < e; ++t) {
    const T* c = cos + t * half;
    const T* s = sin + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* x1 = x + t * row_stride + h * head_stride;
      T* x2 = x1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(x1[i]), bb = static_cast<float>(x2[i]);
        const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
        const float n1 = static_cast<float>(round_to<T>(static_cast<float>(round_to<T>(a * ci)) -
                                                        static_cast<float>(round_to<T>(bb * si))));
        const float n2 = static_cast<float>(round_to<T>(static_cast<float>(round_to<T>(bb * ci)) +
                                                        static_cast<float>(round_to<T>(a * si))));
        x1[i] = static_cast<T>(n1);
        x2[i] = static_cast<T>(n2);
      }
    }
  }
}

}  // namespace

// out = x * rsqrt(mean(x^2) + eps) * weight over the last dim, accumulated in fp32, rounded once (as F.rms_norm).
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm wants contiguous tensors");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: out must match x and weight the last dim");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out must share a dtype");
  const int64_t width = x.size(-1), rows = x.numel() / std::max<int64_t>(width, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)), [&](int64_t b, int64_t e) {
      rms_norm_rows<scalar_t>(o, xp, w, b, e, width, static_cast<float>(eps));
    });
  });
}

// In-place rotary embedding of x [T, H, D] (unit stride on D) with cos/sin [T, D/2] contiguous.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope_: x must be [T, H, D] with unit stride on D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) / 2 &&
                  sin.numel() == cos.numel(),
              "rope_: cos and sin must be contiguous [T, D/2]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope_: x, cos and sin must share a dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, std::max<int64_t>(1, 8192 / std::max<int64_t>(heads * half, 1)),
                     [&](int64_t b, int64_t e) {
      rope_rows<scalar_t>(xp, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), b, e, heads, half, x.stride(0),
                          x.stride(1));
    });
  });
}
