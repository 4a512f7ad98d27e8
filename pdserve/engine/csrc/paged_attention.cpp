// Single-query (decode) attention read straight out of the paged KV pool.
//
// The torch formulation gathers every sequence's blocks into a padded copy, permutes it for the matmul (a second
// copy), and only then reads it: three passes over the KV bytes plus padding. This kernel reads each K and V row
// once, in place, through the block table: one pass, no padding, no temporaries beyond one score row per head.
// Work is split over sequences (or runs of their KV heads) on torch's own OpenMP pool (at::parallel_for); the
// query heads that share a KV head (GQA) are served from the same K/V row loads. Scores, softmax and the accumulator are
// fp32 whatever the cache dtype, like the torch path it replaces.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include "simd.h"
#include <vector>

#ifndef PDSERVE_PREFETCH_BLOCKS
#define PDSERVE_PREFETCH_BLOCKS 1
#endif

namespace {

// Calls f(i, row) for positions first..len-1 (i = position - first) with a pointer to that position's row of
// one head, walking the block table block by block (no division per position), and prefetching the next block's
// rows while the current one is consumed: consecutive blocks are far apart in the pool.
template <typename T, typename F>
inline void for_each_row(const T* head_base, const int64_t* table, int64_t block_stride, int64_t row_stride,
                         int64_t block_size, int64_t row_bytes, int64_t first, int64_t len, F&& f) {
  constexpr int64_t kAhead = PDSERVE_PREFETCH_BLOCKS;
  const int64_t row_step = row_stride * static_cast<int64_t>(sizeof(T));
  const int64_t last_block = (len - 1) / block_size;
  int64_t p = first;
  while (p < len) {
    const int64_t b = p / block_size;
    const int64_t stop = std::min(len, (b + 1) * block_size);
    // Row o of the block kAhead ahead is prefetched while row o of this one is consumed: the hardware
    // prefetchers cannot follow the jump between blocks, and one row at a time keeps few misses in flight.
    const char* ahead = b + kAhead <= last_block
        ? reinterpret_cast<const char*>(head_base + table[b + kAhead] * block_stride) : nullptr;
    const T* base = head_base + table[b] * block_stride;
    for (int64_t o = p - b * block_size; p < stop; ++o, ++p) {
      if (ahead)
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + o * row_step + off);
      f(p - first, base + o * row_stride);
    }
  }
}

struct Walk {  // where one head's K (or V) rows of one sequence live
  int64_t block_stride, row_stride, block_size, row_bytes, first, len;
};

// Generic (any dtype, head_dim, group): scores[(h * group + g) * n + i] = q_hg . k_hi, then
// acc_hg = sum_i p_hgi v_hi, for the item's `heads` KV heads read from each token's row in one go.
template <typename T>
void attend_generic(const float* qf, int64_t heads, int64_t group, int64_t d, const T* k_base, const T* v_base,
                    const int64_t* table, const Walk& w, float* scores, float* acc, float* tmp);

// Softmax of each of `rows` score rows of length n, in place.
void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t j = 0; j < rows; ++j) pdserve::softmax_inplace(scores + j * n, n);  // n >= 1: lens are checked
}

#if defined(__AVX512F__)
// bf16 with head_dim % 16 == 0: 16 elements widened to fp32 per instruction pair, the group's accumulators in
// registers (G is a template parameter so they can be), one horizontal sum per score.
template <int G>
void scores_bf16(const float* qf, int64_t heads, int64_t d, const c10::BFloat16* base, const int64_t* table,
                 const Walk& w, float* scores) {
  const int64_t n = w.len - w.first;
  for_each_row(base, table, w.block_stride, w.row_stride, w.block_size, w.row_bytes, w.first, w.len,
               [&](int64_t i, const c10::BFloat16* k) {
                 for (int64_t h = 0; h < heads; ++h) {
                   const float* qh = qf + h * G * d;
                   __m512 acc[G];
                   for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
                   for (int64_t c = 0; c < d; c += 16) {
                     const __m512 kc = pdserve::load_bf16(k + h * d + c);
                     for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * d + c), kc, acc[g]);
                   }
                   for (int g = 0; g < G; ++g) scores[(h * G + g) * n + i] = _mm512_reduce_add_ps(acc[g]);
                 }
               });
}

template <int G>
void accumulate_bf16(const float* scores, int64_t heads, int64_t d, const c10::BFloat16* base,
                     const int64_t* table, const Walk& w, float* out) {
  const int64_t n = w.len - w.first;
  std::fill(out, out + heads * G * d, 0.f);
  for_each_row(base, table, w.block_stride, w.row_stride, w.block_size, w.row_bytes, w.first, w.len,
               [&](int64_t i, const c10::BFloat16* v) {
                 for (int64_t h = 0; h < heads; ++h) {
                   __m512 p[G];
                   for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[(h * G + g) * n + i]);
                   for (int64_t c = 0; c < d; c += 16) {
                     const __m512 vc = pdserve::load_bf16(v + h * d + c);
                     for (int g = 0; g < G; ++g) {
                       float* o = out + (h * G + g) * d + c;
                       _mm512_storeu_ps(o, _mm512_fmadd_ps(p[g], vc, _mm512_loadu_ps(o)));
                     }
                   }
                 }
               });
}

template <int G>
void attend_bf16(const float* qf, int64_t heads, int64_t d, const c10::BFloat16* k_base,
                 const c10::BFloat16* v_base, const int64_t* table, const Walk& w, float* scores, float* acc) {
  scores_bf16<G>(qf, heads, d, k_base, table, w, scores);
  softmax_rows(scores, heads * G, w.len - w.first);
  accumulate_bf16<G>(scores, heads, d, v_base, table, w, acc);
}
#endif

#if defined(PDSERVE_AVX2)
// AVX2 builds (no AVX-512), fp32 and bf16 caches with head_dim % 8 == 0: the group's query
// heads against each K row from registers, one horizontal sum per score, as attend_bf16 does with 16. The generic
// loop it replaces took 72 us a layer at 256 tokens of context with the KV in cache (bench model shapes, 1 thread,
// AMD EPYC Zen 3): its per-element dot products and accumulator traffic, not the memory, were the cost.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return pdserve::load_bf16_8(p); }

template <int G, typename T>
void attend8(const float* qf, int64_t heads, int64_t d, const T* k_base, const T* v_base, const int64_t* table,
             const Walk& w, float* scores, float* out) {
  const int64_t n = w.len - w.first;
  for_each_row(k_base, table, w.block_stride, w.row_stride, w.block_size, w.row_bytes, w.first, w.len,
               [&](int64_t i, const T* k) {
                 for (int64_t h = 0; h < heads; ++h) {
                   const float* qh = qf + h * G * d;
                   __m256 acc[G];
                   for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
                   for (int64_t c = 0; c < d; c += 8) {
                     const __m256 kc = load8(k + h * d + c);
                     for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * d + c), kc, acc[g]);
                   }
                   for (int g = 0; g < G; ++g) scores[(h * G + g) * n + i] = pdserve::reduce_add8(acc[g]);
                 }
               });
  softmax_rows(scores, heads * G, n);
  std::fill(out, out + heads * G * d, 0.f);
  for_each_row(v_base, table, w.block_stride, w.row_stride, w.block_size, w.row_bytes, w.first, w.len,
               [&](int64_t i, const T* v) {
                 for (int64_t h = 0; h < heads; ++h) {
                   __m256 p[G];
                   for (int g = 0; g < G; ++g) p[g] = _mm256_set1_ps(scores[(h * G + g) * n + i]);
                   for (int64_t c = 0; c < d; c += 8) {
                     const __m256 vc = load8(v + h * d + c);
                     for (int g = 0; g < G; ++g) {
                       float* o = out + (h * G + g) * d + c;
                       _mm256_storeu_ps(o, _mm256_fmadd_ps(p[g], vc, _mm256_loadu_ps(o)));
                     }
                   }
                 }
               });
}
#endif

template <typename T>
void attend_generic(const float* qf, int64_t heads, int64_t group, int64_t d, const T* k_base, const T* v_base,
                    const int64_t* table, const Walk& w, float* scores, float* acc, float* tmp) {
  const int64_t n = w.len - w.first, width = heads * d;
  for_each_row(k_base, table, w.block_stride, w.row_stride, w.block_size, w.row_bytes, w.first, w.len,
               [&](int64_t i, const T* k) {
                 for (int64_t e = 0; e < width; ++e) tmp[e] = static_cast<float>(k[e]);
                 for (int64_t j = 0; j < heads * group; ++j) {
                   const float* kj = tmp + (j / group) * d;
                   float dot = 0.f;
                   for (int64_t e = 0; e < d; ++e) dot += qf[j * d + e] * kj[e];
                   scores[j * n + i] = dot;
                 }
               });
  softmax_rows(scores, heads * group, n);
  std::fill(acc, acc + heads * group * d, 0.f);
  for_each_row(v_base, table, w.block_stride, w.row_stride, w.block_size, w.row_bytes, w.first, w.len,
               [&](int64_t i, const T* v) {
                 for (int64_t e = 0; e < width; ++e) tmp[e] = static_cast<float>(v[e]);
                 for (int64_t j = 0; j < heads * group; ++j) {
                   const float p = scores[j * n + i];
                   const float* vj = tmp + (j / group) * d;
                   for (int64_t e = 0; e < d; ++e) acc[j * d + e] += p * vj[e];
                 }
               });
}

// Calls fn(std::integral_constant<int, G>{}) for G = group in 1..8, so a kernel can keep the group's accumulators in
// registers; false (nothing called) for other groups.
template <typename Fn>
bool with_group(int64_t group, Fn&& fn) {
  switch (group) {
    case 1: fn(std::integral_constant<int, 1>{}); return true;
    case 2: fn(std::integral_constant<int, 2>{}); return true;
    case 3: fn(std::integral_constant<int, 3>{}); return true;
    case 4: fn(std::integral_constant<int, 4>{}); return true;
    case 5: fn(std::integral_constant<int, 5>{}); return true;
    case 6: fn(std::integral_constant<int, 6>{}); return true;
    case 7: fn(std::integral_constant<int, 7>{}); return true;
    case 8: fn(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

// The KV heads [h0, h0 + heads) of one sequence: their query heads' outputs into acc ([heads * group, d] fp32).
// Rows are walked token by token, each token's K (then V) bytes of all these heads being one contiguous run.
template <typename T>
void attend_item(const float* qf, int64_t heads, int64_t group, int64_t d, const T* k_base, const T* v_base,
                 const int64_t* table, const Walk& w, float* scores, float* acc, float* tmp) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (d % 16 == 0 && with_group(group, [&](auto g) {
          attend_bf16<decltype(g)::value>(qf, heads, d, k_base, v_base, table, w, scores, acc);
        }))
      return;
  }
#endif
#if defined(PDSERVE_AVX2)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (d % 8 == 0 && with_group(group, [&](auto g) {
          attend8<decltype(g)::value>(qf, heads, d, k_base, v_base, table, w, scores, acc);
        }))
      return;
  }
#endif
  attend_generic<T>(qf, heads, group, d, k_base, v_base, table, w, scores, acc, tmp);
}

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                           const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                           double scale, int64_t sliding_window) {
  const int64_t n_seq = rows.size(0);
  const int64_t n_heads = q.size(1), head_dim = q.size(2);
  const int64_t n_layers = kv.size(1), block_size = kv.size(3), n_kv = kv.size(4);
  const int64_t group = n_heads / n_kv;
  const int64_t max_blocks = block_tables.size(1);
  // Element strides of the pool [blocks, layers, 2, block_size, kv_heads, head_dim] (contiguous).
  const int64_t row_stride = n_kv * head_dim;                // one token inside a block: all its KV heads
  const int64_t kv_stride = block_size * row_stride;         // K -> V of one (block, layer)
  const int64_t block_stride = n_layers * 2 * kv_stride;     // one block
  const T* layer_base = kv.data_ptr<T>() + layer * 2 * kv_stride;
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // A work item is one sequence and a run of its KV heads: whole sequences when there are enough to keep every
  // thread busy, otherwise (few long sequences, batch 1) split by heads so every thread still has work.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = n_seq >= 2 * threads ? 1 : std::min<int64_t>(n_kv, (2 * threads + n_seq - 1) / n_seq);
  const int64_t heads_per_part = (n_kv + parts - 1) / parts;

  at::parallel_for(0, n_seq * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(n_heads * head_dim), acc(n_heads * head_dim), tmp(row_stride), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / parts, part = item % parts;
      const int64_t h0 = part * heads_per_part, h1 = std::min(n_kv, h0 + heads_per_part);
      if (h0 >= h1) continue;
      const int64_t heads = h1 - h0, nq = heads * group;  // KV heads / query heads of this item
      const int64_t len = len_ptr[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const Walk w{block_stride, row_stride, block_size, heads * head_dim * static_cast<int64_t>(sizeof(T)), first,
                   len};
      const int64_t r = row_ptr[s];
      for (int64_t j = 0; j < nq; ++j) {
        const T* qh = q_ptr + r * q_row + (h0 * group + j) * q_head;
        for (int64_t e = 0; e < head_dim; ++e) qf[j * head_dim + e] = static_cast<float>(qh[e]) * fscale;
      }
      scores.resize(nq * (len - first));
      attend_item<T>(qf.data(), heads, group, head_dim, layer_base + h0 * head_dim,
                     layer_base + kv_stride + h0 * head_dim, table_ptr + s * max_blocks, w, scores.data(),
                     acc.data(), tmp.data());
      for (int64_t j = 0; j < nq; ++j) {
        T* oh = out_ptr + r * o_row + (h0 * group + j) * o_head;
        for (int64_t e = 0; e < head_dim; ++e) oh[e] = static_cast<T>(acc[j * head_dim + e]);
      }
    }
  });
}

}  // namespace

// out[rows[i]] = softmax(q[rows[i]] . K_i^T * scale) V_i for the K/V of sequence i read through block_tables[i]
// (its first context_lens[i] positions, or the last `sliding_window` of them when > 0).
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, int64_t sliding_window) {
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 6, "kv pool must be a contiguous 6-d tensor");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a unit stride on head_dim");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && out.scalar_type() == kv.scalar_type(),
              "q, out and kv must share a dtype");
  TORCH_CHECK(q.size(2) == kv.size(5) && q.size(1) % kv.size(4) == 0, "head shapes of q and kv disagree");
  TORCH_CHECK(rows.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "rows, block_tables and context_lens must be int64");
  TORCH_CHECK(rows.is_contiguous() && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "index tensors must be contiguous");
  TORCH_CHECK(layer >= 0 && layer < kv.size(1), "layer out of range");
  TORCH_CHECK(block_tables.size(0) == rows.size(0) && context_lens.size(0) == rows.size(0),
              "rows, block_tables and context_lens disagree on the number of sequences");
  // Bounds are checked here, once, so the kernel can never read outside the pool or write outside `out`.
  const int64_t* t = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < kv.size(0), "block id out of range");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* l = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < q.size(0), "row out of range");
    TORCH_CHECK(l[i] >= 1 && l[i] <= block_tables.size(1) * kv.size(3), "context length out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(out, q, kv, layer, rows, block_tables, context_lens, scale, sliding_window);
  });
}
