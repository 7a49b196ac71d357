// x @ W.T over GGUF blocks with int8 activations (`--int8-activations`, off by default: it changes the numbers).
//
// A many-row step with float32 activations is bound by the FMA rate: gemm.cpp's loop over expanded panels
// reaches about 80% of it, and one FMA instruction is 8 multiply-adds. AVX2's vpmaddubsw multiplies 32 pairs of
// bytes (unsigned by signed) and adds neighbours into int16 in one instruction: with x rounded to int8 and W's
// own 4- or 5-bit unsigned integers, a block of 32 weights sums in int16 without overflow (8 x 2 x 15 x 127 <
// 32767 for 4 bits; 5 bits widen to int32 every 4 steps), and the float scales are applied once per block.
// Q8_0's signed integers go in as |w| times x with w's sign (vpsignb), widened at every step.
//
// Where the CPU has AVX512-VNNI (Ice Lake and later, Zen 4 and later: the caller says so, from
// engine/machine/hardware.py), vpdpbusd does the same 4-byte dot products and adds them into int32 in one instruction:
// no int16 sums to widen, half the instructions per step.
//
// x is rounded per block of 32 (one scale each, as llama.cpp's Q8_0 activations): q = round(x * 127 / max|x|).
// A step of few rows (decoding: `gguf_matvec_int8`, and decode_layers.cpp) reads W's blocks where they lie, one
// row at a time: 32 weights widen to 32 bytes and one dot product per row of x sums them, against some 14
// 256-bit operations per block for float32 x; on a Zen 4, 1.6 times the blocks per second.
// For many rows (`gguf_matmul_int8`), W's rows are taken 8 at a time, "a group": its panel holds, for every 4 consecutive K, the 4 integers of each
// of the 8 rows side by side (32 bytes), so that one vpmaddubsw against 4 bytes of x broadcast gives the 8 rows'
// partial sums in its lanes, and no horizontal sums are needed. Each block of 32 has a scale and a minimum per row
// (w = scale * q + min); the minimum multiplies the sum of x's rounded block. The result is x rounded, exactly
// as rounded, times W: only the summation order differs from float64 over the same two. Types: Q4_0, Q4_1,
// Q8_0, Q4_K, Q5_K (blocks of 32 with one scale each); the caller runs Q6_K (scales per 16) with float32
// activations.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "int8_matmul.h"

namespace {

using namespace lmgate;

constexpr int64_t BLOCK = 32;         // weights (and activations) per scale
constexpr int64_t GROUP = 8;          // rows of W whose sums share a vector
constexpr int64_t STEPS = BLOCK / 4;  // broadcasts of 4 bytes of x per block
constexpr int64_t PANEL_GROUPS = 8;   // groups expanded at a time: 64 rows of W, K x 64 bytes, stay in L2
constexpr int TILE_ROWS = 4;          // rows of x per tile, against two groups: 8 int16 accumulators
constexpr int64_t LINE = 64;

constexpr bool supported(int64_t type) { return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K || type == Q5_K; }

// Q8_0's integers are signed, and vpmaddubsw wants one operand unsigned: |w| times x with w's sign.
constexpr bool signed_ints(int64_t type) { return type == Q8_0; }

// Steps of int16 sums before they are widened to int32: 4-bit integers never overflow a block; 5-bit ones would
// after 4 steps, and one step of 8-bit ones comes near the limit (2 x 128 x 127).
constexpr int widen_steps(int64_t type) { return type == Q5_K ? 4 : type == Q8_0 ? 1 : STEPS; }

// x as int8 per block of 32: q = round(x / scale). `sum` is the block's sum as rounded, scale * sum(q), which
// the weights' minimums multiply: with x's own sum the two parts of w = scale * q + min would see different x, and
// where they nearly cancel (Q4_0's q - 8) the error grew threefold. Each block's scale and sum lie side by side
// (`scale_sum`), so the matvec multiplies both by the weights' scale and minimum in one operation.
struct Int8Rows {
  std::vector<int8_t> q;         // [M, K]
  std::vector<float> scale_sum;  // [M, K / 32, 2]
};

void quantize_block(const float* x, int8_t* q, float* scale, float* sum) {
#if defined(__AVX2__)
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i ints[4];
  for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // rounds to nearest even
  const __m256i words = _mm256_packs_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
  // The packs interleave 128-bit lanes: dwords 0, 4, 1, 5, ... hold x's bytes in order.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  alignas(32) int16_t halves[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(halves), words);
  int32_t total = 0;
  for (int16_t h : halves) total += h;
  *scale = top / 127.f;
  *sum = *scale * static_cast<float>(total);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::abs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t i = 0; i < BLOCK; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    total += q[i];
  }
  *scale = amax / 127.f;
  *sum = *scale * static_cast<float>(total);
#endif
}

// A few thousand blocks round on the calling thread: a parallel region of their own would wake the sleeping
// OpenMP threads (engine/__init__.py) once more per call, for less work than a wake-up costs.
constexpr int64_t QUANTIZE_GRAIN = 4096;

Int8Rows quantize_rows(const float* x, int64_t m, int64_t k) {
  const int64_t blocks = k / BLOCK;
  Int8Rows rows{std::vector<int8_t>(m * k), std::vector<float>(m * blocks * 2)};
  at::parallel_for(0, m * blocks, QUANTIZE_GRAIN, [&](int64_t begin, int64_t end) {
    lmgate::quantize_int8(x + begin * BLOCK, 1, (end - begin) * BLOCK, rows.q.data() + begin * BLOCK,
                          rows.scale_sum.data() + 2 * begin);
  });
  return rows;
}

// Block j (of 32 weights) of a row as 32 integers (unsigned but Q8_0's), with the scale and minimum they share.
template <int64_t TYPE>
void block_ints(const uint8_t* row, int64_t j, uint8_t q[BLOCK], float* scale, float* min) {
  if constexpr (TYPE == Q8_0) {
    const uint8_t* b = row + j * layout_of(TYPE).bytes;
    *scale = half_at(b);
    *min = 0.f;
    std::memcpy(q, b + 2, BLOCK);  // int8 as bytes
  } else if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
    const uint8_t* b = row + j * layout_of(TYPE).bytes;
    const uint8_t* qs = b + (TYPE == Q4_0 ? 2 : 4);
    *scale = half_at(b);
    *min = TYPE == Q4_0 ? -8.f * *scale : half_at(b + 2);
    for (int l = 0; l < 16; ++l) {
      q[l] = qs[l] & 0xF;
      q[l + 16] = qs[l] >> 4;
    }
  } else {
    const uint8_t* b = row + j / 8 * layout_of(TYPE).bytes;
    const int sub = static_cast<int>(j % 8), pair = sub / 2;
    float sc, mn;
    scale_min(b + 4, sub, &sc, &mn);
    *scale = half_at(b) * sc;
    *min = -half_at(b + 2) * mn;
    const uint8_t* qs = b + (TYPE == Q5_K ? 48 : 16) + 32 * pair;
    for (int l = 0; l < 32; ++l) {
      q[l] = sub % 2 ? qs[l] >> 4 : qs[l] & 0xF;
      if constexpr (TYPE == Q5_K) q[l] |= ((b[16 + l] >> sub) & 1) << 4;
    }
  }
}

#if defined(__AVX2__)
template <int64_t TYPE>
__m256i block_ints_avx2(const uint8_t* row, int64_t j) {
  if constexpr (TYPE == Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * layout_of(TYPE).bytes + 2));
  } else if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
    const uint8_t* b = row + j * layout_of(TYPE).bytes;
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (TYPE == Q4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
  } else {
    __m256i ints[2];
    k_quant_ints<TYPE == Q5_K>(row + j / 8 * layout_of(TYPE).bytes, static_cast<int>(j % 8) / 2, ints);
    return ints[j % 2];
  }
}

// The scale and minimum that block j's integers share, in lanes 0 and 1 (Q4_1's two halves converted at once).
template <int64_t TYPE>
__m128 block_scale_min(const uint8_t* row, int64_t j) {
  if constexpr (TYPE == Q4_1) {
    int32_t both;
    std::memcpy(&both, row + j * layout_of(TYPE).bytes, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(both));
  } else if constexpr (TYPE == Q4_0 || TYPE == Q8_0) {
    const float d = half_at(row + j * layout_of(TYPE).bytes);
    return _mm_setr_ps(d, TYPE == Q4_0 ? -8.f * d : 0.f, 0.f, 0.f);
  } else {
    const uint8_t* b = row + j / 8 * layout_of(TYPE).bytes;
    float sc, mn;
    scale_min(b + 4, static_cast<int>(j % 8), &sc, &mn);
    return _mm_setr_ps(half_at(b) * sc, -half_at(b + 2) * mn, 0.f, 0.f);
  }
}

// v[r] holds 8 dwords of row r; afterwards v[s] holds dword s of every row, row r in dword r.
inline void transpose8x8(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}
#endif

// A group: 8 rows of W (the first `rows` real, the rest zero) as q [K / 4][32 bytes] (K index 4s + i of row r
// at byte 32s + 4r + i), scale and min [K / 32][8].
struct GroupView {
  uint8_t* q;
  float* scale;
  float* min;
};

template <int64_t TYPE>
void expand_group(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t k, GroupView g) {
  for (int64_t j = 0; j < k / BLOCK; ++j) {
    float* scale = g.scale + j * GROUP;
    float* min = g.min + j * GROUP;
    uint8_t* q = g.q + j * BLOCK * GROUP;
#if defined(__AVX2__)
    __m256i v[GROUP];
    for (int64_t r = 0; r < GROUP; ++r) {
      const __m128 pair = r < rows ? block_scale_min<TYPE>(w + r * row_bytes, j) : _mm_setzero_ps();
      v[r] = r < rows ? block_ints_avx2<TYPE>(w + r * row_bytes, j) : _mm256_setzero_si256();
      scale[r] = _mm_cvtss_f32(pair);
      min[r] = _mm_cvtss_f32(_mm_movehdup_ps(pair));
    }
    transpose8x8(v);
    for (int64_t s = 0; s < STEPS; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + s * 32), v[s]);
#else
    uint8_t ints[GROUP][BLOCK] = {};
    for (int64_t r = 0; r < GROUP; ++r) {
      if (r < rows) {
        block_ints<TYPE>(w + r * row_bytes, j, ints[r], scale + r, min + r);
      } else {
        scale[r] = min[r] = 0.f;
      }
    }
    for (int64_t s = 0; s < STEPS; ++s) {
      for (int64_t r = 0; r < GROUP; ++r) std::memcpy(q + s * 32 + r * 4, ints[r] + s * 4, 4);
    }
#endif
  }
}

// One tile: R rows of x against C groups over all of K, into out (`cols` of the 8 * C columns are real).
struct Tile {
  const int8_t* xq;      // R rows of K
  const float* xscale_sum;  // R rows of K / 32 pairs
  int64_t k;
  GroupView group;       // the first group; the next is `group_bytes` / `group_blocks` further
  int64_t group_bytes;   // K * 8
  int64_t group_blocks;  // K / 32 * 8
  float* out;
  int64_t out_stride;
  int64_t cols;
};

// The two ways to a 4-byte dot product of unsigned w and signed x: AVX2's vpmaddubsw (int16 sums, widened by
// the caller) or AVX512-VNNI's vpdpbusd (added into int32 as it goes).
enum class Dot { MADDUBS, VNNI };

#if defined(__AVX2__) && defined(__FMA__)
// vpdpbusd (the EVEX form, AVX512-VNNI with VL) written as asm: the assembler takes it whatever the compiler's
// target, so one loop serves both ways and nothing else in it may become an AVX-512 instruction.
inline __m256i dot_vnni(__m256i acc, __m256i w, __m256i x) {
  asm("vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
  return acc;
}
#endif

template <int R, int C, int64_t TYPE, Dot DOT>
void tile(const Tile& t) {
  constexpr int WIDEN = widen_steps(TYPE);
  constexpr bool IN_WHOLE = DOT == Dot::VNNI || WIDEN < STEPS;  // a block's sums end in `whole`, else in `part`
  const int64_t blocks = t.k / BLOCK;
  alignas(32) float sums[R][C * GROUP];
#if defined(__AVX2__) && defined(__FMA__)
  // The float sums live in `sums` (L1): with them in registers a 4 x 2 tile needs 19 of the 16, and the
  // compiler's spills landed inside the integer loop.
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm256_store_ps(sums[r] + c * GROUP, _mm256_setzero_ps());
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i part[R][C], whole[R][C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) part[r][c] = whole[r][c] = _mm256_setzero_si256();
    }
#pragma GCC unroll 1
    for (int s = 0; s < STEPS; ++s) {
      __m256i w[C], magnitude[C];
      for (int c = 0; c < C; ++c) {
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.group.q + c * t.group_bytes + (b * STEPS + s) * 32));
        if constexpr (signed_ints(TYPE)) magnitude[c] = _mm256_abs_epi8(w[c]);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, t.xq + r * t.k + b * BLOCK + s * 4, 4);
        const __m256i x = _mm256_set1_epi32(four);
        for (int c = 0; c < C; ++c) {
          const __m256i wu = signed_ints(TYPE) ? magnitude[c] : w[c];
          const __m256i xs = signed_ints(TYPE) ? _mm256_sign_epi8(x, w[c]) : x;
          if constexpr (DOT == Dot::VNNI) {
            whole[r][c] = dot_vnni(whole[r][c], wu, xs);
          } else {
            part[r][c] = _mm256_add_epi16(part[r][c], _mm256_maddubs_epi16(wu, xs));
          }
        }
      }
      if (DOT == Dot::MADDUBS && WIDEN < STEPS && (s + 1) % WIDEN == 0) {
        for (int r = 0; r < R; ++r) {
          for (int c = 0; c < C; ++c) {
            whole[r][c] = _mm256_add_epi32(whole[r][c], _mm256_madd_epi16(part[r][c], ones));
            part[r][c] = _mm256_setzero_si256();
          }
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m256 scale = _mm256_loadu_ps(t.group.scale + c * t.group_blocks + b * GROUP);
      const __m256 min = _mm256_loadu_ps(t.group.min + c * t.group_blocks + b * GROUP);
      for (int r = 0; r < R; ++r) {
        const __m256i ints = IN_WHOLE ? whole[r][c] : _mm256_madd_epi16(part[r][c], ones);
        float* acc = sums[r] + c * GROUP;
        const float* xs = t.xscale_sum + 2 * (r * blocks + b);
        __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_mul_ps(scale, _mm256_set1_ps(xs[0])), _mm256_load_ps(acc));
        _mm256_store_ps(acc, _mm256_fmadd_ps(min, _mm256_set1_ps(xs[1]), sum));
      }
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t n = 0; n < C * GROUP; ++n) {
      const int64_t c = n / GROUP, lane = n % GROUP;
      const uint8_t* q = t.group.q + c * t.group_bytes + lane * 4;
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < BLOCK; ++i) {
          const uint8_t byte = q[(b * STEPS + i / 4) * 32 + i % 4];
          const int32_t wi = signed_ints(TYPE) ? static_cast<int8_t>(byte) : byte;
          dot += wi * t.xq[r * t.k + b * BLOCK + i];
        }
        const int64_t at = c * t.group_blocks + b * GROUP + lane;
        const float* xs = t.xscale_sum + 2 * (r * blocks + b);
        total += static_cast<float>(dot) * (t.group.scale[at] * xs[0]) + t.group.min[at] * xs[1];
      }
      sums[r][n] = total;
    }
  }
#endif
  for (int r = 0; r < R; ++r) std::memcpy(t.out + r * t.out_stride, sums[r], t.cols * sizeof(float));
}

template <int64_t TYPE, int R = TILE_ROWS>
void any_tile(int64_t rows, int64_t groups, bool vnni, const Tile& t) {
  if (rows == R) {
    if (vnni) {
      groups == 2 ? tile<R, 2, TYPE, Dot::VNNI>(t) : tile<R, 1, TYPE, Dot::VNNI>(t);
    } else {
      groups == 2 ? tile<R, 2, TYPE, Dot::MADDUBS>(t) : tile<R, 1, TYPE, Dot::MADDUBS>(t);
    }
  } else if constexpr (R > 1) {
    any_tile<TYPE, R - 1>(rows, groups, vnni, t);
  }
}

template <int64_t TYPE>
void matmul_int8(const float* x, int64_t m_rows, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n_rows,
                 bool vnni, float* out) {
  const Int8Rows xq = quantize_rows(x, m_rows, k);
  const int64_t blocks = k / BLOCK, groups = (n_rows + GROUP - 1) / GROUP;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> q(PANEL_GROUPS * k * GROUP);
    std::vector<float> scale(PANEL_GROUPS * blocks * GROUP), min(PANEL_GROUPS * blocks * GROUP);
    const auto view = [&](int64_t i) {
      return GroupView{q.data() + i * k * GROUP, scale.data() + i * blocks * GROUP, min.data() + i * blocks * GROUP};
    };
    for (int64_t g0 = begin; g0 < end; g0 += PANEL_GROUPS) {
      const int64_t count = std::min(PANEL_GROUPS, end - g0);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t n0 = (g0 + i) * GROUP;
        expand_group<TYPE>(w + n0 * row_bytes, row_bytes, std::min(GROUP, n_rows - n0), k, view(i));
      }
      // The next panel's blocks are fetched a few lines per tile while this one's tiles run: at 64 rows, waiting
      // for them at the next expansion took a tenth of the call.
      const int64_t next_n0 = (g0 + count) * GROUP;
      const int64_t next_rows = g0 + count < end ? std::min(std::min(PANEL_GROUPS, end - g0 - count) * GROUP, n_rows - next_n0) : 0;
      const char* next = reinterpret_cast<const char*>(w + next_n0 * row_bytes);
      const int64_t lines = next_rows * row_bytes / LINE;
      const int64_t per_tile = (lines + (m_rows + TILE_ROWS - 1) / TILE_ROWS * ((count + 1) / 2) - 1) /
                               ((m_rows + TILE_ROWS - 1) / TILE_ROWS * ((count + 1) / 2));
      int64_t fetched = 0;
      for (int64_t m0 = 0; m0 < m_rows; m0 += TILE_ROWS) {
        for (int64_t i = 0; i < count; i += 2) {
          for (int64_t l = 0; l < per_tile && fetched < lines; ++l, ++fetched) __builtin_prefetch(next + fetched * LINE);
          const int64_t n0 = (g0 + i) * GROUP, pair = std::min<int64_t>(2, count - i);
          const Tile t{xq.q.data() + m0 * k, xq.scale_sum.data() + 2 * m0 * blocks, k, view(i),
                       k * GROUP, blocks * GROUP, out + m0 * n_rows + n0, n_rows, std::min(pair * GROUP, n_rows - n0)};
          any_tile<TYPE>(std::min<int64_t>(TILE_ROWS, m_rows - m0), pair, vnni, t);
        }
      }
    }
  });
}

constexpr int64_t MATVEC_ROWS = 8;  // rows of x one pass over W serves (quantized_matmul.cpp's MAX_ROWS)

// out[m, n] = x[m] . W[n] for `ROWS` rows of x as rounded (`xq`, each block's scale and sum in `xss`) and rows
// n_begin .. n_end of W, read one block at a time where it lies: its 32 integers meet each row's 32 bytes in one
// dot product, and its scale and minimum multiply the row's scale and sum in one more. x as rounded times W, as
// the GEMM's tiles compute it; the float steps after the exact integer sums round in another order, so the two
// agree to float32 rounding, not to the bit.
template <int ROWS, int64_t TYPE, Dot DOT>
void matvec_int8_rows(const int8_t* xq, const float* xss, int64_t k, const uint8_t* w, int64_t row_bytes,
                      int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  const int64_t blocks = k / BLOCK;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * row_bytes;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[ROWS];
    __m128 offsets[ROWS];
    for (int m = 0; m < ROWS; ++m) {
      acc[m] = _mm256_setzero_ps();
      offsets[m] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256i wq = block_ints_avx2<TYPE>(row, b);
      const __m256i wu = signed_ints(TYPE) ? _mm256_abs_epi8(wq) : wq;
      const __m128 scale_min = block_scale_min<TYPE>(row, b);
      for (int m = 0; m < ROWS; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + b * BLOCK));
        const __m256i xs = signed_ints(TYPE) ? _mm256_sign_epi8(x, wq) : x;
        const __m256i ints = DOT == Dot::VNNI ? dot_vnni(_mm256_setzero_si256(), wu, xs)
                                              : _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), _mm256_set1_epi16(1));
        // [scale * x's scale, min * x's sum]
        const __m128 f = _mm_mul_ps(scale_min, _mm_castsi128_ps(_mm_loadl_epi64(
                                                   reinterpret_cast<const __m128i*>(xss + 2 * (m * blocks + b)))));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_broadcastss_ps(f), acc[m]);
        offsets[m] = _mm_add_ps(offsets[m], f);
      }
    }
    for (int m = 0; m < ROWS; ++m) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
      out[m * out_stride + n] = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q))) +
                                _mm_cvtss_f32(_mm_movehdup_ps(offsets[m]));
    }
#else
    for (int m = 0; m < ROWS; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t q[BLOCK];
        float scale, min;
        block_ints<TYPE>(row, b, q, &scale, &min);
        int32_t dot = 0;
        for (int64_t i = 0; i < BLOCK; ++i) {
          dot += (signed_ints(TYPE) ? static_cast<int8_t>(q[i]) : q[i]) * xq[m * k + b * BLOCK + i];
        }
        const float* xs = xss + 2 * (m * blocks + b);
        total += static_cast<float>(dot) * (scale * xs[0]) + min * xs[1];
      }
      out[m * out_stride + n] = total;
    }
#endif
  }
}

template <int64_t TYPE, int ROWS = 1>
void matvec_int8_any_rows(int64_t rows, bool vnni, const int8_t* xq, const float* xss, int64_t k, const uint8_t* w,
                          int64_t row_bytes, int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  if (rows == ROWS) {
    (vnni ? matvec_int8_rows<ROWS, TYPE, Dot::VNNI> : matvec_int8_rows<ROWS, TYPE, Dot::MADDUBS>)(
        xq, xss, k, w, row_bytes, n_begin, n_end, out, out_stride);
  } else if constexpr (ROWS < MATVEC_ROWS) {
    matvec_int8_any_rows<TYPE, ROWS + 1>(rows, vnni, xq, xss, k, w, row_bytes, n_begin, n_end, out, out_stride);
  }
}

// The checks both ops make: float32 [M, K] x, blocks of a type the kernels take, vpdpbusd only where it runs.
at::Tensor checked_x(const at::Tensor& x, const at::Tensor& blocks, int64_t type, bool vnni) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a float32 [M, K] tensor");
  TORCH_CHECK(supported(type), "int8 activations need Q4_0, Q4_1, Q8_0, Q4_K or Q5_K weights, got type ", type);
  TORCH_CHECK(!vnni || lmgate::vnni_runs(), "vnni asked for on a CPU without AVX512-VNNI");
  check_gguf_blocks(blocks, type, x.size(1));
  return x.contiguous();
}

// x: [M, K] float32; blocks: [N, row_bytes] of a type `supported` takes. x @ W.T with x rounded to int8, with
// vpdpbusd where `vnni` (the same numbers: integer sums are exact either way).
at::Tensor gguf_matmul_int8(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, bool vnni) {
  const at::Tensor x = checked_x(x_in, blocks, type, vnni);
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = blocks.size(0);
  at::Tensor out = at::empty({m_rows, n_rows}, x.options());
  if (m_rows == 0 || n_rows == 0) return out;
  with_type(type, [&](auto t) {
    if constexpr (supported(decltype(t)::value)) {  // checked_x refused the others
      matmul_int8<decltype(t)::value>(x.data_ptr<float>(), m_rows, k, blocks.data_ptr<uint8_t>(), blocks.size(1),
                                      n_rows, vnni, out.data_ptr<float>());
    }
  });
  return out;
}

// gguf_matmul_int8 for a few rows (any number; 8 at a time): each thread reads its rows of W once.
at::Tensor gguf_matvec_int8(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, bool vnni) {
  const at::Tensor x = checked_x(x_in, blocks, type, vnni);
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = blocks.size(0);
  at::Tensor out = at::empty({m_rows, n_rows}, x.options());
  if (m_rows == 0 || n_rows == 0) return out;
  const Int8Rows xq = quantize_rows(x.data_ptr<float>(), m_rows, k);
  at::parallel_for(0, n_rows, 8, [&](int64_t begin, int64_t end) {
    lmgate::gguf_matvec_int8_range(type, m_rows, xq.q.data(), xq.scale_sum.data(), k, blocks.data_ptr<uint8_t>(),
                                   blocks.size(1), begin, end, vnni, out.data_ptr<float>(), n_rows);
  });
  return out;
}

}  // namespace

namespace lmgate {

bool int8_type(int64_t type) { return supported(type); }

bool vnni_runs() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

void quantize_int8(const float* x, int64_t rows, int64_t k, int8_t* q, float* scale_sum) {
  for (int64_t i = 0; i < rows * (k / BLOCK); ++i) quantize_block(x + i * BLOCK, q + i * BLOCK, scale_sum + 2 * i, scale_sum + 2 * i + 1);
}

void gguf_matvec_int8_range(int64_t type, int64_t rows, const int8_t* xq, const float* scale_sum, int64_t k,
                            const uint8_t* w, int64_t row_bytes, int64_t n_begin, int64_t n_end, bool vnni, float* out,
                            int64_t out_stride) {
  TORCH_CHECK(supported(type), "int8 activations need Q4_0, Q4_1, Q8_0, Q4_K or Q5_K weights, got type ", type);
  with_type(type, [&](auto t) {
    if constexpr (supported(decltype(t)::value)) {
      for (int64_t m0 = 0; m0 < rows; m0 += MATVEC_ROWS) {
        matvec_int8_any_rows<decltype(t)::value>(std::min(MATVEC_ROWS, rows - m0), vnni, xq + m0 * k,
                                                 scale_sum + 2 * m0 * (k / BLOCK), k, w, row_bytes, n_begin, n_end,
                                                 out + m0 * out_stride, out_stride);
      }
    }
  });
}

}  // namespace lmgate

TORCH_LIBRARY_FRAGMENT(lmgate, m) {
  m.def("gguf_matmul_int8(Tensor x, Tensor blocks, int type, bool vnni=False) -> Tensor");
  m.def("gguf_matvec_int8(Tensor x, Tensor blocks, int type, bool vnni=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmgate, CPU, m) {
  m.impl("gguf_matmul_int8", &gguf_matmul_int8);
  m.impl("gguf_matvec_int8", &gguf_matvec_int8);
}
