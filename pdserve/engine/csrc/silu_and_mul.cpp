// SwiGLU's elementwise half in one pass: out = silu(gate) * up with gate_up = [gate | up] along the last dim.
//
// torch runs it as three bf16 kernels (silu, mul, and the chunk's strided reads), each widening to fp32 and back;
// at a 2048-token prefill chunk of the bench model that was ~9 ms of every layer. One pass reads gate_up once and
// writes out once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> bf16 bits (upper halves) with round-to-nearest-even, as torch converts; inputs are finite here.
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}

inline __m512 round_bf16(__m512 v) {  // v rounded to the nearest bf16, kept as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16_bits(v), 16));
}

inline void store_bf16x16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16_bits(v)));
}

// e^x for any x (clamped to fp32's range): Cephes expf reduction and polynomial, 2^n by scalef.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

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
        const __m512 g = load_bf16x16(gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store_bf16x16(o + i, _mm512_mul_ps(round_bf16(s), load_bf16x16(up + i)));
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
