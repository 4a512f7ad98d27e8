// SwiGLU's elementwise half in one pass: out = silu(gate) * up with gate_up = [gate | up] along the last dim.
//
// torch runs it as three bf16 kernels (silu, mul, and the chunk's strided reads), each widening to fp32 and back;
// at a 2048-token prefill chunk of the bench model that was ~9 ms of every layer. One pass reads gate_up once and
// writes out once.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include "simd.h"

namespace {


template <typename T>
void silu_and_mul_rows(T* out, const T* in, int64_t row_begin, int64_t row_end, int64_t width) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* gate = in + r * 2 * width;
    const T* up = gate + width;
    T* o = out + r * width;
    int64_t i = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= width; i += 16) {
        // silu(g) rounded to bf16 first, then the product rounded again: exactly torch's two-kernel rounding.
        const __m512 g = pdserve::load_bf16(gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, pdserve::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        pdserve::store_bf16(o + i, _mm512_mul_ps(pdserve::round_bf16(s), pdserve::load_bf16(up + i)));
      }
    } else if constexpr (std::is_same_v<T, float>) {
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= width; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, pdserve::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
      }
    }
#elif defined(PDSERVE_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      for (; i + 8 <= width; i += 8) {  // the same two roundings as torch's bf16 kernels (above)
        const __m256 g = pdserve::load_bf16_8(gate + i);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, pdserve::exp_ps8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        pdserve::store_bf16_8(o + i, _mm256_mul_ps(pdserve::round_bf16_8(s), pdserve::load_bf16_8(up + i)));
      }
    } else if constexpr (std::is_same_v<T, float>) {
      for (; i + 8 <= width; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, pdserve::exp_ps8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
      }
    }
#endif
    for (; i < width; ++i) {
      const float g = static_cast<float>(gate[i]);
      const T s = static_cast<T>(g / (1.0f + std::exp(-g)));
      o[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(up[i]));
    }
  }
}

}  // namespace

// out[t, :] = silu(gate_up[t, :I]) * gate_up[t, I:] for gate_up [T, 2I] contiguous, out [T, I] contiguous.
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1),
              "out must be a contiguous [T, I] tensor");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "out and gate_up must share a dtype");
  const int64_t rows = gate_up.size(0), width = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t b, int64_t e) {
      silu_and_mul_rows<scalar_t>(o, in, b, e, width);
    });
  });
}
