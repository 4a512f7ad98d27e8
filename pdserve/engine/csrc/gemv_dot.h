// The dot products under the native decode GEMVs, shared by weight_gemv.cpp (one projection) and
// moe_experts.cpp (a layer's experts): a weight row widened to fp32 in registers (int8, bf16 or fp32 as stored)
// against up to kRowGroup fp32 activation rows, the batch-1 shape with software prefetch (dot_rows_w), and
// bf16 x bf16 with vdpbf16ps on AVX512-BF16 (dot_rows_dp). Why each shape is what it is: the comments below.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace pdserve::gemv {

constexpr int64_t kRowGroup = 4;  // activation rows sharing one widened weight vector

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec widen(const c10::BFloat16* p) { return pdserve::load_bf16(p); }
inline vec widen(const float* p) { return vload(p); }
#define PDSERVE_GEMV_SIMD 1
#elif defined(PDSERVE_AVX2)
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec v) { return pdserve::reduce_add8(v); }
inline vec widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec widen(const c10::BFloat16* p) { return pdserve::load_bf16_8(p); }
inline vec widen(const float* p) { return vload(p); }
#define PDSERVE_GEMV_SIMD 1
#endif

// How far ahead of the weight row being read the GEMVs prefetch (see dot_rows_w and dot_rows_dp below).
constexpr int64_t kPrefetchBytes = 2048;

inline float to_f(int8_t v) { return static_cast<float>(v); }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(float v) { return v; }

// dots[r] = x[r] . w for the R (<= kRowGroup) activation rows starting at x (row stride k). C independent chains
// per row: an FMA's 4-cycle latency would otherwise cap a single row at ~1 vector a cycle, below the bandwidth
// of one core (4 chains for R = 1, 2 for the rest: R * C accumulators stay within 16 vector registers on AVX2).
template <typename W, int64_t R>
inline void dot_rows(float* dots, const float* x, const W* w, int64_t k) {
  int64_t i = 0;
#if defined(PDSERVE_GEMV_SIMD)
  constexpr int64_t C = R == 1 ? 4 : 2;
  vec acc[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) acc[r][c] = vzero();
  for (; i + C * kLanes <= k; i += C * kLanes) {
    // the weight row's stream 2 KiB ahead, every line of it (see kPrefetchBytes): rows are contiguous, so this
    // runs on into the next row; a stack of expert rows read one at a time reads ~1.2-2.8x faster with it
    for (int64_t b = 0; b < C * kLanes * int64_t(sizeof(W)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes + b, _MM_HINT_T0);
    vec wv[C];
    for (int64_t c = 0; c < C; ++c) wv[c] = widen(w + i + c * kLanes);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) acc[r][c] = vfma(vload(x + r * k + i + c * kLanes), wv[c], acc[r][c]);
  }
  for (; i + kLanes <= k; i += kLanes) {  // what is left in whole vectors
    const vec wv = widen(w + i);
    for (int64_t r = 0; r < R; ++r) acc[r][0] = vfma(vload(x + r * k + i), wv, acc[r][0]);
  }
  for (int64_t r = 0; r < R; ++r) {
    vec t = acc[r][0];
    for (int64_t c = 1; c < C; ++c) t = vadd(t, acc[r][c]);
    dots[r] = vsum(t);
  }
#else
  for (int64_t r = 0; r < R; ++r) dots[r] = 0.f;
#endif
  for (; i < k; ++i) {
    const float wv = to_f(w[i]);
    for (int64_t r = 0; r < R; ++r) dots[r] += x[r * k + i] * wv;
  }
}

// Batch 1: kBatch1Rows weight rows at once, dots[j] = x . w[j] for j < kBatch1Rows (rows k apart), with a software
// prefetch 2 KiB ahead in each row, once per cache line. One core's DRAM bandwidth is set by how many cache-line
// misses it keeps in flight: one row at a time without prefetch read ~5 GB/s where MKL's fp32 GEMV read ~11.
// The best shape differs by machine, and the build's ISA is what tells them apart here:
// - AVX-512 build, measured on a Sapphire Rapids class Xeon (the 124M bench model's projections, 1 thread): two
//   rows, two vectors each per iteration, read int8 weights at 9.4-9.9 GB/s where four rows with the prefetch
//   1 KiB ahead (issued every iteration) read 7.7-8.1 GB/s; bf16 weights read the same either way (~10 GB/s).
// - AVX2 build, measured on an AMD EPYC (Zen 3; all the bench model's projections and lm_head, 2 threads, from
//   DRAM): one row, one cache line per iteration (8 vectors of int8, 4 of bf16) took int8 from 7.0-8.0 ms to
//   5.2-6.5 ms a pass and bf16 from 13.4-14.2 to 11.2-11.7 ms; two rows of a line each, or half a line, were
//   slower, and the prefetch distance mattered less (1-3 KiB within 5%).
// - AVX-512 build on an AMD EPYC (Zen 4, 2 threads, bf16 rows of 768 from DRAM): two adjacent rows at once read
//   17-20 GB/s, one row at a time 38-41 GB/s (a plain read of the same bytes: 28-33). Zen's prefetchers follow one
//   sequential stream; two rows 1.5 KiB apart, touched alternately, look like none. So AMD builds (kernels.py
//   passes PDSERVE_CPU_AMD) take the AVX2 build's shape: one row, one cache line per iteration.
#if defined(__AVX512F__) && defined(PDSERVE_CPU_AMD)
constexpr int64_t kBatch1Rows = 1;
template <typename W>
constexpr int64_t batch1_vecs() { return 64 / (kLanes * int64_t(sizeof(W))); }  // one cache line
#elif defined(__AVX512F__)
constexpr int64_t kBatch1Rows = 2;
template <typename W>
constexpr int64_t batch1_vecs() { return 2; }
#elif defined(PDSERVE_AVX2)
constexpr int64_t kBatch1Rows = 1;
template <typename W>
constexpr int64_t batch1_vecs() { return 64 / (kLanes * int64_t(sizeof(W))); }  // one cache line
#else  // scalar build: the loop below is the tail loop only
constexpr int64_t kBatch1Rows = 2;
#endif

template <typename W>
inline void dot_rows_w(float* dots, const float* x, const W* w, int64_t k) {
  int64_t i = 0;
#if defined(PDSERVE_GEMV_SIMD)
  constexpr int64_t V = batch1_vecs<W>();
  constexpr int64_t kStep = V * kLanes;  // elements per iteration and row
  constexpr int64_t kLine = 64 / (kStep * sizeof(W)) > 0 ? 64 / (kStep * sizeof(W)) : 1;  // iterations a line
  vec a[kBatch1Rows][V];
  for (int r = 0; r < kBatch1Rows; ++r)
    for (int v = 0; v < V; ++v) a[r][v] = vzero();
  for (int64_t it = 0; i + kStep <= k; i += kStep, ++it) {
    vec xv[V];
    for (int v = 0; v < V; ++v) xv[v] = vload(x + i + v * kLanes);
    for (int r = 0; r < kBatch1Rows; ++r) {
      const W* wr = w + r * k + i;
      if (it % kLine == 0) _mm_prefetch(reinterpret_cast<const char*>(wr) + kPrefetchBytes, _MM_HINT_T0);
      for (int v = 0; v < V; ++v) a[r][v] = vfma(xv[v], widen(wr + v * kLanes), a[r][v]);
    }
  }
  for (int r = 0; r < kBatch1Rows; ++r) {
    vec t = a[r][0];
    for (int v = 1; v < V; ++v) t = vadd(t, a[r][v]);
    dots[r] = vsum(t);
  }
#else
  for (int r = 0; r < kBatch1Rows; ++r) dots[r] = 0.f;
#endif
  for (; i < k; ++i)
    for (int r = 0; r < kBatch1Rows; ++r) dots[r] += x[i] * to_f(w[r * k + i]);
}

#if defined(__AVX512BF16__)
// Small batches with bf16 activations and bf16 weights (a bf16 model on an AVX512-BF16 CPU): vdpbf16ps multiplies
// the bf16 pairs as they are and accumulates in fp32, so neither side is widened and a cache line of weights is one
// instruction per activation row. One weight row at a time, two lines per iteration, shared by R activation rows.
// Measured on an AMD EPYC (Zen 4, 2 threads; the bench model's projections + lm_head, a step's 49 calls) at one
// row: 7.0-7.7 ms against 8.6-9.3 ms widening to fp32 FMAs, and 11.6-13.6 ms through oneDNN's prepacked linear.
template <int64_t R>
inline void dot_rows_dp(float* dots, const c10::BFloat16* x, const c10::BFloat16* w, int64_t k) {
  __m512 a[R][2];
  for (int64_t r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
    for (int64_t r = 0; r < R; ++r) {
      a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512(x + r * k + i), w0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_loadu_si512(x + r * k + i + 32), w1);
    }
  }
  for (; i + 32 <= k; i += 32) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i);
    for (int64_t r = 0; r < R; ++r)
      a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512(x + r * k + i), w0);
  }
  for (int64_t r = 0; r < R; ++r) {
    float dot = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
    for (int64_t j = i; j < k; ++j) dot += static_cast<float>(x[r * k + j]) * static_cast<float>(w[j]);
    dots[r] = dot;
  }
}

#endif

}  // namespace pdserve::gemv
