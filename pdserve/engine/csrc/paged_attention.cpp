// Single-query (decode) attention read straight out of the paged KV pool.
//
// The torch formulation gathers every sequence's blocks into a padded copy, permutes it for the matmul (a second
// copy), and only then reads it: three passes over the KV bytes plus padding. This kernel reads each K and V row
// once, in place, through the block table: one pass, no padding, no temporaries beyond one score row per head.
// Work is split over sequences (or runs of their KV heads) on torch's own OpenMP pool (at::parallel_for); the
// query heads that share a KV head (GQA) are served from the same K/V row loads. Scores, softmax and the accumulator are
// fp32 whatever the cache dtype, like the torch path it replaces.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
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
  const int64_t layer_off = layer * 2 * kv_stride;
  const T* kv_ptr = kv.data_ptr<T>();
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // A work item is one sequence and a run of its KV heads. Whole sequences (all heads) when there are enough of
  // them to keep every thread busy: each token's K (and V) row is then one contiguous run of bytes, which the
  // prefetchers stream; few long sequences (batch 1) are split by heads so every thread still has work.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = n_seq >= 2 * threads ? 1 : std::min<int64_t>(n_kv, (2 * threads + n_seq - 1) / n_seq);
  const int64_t heads_per_part = (n_kv + parts - 1) / parts;

  at::parallel_for(0, n_seq * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(n_heads * head_dim), acc(n_heads * head_dim), row(row_stride), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / parts, part = item % parts;
      const int64_t h0 = part * heads_per_part, h1 = std::min(n_kv, h0 + heads_per_part);
      if (h0 >= h1) continue;
      const int64_t nh = (h1 - h0) * group;  // query heads of this item
      const int64_t width = (h1 - h0) * head_dim;  // elements of a K/V row this item reads
      const int64_t len = len_ptr[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      const int64_t* table = table_ptr + s * max_blocks;
      const int64_t r = row_ptr[s];
      for (int64_t j = 0; j < nh; ++j) {
        const T* qh = q_ptr + r * q_row + (h0 * group + j) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) qf[j * head_dim + d] = static_cast<float>(qh[d]) * fscale;
      }
      scores.assign(nh * n, 0.f);
      auto row_at = [&](int64_t p, int64_t which) {
        return kv_ptr + table[p / block_size] * block_stride + layer_off + which * kv_stride +
               (p % block_size) * row_stride + h0 * head_dim;
      };
      // Pass 1: scores = q . k for every visible position; each K row is loaded once for all its query heads.
      for (int64_t p = first; p < len; ++p) {
        if (p + block_size < len) __builtin_prefetch(row_at(p + block_size, 0));  // same row, next block
        to_float(row_at(p, 0), row.data(), width);
        for (int64_t j = 0; j < nh; ++j) {
          const float* qj = qf.data() + j * head_dim;
          const float* kj = row.data() + (j / group) * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * kj[d];
          scores[j * n + (p - first)] = dot;
        }
      }
      // Softmax per query head (fp32, max-subtracted).
      for (int64_t j = 0; j < nh; ++j) {
        float* sc = scores.data() + j * n;
        float mx = sc[0];  // n >= 1: context_lens are checked to be positive
        for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sc[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sc[i] = std::exp(sc[i] - mx);
          sum += sc[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sc[i] *= inv;
      }
      // Pass 2: out = sum_p prob_p * v_p.
      std::fill(acc.begin(), acc.begin() + nh * head_dim, 0.f);
      for (int64_t p = first; p < len; ++p) {
        if (p + block_size < len) __builtin_prefetch(row_at(p + block_size, 1));
        to_float(row_at(p, 1), row.data(), width);
        for (int64_t j = 0; j < nh; ++j) {
          const float w = scores[j * n + (p - first)];
          const float* vj = row.data() + (j / group) * head_dim;
          float* a = acc.data() + j * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * vj[d];
        }
      }
      for (int64_t j = 0; j < nh; ++j) {
        T* oh = out_ptr + r * o_row + (h0 * group + j) * o_head;
        for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<T>(acc[j * head_dim + d]);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV pool");
}
