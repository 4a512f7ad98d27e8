// Helpers shared by the native kernels: bf16 loads/stores and exp for AVX-512 (16 lanes) and for AVX2 + FMA
// (8 lanes, suffix 8), and an fp32 softmax vectorised with whichever the build targets (plain C++ otherwise).
// The build target is -march=native, lowered by PDSERVE_CPU_ISA (kernels.py), so both paths are testable here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace pdserve {

// 16 bf16 values widened to fp32 (bf16 is the upper half of an fp32: a shift).
inline __m512 load_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> bf16 bits (in the low halves) with round-to-nearest-even, as torch converts; inputs are finite here.
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}

inline __m512 round_bf16(__m512 v) {  // v rounded to the nearest bf16, kept as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16_bits(v), 16));
}

inline void store_bf16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16_bits(v)));
}

// e^x, 16 lanes, x clamped to fp32's range: Cephes' expf range reduction and polynomial (relative error ~2e-7,
// like libm's expf), 2^n applied by scalef. Scalar std::exp was most of the attention kernel's time.
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

}  // namespace pdserve
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PDSERVE_AVX2 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace pdserve {

inline __m256 load_bf16_8(const c10::BFloat16* p) {  // 8 bf16 widened to fp32 by a shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256i round_bf16_bits_8(__m256 v) {  // round-to-nearest-even, as torch converts (finite inputs)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}

inline __m256 round_bf16_8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_bits_8(v), 16));
}

inline void store_bf16_8(c10::BFloat16* p, __m256 v) {
  const __m256i b = round_bf16_bits_8(v);  // 8 x u32 holding u16 values: pack to 8 x u16 in lane order
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// e^x, 8 lanes: the AVX-512 exp_ps's Cephes reduction and polynomial; 2^n built in the exponent bits (n is in
// [-126, 127] after the clamp, so no scalef is needed).
inline __m256 exp_ps8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pdserve
#endif

namespace pdserve {

// The ISA this build targets (after PDSERVE_CPU_ISA's cap), as cpu_isa.LEVELS names it.
inline const char* compiled_isa() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return "amx";
#elif defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(PDSERVE_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// Softmax of n >= 1 fp32 scores in place (max-subtracted).
inline void softmax_inplace(float* sc, int64_t n) {
  float mx = sc[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sc[i]);
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + i), vmx));
    _mm512_storeu_ps(sc + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(PDSERVE_AVX2)
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), vmx));
    _mm256_storeu_ps(sc + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = reduce_add8(vsum);
#endif
  for (; i < n; ++i) {
    sc[i] = std::exp(sc[i] - mx);
    sum += sc[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < n; ++i) sc[i] *= inv;
}

}  // namespace pdserve
