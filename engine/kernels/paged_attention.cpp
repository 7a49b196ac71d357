// Decode attention over the paged KV cache, reading each block where it lies.
//
// The torch path gathers every sequence's blocks into a padded copy and then reads the copy again in two
// batched matmuls: three passes over the context through DRAM. Here each (sequence, KV head) pair walks its
// blocks once, keys and values together, with an online softmax (running max and sum, as flash decoding
// does), sharing each block across the query heads of its group. All arithmetic is fp32 whatever the cache's
// dtype; the result is rounded to it once at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace lmgate {
void check_decode_tables(const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                         int64_t num_blocks);
}

namespace {

using Vec = at::vec::Vectorized<float>;

// A block's rows as fp32: in place for a float cache, converted into `buffer` otherwise.
template <typename scalar_t>
const float* as_float(const scalar_t* src, float* buffer, int64_t n) {
  at::vec::convert(src, buffer, n);
  return buffer;
}

template <>
const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

// Blocks lie scattered over the cache, so the hardware prefetcher, which stops at page boundaries, cannot
// see the next one coming; asking for it early hides most of the DRAM latency.
template <typename scalar_t>
void prefetch(const scalar_t* block, int64_t elems) {
  const char* bytes = reinterpret_cast<const char*>(block);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(scalar_t)); off += 64) {
    __builtin_prefetch(bytes + off);
  }
}

float reduce_sum(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, x);
}

// scores[t] = scale * (query . keys[t]) for `rows` keys of `n` elements. Four keys at a time, so that four
// chains of multiply-adds run side by side: one chain per key waits on each multiply-add before the next,
// and left the kernel bound by that latency at a third of the memory bandwidth.
void key_scores(const float* query, const float* keys, int64_t rows, int64_t n, float scale, float* scores) {
  int64_t t = 0;
  for (; t + 4 <= rows; t += 4) {
    const float* k = keys + t * n;
    Vec acc0(0.f), acc1(0.f), acc2(0.f), acc3(0.f);
    int64_t d = 0;
    for (; d + Vec::size() <= n; d += Vec::size()) {
      const Vec x = Vec::loadu(query + d);
      acc0 = at::vec::fmadd(x, Vec::loadu(k + d), acc0);
      acc1 = at::vec::fmadd(x, Vec::loadu(k + n + d), acc1);
      acc2 = at::vec::fmadd(x, Vec::loadu(k + 2 * n + d), acc2);
      acc3 = at::vec::fmadd(x, Vec::loadu(k + 3 * n + d), acc3);
    }
    float sums[4] = {reduce_sum(acc0), reduce_sum(acc1), reduce_sum(acc2), reduce_sum(acc3)};
    for (; d < n; ++d) {
      for (int64_t i = 0; i < 4; ++i) {
        sums[i] += query[d] * k[i * n + d];
      }
    }
    for (int64_t i = 0; i < 4; ++i) {
      scores[t + i] = sums[i] * scale;
    }
  }
  for (; t < rows; ++t) {
    const float* k = keys + t * n;
    Vec acc(0.f);
    int64_t d = 0;
    for (; d + Vec::size() <= n; d += Vec::size()) {
      acc = at::vec::fmadd(Vec::loadu(query + d), Vec::loadu(k + d), acc);
    }
    float sum = reduce_sum(acc);
    for (; d < n; ++d) {
      sum += query[d] * k[d];
    }
    scores[t] = sum * scale;
  }
}

// out[0:n] = out * scale + sum over rows t of weights[t] * x[t, 0:n]. Four accumulators per register's
// worth of columns, so that consecutive rows' multiply-adds do not wait on each other.
void scale_add_rows(float* out, float scale, const float* weights, const float* x, int64_t rows, int64_t n) {
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    Vec acc0 = Vec::loadu(out + d) * Vec(scale), acc1(0.f), acc2(0.f), acc3(0.f);
    int64_t t = 0;
    for (; t + 4 <= rows; t += 4) {
      acc0 = at::vec::fmadd(Vec(weights[t]), Vec::loadu(x + t * n + d), acc0);
      acc1 = at::vec::fmadd(Vec(weights[t + 1]), Vec::loadu(x + (t + 1) * n + d), acc1);
      acc2 = at::vec::fmadd(Vec(weights[t + 2]), Vec::loadu(x + (t + 2) * n + d), acc2);
      acc3 = at::vec::fmadd(Vec(weights[t + 3]), Vec::loadu(x + (t + 3) * n + d), acc3);
    }
    for (; t < rows; ++t) {
      acc0 = at::vec::fmadd(Vec(weights[t]), Vec::loadu(x + t * n + d), acc0);
    }
    ((acc0 + acc1) + (acc2 + acc3)).store(out + d);
  }
  for (; d < n; ++d) {
    float acc = out[d] * scale;
    for (int64_t t = 0; t < rows; ++t) {
      acc += weights[t] * x[t * n + d];
    }
    out[d] = acc;
  }
}

// Per-thread buffers of `attend_group`, sized once for a group of query heads.
struct AttentionScratch {
  std::vector<float> queries, acc, buffer, probs, running_max, running_sum;
  AttentionScratch(int64_t group, int64_t dim, int64_t block_size)
      : queries(group * dim), acc(group * dim), buffer(block_size * dim), probs(group * block_size),
        running_max(group), running_sum(group) {}
};

// The `group` query heads `q` [group, dim] of one sequence against its `len` tokens of one KV head, whose
// blocks `table` lists: out [group, dim] = softmax(scale * q K^T) V, walking the blocks once.
template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_head, const scalar_t* v_head, const int64_t* table, int64_t len,
            int64_t block_size, int64_t dim, int64_t group, float scale, scalar_t* out, AttentionScratch& s) {
  constexpr int64_t kAhead = 2;  // blocks prefetched ahead of the one in use
  const int64_t block_elems = block_size * dim, blocks = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < std::min(kAhead, blocks); ++b) {
    prefetch(k_head + table[b] * block_elems, block_elems);
    prefetch(v_head + table[b] * block_elems, block_elems);
  }
  at::vec::convert(q, s.queries.data(), group * dim);
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.running_max.begin(), s.running_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.running_sum.begin(), s.running_sum.end(), 0.f);

  for (int64_t b = 0; b < blocks; ++b) {
    if (b + kAhead < blocks) {
      prefetch(k_head + table[b + kAhead] * block_elems, block_elems);
      prefetch(v_head + table[b + kAhead] * block_elems, block_elems);
    }
    const int64_t rows = std::min(block_size, len - b * block_size);
    const float* keys = as_float(k_head + table[b] * block_elems, s.buffer.data(), rows * dim);
    for (int64_t g = 0; g < group; ++g) {
      key_scores(s.queries.data() + g * dim, keys, rows, dim, scale, s.probs.data() + g * block_size);
    }
    const float* values = as_float(v_head + table[b] * block_elems, s.buffer.data(), rows * dim);
    for (int64_t g = 0; g < group; ++g) {
      float* p = s.probs.data() + g * block_size;
      const float block_max =
          at::vec::reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, p, rows);
      const float new_max = std::max(s.running_max[g], block_max);
      const float rescale = std::exp(s.running_max[g] - new_max);  // 0 before the first block
      at::vec::map([new_max](Vec x) { return (x - Vec(new_max)).exp(); }, p, p, rows);
      s.running_sum[g] = s.running_sum[g] * rescale +
                         at::vec::reduce_all<float>([](Vec x, Vec y) { return x + y; }, p, rows);
      s.running_max[g] = new_max;
      scale_add_rows(s.acc.data() + g * dim, rescale, p, values, rows, dim);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / s.running_sum[g];
    float* a = s.acc.data() + g * dim;
    at::vec::map([inv](Vec x) { return x * Vec(inv); }, a, a, dim);
    at::vec::convert(a, out + g * dim, dim);
  }
}

template <typename scalar_t>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& lengths, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads, width = block_tables.size(1), head_elems = num_blocks * block_size * dim;
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();

  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    AttentionScratch scratch(group, dim, block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads, first = (seq * heads + head * group) * dim;
      attend(q_data + first, k_data + head * head_elems, v_data + head * head_elems, tables + seq * width, lens[seq],
             block_size, dim, group, static_cast<float>(scale), out_data + first, scratch);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be [tokens, heads, dim] and the caches [kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(0) == 0, "q and the caches disagree on shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(lengths.numel() == q.size(0), "one block table row and one length per query token");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && lengths.device().is_cpu(),
              "all inputs must be on the CPU");
  lmgate::check_decode_tables(block_tables, lengths, k_cache.size(2), k_cache.size(1));
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(q, k_cache, v_cache, block_tables, lengths, scale, out);
  });
  return out;
}

}  // namespace

namespace lmgate {

// Every block a decode row's length reaches must lie inside the cache: the kernels read them unchecked.
void check_decode_tables(const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                         int64_t num_blocks) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && lengths.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == lengths.numel(),
              "block_tables and lengths must be contiguous int64, one table row per length");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t i = 0; i < lengths.numel(); ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "length ", lens[i], " of row ", i,
                " is outside 1..", width * block_size, " (its block table's capacity)");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(tables[i * width + b] >= 0 && tables[i * width + b] < num_blocks, "block ",
                  tables[i * width + b], " of row ", i, " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

void attend_group(const float* q, const float* k_head, const float* v_head, const int64_t* table, int64_t len,
                  int64_t block_size, int64_t dim, int64_t group, float scale, float* out) {
  AttentionScratch scratch(group, dim, block_size);
  attend(q, k_head, v_head, table, len, block_size, dim, group, scale, out, scratch);
}

}  // namespace lmgate

TORCH_LIBRARY(lmgate, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmgate, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
