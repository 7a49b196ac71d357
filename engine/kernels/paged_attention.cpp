// Decode and prefill attention over the paged KV cache, reading each block where it lies.
//
// The torch path gathers every sequence's blocks into a padded copy and then reads the copy again in two
// batched matmuls: three passes over the context through DRAM. Here each (sequence, KV head) pair reads its
// key blocks once, then its value blocks once, sharing each block across the query heads of its group (in
// register tiles on AVX2); a prefill chunk does the same per tile of queries, up to the tile's causal limit.
// All arithmetic is fp32 whatever the cache's dtype; the result is rounded to q's once at the end. q may be
// float32 over a 16-bit cache (`--kv-cache-dtype`): half the bytes to read. The softmax's exponentials are
// ATen's exp_u20 (within 20 ULP; Sleef's exp, within 1, took 8% of a prefill chunk's time more).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

// The register tiles below: AVX2 with FMA, and F16C to widen a float16 cache as it is loaded.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMGATE_ATTENTION_TILES 1
#endif

namespace lmgate {
void check_decode_tables(const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                         int64_t num_blocks);
}

namespace {

using Vec = at::vec::Vectorized<float>;

// A part of a block's rows as fp32, for the loops that read only float32 (the register tiles widen a 16-bit
// cache as they load it, `load8`): in place for a float cache, converted into `buffer` otherwise. A part at a
// time, as it is used, so that the reads interleave with the next block's prefetches. A float16 decode over
// 64 sequences x 192 tokens on a 2-core Zen 4 read 11 GB/s widening whole blocks into the buffer, 15.5 in
// parts, 17.5 with the tiles loading the cache itself.
template <typename scalar_t>
const float* as_float(const scalar_t* src, float* buffer, int64_t n) {
  at::vec::convert(src, buffer, n);
  return buffer;
}

template <>
const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

#if defined(__F16C__)
// ATen's Half-to-float conversion runs one value at a time; F16C widens eight per instruction, which made a
// float16 cache faster to read than a float32 one instead of slower.
template <>
const float* as_float<c10::Half>(const c10::Half* src, float* buffer, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(buffer + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) buffer[i] = static_cast<float>(src[i]);
  return buffer;
}
#endif

// Asks for the cache lines of bytes [from, to) of `block`, into L2 (prefetcht1): requests into L1 hold its few
// miss buffers, which the loads of the block in use need too. A 64-sequence decode over 30 layers' caches on a
// 2-core Zen 4 read 14-20 GB/s with prefetcht0 and 22-29 with prefetcht1 (a sum over memory: 28).
void prefetch(const void* block, int64_t from, int64_t to) {
  for (int64_t off = from; off < to; off += 64) __builtin_prefetch(static_cast<const char*>(block) + off, 0, 2);
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

// out[0:n] += sum over rows t of weights[t] * x[t, 0:n]. Four accumulators per register's worth of columns,
// so that consecutive rows' multiply-adds do not wait on each other.
void add_rows(float* out, const float* weights, const float* x, int64_t rows, int64_t n) {
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    Vec acc0 = Vec::loadu(out + d), acc1(0.f), acc2(0.f), acc3(0.f);
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
    float acc = out[d];
    for (int64_t t = 0; t < rows; ++t) {
      acc += weights[t] * x[t * n + d];
    }
    out[d] = acc;
  }
}

// Per-thread buffers of `attend`, grown to the largest tile and longest context seen.
struct AttentionScratch {
  std::vector<float> queries, acc, buffer, inv_sums, probs;
  void reserve(int64_t vectors, int64_t dim, int64_t len, int64_t block_size) {
    const auto grow = [](std::vector<float>& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(queries, vectors * dim);
    grow(acc, vectors * dim);
    grow(buffer, block_size * dim);  // a block converted from a 16-bit cache
    grow(inv_sums, vectors);
    grow(probs, vectors * len);
  }
};

#ifdef LMGATE_ATTENTION_TILES
constexpr int kTileHeads = 3;  // query heads per register tile: 3 x 4 accumulators, 12 of AVX2's 16 registers

// The four sums of a0 .. a3's lanes, in order (a horizontal sum each would cost four times the shuffles).
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Eight of a cache's values as fp32 in a register: a 16-bit cache is widened as it is loaded (float16 by
// F16C, bfloat16 by a shift), with no pass through a buffer.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// acc[i] += x * y[i] for four vectors: one operand of a tile shared by four independent chains.
inline void fma4(__m256 x, const __m256 y[4], __m256 acc[4]) {
  for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(x, y[i], acc[i]);
}

// scores[g * stride + i] = scale * (q[g] . k_i) for G query heads and four keys of `dim` elements: each key
// vector is loaded once for the G heads, and the G x 4 sums are reduced together. Four key pointers, not a
// base and a count, keep the tile's accumulators in registers: an array of pointers clamped to a short tail
// made GCC keep them on the stack (130 against 95 ns for 16 keys x 3 heads on a Zen 3).
template <int G, typename T>
inline void score_tile(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t dim, float scale,
                       float* scores, int64_t stride) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 kd[4] = {load8(k0 + d), load8(k1 + d), load8(k2 + d), load8(k3 + d)};
    for (int g = 0; g < G; ++g) fma4(_mm256_loadu_ps(q + g * dim + d), kd, acc[g]);
  }
  const __m128 s = _mm_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    _mm_storeu_ps(scores + g * stride, _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), s));
  }
}

// scores[g * stride + t] = scale * (q[g] . keys[t]) for G query heads and `rows` keys of `dim` (a multiple of
// 32) elements, four keys at a time; a short last tile repeats its last key and keeps only its own sums.
template <int G, typename T>
void tile_scores(const float* q, const T* keys, int64_t rows, int64_t dim, float scale, float* scores, int64_t stride) {
  int64_t t = 0;
  for (; t + 4 <= rows; t += 4) {
    const T* k = keys + t * dim;
    score_tile<G>(q, k, k + dim, k + 2 * dim, k + 3 * dim, dim, scale, scores + t, stride);
  }
  if (t == rows) return;
  const T* k[4];
  for (int64_t i = 0; i < 4; ++i) k[i] = keys + std::min(t + i, rows - 1) * dim;
  float tail[G * 4];
  score_tile<G>(q, k[0], k[1], k[2], k[3], dim, scale, tail, 4);
  for (int g = 0; g < G; ++g) std::copy(tail + g * 4, tail + g * 4 + (rows - t), scores + g * stride + t);
}

// acc[g] += sum over rows t of p[g * stride + t] * values[t] for G heads, 32 columns at a time: each value row
// is loaded once for the G heads.
template <int G, typename T>
void tile_values(const float* p, int64_t stride, const T* values, int64_t rows, int64_t dim, float* acc) {
  for (int64_t d = 0; d < dim; d += 32) {
    __m256 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm256_loadu_ps(acc + g * dim + d + 8 * i);
    for (int64_t t = 0; t < rows; ++t) {
      const T* v = values + t * dim + d;
      const __m256 vt[4] = {load8(v), load8(v + 8), load8(v + 16), load8(v + 24)};
      for (int g = 0; g < G; ++g) fma4(_mm256_broadcast_ss(p + g * stride + t), vt, a[g]);
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + g * dim + d + 8 * i, a[g][i]);
  }
}

// `fn<G>(g)` for the group's heads in tiles of kTileHeads (the last tile smaller).
template <typename F>
void over_tiles(int64_t group, F&& fn) {
  int64_t g = 0;
  for (; g + kTileHeads <= group; g += kTileHeads) fn(std::integral_constant<int, kTileHeads>{}, g);
  if (group - g == 2) fn(std::integral_constant<int, 2>{}, g);
  if (group - g == 1) fn(std::integral_constant<int, 1>{}, g);
}
#endif

// Whether the register tiles run for rows of `dim` elements: they take 32 columns at a time.
constexpr bool tiles_take(int64_t dim) {
#ifdef LMGATE_ATTENTION_TILES
  return dim % 32 == 0;
#else
  return false;
#endif
}

// The cache types the arithmetic may read where they lie: float32 (every loop reads it) and the 16-bit types
// the register tiles widen as they load (`load8`). Other caches' rows are widened into a buffer (`as_float`).
template <typename cache_t>
constexpr bool kReadInPlace =
    std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::Half> || std::is_same_v<cache_t, c10::BFloat16>;

// scores[g * stride + t] = scale * (q[g] . keys[t]) for the group's heads and `rows` keys; keys of a 16-bit
// cache only where `tiles_take(dim)`.
template <typename T>
void group_scores(const float* q, const T* keys, int64_t rows, int64_t dim, int64_t group, float scale,
                  float* scores, int64_t stride) {
#ifdef LMGATE_ATTENTION_TILES
  if (tiles_take(dim)) {
    over_tiles(group, [&](auto G, int64_t g) {
      tile_scores<decltype(G)::value>(q + g * dim, keys, rows, dim, scale, scores + g * stride, stride);
    });
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t g = 0; g < group; ++g) key_scores(q + g * dim, keys, rows, dim, scale, scores + g * stride);
  } else {
    TORCH_INTERNAL_ASSERT(false, "a 16-bit cache read in place without the register tiles");
  }
}

// acc[g] += sum over rows t of p[g * stride + t] * values[t] for the group's heads; values of a 16-bit cache
// only where `tiles_take(dim)`.
template <typename T>
void group_values(const float* p, int64_t stride, const T* values, int64_t rows, int64_t dim, int64_t group,
                  float* acc) {
#ifdef LMGATE_ATTENTION_TILES
  if (tiles_take(dim)) {
    over_tiles(group, [&](auto G, int64_t g) {
      tile_values<decltype(G)::value>(p + g * stride, stride, values, rows, dim, acc + g * dim);
    });
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t g = 0; g < group; ++g) add_rows(acc + g * dim, p + g * stride, values, rows, dim);
  } else {
    TORCH_INTERNAL_ASSERT(false, "a 16-bit cache read in place without the register tiles");
  }
}

// A tile of `rows` consecutive query tokens of one sequence, each with the `group` query heads of one KV head,
// against that head's first `len` tokens, whose blocks `table` lists; the tile's last token is at position
// len - 1, so its token r sees keys [0, len - rows + 1 + r) (causal; a decode is one row that sees all).
// q's rows are `q_row` apart, out's `out_row`: out[r][g] = softmax(scale * q[r][g] K^T) V. With `lse`, each
// query vector's log-sum-exp of its scores too (row-major, as the vectors), by which the outputs over parts of
// one context merge (flash decoding, decode_layers.cpp).
//
// Two passes, keys then values, each block read once for the whole tile: a query's scores are only len
// floats, so they are kept whole (no running max and rescaling per block, as an online softmax needs) and
// the exponentials run once over each. On a 2-core Zen 3, 55% faster for decodes than one pass with
// per-head dot products when the blocks are in cache. A prefill tile also scores the keys past each row's
// limit (at most rows - 1 of them) and zeroes their weights, so that every block is one tile-wide step.
//
// Blocks lie scattered over the cache, where the hardware prefetcher cannot see the next one coming, so each
// walk asks for the block after the one in use (the keys' last asks for the values' first), a share of its
// lines before each part of `part` rows of the current block: asking for a whole block at once stalled the
// arithmetic until the requests drained. A decode uses its blocks four rows at a time (scattered blocks on a
// 2-core Zen 3: 15-16 GB/s whole and only at jumps in the table, 19-20 in parts); a prefill tile, which
// mostly finds its blocks in cache, whole (in parts, re-reading its accumulators made it 20% slower).
template <typename q_t, typename cache_t>
void attend(const q_t* q, int64_t q_row, int64_t rows, const cache_t* k_head, const cache_t* v_head,
            const int64_t* table, int64_t len, int64_t block_size, int64_t dim, int64_t group, float scale, q_t* out,
            int64_t out_row, AttentionScratch& s, float* lse = nullptr) {
  const int64_t block_elems = block_size * dim, blocks = (len + block_size - 1) / block_size;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(cache_t));
  const int64_t vectors = rows * group;  // query vectors of the tile, row-major: [rows, group, dim]
  const int64_t part = rows == 1 ? 4 : block_size;
  const bool in_place = std::is_same_v<cache_t, float> || tiles_take(dim);  // else widened into s.buffer
  const auto walk = [&](const cache_t* head, const cache_t* then, auto&& use) {
    for (int64_t b = 0; b < blocks; ++b) {
      const cache_t* next = b + 1 < blocks ? head + table[b + 1] * block_elems
                            : then != nullptr ? then + table[0] * block_elems
                                              : nullptr;
      const int64_t n = std::min(block_size, len - b * block_size), parts = (n + part - 1) / part;
      const cache_t* block = head + table[b] * block_elems;
      for (int64_t i = 0; i < parts; ++i) {
        if (next != nullptr) prefetch(next, block_bytes * i / parts, block_bytes * (i + 1) / parts);
        const int64_t m = std::min(part, n - i * part);
        const cache_t* rows_of_part = block + i * part * dim;
        if constexpr (kReadInPlace<cache_t>) {
          if (in_place) {
            use(b * block_size + i * part, m, rows_of_part);
            continue;
          }
        }
        use(b * block_size + i * part, m, as_float(rows_of_part, s.buffer.data(), m * dim));
      }
    }
  };
  s.reserve(vectors, dim, len, block_size);
  prefetch(k_head + table[0] * block_elems, 0, block_bytes);
  for (int64_t r = 0; r < rows; ++r) at::vec::convert(q + r * q_row, s.queries.data() + r * group * dim, group * dim);
  float* probs = s.probs.data();
  walk(k_head, v_head, [&](int64_t t, int64_t n, const auto* keys) {
    group_scores(s.queries.data(), keys, n, dim, vectors, scale, probs + t, len);
  });
  for (int64_t v = 0; v < vectors; ++v) {
    float* p = probs + v * len;
    const int64_t seen = len - rows + 1 + v / group;
    const float max = at::vec::reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, p, seen);
    at::vec::map([max](Vec x) { return (x - Vec(max)).exp_u20(); }, p, p, seen);
    const float sum = at::vec::reduce_all<float>([](Vec x, Vec y) { return x + y; }, p, seen);
    s.inv_sums[v] = 1.f / sum;
    if (lse != nullptr) lse[v] = max + std::log(sum);
    std::fill(p + seen, p + len, 0.f);
  }
  std::fill(s.acc.begin(), s.acc.begin() + vectors * dim, 0.f);
  walk(v_head, nullptr, [&](int64_t t, int64_t n, const auto* values) {
    group_values(probs + t, len, values, n, dim, vectors, s.acc.data());
  });
  for (int64_t v = 0; v < vectors; ++v) {
    float* a = s.acc.data() + v * dim;
    at::vec::map([inv = s.inv_sums[v]](Vec x) { return x * Vec(inv); }, a, a, dim);
    at::vec::convert(a, out + (v / group) * out_row + (v % group) * dim, dim);
  }
}

template <typename q_t, typename cache_t>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& lengths, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads, width = block_tables.size(1), head_elems = num_blocks * block_size * dim;
  const q_t* q_data = q.data_ptr<q_t>();
  const int64_t q_row = q.stride(0);  // q may be a view of the rotated QK heads: its rows strided
  const cache_t* k_data = k_cache.data_ptr<cache_t>();
  const cache_t* v_data = v_cache.data_ptr<cache_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  q_t* out_data = out.data_ptr<q_t>();

  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    AttentionScratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads;
      attend(q_data + seq * q_row + head * group * dim, q_row, 1, k_data + head * head_elems,
             v_data + head * head_elems, tables + seq * width, lens[seq], block_size, dim, group,
             static_cast<float>(scale), out_data + (seq * heads + head * group) * dim, heads * dim, scratch);
    }
  });
}

// Query tokens per prefill tile: the tile's queries share each key and value block read, 16 x the group's
// heads of them (48 for SmolLM2), while a row scores at most 15 keys past its causal limit.
constexpr int64_t kPrefillTile = 16;

template <typename q_t, typename cache_t>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                       const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t heads = q.size(1), dim = q.size(2), q_row = q.stride(0);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads, width = block_tables.size(1), head_elems = num_blocks * block_size * dim;
  const q_t* q_data = q.data_ptr<q_t>();
  const cache_t* k_data = k_cache.data_ptr<cache_t>();
  const cache_t* v_data = v_cache.data_ptr<cache_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* qlens = q_lens.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  q_t* out_data = out.data_ptr<q_t>();
  struct Tile {
    int64_t chunk, head, first, rows;
  };
  std::vector<Tile> tiles;
  for (int64_t c = 0; c < q_lens.numel(); ++c) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t r = 0; r < qlens[c]; r += kPrefillTile) tiles.push_back({c, h, r, std::min(kPrefillTile, qlens[c] - r)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    AttentionScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Tile& t = tiles[i];
      const int64_t row = starts[t.chunk] + t.first, len = ctx[t.chunk] - qlens[t.chunk] + t.first + t.rows;
      attend(q_data + row * q_row + t.head * group * dim, q_row, t.rows, k_data + t.head * head_elems,
             v_data + t.head * head_elems, tables + t.chunk * width, len, block_size, dim, group,
             static_cast<float>(scale), out_data + (row * heads + t.head * group) * dim, heads * dim, scratch);
    }
  });
}

// The checks both ops share: shapes, dtypes (q the caches' own, or float32 over a 16-bit cache), devices,
// and q's heads contiguous (its rows may be strided: a view of the rotated QK heads).
void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be [tokens, heads, dim] and the caches [kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(0) == 0, "q and the caches disagree on shape");
  const bool sixteen_bit_cache = k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() || (q.scalar_type() == at::kFloat && sixteen_bit_cache)),
              "the caches must share a dtype, and q must have it or be float32 (a 16-bit cache under float32)");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q's heads and the caches must be contiguous (q's rows may be strided)");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "all inputs must be on the CPU");
}

// fn<q_t, cache_t>() for the dtypes of q and the caches.
template <typename F>
void dispatch_attention(const at::Tensor& q, const at::Tensor& k_cache, F&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention", [&] {
    if (q.scalar_type() == at::kFloat) {
      fn(float{}, scalar_t{});
    } else {
      fn(scalar_t{}, scalar_t{});
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lengths, double scale) {
  check_attention_inputs(q, k_cache, v_cache);
  TORCH_CHECK(lengths.numel() == q.size(0), "one block table row and one length per query token");
  TORCH_CHECK(block_tables.device().is_cpu() && lengths.device().is_cpu(), "all inputs must be on the CPU");
  lmgate::check_decode_tables(block_tables, lengths, k_cache.size(2), k_cache.size(1));
  at::Tensor out = at::empty(q.sizes(), q.options());
  dispatch_attention(q, k_cache, [&](auto q_type, auto cache_type) {
    decode_attention<decltype(q_type), decltype(cache_type)>(q, k_cache, v_cache, block_tables, lengths, scale, out);
  });
  return out;
}

// Prefill chunks, one after another in q's rows: chunk c is rows [q_starts[c], q_starts[c] + q_lens[c]),
// its keys and values already stored, context_lens[c] tokens of them in all (the chunk's last token is the
// last of them), causal. block_tables [chunks, width]. Returns [tokens, heads, dim], contiguous.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& q_starts_in,
                                   const at::Tensor& q_lens_in, const at::Tensor& context_lens, double scale) {
  check_attention_inputs(q, k_cache, v_cache);
  const at::Tensor q_starts = q_starts_in.contiguous(), q_lens = q_lens_in.contiguous();
  TORCH_CHECK(q_starts.scalar_type() == at::kLong && q_lens.scalar_type() == at::kLong && q_starts.device().is_cpu() &&
                  q_lens.device().is_cpu() && block_tables.device().is_cpu() && context_lens.device().is_cpu() &&
                  q_starts.numel() == q_lens.numel() && context_lens.numel() == q_lens.numel(),
              "q_starts, q_lens and context_lens must be int64 CPU tensors, one of each per chunk");
  lmgate::check_decode_tables(block_tables, context_lens, k_cache.size(2), k_cache.size(1));
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* qlens = q_lens.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  int64_t next = 0;
  for (int64_t c = 0; c < q_lens.numel(); ++c) {
    TORCH_CHECK(starts[c] == next && qlens[c] >= 1 && qlens[c] <= ctx[c], "chunk ", c, " (rows from ", starts[c],
                ", ", qlens[c], " of them, context ", ctx[c], ") does not follow the one before it inside its context");
    next += qlens[c];
  }
  TORCH_CHECK(next == q.size(0), "the chunks cover ", next, " rows of q's ", q.size(0));
  at::Tensor out = at::empty(q.sizes(), q.options());
  dispatch_attention(q, k_cache, [&](auto q_type, auto cache_type) {
    prefill_attention<decltype(q_type), decltype(cache_type)>(q, k_cache, v_cache, block_tables, q_starts, q_lens,
                                                              context_lens, scale, out);
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

// One decode row's `group` query heads against one KV head's first `len` tokens (decode_layers.cpp); with
// `lse`, their log-sum-exps too.
void attend_group(const float* q, const void* k_head, const void* v_head, at::ScalarType cache_type,
                  const int64_t* table, int64_t len, int64_t block_size, int64_t dim, int64_t group, float scale,
                  float* out, float* lse) {
  thread_local AttentionScratch scratch;  // grown once per thread, not allocated and zeroed per (row, KV head)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache_type, "attend_group", [&] {
    attend(q, 0, 1, static_cast<const scalar_t*>(k_head), static_cast<const scalar_t*>(v_head), table, len,
           block_size, dim, group, scale, out, 0, scratch, lse);
  });
}

}  // namespace lmgate

TORCH_LIBRARY(lmgate, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, "
        "float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor q_starts, "
        "Tensor q_lens, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmgate, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
