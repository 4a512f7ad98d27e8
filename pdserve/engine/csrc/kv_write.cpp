// A step's new K/V rows stored into the paged pool: one call per layer instead of torch's index arithmetic and two
// index_copy_ (five small ops, each paying dispatch and, for index_copy_, an OpenMP fork: ~0.15 ms a layer at
// batch 1 on a 2-core AMD EPYC, a tenth of the step). The rows are a few hundred bytes each: a plain memcpy loop
// on the calling thread is what they need.
#include <ATen/core/Tensor.h>

#include <cstring>
#include <stdexcept>

// kv [num_blocks, layers, 2, block_size, KVH, D] (contiguous); k, v [T, KVH, D] in kv's dtype with each token's
// KVH * D values contiguous (row stride free: they are views into the fused qkv output); slot_blocks and
// slot_offsets [T] int64: token t goes to (slot_blocks[t], layer, K|V, slot_offsets[t]).
void write_kv(at::Tensor kv, int64_t layer, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
              const at::Tensor& k, const at::Tensor& v) {
  if (kv.dim() != 6 || !kv.is_contiguous() || k.dim() != 3 || v.dim() != 3 || k.sizes() != v.sizes())
    throw std::invalid_argument("write_kv: want a contiguous 6-d pool and k, v [T, KVH, D]");
  if (k.scalar_type() != kv.scalar_type() || v.scalar_type() != kv.scalar_type())
    throw std::invalid_argument("write_kv: k and v must have the pool's dtype");
  const int64_t n = kv.size(0), layers = kv.size(1), bs = kv.size(3), t_rows = k.size(0);
  const int64_t row = kv.size(4) * kv.size(5);
  if (k.size(1) != kv.size(4) || k.size(2) != kv.size(5))
    throw std::invalid_argument("write_kv: k's heads and head size must match the pool's");
  for (const at::Tensor* x : {&k, &v})
    if (x->stride(2) != 1 || x->stride(1) != x->size(2))
      throw std::invalid_argument("write_kv: each token's K/V values must be contiguous");
  if (layer < 0 || layer >= layers) throw std::invalid_argument("write_kv: layer out of range");
  if (slot_blocks.scalar_type() != at::kLong || slot_offsets.scalar_type() != at::kLong ||
      !slot_blocks.is_contiguous() || !slot_offsets.is_contiguous() || slot_blocks.numel() != t_rows ||
      slot_offsets.numel() != t_rows)
    throw std::invalid_argument("write_kv: slot_blocks and slot_offsets must be contiguous int64 [T]");
  const int64_t esz = kv.element_size(), bytes = row * esz;
  const int64_t* blk = slot_blocks.data_ptr<int64_t>();
  const int64_t* off = slot_offsets.data_ptr<int64_t>();
  char* pool = static_cast<char*>(kv.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * esz, vs = v.stride(0) * esz;
  for (int64_t t = 0; t < t_rows; ++t) {
    if (blk[t] < 0 || blk[t] >= n || off[t] < 0 || off[t] >= bs)
      throw std::invalid_argument("write_kv: slot out of range");
    const int64_t r = ((blk[t] * layers + layer) * 2) * bs + off[t];  // K row; V is block_size rows on
    std::memcpy(pool + r * bytes, kp + t * ks, bytes);
    std::memcpy(pool + (r + bs) * bytes, vp + t * vs, bytes);
  }
}
