// Weight-only GEMV for decode: out[m, n] = scale[n] * sum_k x[m, k] * w[n, k], with w stored narrower than the
// compute dtype (int8 with a per-output-channel scale, or bf16 computed in fp32) and widened to fp32 in registers;
// and bf16 x bf16 on AVX512-BF16 CPUs, multiplied as stored (vdpbf16ps, fp32 accumulation; gemv_bf16_dp).
//
// A batch-1 decode step is the weight bytes read (docs/engine.md, "Batch-1 decode"); torch's own int8
// weight-only matmul (aten::_weight_int8pack_mm) runs fp32 activations in a scalar loop (0.6 GB/s measured), and a
// bf16 weight with fp32 activations has no torch kernel at all. Each weight row is read once from memory and
// used for up to 4 activation rows at a time (widened once per group); accumulation is fp32, scale applied once.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <cstring>
#include <stdexcept>
#include <vector>

#include "gemv_dot.h"

namespace {

using namespace pdserve::gemv;

template <typename W, typename O>
void gemv(O* out, const float* x, const W* w, const float* scales, int64_t m, int64_t n, int64_t k) {
  // ~64 KiB of weights per task: enough work per thread, and every thread streams its own rows.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(k * int64_t(sizeof(W)), 1));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    float dots[kRowGroup];
    int64_t j = b;
    if (m == 1) {
      for (; j + kBatch1Rows <= e; j += kBatch1Rows) {
        dot_rows_w(dots, x, w + j * k, k);
        for (int r = 0; r < kBatch1Rows; ++r) out[j + r] = static_cast<O>(dots[r] * (scales ? scales[j + r] : 1.f));
      }
    }
    for (; j < e; ++j) {
      const W* wr = w + j * k;
      const float s = scales ? scales[j] : 1.f;
      for (int64_t r0 = 0; r0 < m; r0 += kRowGroup) {
        const int64_t rows = std::min(kRowGroup, m - r0);
        const float* xr = x + r0 * k;
        switch (rows) {
          case 1: dot_rows<W, 1>(dots, xr, wr, k); break;
          case 2: dot_rows<W, 2>(dots, xr, wr, k); break;
          case 3: dot_rows<W, 3>(dots, xr, wr, k); break;
          default: dot_rows<W, 4>(dots, xr, wr, k); break;
        }
        for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n + j] = static_cast<O>(dots[r] * s);
      }
    }
  });
}

#if defined(__AVX512BF16__)
void gemv_bf16_dp(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w, int64_t m, int64_t n,
                  int64_t k) {
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(k * 2, 1));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    float dots[kRowGroup];
    for (int64_t j = b; j < e; ++j) {
      const c10::BFloat16* wr = w + j * k;
      for (int64_t r0 = 0; r0 < m; r0 += kRowGroup) {
        const int64_t rows = std::min(kRowGroup, m - r0);
        const c10::BFloat16* xr = x + r0 * k;
        switch (rows) {
          case 1: dot_rows_dp<1>(dots, xr, wr, k); break;
          case 2: dot_rows_dp<2>(dots, xr, wr, k); break;
          case 3: dot_rows_dp<3>(dots, xr, wr, k); break;
          default: dot_rows_dp<4>(dots, xr, wr, k); break;
        }
        for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n + j] = static_cast<c10::BFloat16>(dots[r]);
      }
    }
  });
}
#endif

}  // namespace

// out [m, n] (x's dtype) = x [m, k] (fp32 or bf16) @ (scales[:, None] * weight [n, k]).T; weight int8 (scales [n]
// fp32 required) or bf16 (scales must be undefined: computed in fp32).
void weight_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales) {
  if (x.dim() != 2 || weight.dim() != 2 || out.dim() != 2 || x.size(1) != weight.size(1) ||
      out.size(0) != x.size(0) || out.size(1) != weight.size(0))
    throw std::invalid_argument("weight_gemv: want x [m, k], weight [n, k], out [m, n]");
  if (!x.is_contiguous() || !weight.is_contiguous() || !out.is_contiguous() || out.scalar_type() != x.scalar_type())
    throw std::invalid_argument("weight_gemv: tensors must be contiguous and out must have x's dtype");
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  const bool int8 = weight.scalar_type() == at::kChar;
  if (!int8 && weight.scalar_type() != at::kBFloat16)
    throw std::invalid_argument("weight_gemv: weight must be int8 or bfloat16");
  const float* s = nullptr;
  if (int8) {
    if (!scales || !scales->defined() || scales->scalar_type() != at::kFloat || scales->numel() != n ||
        !scales->is_contiguous())
      throw std::invalid_argument("weight_gemv: int8 weights need contiguous fp32 scales [n]");
    s = scales->data_ptr<float>();
  } else if (scales && scales->defined()) {
    throw std::invalid_argument("weight_gemv: bf16 weights take no scales");
  }
#if defined(__AVX512BF16__)
  if (!int8 && x.scalar_type() == at::kBFloat16) {
    if (m && n) gemv_bf16_dp(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                             weight.data_ptr<c10::BFloat16>(), m, n, k);
    return;
  }
#endif
  std::vector<float> widened;  // bf16 activations widened once (m * k floats: small at decode batch sizes)
  const float* xf;
  if (x.scalar_type() == at::kFloat) {
    xf = x.data_ptr<float>();
  } else if (x.scalar_type() == at::kBFloat16) {
    widened.resize(m * k);
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < m * k; ++i) widened[i] = static_cast<float>(xb[i]);
    xf = widened.data();
  } else {
    throw std::invalid_argument("weight_gemv: x must be float32 or bfloat16");
  }
  if (m == 0 || n == 0) return;
  if (x.scalar_type() == at::kFloat) {
    if (int8) gemv(out.data_ptr<float>(), xf, weight.data_ptr<int8_t>(), s, m, n, k);
    else gemv(out.data_ptr<float>(), xf, weight.data_ptr<c10::BFloat16>(), s, m, n, k);
  } else {
    if (int8) gemv(out.data_ptr<c10::BFloat16>(), xf, weight.data_ptr<int8_t>(), s, m, n, k);
    else gemv(out.data_ptr<c10::BFloat16>(), xf, weight.data_ptr<c10::BFloat16>(), s, m, n, k);
  }
}
