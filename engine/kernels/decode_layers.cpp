// Every decoder layer of a Llama-family model for a decode step, in one call and one parallel region: with
// GGUF-quantized linear layers for steps of a few rows, or with float32 ones packed in column panels
// (gemm.cpp's `pack_columns`) for steps of any size.
//
// Run as torch ops, one decoded token of the embedded model is some 450 small ops and 121 quantized matvecs:
// each op pays the dispatcher and each parallel op wakes the OpenMP team (sleeping waiters, engine/__init__.py),
// and together they took more time than reading the weights. Here the team starts once per step; between
// the phases of a layer the threads meet at a spinning barrier, and every phase splits its work by rows of
// W (or by (row, KV head, part of the context) for attention) so that no thread waits on another inside a
// phase.
//
// Per layer: h = rms_norm(x) (each thread its own copy); qkv = h Wqkv^T (+ bias); per (row, KV head, part):
// q/k norm (Qwen3), rotary, K/V stored at the row's slot (by the part holding it), attention over the part's
// blocks; each thread merges the parts (`merge_parts`) and computes its share of x += attn Wo^T;
// h = rms_norm(x); act = silu(h Wgate^T) * h Wup^T (a thread owns both halves of its rows); x += act Wdown^T.
// With column panels, threads take whole panels of every matrix (their shares are multiples of the panel
// width), and gate_up's pairs of panels hold the gate and the up columns of the same activations (gemm.cpp's
// `pack_gated_columns`), so that a pair's sums give its activations at once. A 64-row decode step of the
// embedded model ran some 300 parallel torch ops, each waking the team (25-35 us each on a 2-core Zen 4): the
// same step is 5 barriers a layer here.
// fp32 throughout (a 16-bit KV cache is converted as it is stored and read), the same arithmetic as the torch
// path up to the order of sums; with int8 activations (`--int8-activations`) each matrix whose type allows it reads
// its input rounded to int8 per block of 32, as the torch path's layers do (int8_matmul.cpp), each thread
// rounding its own copy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "int8_matmul.h"

namespace lmgate {
// paged_attention.cpp
void check_decode_tables(const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                         int64_t num_blocks);
void attend_group(const float* q, const void* k_head, const void* v_head, at::ScalarType cache_type,
                  const int64_t* table, int64_t len, int64_t block_size, int64_t dim, int64_t group, float scale,
                  float* out, float* lse);
// layer_ops.cpp
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t n, float eps, float* out);
void rotary_head(const float* x, const float* cos, const float* sin, int64_t dim, float* out);
void silu_and_mul_row(const float* gate, const float* up, int64_t n, float* out);
// quantized_matmul.cpp
void check_gguf_blocks(const at::Tensor& blocks, int64_t type, int64_t k);
void gguf_matvec_range(int64_t type, int64_t rows, const float* x, int64_t k, const uint8_t* w, int64_t row_bytes,
                       int64_t n_begin, int64_t n_end, float* out, int64_t out_stride);
}  // namespace lmgate

namespace {

constexpr int64_t MAX_ROWS = 8;  // rows quantized_matmul.cpp's matvec serves in one pass over W (MATVEC_ROWS)
constexpr int64_t ALIGN = 16;  // floats per share boundary: threads never write the same 64-byte line
constexpr int64_t COLUMN_PANELS = -1;  // a part's type for float32 W packed by gemm.cpp's pack_columns
constexpr int64_t GATED_PANELS = -2;  // gate_up's type where it is packed by pack_gated_columns

// The team's meeting point between phases. Threads spin for about 20 us (the threads of a phase finish
// within microseconds of each other, far less than a sleep and a wake-up take), then yield, so that a thread
// a busy neighbour displaced gets its core back. With one busy process beside a 2-core engine, spinning 20
// times longer before yielding gave 30 tok/s on one stream against 45-48 (and 39 for the layer-by-layer path).
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < 1000) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      } else {
        spins = 1000;  // stays put: no overflow however long the wait
        std::this_thread::yield();
      }
    }
  }

 private:
  const int threads_;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

struct Range {
  int64_t begin, end;
};

// Parts each (row, KV head)'s context is split into so that the team's threads get equal shares of the
// attention items: one stream of a model with 3 KV heads on 2 threads left one thread reading two heads'
// caches while the other read one (flash decoding's split, merged by log-sum-exp).
int64_t context_parts(int64_t items, int team) {
  return team / std::gcd(items, static_cast<int64_t>(team));
}

// attn[m] for every row from the parts' outputs: each part's softmax was over its own blocks, so part p
// weighs exp(lse_p - lse), lse the log-sum-exp over all of them (an empty part's lse is -inf).
void merge_parts(const float* outs, const float* lses, int64_t rows, int64_t num_kv_heads, int64_t parts,
                 int64_t group, int64_t dim, float* attn) {
  for (int64_t mg = 0; mg < rows * num_kv_heads; ++mg) {
    for (int64_t h = 0; h < group; ++h) {
      float top = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, lses[(mg * parts + p) * group + h]);
      float total = 0.f;
      for (int64_t p = 0; p < parts; ++p) total += std::exp(lses[(mg * parts + p) * group + h] - top);
      float* out = attn + (mg * group + h) * dim;
      std::fill(out, out + dim, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const float weight = std::exp(lses[(mg * parts + p) * group + h] - top) / total;
        const float* part = outs + ((mg * parts + p) * group + h) * dim;
        if (weight > 0.f) {
          for (int64_t d = 0; d < dim; ++d) out[d] += weight * part[d];
        }
      }
    }
  }
}

// This thread's share of `total` items, in multiples of `align` where it can.
Range share(int64_t total, int thread, int threads, int64_t align) {
  const int64_t units = (total + align - 1) / align;
  const int64_t begin = units * thread / threads * align, end = units * (thread + 1) / threads * align;
  return {std::min(begin, total), std::min(end, total)};
}

// A quantized matrix as parts of rows, each of its own GGUF type (one part, mostly; a Q4_K_M file's Q, K and V
// projection can be Q4_K, Q4_K and Q6_K).
struct Part {
  const uint8_t* blocks;
  int64_t type, first, rows, row_bytes;
};

// Rows of x rounded to int8 per block of 32 (int8_matmul.cpp's layout), for the parts whose type takes them.
struct Int8Input {
  const int8_t* q;
  const float* scale_sum;
  bool vnni;
};

struct Linear {
  std::vector<Part> parts;
  int64_t rows = 0;
  bool takes_int8 = false;  // a part's type reads int8 x: worth rounding x for

  // out[m, n] = x[m] . W[n] for the rows n in [begin, end) of the whole matrix (for a gated pack, the
  // activations silu(x[m] . Wgate[n]) * (x[m] . Wup[n])); x as rounded (`x8`) where given and the part's type
  // allows.
  void matvec(int64_t m_rows, const float* x, const Int8Input* x8, int64_t k, int64_t begin, int64_t end, float* out,
              int64_t stride) const {
    for (const Part& p : parts) {
      const int64_t b = std::max(begin, p.first), e = std::min(end, p.first + p.rows);
      if (b >= e) continue;
      if (p.type == COLUMN_PANELS) {
        lmgate::column_range(x, m_rows, k, reinterpret_cast<const float*>(p.blocks), p.rows, b - p.first, e - p.first,
                             out + p.first, stride);
      } else if (p.type == GATED_PANELS) {
        lmgate::gated_range(x, m_rows, k, reinterpret_cast<const float*>(p.blocks), p.rows, b - p.first, e - p.first,
                            out + p.first, stride);
      } else if (x8 != nullptr && lmgate::int8_type(p.type)) {
        lmgate::gguf_matvec_int8_range(p.type, m_rows, x8->q, x8->scale_sum, k, p.blocks, p.row_bytes, b - p.first,
                                       e - p.first, x8->vnni, out + p.first, stride);
      } else {
        lmgate::gguf_matvec_range(p.type, m_rows, x, k, p.blocks, p.row_bytes, b - p.first, e - p.first,
                                  out + p.first, stride);
      }
    }
  }
};

struct Layer {
  const float *input_norm, *post_norm, *q_norm, *k_norm, *qkv_bias;  // q_norm, k_norm, qkv_bias may be null
  Linear qkv, o, gate_up, down;
  void *k_cache, *v_cache;  // of the step's cache dtype
};

// n floats into a cache of `type` from element `offset` on, rounded as store_kv (layer_ops.cpp) rounds them.
void store(const float* src, int64_t n, at::ScalarType type, void* cache, int64_t offset) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "decode_layers store", [&] {
    at::vec::convert(src, static_cast<scalar_t*>(cache) + offset, n);
  });
}

// The next matrix of `weights` / `types`, `count` parts from `*next` on, K columns wide; `rows` < 0: any (a
// quantized one's). A matrix in column panels is one part whose padding hides its row count: `rows` says it
// (a gated pack's rows are its activations).
Linear linear(at::TensorList weights, at::IntArrayRef types, int64_t* next, int64_t count, int64_t k, int64_t rows) {
  TORCH_CHECK(count >= 1 && *next + count <= static_cast<int64_t>(weights.size()), "decode_layers: parts run past the weights");
  Linear l;
  if (types[*next] == COLUMN_PANELS || types[*next] == GATED_PANELS) {
    const at::Tensor& w = weights[*next];
    // panels of `width` columns, a gated pack's in pairs (`group`) per `width` activations
    const int64_t width = lmgate::column_width(), group = types[*next] == GATED_PANELS ? 2 : 1;
    const int64_t groups = (rows + width - 1) / width;
    TORCH_CHECK(count == 1 && rows >= 0, "decode_layers: a matrix in column panels is one part of known rows");
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == group * groups &&
                    w.size(1) == k && w.size(2) == width,
                "decode_layers: a matrix in column panels must be a [", group * groups, ", ", k, ", ", width,
                "] float32 pack");
    l.parts.push_back({reinterpret_cast<const uint8_t*>(w.data_ptr<float>()), types[*next], 0, rows, 0});
    l.rows = rows;
    *next += 1;
    return l;
  }
  for (int64_t i = *next; i < *next + count; ++i) {
    TORCH_CHECK(types[i] >= 0, "decode_layers: a matrix mixes column panels and quantized parts");
    lmgate::check_gguf_blocks(weights[i], types[i], k);
    l.parts.push_back({weights[i].data_ptr<uint8_t>(), types[i], l.rows, weights[i].size(0), weights[i].size(1)});
    l.rows += weights[i].size(0);
    l.takes_int8 = l.takes_int8 || lmgate::int8_type(types[i]);
  }
  *next += count;
  TORCH_CHECK(rows < 0 || l.rows == rows, "a quantized matrix has ", l.rows, " rows, expected ", rows);
  return l;
}

const float* vector_of(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, what,
              " must be a contiguous float32 tensor of ", n, " elements");
  return t.data_ptr<float>();
}

// x: [M, hidden] float32, the residual stream, updated in place. Per layer i: norms[i * per_layer ...] are
// input_layernorm, post_attention_layernorm (then q_norm, k_norm when there are four); parts[4 i ...] say how
// many entries of weights (blocks) and types (their GGUF types, or COLUMN_PANELS for a float32 matrix packed by
// pack_columns: then every matrix is so, one part each, and gate_up_proj GATED_PANELS, packed by
// pack_gated_columns) make qkv_proj, o_proj, gate_up_proj and down_proj, taken in order; qkv_bias is
// empty or one per layer. cos, sin: [M, head_dim]; caches: [kv_heads, blocks, block_size, head_dim], all
// float32, float16 or bfloat16;
// slots: [M] each row's slot for this step's K/V; block_tables [M, width] and lengths [M] as in
// paged_decode_attention (lengths count this step's token). int8_activations: rounds each matrix's input to int8
// for the types that allow it, vpdpbusd where `vnni`.
void decode_layers(at::Tensor& x, at::TensorList norms, at::TensorList weights, at::IntArrayRef types,
                   at::IntArrayRef parts, at::TensorList qkv_bias, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                   at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& block_tables,
                   const at::Tensor& lengths, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                   bool int8_activations, bool vnni) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, H]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const bool columns = !types.empty() && types[0] == COLUMN_PANELS;
  TORCH_CHECK(rows >= 1 && (columns || rows <= MAX_ROWS), "decode_layers serves 1..", MAX_ROWS,
              " rows of a quantized model, got ", rows);
  TORCH_CHECK(!(columns && int8_activations), "int8 activations are for quantized matrices, not column panels");
  TORCH_CHECK(num_layers >= 1 && v_caches.size() == k_caches.size() && parts.size() == 4 * k_caches.size() &&
                  types.size() == weights.size() && (norms.size() == 2 * k_caches.size() || norms.size() == 4 * k_caches.size()) &&
                  (qkv_bias.empty() || qkv_bias.size() == k_caches.size()),
              "decode_layers: per layer 2 or 4 norms, 4 matrices with their types, 0 or 1 bias and 2 caches");
  const at::Tensor& cache0 = k_caches[0];
  TORCH_CHECK(cache0.dim() == 4 && num_kv_heads >= 1 && cache0.size(0) == num_kv_heads && num_heads % num_kv_heads == 0,
              "caches must be [kv_heads, blocks, block_size, head_dim]");
  const int64_t num_blocks = cache0.size(1), block_size = cache0.size(2), dim = cache0.size(3);
  const at::ScalarType cache_type = cache0.scalar_type();
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16,
              "the caches must be float32, float16 or bfloat16");
  const int64_t group = num_heads / num_kv_heads, q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  const int64_t qkv_rows = q_size + 2 * kv_size, per_layer_norms = static_cast<int64_t>(norms.size()) / num_layers;
  TORCH_CHECK(dim % 2 == 0 && cos.sizes() == at::IntArrayRef({rows, dim}) && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "cos and sin must be contiguous float32 [M, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "slots must be contiguous int64 [M]");
  TORCH_CHECK(block_tables.size(0) == rows, "one block table row and one length per row of x");
  TORCH_CHECK(!vnni || lmgate::vnni_runs(), "vnni asked for on a CPU without AVX512-VNNI");
  lmgate::check_decode_tables(block_tables, lengths, block_size, num_blocks);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < rows; ++m) {
    TORCH_CHECK(slot[m] >= 0 && slot[m] < num_blocks * block_size, "slot ", slot[m], " of row ", m,
                " is outside the cache");
  }
  std::vector<Layer> layers(num_layers);
  int64_t next = 0, intermediate = 0;
  for (int64_t i = 0; i < num_layers; ++i) {
    Layer& l = layers[i];
    const at::Tensor* n = norms.data() + i * per_layer_norms;
    l.input_norm = vector_of(n[0], hidden, "input_layernorm");
    l.post_norm = vector_of(n[1], hidden, "post_attention_layernorm");
    l.q_norm = per_layer_norms == 4 ? vector_of(n[2], dim, "q_norm") : nullptr;
    l.k_norm = per_layer_norms == 4 ? vector_of(n[3], dim, "k_norm") : nullptr;
    l.qkv_bias = qkv_bias.empty() ? nullptr : vector_of(qkv_bias[i], qkv_rows, "qkv bias");
    l.qkv = linear(weights, types, &next, parts[4 * i], hidden, qkv_rows);
    l.o = linear(weights, types, &next, parts[4 * i + 1], q_size, hidden);
    if (columns) {  // a gated pack's padding hides its activations: down's K, alike in every layer
      const int64_t down_at = next + 1;
      TORCH_CHECK(parts[4 * i + 2] == 1 && down_at < static_cast<int64_t>(weights.size()) &&
                      weights[down_at].dim() == 3 && (i == 0 || weights[down_at].size(1) == intermediate),
                  "decode_layers: down_proj in column panels of the first layer's K expected");
      intermediate = weights[down_at].size(1);
      l.gate_up = linear(weights, types, &next, 1, hidden, intermediate);
    } else {
      l.gate_up = linear(weights, types, &next, parts[4 * i + 2], hidden, i == 0 ? -1 : 2 * intermediate);
      TORCH_CHECK(l.gate_up.rows % 2 == 0, "gate_up_proj must have an even number of rows");
      intermediate = l.gate_up.rows / 2;
    }
    l.down = linear(weights, types, &next, parts[4 * i + 3], intermediate, hidden);
    for (const Linear* m : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      const int64_t type = m->parts[0].type, panels = m == &l.gate_up ? GATED_PANELS : COLUMN_PANELS;
      TORCH_CHECK(columns ? type == panels : type >= 0, "decode_layers: either every matrix is in column panels "
                  "(gate_up_proj gated) or none is");
    }
    for (const at::Tensor* c : {&k_caches[i], &v_caches[i]}) {
      TORCH_CHECK(c->sizes() == cache0.sizes() && c->scalar_type() == cache_type && c->is_contiguous(),
                  "every cache must be a contiguous tensor of the first one's shape and dtype");
    }
    l.k_cache = k_caches[i].data_ptr();
    l.v_cache = v_caches[i].data_ptr();
  }
  TORCH_CHECK(next == static_cast<int64_t>(weights.size()), "decode_layers: ", weights.size() - next,
              " weights left over after the layers' parts");

  const int threads = std::max(1, at::get_num_threads());
  const int64_t splits = context_parts(rows * num_kv_heads, threads);
  // Shared between the phases: each is written by its owners and read after the next barrier.
  std::vector<float> qkv(rows * qkv_rows), part_outs(rows * q_size * splits), part_lses(rows * num_heads * splits),
      delta(rows * hidden), gate_up(columns ? 0 : rows * 2 * intermediate), act(rows * intermediate);
  float* xs = x.data_ptr<float>();
  const float* cos_data = cos.data_ptr<float>();
  const float* sin_data = sin.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), head_elems = num_blocks * block_size * dim;
  const int64_t head_bytes = head_elems * static_cast<int64_t>(c10::elementSize(cache_type));
  std::unique_ptr<SpinBarrier> barrier;

#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    barrier = std::make_unique<SpinBarrier>(omp_get_num_threads());  // the team may be smaller than asked
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    std::vector<float> h(rows * hidden), attn(splits > 1 ? rows * q_size : 0), queries(group * dim);
    // This thread's rounding of the input of matrix `l`: null unless int8_activations and a part of l takes it.
    const int64_t widest = std::max({hidden, q_size, intermediate});
    std::vector<int8_t> x8(int8_activations ? rows * widest : 0);
    std::vector<float> x8_scales(int8_activations ? rows * widest / 16 : 0);
    const Int8Input input8{x8.data(), x8_scales.data(), vnni};
    auto rounded = [&](const Linear& l, const float* src, int64_t k) -> const Int8Input* {
      if (!int8_activations || !l.takes_int8) return nullptr;
      lmgate::quantize_int8(src, rows, k, x8.data(), x8_scales.data());
      return &input8;
    };
    // Shares of a matrix's output columns (a gated pack's activations): whole panels where the matrices are in
    // column panels (pairs of AVX2's 24-float panels, so that no two threads write one line).
    const int64_t align = columns ? std::lcm(lmgate::column_width(), ALIGN) : ALIGN;
    const Range hr = share(hidden, t, team, align), qr = share(qkv_rows, t, team, align);
    const Range ir = share(intermediate, t, team, align);
    const Range ar = share(rows * num_kv_heads * splits, t, team, 1);
    const int64_t h0 = hr.begin, h1 = hr.end, q0 = qr.begin, q1 = qr.end, i0 = ir.begin, i1 = ir.end;
    // x[:, h0:h1] += delta[:, h0:h1], where this thread wrote delta's columns.
    auto add_residual = [&] {
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t c = h0; c < h1; ++c) xs[m * hidden + c] += delta[m * hidden + c];
      }
    };

    for (const Layer& l : layers) {
      lmgate::rms_norm_rows(xs, l.input_norm, rows, hidden, static_cast<float>(eps), h.data());
      l.qkv.matvec(rows, h.data(), rounded(l.qkv, h.data(), hidden), hidden, q0, q1, qkv.data(), qkv_rows);
      if (l.qkv_bias != nullptr) {
        for (int64_t m = 0; m < rows; ++m) {
          for (int64_t c = q0; c < q1; ++c) qkv[m * qkv_rows + c] += l.qkv_bias[c];
        }
      }
      barrier->wait();

      for (int64_t item = ar.begin; item < ar.end; ++item) {
        const int64_t part = item % splits, m = item / splits / num_kv_heads, g = item / splits % num_kv_heads;
        const int64_t blocks = (lens[m] + block_size - 1) / block_size;
        const int64_t first = blocks * part / splits, end = blocks * (part + 1) / splits;  // the last part holds the row's token
        float* out = part_outs.data() + item * group * dim;
        float* lse = part_lses.data() + item * group;
        if (first == end) {  // a context of fewer blocks than parts
          std::fill(lse, lse + group, -INFINITY);
          continue;
        }
        float* row = qkv.data() + m * qkv_rows;
        const float* c = cos_data + m * dim;
        const float* s = sin_data + m * dim;
        for (int64_t head = 0; head < group; ++head) {  // each part its own copy: parts may run side by side
          float* q = queries.data() + head * dim;
          std::copy(row + (g * group + head) * dim, row + (g * group + head + 1) * dim, q);
          if (l.q_norm != nullptr) lmgate::rms_norm_rows(q, l.q_norm, 1, dim, static_cast<float>(eps), q);
          lmgate::rotary_head(q, c, s, dim, q);
        }
        if (end == blocks) {
          float* k = row + q_size + g * dim;
          const float* v = row + q_size + kv_size + g * dim;
          if (l.k_norm != nullptr) lmgate::rms_norm_rows(k, l.k_norm, 1, dim, static_cast<float>(eps), k);
          lmgate::rotary_head(k, c, s, dim, k);
          store(k, dim, cache_type, l.k_cache, g * head_elems + slot[m] * dim);
          store(v, dim, cache_type, l.v_cache, g * head_elems + slot[m] * dim);
        }
        lmgate::attend_group(queries.data(), static_cast<const char*>(l.k_cache) + g * head_bytes,
                             static_cast<const char*>(l.v_cache) + g * head_bytes, cache_type,
                             tables + m * width + first, std::min(lens[m], end * block_size) - first * block_size,
                             block_size, dim, group, static_cast<float>(scale), out, lse);
      }
      barrier->wait();

      // Whole contexts are attn already, laid out as it is; parts are merged by each thread for itself.
      const float* attended = part_outs.data();
      if (splits > 1) {
        merge_parts(part_outs.data(), part_lses.data(), rows, num_kv_heads, splits, group, dim, attn.data());
        attended = attn.data();
      }
      l.o.matvec(rows, attended, rounded(l.o, attended, q_size), q_size, h0, h1, delta.data(), hidden);
      add_residual();
      barrier->wait();

      lmgate::rms_norm_rows(xs, l.post_norm, rows, hidden, static_cast<float>(eps), h.data());
      if (columns) {  // a gated pack: each panel's sums give its activations
        l.gate_up.matvec(rows, h.data(), nullptr, hidden, i0, i1, act.data(), intermediate);
      } else {  // a thread's rows of gate and of up are the same columns: its SiLU needs no barrier
        const Int8Input* h8 = rounded(l.gate_up, h.data(), hidden);
        l.gate_up.matvec(rows, h.data(), h8, hidden, i0, i1, gate_up.data(), 2 * intermediate);
        l.gate_up.matvec(rows, h.data(), h8, hidden, intermediate + i0, intermediate + i1, gate_up.data(), 2 * intermediate);
        for (int64_t m = 0; m < rows; ++m) {
          const float* gate = gate_up.data() + m * 2 * intermediate;
          lmgate::silu_and_mul_row(gate + i0, gate + intermediate + i0, i1 - i0, act.data() + m * intermediate + i0);
        }
      }
      barrier->wait();

      l.down.matvec(rows, act.data(), rounded(l.down, act.data(), intermediate), intermediate, h0, h1, delta.data(), hidden);
      add_residual();
      barrier->wait();
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmgate, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor[] norms, Tensor[] weights, int[] types, int[] parts, Tensor[] qkv_bias, "
        "Tensor cos, Tensor sin, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slots, Tensor block_tables, "
        "Tensor lengths, int num_heads, int num_kv_heads, float eps, float scale, bool int8_activations=False, "
        "bool vnni=False) -> ()");
}

TORCH_LIBRARY_IMPL(lmgate, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
