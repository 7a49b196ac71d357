// The elementwise parts of a decoder layer, one pass each over float32 or bfloat16 rows: RMSNorm (with the
// residual add before it, or without), rotary embedding, SiLU-and-multiply, and the store of a step's keys and
// values into the paged cache; and greedy sampling's argmax over each row of float32 logits.
//
// As torch ops they are 2-6 ops apiece (RMSNorm alone: square, mean, add, rsqrt, two multiplies), each
// reading and writing the whole batch and each a parallel region of its own; at 64 rows they took about an
// eighth of a float32 decode step on a 2-core machine, time in which no GEMM ran. Rows are split over
// threads only where a share is worth a wake-up (`GRAIN` elements), so a one-row step stays on its thread.
//
// bfloat16 rows are widened to float32 and rounded back to bfloat16 wherever torch's bfloat16 ops round a
// result (after each op of the expression a kernel replaces): the residual add and rotary give torch's bits;
// the norm's sum (in another order) and SiLU's exp_u20 can move a value by one bfloat16 step. As torch ops they
// were about a quarter of a 64-row decode step on a 2-core Intel Xeon with AMX (where oneDNN's bf16 matmuls are
// fast): some 250 dispatches and parallel regions a step; here 3-5x less time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace lmgate {

using Vec = at::vec::Vectorized<float>;

// out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)) for `rows` rows of `n`; out may be x.
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    const float sum = at::vec::map_reduce_all<float>([](Vec v) { return v * v; },
                                                     [](Vec a, Vec b) { return a + b; }, xr, n);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    at::vec::map2([inv](Vec v, Vec g) { return g * (v * Vec(inv)); }, out + r * n, xr, weight, n);
  }
}

// One head: out = x * cos + rotate_half(x) * sin, `sin` carrying rotate_half's sign; out may be x.
void rotary_head(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  int64_t d = 0;
  for (; d + Vec::size() <= half; d += Vec::size()) {
    const Vec a = Vec::loadu(x + d), b = Vec::loadu(x + half + d);
    (a * Vec::loadu(cos + d) + b * Vec::loadu(sin + d)).store(out + d);
    (b * Vec::loadu(cos + half + d) + a * Vec::loadu(sin + half + d)).store(out + half + d);
  }
  for (; d < half; ++d) {
    const float a = x[d], b = x[half + d];
    out[d] = a * cos[d] + b * sin[d];
    out[half + d] = b * cos[half + d] + a * sin[half + d];
  }
}

// silu(g) = g / (1 + exp(-g)). exp_u20 (within 20 ULP, about 2e-7 relative on silu here) takes half the time
// of Sleef's exp, which made silu_and_mul 2% of a float32 run's time.
inline Vec silu(Vec g) { return g / (Vec(1.f) + (Vec(0.f) - g).exp_u20()); }

// out = silu(gate) * up over n elements.
void silu_and_mul_row(const float* gate, const float* up, int64_t n, float* out) {
  at::vec::map2([](Vec g, Vec u) { return silu(g) * u; }, out, gate, up, n);
}

}  // namespace lmgate

namespace {

using lmgate::Vec;

// Elements per thread's share, at least. Under OMP_WAIT_POLICY=PASSIVE (engine/__init__.py) the second
// thread sleeps between parallel regions, and waking it cost more than it saved below about a million
// elements: on a 2-core Zen 4, add_rms_norm over 64 x 576 took 66 us on two threads and 13 on one, over 512 x
// 576 107 against 86; silu_and_mul over 512 x 3072 gains from two (228 against 317).
constexpr int64_t GRAIN = 1 << 20;

int64_t rows_per_share(int64_t row_elems) { return std::max<int64_t>(1, GRAIN / std::max<int64_t>(row_elems, 1)); }

using BF16 = c10::BFloat16;

void check_float_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), what, " must be a float32 CPU tensor");
}

// Rows the ops take: float32 or bfloat16 on the CPU, and every other operand of the same dtype.
void check_rows_cpu(const at::Tensor& t, const char* what, const at::Tensor& like) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.device().is_cpu(), what,
              " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), what, " must have the dtype of the op's other tensors");
}

using BVec = at::vec::Vectorized<BF16>;  // twice Vec::size() values

// A vector's worth of bfloat16 values (or the `count` left at a row's end, the rest zeros) as two float vectors.
inline std::tuple<Vec, Vec> load_bf16(const BF16* p, int64_t count) {
  return at::vec::convert_to_float<BF16>(count == BVec::size() ? BVec::loadu(p) : BVec::loadu(p, count));
}

// Two float vectors rounded to bfloat16 (to nearest, ties to even) and stored, `count` values of them.
inline void store_bf16(Vec a, Vec b, BF16* p, int64_t count) {
  const BVec v = at::vec::convert_from_float<BF16>(a, b);
  if (count == BVec::size()) {
    v.store(p);
  } else {
    v.store(p, count);
  }
}

// What a bfloat16 op returns for two float vectors of results: each rounded to bfloat16, widened back.
inline std::tuple<Vec, Vec> rounded(Vec a, Vec b) {
  return at::vec::convert_to_float<BF16>(at::vec::convert_from_float<BF16>(a, b));
}

// One bfloat16 row: x = round(x + delta), in place, as a bfloat16 add.
void add_row_bf16(BF16* x, const BF16* delta, int64_t n) {
  for (int64_t i = 0; i < n; i += BVec::size()) {
    const int64_t count = std::min<int64_t>(BVec::size(), n - i);
    const auto [a, b] = load_bf16(x + i, count);
    const auto [da, db] = load_bf16(delta + i, count);
    store_bf16(a + da, b + db, x + i, count);
  }
}

// One bfloat16 row: out = weight * round(x * rsqrt(mean(x^2) + eps)), Hugging Face's LlamaRMSNorm in bfloat16
// (the norm in float32, the weight's product in bfloat16).
void rms_norm_row_bf16(const BF16* x, const BF16* weight, int64_t n, float eps, BF16* out) {
  Vec acc(0.f);
  for (int64_t i = 0; i < n; i += BVec::size()) {
    const auto [a, b] = load_bf16(x + i, std::min<int64_t>(BVec::size(), n - i));
    acc = at::vec::fmadd(a, a, at::vec::fmadd(b, b, acc));
  }
  const float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc);
  const Vec inv(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += BVec::size()) {
    const int64_t count = std::min<int64_t>(BVec::size(), n - i);
    const auto [a, b] = load_bf16(x + i, count);
    const auto [na, nb] = rounded(a * inv, b * inv);
    const auto [wa, wb] = load_bf16(weight + i, count);
    store_bf16(wa * na, wb * nb, out + i, count);
  }
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, as Hugging Face's LlamaRMSNorm.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_rows_cpu(x_in, "x", x_in);
  check_rows_cpu(weight_in, "weight", x_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  TORCH_CHECK(weight.numel() == n, "weight has ", weight.numel(), " elements, x's rows ", n);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    const BF16* xs = x.data_ptr<BF16>();
    const BF16* w = weight.data_ptr<BF16>();
    BF16* os = out.data_ptr<BF16>();
    at::parallel_for(0, rows, rows_per_share(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rms_norm_row_bf16(xs + r * n, w, n, static_cast<float>(eps), os + r * n);
      }
    });
    return out;
  }
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_share(n), [&](int64_t begin, int64_t end) {
    lmgate::rms_norm_rows(xs + begin * n, w, end - begin, n, static_cast<float>(eps), os + begin * n);
  });
  return out;
}

// x += delta, in place, then returns rms_norm(x): the residual add of a decoder layer, in the norm's pass
// over x instead of an add of its own (a dispatch, a parallel region and a pass over the rows each).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta_in, const at::Tensor& weight_in, double eps) {
  check_rows_cpu(x, "x", x);
  check_rows_cpu(delta_in, "delta", x);
  check_rows_cpu(weight_in, "weight", x);
  TORCH_CHECK(x.is_contiguous() && x.sizes() == delta_in.sizes(), "x must be contiguous and delta of its shape");
  const at::Tensor delta = delta_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  TORCH_CHECK(weight.numel() == n, "weight has ", weight.numel(), " elements, x's rows ", n);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    BF16* xs = x.data_ptr<BF16>();
    const BF16* ds = delta.data_ptr<BF16>();
    const BF16* w = weight.data_ptr<BF16>();
    BF16* os = out.data_ptr<BF16>();
    at::parallel_for(0, rows, rows_per_share(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row_bf16(xs + r * n, ds + r * n, n);
        rms_norm_row_bf16(xs + r * n, w, n, static_cast<float>(eps), os + r * n);
      }
    });
    return out;
  }
  float* xs = x.data_ptr<float>();
  const float* ds = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_share(n), [&](int64_t begin, int64_t end) {
    at::vec::map2([](Vec a, Vec b) { return a + b; }, xs + begin * n, xs + begin * n, ds + begin * n, (end - begin) * n);
    lmgate::rms_norm_rows(xs + begin * n, w, end - begin, n, static_cast<float>(eps), os + begin * n);
  });
  return out;
}

// The index of each row's largest value, the first of equals, and of its first NaN if it has one: what
// torch's argmax returns, for greedy sampling's [rows, vocab] logits. torch's ran on one thread, 1.6 ms
// for 64 rows of 49,152 on a 2-core Zen 3: 1% of a float32 decode step.
at::Tensor argmax_rows(const at::Tensor& logits_in) {
  check_float_cpu(logits_in, "logits");
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xs = logits.data_ptr<float>();
  int64_t* os = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, rows_per_share(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xs + r * n;
      const float best = at::vec::reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, x, n);
      int64_t i = 0;
      if (std::isnan(best)) {
        while (i < n - 1 && !std::isnan(x[i])) ++i;
      } else {
        constexpr int none_equal = (1 << Vec::size()) - 1;  // zero_mask of a comparison with no lane equal
        while (i + Vec::size() <= n && (Vec::loadu(x + i) == Vec(best)).zero_mask() == none_equal) i += Vec::size();
        while (i < n - 1 && x[i] != best) ++i;  // best is one of the row's values: stops at it
      }
      os[r] = i;
    }
  });
  return out;
}

// One bfloat16 head: round(round(x * cos) + round(rotate_half(x) * sin)), the three roundings of the torch
// expression, `sin` carrying rotate_half's sign.
void rotary_head_bf16(const BF16* x, const BF16* cos, const BF16* sin, int64_t dim, BF16* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; d += BVec::size()) {
    const int64_t count = std::min<int64_t>(BVec::size(), half - d);
    const auto [a0, a1] = load_bf16(x + d, count);
    const auto [b0, b1] = load_bf16(x + half + d, count);
    const auto [c0, c1] = load_bf16(cos + d, count);
    const auto [s0, s1] = load_bf16(sin + d, count);
    const auto [ch0, ch1] = load_bf16(cos + half + d, count);
    const auto [sh0, sh1] = load_bf16(sin + half + d, count);
    const auto [p0, p1] = rounded(a0 * c0, a1 * c1);
    const auto [q0, q1] = rounded(b0 * s0, b1 * s1);
    store_bf16(p0 + q0, p1 + q1, out + d, count);
    const auto [ph0, ph1] = rounded(b0 * ch0, b1 * ch1);
    const auto [qh0, qh1] = rounded(a0 * sh0, a1 * sh1);
    store_bf16(ph0 + qh0, ph1 + qh1, out + half + d, count);
  }
}

// x: [T, heads, dim], rows of heads possibly strided (a view of the fused QKV projection); cos, sin:
// [T, 1, dim], sin carrying rotate_half's sign. Returns x * cos + rotate_half(x) * sin, contiguous.
at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_rows_cpu(x_in, "x", x_in);
  check_rows_cpu(cos_in, "cos", x_in);
  check_rows_cpu(sin_in, "sin", x_in);
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(2) % 2 == 0, "x must be [tokens, heads, dim] with an even dim");
  const int64_t tokens = x_in.size(0), heads = x_in.size(1), dim = x_in.size(2);
  const at::Tensor x = x_in.stride(2) == 1 && x_in.stride(1) == dim ? x_in : x_in.contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim, "cos and sin must be [tokens, 1, dim]");
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const int64_t row_stride = x.stride(0);
  if (x.scalar_type() == at::kBFloat16) {
    const BF16* xs = x.data_ptr<BF16>();
    const BF16* cs = cos.data_ptr<BF16>();
    const BF16* ss = sin.data_ptr<BF16>();
    BF16* os = out.data_ptr<BF16>();
    at::parallel_for(0, tokens, rows_per_share(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          rotary_head_bf16(xs + t * row_stride + h * dim, cs + t * dim, ss + t * dim, dim, os + (t * heads + h) * dim);
        }
      }
    });
    return out;
  }
  const float* xs = x.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* ss = sin.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, tokens, rows_per_share(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + t * dim;
      const float* s = ss + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        lmgate::rotary_head(xs + t * row_stride + h * dim, c, s, dim, os + (t * heads + h) * dim);
      }
    }
  });
  return out;
}

// gate_up: [..., 2 * n], the gate's half first. Returns silu(gate) * up, [..., n] (in bfloat16: silu's result
// rounded, then the product's).
at::Tensor silu_and_mul(const at::Tensor& gate_up_in) {
  check_rows_cpu(gate_up_in, "gate_up", gate_up_in);
  const at::Tensor gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up's last dimension must be even");
  const int64_t n = gate_up.size(-1) / 2, rows = n == 0 ? 0 : gate_up.numel() / (2 * n);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    const BF16* in = gate_up.data_ptr<BF16>();
    BF16* os = out.data_ptr<BF16>();
    at::parallel_for(0, rows, rows_per_share(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const BF16* gate = in + r * 2 * n;
        for (int64_t i = 0; i < n; i += BVec::size()) {
          const int64_t count = std::min<int64_t>(BVec::size(), n - i);
          const auto [g0, g1] = load_bf16(gate + i, count);
          const auto [u0, u1] = load_bf16(gate + n + i, count);
          const auto [s0, s1] = rounded(lmgate::silu(g0), lmgate::silu(g1));
          store_bf16(s0 * u0, s1 * u1, os + r * n + i, count);
        }
      }
    });
    return out;
  }
  const float* in = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_share(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      lmgate::silu_and_mul_row(in + r * 2 * n, in + r * 2 * n + n, n, os + r * n);
    }
  });
  return out;
}

// A step's keys and values into their slots of the caches [kv_heads, blocks, block_size, dim]: k and v are
// [T, kv_heads, dim] float32 or bfloat16 views of the QKV projection (rows strided); a narrower cache gets them
// rounded (`--kv-cache-dtype`). index_copy_ took about 45 us a call for a 64-row decode step, most of it in dispatch
// and its general indexing; here a row is one copy.
template <typename row_t, typename cache_t>
void store_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                const int64_t* slot) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), capacity = k_cache.size(1) * k_cache.size(2);
  const row_t* ks = k.data_ptr<row_t>();
  const row_t* vs = v.data_ptr<row_t>();
  cache_t* kc = k_cache.data_ptr<cache_t>();
  cache_t* vc = v_cache.data_ptr<cache_t>();
  at::parallel_for(0, tokens, rows_per_share(2 * heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t to = (h * capacity + slot[t]) * dim;
        at::vec::convert(ks + t * k.stride(0) + h * k.stride(1), kc + to, dim);
        at::vec::convert(vs + t * v.stride(0) + h * v.stride(1), vc + to, dim);
      }
    }
  });
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots_in) {
  check_rows_cpu(k, "k", k);
  check_rows_cpu(v, "v", k);
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16),
              "the caches must be CPU tensors of one dtype: float32, float16 or bfloat16");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(3),
              "k, v must be [tokens, kv_heads, dim] and the caches [kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rows of k and v, and the caches, must be contiguous");
  const at::Tensor slots = slots_in.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "one int64 slot per token");
  const int64_t capacity = k_cache.size(1) * k_cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " is outside the cache's ", capacity);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache_type, "store_kv", [&] {
    if (k.scalar_type() == at::kBFloat16) {
      store_rows<BF16, scalar_t>(k, v, k_cache, v_cache, slot);
    } else {
      store_rows<float, scalar_t>(k, v, k_cache, v_cache, slot);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmgate, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(lmgate, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("store_kv", &store_kv);
}
