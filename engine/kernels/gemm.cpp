// x @ W.T in float32, in two layouts of W: the float path's linear layers, and the quantized path's GEMM.
//
// Columns (`pack_columns`, `linear_columns`, `column_range`): W packed once into panels of `COLUMNS` output
// columns (3 vectors: 48 with AVX-512, 24 with AVX2), K-major, so a register tile is 8 rows of x (4 with AVX2)
// times 3 vectors of columns, each x broadcast and each weight vector loaded once per K step, with no reduction
// across lanes at the end. On a 2-core Zen 4 with AVX-512, in one run, SmolLM2's four layers and LM head over
// 30 layers' weights at 64 rows: 208-219 GFLOP/s against oneDNN's 174-208 and the row tiles' 110-140; 16 rows
// 182-202 against oneDNN's 127-162; 512 rows 217-226 against 208-223. oneDNN's weight blocks of 64 columns
// split N = 576 into 9, which 2 threads share 5 to 4; panels of 48 split it 6 to 6. With AVX2 code on the
// same machine the column tiles about tied the row tiles at 64 rows (180-199 against 189-208), beat them at 16 (140-162
// against 99-126) and 512 (214-220 against 200-206), and a float32 engine of 64 streams ran 333 against 302
// tokens/s (with decode_layers.cpp, which needs whole panels per thread).
//
// Gated columns (`pack_gated_columns`, `linear_gated_columns`, `gated_range`): a Llama MLP's gate_up W in pairs
// of panels, the gate and the up columns of the same COLUMNS activations, so that silu(gate) * up is computed
// in whole vectors from a tile's sums while they are in cache, and the [M, 2 x intermediate] projection is
// never written to memory and read back (the separate SiLU pass took 14 ms of a 600 ms step of 512 rows on the
// 2-core Zen 4: 586 against 608 ms a step with it gone; decode steps of 64 rows 105-110 against 112-115 ms).
// Pairs of whole panels, not halves of one, so that SiLU runs on whole vectors: 30 layers' gate_up at 64 rows,
// gated against plain and a SiLU pass, 32.5 against 33.4 ms with AVX-512 and 35.9 against 36.3 with AVX2 code,
// where AVX2's 12-float halves had taken 48.5 against 41.8.
//
// Rows (`panel_gemm`): W as rows of K weights, which quantized_matmul.cpp expands from blocks a panel of
// `PANEL` rows at a time into L2 while every row of x passes over them in register tiles of 4 rows x 3 weight
// rows (6 with AVX-512), the next panel prefetched a little per tile. Over float32 rows on a 2-core Zen 3, 64
// rows: 165 against oneDNN's 132 GFLOP/s, 16 rows: 132 against 86, 256 rows: 162 against 151.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm.h"

namespace lmgate {
// layer_ops.cpp
void silu_and_mul_row(const float* gate, const float* up, int64_t n, float* out);
}  // namespace lmgate

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t PANEL = 48;  // rows of W at a time: 48 x K floats stay in L2 for every row of x
// The register tile: 12 accumulators of AVX2's 16 vector registers; AVX-512 has 32, and with 24 of them each
// weight vector loaded serves 4 rows and each row's 6 weights (on a Zen 4, 4 x 3 ran at 110-140 GFLOP/s).
constexpr int64_t TILE_M = 4;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t TILE_N = 6;
#else
constexpr int64_t TILE_N = 3;
#endif
constexpr int64_t LINE = 64;

// A tile's 4 rows of x and 3 of W, K_CHUNK floats each (21 KB), stay in L1 while the panel's tiles pass over
// them; with K = 1536 whole rows (42 KB) did not, and the down projection ran at 151 GFLOP/s where the
// layers with K = 576 ran at 173 (2-core Zen 3; 166 in chunks of 768).
constexpr int64_t K_CHUNK = 768;

// K in equal chunks of at most K_CHUNK floats, each a whole number of vectors but the last.
int64_t chunk_length(int64_t k) {
  const int64_t chunks = (k + K_CHUNK - 1) / K_CHUNK, v = Vec::size();
  return ((k + chunks - 1) / chunks + v - 1) / v * v;
}

// out[m * stride] = the sum of acc[m]'s lanes (added to out[m * stride] when `add`), for the four rows of one
// column of a tile: two rounds of pairwise adds reduce all four at once, where one at a time took as many
// instructions each.
inline void store_sums4(const Vec acc[4], float* out, int64_t stride, bool add) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 z = acc[i];
    v[i] = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));
#else
    v[i] = acc[i];
#endif
  }
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  alignas(16) float sums[4];
  _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  for (int i = 0; i < 4; ++i) out[i * stride] = add ? out[i * stride] + sums[i] : sums[i];
#else
  for (int i = 0; i < 4; ++i) {
    const float sum = at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, acc[i]);
    out[i * stride] = add ? out[i * stride] + sum : sum;
  }
#endif
}

// out[m][n] = x[m] . panel[n] over k elements for an M x N tile whose rows are `ld` apart (or out[m][n] += it,
// when `add`), the sums running along K in vectors and reduced at the end.
template <int64_t M, int64_t N>
void dot_tile(const float* x, const float* panel, int64_t ld, int64_t k, float* out, int64_t out_stride, bool add) {
  Vec acc[N][M];
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) acc[n][m] = Vec(0.f);
  }
  for (int64_t i = 0; i < k; i += Vec::size()) {
    Vec b[N];
    for (int64_t n = 0; n < N; ++n) b[n] = Vec::loadu(panel + n * ld + i);
    for (int64_t m = 0; m < M; ++m) {
      const Vec a = Vec::loadu(x + m * ld + i);
      for (int64_t n = 0; n < N; ++n) acc[n][m] = at::vec::fmadd(a, b[n], acc[n][m]);
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    if constexpr (M == 4) {
      store_sums4(acc[n], out + n, out_stride, add);
    } else {
      for (int64_t m = 0; m < M; ++m) {
        const float sum = at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, acc[n][m]);
        out[m * out_stride + n] = add ? out[m * out_stride + n] + sum : sum;
      }
    }
  }
}

template <int64_t M = TILE_M, int64_t N = TILE_N>
void dot_any_tile(int64_t m, int64_t n, const float* x, const float* panel, int64_t ld, int64_t k, float* out,
                  int64_t out_stride, bool add) {
  if (m == M && n == N) {
    dot_tile<M, N>(x, panel, ld, k, out, out_stride, add);
  } else if constexpr (N > 1) {
    dot_any_tile<M, N - 1>(m, n, x, panel, ld, k, out, out_stride, add);
  } else if constexpr (M > 1) {
    dot_any_tile<M - 1, TILE_N>(m, n, x, panel, ld, k, out, out_stride, add);
  }
}

// The column layout: W^T in panels of COLUMNS output columns, [panels][K][COLUMNS], the last panel padded
// with zero columns.
constexpr int64_t PANEL_VECTORS = 3;
constexpr int64_t COLUMNS = PANEL_VECTORS * Vec::size();
// Rows of x per register tile: 8 x 3 accumulators of AVX-512's 32 registers, 4 x 3 of AVX2's 16.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t COLUMN_TILE_M = 8;
#else
constexpr int64_t COLUMN_TILE_M = 4;
#endif

// Lines of W a tile asks for ahead of their use: `lines` cache lines from `from` on, `burst` of them every
// AHEAD_STEPS steps of K.
struct Ahead {
  const char* from;
  int64_t lines, burst;
};
constexpr int64_t AHEAD_STEPS = 8;

// acc[m] += x[m][i] * panel[i] for the K steps [i0, i1), M rows of x `ld` apart.
template <int64_t M>
inline void column_steps(const float* x, int64_t ld, const float* panel, int64_t i0, int64_t i1,
                         Vec (&acc)[M][PANEL_VECTORS]) {
  for (int64_t i = i0; i < i1; ++i) {
    Vec b[PANEL_VECTORS];
    for (int64_t v = 0; v < PANEL_VECTORS; ++v) b[v] = Vec::loadu(panel + i * COLUMNS + v * Vec::size());
    for (int64_t m = 0; m < M; ++m) {
      const Vec a(x[m * ld + i]);
      for (int64_t v = 0; v < PANEL_VECTORS; ++v) acc[m][v] = at::vec::fmadd(a, b[v], acc[m][v]);
    }
  }
}

// out[m][0:cols] = x[m] @ panel (or += it, when `add`) for M rows of x `ld` apart, over k steps of the panel,
// asking for `ahead`'s lines into L2 on the way, a few every AHEAD_STEPS steps: a burst of requests at the
// tile's start held the miss buffers its own loads needed.
template <int64_t M>
void column_tile(const float* x, int64_t ld, const float* panel, int64_t k, float* out, int64_t out_stride,
                 int64_t cols, bool add, Ahead ahead) {
  Vec acc[M][PANEL_VECTORS];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t v = 0; v < PANEL_VECTORS; ++v) acc[m][v] = Vec(0.f);
  }
  int64_t i = 0, line = 0;
  for (; i + AHEAD_STEPS <= k; i += AHEAD_STEPS) {
    for (int64_t j = 0; j < ahead.burst && line < ahead.lines; ++j, ++line) {
      __builtin_prefetch(ahead.from + line * LINE, 0, 2);
    }
    column_steps<M>(x, ld, panel, i, i + AHEAD_STEPS, acc);
  }
  column_steps<M>(x, ld, panel, i, k, acc);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t v = 0; v < PANEL_VECTORS && v * Vec::size() < cols; ++v) {
      const int64_t count = std::min<int64_t>(Vec::size(), cols - v * Vec::size());
      float* o = out + m * out_stride + v * Vec::size();
      (add ? acc[m][v] + Vec::loadu(o, count) : acc[m][v]).store(o, count);
    }
  }
}

template <int64_t M = COLUMN_TILE_M>
void column_any_tile(int64_t m, const float* x, int64_t ld, const float* panel, int64_t k, float* out,
                     int64_t out_stride, int64_t cols, bool add, Ahead ahead) {
  if (m == M) {
    column_tile<M>(x, ld, panel, k, out, out_stride, cols, add, ahead);
  } else if constexpr (M > 1) {
    column_any_tile<M - 1>(m, x, ld, panel, k, out, out_stride, cols, add, ahead);
  }
}

// w: [N, K] float32 -> [ceil(N / COLUMNS), K, COLUMNS], what `linear_columns` reads.
at::Tensor pack_columns(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "w must be a float32 [N, K] tensor");
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + COLUMNS - 1) / COLUMNS;
  at::Tensor packed = at::zeros({panels, k, COLUMNS}, w.options());
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t cols = std::min(COLUMNS, n - p * COLUMNS);
    packed[p].narrow(1, 0, cols).copy_(w.narrow(0, p * COLUMNS, cols).t());
  }
  return packed;
}

// w: [2n, K] float32, a gate_up projection (gate's n rows, then up's) -> `pack_columns`' layout of its rows
// reordered [gate 0:C, up 0:C, gate C:2C, up C:2C, ...], C = COLUMNS, zero-padded: pairs of panels, the gate
// and the up columns of the same C activations, so that a pair's sums give them (`linear_gated_columns`) in
// whole vectors.
at::Tensor pack_gated_columns(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat && w_in.size(0) % 2 == 0,
              "w must be a float32 [2n, K] tensor");
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0) / 2, pairs = (n + COLUMNS - 1) / COLUMNS;
  at::Tensor paired = at::zeros({pairs * 2 * COLUMNS, w.size(1)}, w.options());
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t cols = std::min(COLUMNS, n - p * COLUMNS);
    paired.narrow(0, 2 * p * COLUMNS, cols).copy_(w.narrow(0, p * COLUMNS, cols));
    paired.narrow(0, (2 * p + 1) * COLUMNS, cols).copy_(w.narrow(0, n + p * COLUMNS, cols));
  }
  return pack_columns(paired);
}

// out[m][0:cols] = x[m] @ panel for the rows [m_begin, m_end) of x (out's row m_begin first), K in chunks;
// `done(m0, rows)` after a tile of rows has its last chunk.
//
// While a chunk's tiles run, they ask for the next chunk of W (after the panel's last: the memory that follows
// it, the next panel of the thread's share, or past it, which a prefetch may name without harm), a share each,
// so that the next chunk's first tile finds it in L2. Without, that tile waited on memory: on a 2-core Zen 3,
// 60 of SmolLM2's 1536 x 576 matrices streamed from memory ran 164 GFLOP/s at 64 rows, 108 at 16 and 184 at 256,
// against 188, 178 and 186 with one matrix in cache; with, 188, 143 and 188-191.
template <typename Done>
void column_panel(const float* x, int64_t m_begin, int64_t m_end, int64_t k, const float* panel, int64_t cols,
                  float* out, int64_t out_stride, Done&& done) {
  if (m_end <= m_begin) return;
  const int64_t chunk = chunk_length(k), tiles = (m_end - m_begin + COLUMN_TILE_M - 1) / COLUMN_TILE_M;
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t steps = std::min(chunk, k - k0), next_k = std::min(k0 + chunk, k);
    const int64_t next_steps = next_k < k ? std::min(chunk, k - next_k) : std::min(chunk, k);
    const int64_t next_lines = next_steps * COLUMNS * static_cast<int64_t>(sizeof(float)) / LINE;
    const int64_t per_tile = (next_lines + tiles - 1) / tiles, groups = std::max<int64_t>(1, steps / AHEAD_STEPS);
    const char* next = reinterpret_cast<const char*>(panel + next_k * COLUMNS);
    for (int64_t m0 = m_begin, tile = 0; m0 < m_end; m0 += COLUMN_TILE_M, ++tile) {
      const int64_t rows = std::min(COLUMN_TILE_M, m_end - m0);
      const int64_t first = std::min(next_lines, tile * per_tile), lines = std::min(next_lines - first, per_tile);
      const Ahead ahead{next + first * LINE, lines, (lines + groups - 1) / groups};
      column_any_tile(rows, x + m0 * k + k0, k, panel + k0 * COLUMNS, steps, out + (m0 - m_begin) * out_stride,
                      out_stride, cols, k0 > 0, ahead);
      if (k0 + chunk >= k) done(m0, rows);
    }
  }
}

// Panel p of an n-column W packed by `pack_columns`, for the rows [m_begin, m_end) of x.
void plain_panel(const float* x, int64_t m_begin, int64_t m_end, int64_t k, const float* packed, int64_t n,
                 int64_t p, float* out, int64_t out_stride) {
  column_panel(x, m_begin, m_end, k, packed + p * k * COLUMNS, std::min(COLUMNS, n - p * COLUMNS),
               out + m_begin * out_stride + p * COLUMNS, out_stride, [](int64_t, int64_t) {});
}

// Pair p of a gated pack (`pack_gated_columns`) of n activation columns, for the rows [m_begin, m_end) of x:
// the gate panel's sums into `scratch` (rows of 2 x COLUMNS floats, the gate's half first), then the up
// panel's, and from each of its finished tiles silu(gate) * up into out's columns [p * COLUMNS, (p + 1) *
// COLUMNS), while the tile's up sums are in L1 (its gate sums in L1 or L2).
void gated_panel(const float* x, int64_t m_begin, int64_t m_end, int64_t k, const float* packed, int64_t n,
                 int64_t p, float* scratch, float* out, int64_t out_stride) {
  const int64_t cols = std::min(COLUMNS, n - p * COLUMNS), stride = 2 * COLUMNS;
  const float* gate = packed + 2 * p * k * COLUMNS;
  column_panel(x, m_begin, m_end, k, gate, cols, scratch, stride, [](int64_t, int64_t) {});
  const auto activate = [&](int64_t m0, int64_t rows) {
    for (int64_t m = m0; m < m0 + rows; ++m) {
      const float* sums = scratch + (m - m_begin) * stride;
      lmgate::silu_and_mul_row(sums, sums + COLUMNS, cols, out + m * out_stride + p * COLUMNS);
    }
  };
  column_panel(x, m_begin, m_end, k, gate + k * COLUMNS, cols, scratch + COLUMNS, stride, activate);
}

// This thread's buffer of at least n floats for a gated panel's sums: grown when needed, never cleared (a
// vector per panel zeroed some 190 MB a step of 512 rows).
float* gated_scratch(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// fn(m_begin, m_end, p) over `panels` panels (or a gated pack's pairs) and the rows of x, on the team: threads
// take whole panels (each weight read from memory once) and, where panels are fewer than 4 per thread, blocks
// of rows too.
template <typename PanelFn>
void over_panels(int64_t m_rows, int64_t panels, PanelFn&& fn) {
  if (m_rows == 0 || panels == 0) return;  // a step in which no row samples asks the LM head for none
  const int64_t tiles = (m_rows + COLUMN_TILE_M - 1) / COLUMN_TILE_M;
  const int64_t row_blocks = std::min(tiles, (4 * at::get_num_threads() + panels - 1) / panels);
  const int64_t block_rows = (tiles + row_blocks - 1) / row_blocks * COLUMN_TILE_M;
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m_begin = item % row_blocks * block_rows;  // past the rows for a block the rounding left empty
      if (m_begin < m_rows) fn(m_begin, std::min(m_rows, m_begin + block_rows), item / row_blocks);
    }
  });
}

// out [M, n] from x [M, K] float32 and a pack of `n` output columns, COLUMNS of them for every `group` panels
// (1, or a gated pack's 2): `panel(x, m_begin, m_end, k, packed, n, p, out)` fills group p's columns for the
// rows [m_begin, m_end), on the team (`over_panels`).
template <typename PanelFn>
at::Tensor over_pack(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, int64_t group, PanelFn&& panel) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a float32 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(1) == x_in.size(1) && packed.size(2) == COLUMNS,
              "packed must be a float32 [panels, K, ", COLUMNS, "] pack with x's K");
  const int64_t groups = packed.size(0) / group;
  TORCH_CHECK(packed.size(0) % group == 0 && n > (groups - 1) * COLUMNS && n <= groups * COLUMNS,
              "n does not match the packed panels");
  const at::Tensor x = x_in.contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m_rows, n}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* os = out.data_ptr<float>();
  over_panels(m_rows, groups, [&](int64_t m_begin, int64_t m_end, int64_t p) {
    panel(xs, m_begin, m_end, k, w, n, p, os);
  });
  return out;
}

// x: [M, K] float32; packed: `pack_columns` of an [n, K] W. x @ W.T, [M, n].
at::Tensor linear_columns(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return over_pack(x, packed, n, 1, [](const float* xs, int64_t m_begin, int64_t m_end, int64_t k, const float* w,
                                       int64_t n, int64_t p, float* out) {
    plain_panel(xs, m_begin, m_end, k, w, n, p, out, n);
  });
}

// x: [M, K] float32; packed: `pack_gated_columns` of a [2n, K] gate_up W. silu(x @ Wgate.T) * (x @ Wup.T),
// [M, n]: a Llama MLP's activation, without writing and reading back the [M, 2n] projection.
at::Tensor linear_gated_columns(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return over_pack(x, packed, n, 2, [](const float* xs, int64_t m_begin, int64_t m_end, int64_t k, const float* w,
                                       int64_t n, int64_t p, float* out) {
    gated_panel(xs, m_begin, m_end, k, w, n, p, gated_scratch((m_end - m_begin) * 2 * COLUMNS), out, n);
  });
}

}  // namespace

namespace lmgate {

int64_t column_width() { return COLUMNS; }

void column_range(const float* x, int64_t m_rows, int64_t k, const float* packed, int64_t n, int64_t begin,
                  int64_t end, float* out, int64_t out_stride) {
  for (int64_t p = begin / COLUMNS; p * COLUMNS < end; ++p) plain_panel(x, 0, m_rows, k, packed, n, p, out, out_stride);
}

void gated_range(const float* x, int64_t m_rows, int64_t k, const float* packed, int64_t n, int64_t begin,
                 int64_t end, float* out, int64_t out_stride) {
  float* scratch = gated_scratch(m_rows * 2 * COLUMNS);
  for (int64_t p = begin / COLUMNS; p * COLUMNS < end; ++p) {
    gated_panel(x, 0, m_rows, k, packed, n, p, scratch, out, out_stride);
  }
}

// Threads take whole panels, each expanded into L2 and used a chunk of K at a time; while a thread works on
// one panel it prefetches the next of its own blocks, a few lines per tile, so that the expansion does not wait
// on memory.
void panel_gemm(const float* x, int64_t m_rows, int64_t k, int64_t n_rows, const WeightRows& w, float* out) {
  TORCH_CHECK(k % Vec::size() == 0, "K must be a multiple of ", Vec::size());
  if (m_rows == 0 || n_rows == 0) return;  // a step in which no row samples asks the LM head for none
  const int64_t panels = (n_rows + PANEL - 1) / PANEL;
  const int64_t chunk = chunk_length(k);
  const int64_t tiles = (k + chunk - 1) / chunk * ((m_rows + TILE_M - 1) / TILE_M) * ((PANEL + TILE_N - 1) / TILE_N);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(PANEL * k);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, n_rows - n0);
      w.expand(w.data + n0 * w.row_bytes, cols, w.row_bytes, k, panel.data());
      const char* next = reinterpret_cast<const char*>(w.data + (n0 + cols) * w.row_bytes);
      const int64_t next_lines = p + 1 < end ? std::min(PANEL, n_rows - n0 - cols) * w.row_bytes / LINE : 0;
      const int64_t per_tile = (next_lines + tiles - 1) / tiles;
      int64_t fetched = 0;
      for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        for (int64_t m0 = 0; m0 < m_rows; m0 += TILE_M) {
          for (int64_t j = 0; j < cols; j += TILE_N) {
            for (int64_t l = 0; l < per_tile && fetched < next_lines; ++l, ++fetched) {
              __builtin_prefetch(next + fetched * LINE);
            }
            dot_any_tile(std::min(TILE_M, m_rows - m0), std::min(TILE_N, cols - j), x + m0 * k + k0,
                         panel.data() + j * k + k0, k, std::min(chunk, k - k0), out + m0 * n_rows + n0 + j, n_rows, k0 > 0);
          }
        }
      }
    }
  });
}

}  // namespace lmgate

TORCH_LIBRARY_FRAGMENT(lmgate, m) {
  m.def("pack_columns(Tensor w) -> Tensor");
  m.def("linear_columns(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("pack_gated_columns(Tensor w) -> Tensor");
  m.def("linear_gated_columns(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmgate, CPU, m) {
  m.impl("pack_columns", &pack_columns);
  m.impl("linear_columns", &linear_columns);
  m.impl("pack_gated_columns", &pack_gated_columns);
  m.impl("linear_gated_columns", &linear_gated_columns);
}
