// Linear layers over GGUF's quantized blocks, kept in memory as the file stores them.
//
// A quantized row of K weights is K / 32 (Q4_0, Q4_1, Q8_0) or K / 256 (Q4_K, Q5_K, Q6_K) blocks; each
// block holds its weights' small integers and the scales (and minimums) that turn them back into floats.
// `gguf_dequantize` writes rows out as fp32; `gguf_matvec` computes x @ W.T for a few rows of x without
// ever writing W out: each block is expanded in registers (or a small buffer in L1) and multiplied into every
// row of x while it is there, so W streams through memory once per call, at a fifth to an eighth of fp32's
// bytes; `gguf_matmul`, for many rows, expands panels of W into L2 for gemm.cpp's float32 GEMM, so that each
// weight is expanded once for all the rows.
// All arithmetic is fp32: the values are exactly those `gguf.quants.dequantize` gives, only the order of
// the sums differs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.h"
#include "gguf_blocks.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace lmgate {
void gguf_matvec_range(int64_t type, int64_t rows, const float* x, int64_t k, const uint8_t* w, int64_t row_bytes,
                       int64_t n_begin, int64_t n_end, float* out, int64_t out_stride);
}

namespace {

using namespace lmgate;
using Vec = at::vec::Vectorized<float>;

// Low nibbles are the block's first 16 weights, high nibbles the next 16 (Q4_0 and Q4_1).
void nibbles(const uint8_t* qs, float scale, float offset, float* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = static_cast<float>(qs[j] & 0xF) * scale + offset;
    out[j + 16] = static_cast<float>(qs[j] >> 4) * scale + offset;
  }
}

// Q4_K / Q5_K: 8 sub-blocks of 32, each weight = d * scale * q - dmin * min; Q5_K adds a fifth bit from qh.
template <bool FIVE_BITS>
void k_quant(const uint8_t* b, float* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = FIVE_BITS ? b + 48 : b + 16;
  for (int pair = 0; pair < 4; ++pair) {  // 64 weights: the low nibbles of 32 bytes, then their high nibbles
    float s0, m0, s1, m1;
    scale_min(scales, 2 * pair, &s0, &m0);
    scale_min(scales, 2 * pair + 1, &s1, &m1);
    const float d0 = d * s0, d1 = d * s1, o0 = dmin * m0, o1 = dmin * m1;
    const uint8_t* q = qs + 32 * pair;
    float* y = out + 64 * pair;
    for (int l = 0; l < 32; ++l) {
      int lo = q[l] & 0xF, hi = q[l] >> 4;
      if (FIVE_BITS) {
        lo += ((qh[l] >> (2 * pair)) & 1) << 4;
        hi += ((qh[l] >> (2 * pair + 1)) & 1) << 4;
      }
      y[l] = d0 * static_cast<float>(lo) - o0;
      y[l + 32] = d1 * static_cast<float>(hi) - o1;
    }
  }
}

// Q6_K: 16 sub-blocks of 16 with int8 scales; 4 low bits in ql, 2 high bits in qh, offset by 32.
void q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int half = 0; half < 2; ++half) {  // 128 weights from 64 bytes of ql and 32 of qh
    const uint8_t* l4 = ql + 64 * half;
    const uint8_t* h2 = qh + 32 * half;
    const int8_t* s = sc + 8 * half;
    float* y = out + 128 * half;
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((l4[l] & 0xF) | (((h2[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((l4[l + 32] & 0xF) | (((h2[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(s[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(s[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(s[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(s[is + 6]) * static_cast<float>(q4);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight unsigned bytes as floats, times a scale plus an offset.
inline __m256 u8x8(__m128i bytes, __m256 scale, __m256 offset) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), scale, offset);
}

// 16 bytes of nibbles: the low nibbles are weights 0..15, the high ones 16..31.
inline void nibbles_avx2(const uint8_t* qs, float scale, float offset, float* out) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xF);
  const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  _mm256_storeu_ps(out, u8x8(lo, s, o));
  _mm256_storeu_ps(out + 8, u8x8(_mm_srli_si128(lo, 8), s, o));
  _mm256_storeu_ps(out + 16, u8x8(hi, s, o));
  _mm256_storeu_ps(out + 24, u8x8(_mm_srli_si128(hi, 8), s, o));
}

inline void q8_0_avx2(const uint8_t* b, float* out) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  for (int j = 0; j < 32; j += 8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + j));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
  }
}

// The 32 bytes of `q` as four vectors of floats: unsigned (Q4_K, Q5_K) or signed (Q6_K).
template <bool SIGNED>
inline void bytes_as_floats(__m256i q, __m256 out[4]) {
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 2; ++j) {
      const __m128i bytes = j ? _mm_srli_si128(halves[h], 8) : halves[h];
      out[2 * h + j] = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
    }
  }
}

// Q6_K, weights 128 * half + 32 * quarter .. + 31 as 32 signed integers: 4 low bits from ql, 2 high bits
// from qh, less 32. Each 16 share an int8 scale: sc[8 * half + 2 * quarter] and the next.
inline __m256i q6_k_ints(const uint8_t* b, int half, int quarter) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (quarter & 1)));
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  const __m256i four = _mm256_and_si256(_mm256_srli_epi16(low, 4 * (quarter >> 1)), _mm256_set1_epi8(0xF));
  const __m256i two = _mm256_and_si256(_mm256_srli_epi16(high, 2 * quarter), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(four, _mm256_slli_epi16(two, 4)), _mm256_set1_epi8(32));
}

template <bool FIVE_BITS>
inline void k_quant_avx2(const uint8_t* b, float* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int pair = 0; pair < 4; ++pair) {
    __m256i ints[2];
    k_quant_ints<FIVE_BITS>(b, pair, ints);
    for (int h = 0; h < 2; ++h) {
      float sc, mn;
      scale_min(b + 4, 2 * pair + h, &sc, &mn);
      const __m256 scale = _mm256_set1_ps(d * sc), offset = _mm256_set1_ps(-dmin * mn);
      __m256 q[4];
      bytes_as_floats<false>(ints[h], q);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 64 * pair + 32 * h + 8 * j, _mm256_fmadd_ps(q[j], scale, offset));
    }
  }
}

inline void q6_k_avx2(const uint8_t* b, float* out) {
  const float d = half_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int half = 0; half < 2; ++half) {
    for (int quarter = 0; quarter < 4; ++quarter) {
      __m256 q[4];
      bytes_as_floats<true>(q6_k_ints(b, half, quarter), q);
      const int s = 8 * half + 2 * quarter;
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(out + 128 * half + 32 * quarter + 8 * j, _mm256_mul_ps(q[j], _mm256_set1_ps(d * sc[s + j / 2])));
      }
    }
  }
}
#endif

template <int64_t TYPE>
inline void dequantize_block(const uint8_t* b, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  switch (TYPE) {
    case Q4_0: nibbles_avx2(b + 2, half_at(b), -8.f * half_at(b), out); return;
    case Q4_1: nibbles_avx2(b + 4, half_at(b), half_at(b + 2), out); return;
    case Q8_0: q8_0_avx2(b, out); return;
    case Q4_K: k_quant_avx2<false>(b, out); return;
    case Q5_K: k_quant_avx2<true>(b, out); return;
    case Q6_K: q6_k_avx2(b, out); return;
  }
#endif
  switch (TYPE) {
    case Q4_0: nibbles(b + 2, half_at(b), -8.f * half_at(b), out); return;
    case Q4_1: nibbles(b + 4, half_at(b), half_at(b + 2), out); return;
    case Q8_0: {
      const float d = half_at(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q[j]);
      return;
    }
    case Q4_K: k_quant<false>(b, out); return;
    case Q5_K: k_quant<true>(b, out); return;
    case Q6_K: q6_k(b, out); return;
  }
}

// `count` rows of blocks written out as float32 rows of K: all of W (`gguf_dequantize`), or a panel of it
// for gemm.cpp's loop (`gguf_matmul`).
template <int64_t TYPE>
void expand_rows(const uint8_t* rows, int64_t count, int64_t row_bytes, int64_t k, float* out) {
  const Layout l = layout_of(TYPE);
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t b = 0; b < k / l.weights; ++b) {
      dequantize_block<TYPE>(rows + j * row_bytes + b * l.bytes, out + j * k + b * l.weights);
    }
  }
}

// out[n, :] = the K weights of row n, for every row.
void gguf_dequantize(const at::Tensor& blocks, int64_t type, at::Tensor& out) {
  const int64_t n_rows = out.size(0), k = out.size(1);
  check_gguf_blocks(blocks, type, k);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && blocks.size(0) == n_rows,
              "out must be a contiguous float32 [N, K] tensor");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  with_type(type, [&](auto t) {
    at::parallel_for(0, n_rows, 16, [&](int64_t begin, int64_t end) {
      expand_rows<decltype(t)::value>(src + begin * row_bytes, end - begin, row_bytes, k, dst + begin * k);
    });
  });
}

constexpr int64_t MAX_ROWS = 8;  // rows of x one pass over W serves; more rows take more passes

// out[m, n] = x[m] . W[n] for `ROWS` rows of x. At least four chains of multiply-adds run side by side (one
// would wait on each before the next), and at most eight accumulators stay in registers.
template <int64_t ROWS, int64_t TYPE>
void matvec_rows(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n_begin, int64_t n_end,
                 float* out, int64_t out_stride) {
  constexpr int64_t CHAINS = ROWS >= 4 ? 1 : 4 / ROWS;
  constexpr int64_t STEP = CHAINS * Vec::size();
  constexpr Layout l = TYPE == Q4_0 ? Layout{32, 18} : TYPE == Q4_1 ? Layout{32, 20} : TYPE == Q8_0 ? Layout{32, 34}
                     : TYPE == Q4_K ? Layout{256, 144} : TYPE == Q5_K ? Layout{256, 176} : Layout{256, 210};
  alignas(64) float buffer[l.weights];
  const int64_t per_row = k / l.weights;
  for (int64_t n = n_begin; n < n_end; ++n) {
    Vec acc[ROWS][CHAINS];
    for (int64_t m = 0; m < ROWS; ++m) {
      for (int64_t j = 0; j < CHAINS; ++j) acc[m][j] = Vec(0.f);
    }
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < per_row; ++b) {
      dequantize_block<TYPE>(row + b * l.bytes, buffer);
      const float* xb = x + b * l.weights;
      for (int64_t d = 0; d < l.weights; d += STEP) {
        Vec wv[CHAINS];
        for (int64_t j = 0; j < CHAINS; ++j) wv[j] = Vec::loadu(buffer + d + j * Vec::size());
        for (int64_t m = 0; m < ROWS; ++m) {
          const float* xm = xb + m * k + d;
          for (int64_t j = 0; j < CHAINS; ++j) acc[m][j] = at::vec::fmadd(wv[j], Vec::loadu(xm + j * Vec::size()), acc[m][j]);
        }
      }
    }
    for (int64_t m = 0; m < ROWS; ++m) {
      Vec sum = acc[m][0];
      for (int64_t j = 1; j < CHAINS; ++j) sum = sum + acc[m][j];
      out[m * out_stride + n] = at::vec::vec_reduce_all<float>([](Vec a, Vec c) { return a + c; }, sum);
    }
  }
}

constexpr bool small_blocks(int64_t type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

#if defined(__AVX2__) && defined(__FMA__)

// A 32-weight block's integers as four vectors of floats, unscaled (Q4_0 and Q4_1 unsigned, Q8_0 signed).
// Q4_0 and Q4_1 keep weight i in the low nibble of byte i and weight i + 16 in its high nibble; widening bytes
// to 32-bit lanes takes shuffles, which were the kernel's bottleneck. Instead each 32-bit word of nibbles is
// broadcast to the eight lanes and shifted by 0, 4, .., 28, which yields the weights in the order 0, 16, 1,
// 17, 2, 18, 3, 19, 4, 20, ...: x is put in that order once per call (`nibble_order`), 18% faster on Zen 3.
template <int64_t TYPE>
inline void block_ints(const uint8_t* b, __m256 q[4]) {
  if constexpr (TYPE == Q8_0) {
    for (int j = 0; j < 4; ++j) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
  } else {
    const uint8_t* nibbles = b + (TYPE == Q4_1 ? 4 : 2);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(0xF);
    for (int j = 0; j < 4; ++j) {
      int32_t word;
      std::memcpy(&word, nibbles + 4 * j, 4);
      q[j] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask));
    }
  }
}

// x's `count` runs of 32 in the order block_ints gives a Q4_0 or Q4_1 block's weights: each eight are four
// of the run's first half interleaved with the four 16 places on.
std::vector<float> nibble_order(const float* x, int64_t count) {
  std::vector<float> out(count * 32);
  for (int64_t i = 0; i < count; ++i) {
    for (int j = 0; j < 4; ++j) {
      const __m128 low = _mm_loadu_ps(x + i * 32 + 4 * j), high = _mm_loadu_ps(x + i * 32 + 16 + 4 * j);
      _mm_storeu_ps(out.data() + i * 32 + 8 * j, _mm_unpacklo_ps(low, high));
      _mm_storeu_ps(out.data() + i * 32 + 8 * j + 4, _mm_unpackhi_ps(low, high));
    }
  }
  return out;
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The sum of each run of 32 floats of x, `count` runs: the offsets' share of a block's dot product. Each
// thread computes its own, a few hundred adds against its rows of W.
std::vector<float> sums_of_32(const float* x, int64_t count) {
  std::vector<float> sums(count);
  for (int64_t i = 0; i < count; ++i) {
    sums[i] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x + i * 32), _mm256_loadu_ps(x + i * 32 + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(x + i * 32 + 16), _mm256_loadu_ps(x + i * 32 + 24))));
  }
  return sums;
}

// matvec_rows for the 32-weight types without expanding W: a block's weights are scale * q + offset, so its
// dot with x is scale * (q . x) + offset * sum(x), with the sums of x per block computed once per call.
template <int64_t ROWS, int64_t TYPE>
void matvec_rows_fused(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n_begin,
                       int64_t n_end, float* out, int64_t out_stride) {
  constexpr int64_t BYTES = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34;
  const int64_t blocks = k / 32;
  const std::vector<float> xsum = sums_of_32(x, ROWS * blocks);
  const std::vector<float> permuted = TYPE == Q8_0 ? std::vector<float>() : nibble_order(x, ROWS * blocks);
  const float* xq = TYPE == Q8_0 ? x : permuted.data();
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[ROWS];
    float offsets[ROWS];
    for (int64_t m = 0; m < ROWS; ++m) {
      acc[m] = _mm256_setzero_ps();
      offsets[m] = 0.f;
    }
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * BYTES;
      const float d = half_at(block);
      const float offset = TYPE == Q4_1 ? half_at(block + 2) : TYPE == Q4_0 ? -8.f * d : 0.f;
      __m256 q[4];
      block_ints<TYPE>(block, q);
      const __m256 scale = _mm256_set1_ps(d);
      for (int64_t m = 0; m < ROWS; ++m) {
        const float* xm = xq + m * k + b * 32;
        const __m256 t0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xm + 16), _mm256_mul_ps(q[0], _mm256_loadu_ps(xm)));
        const __m256 t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24), _mm256_mul_ps(q[1], _mm256_loadu_ps(xm + 8)));
        acc[m] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), scale, acc[m]);
        if constexpr (TYPE != Q8_0) offsets[m] += offset * xsum[m * blocks + b];
      }
    }
    for (int64_t m = 0; m < ROWS; ++m) out[m * out_stride + n] = hsum(acc[m]) + offsets[m];
  }
}

#if defined(__AVX512F__)
// matvec_rows for Q4_0 and Q4_1 with AVX-512, where converting each nibble to a float bound the AVX2 loop
// (15 billion weights a second on a Zen 4, a third of what memory delivers): a block's 16 values
// scale * i + offset are one vector, and vpermps looks each weight up in it by the low 4 bits of its lane. The
// block's 16 bytes widened to 16 lanes hold weights 0..15 in their low nibbles and 16..31 in their high ones,
// so x is read in its own order. The weights are those the float path expands (one rounding of the same FMA;
// Q4_0's (i - 8) * scale is exact before its rounding, as i * scale - 8 * scale is). A Q4_1 block's two fp16
// halves are converted by one instruction and broadcast from its lanes: scalar conversions and broadcasts
// were a tenth of the one-row loop (547 against 495 M blocks a second from L2 on a Zen 4 core; Q4_0 598
// against 512), with the same bits out.
template <int64_t ROWS, int64_t TYPE>
void matvec_rows_nibbles_avx512(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n_begin,
                                int64_t n_end, float* out, int64_t out_stride) {
  constexpr int64_t BYTES = TYPE == Q4_0 ? 18 : 20;
  constexpr int64_t CHAINS = ROWS <= 2 ? 2 : 1;  // blocks whose sums go to separate accumulators
  const int64_t blocks = k / 32;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 centred = _mm512_sub_ps(iota, _mm512_set1_ps(8.f));
  const __m512i lane_one = _mm512_set1_epi32(1);
  const auto block_weights = [&](const uint8_t* block, __m512* low, __m512* high) {
    __m512 table;
    if constexpr (TYPE == Q4_1) {
      int32_t halves;  // scale, then minimum
      std::memcpy(&halves, block, 4);
      const __m512 sm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(halves)));
      table = _mm512_fmadd_ps(iota, _mm512_broadcastss_ps(_mm512_castps512_ps128(sm)), _mm512_permutexvar_ps(lane_one, sm));
    } else {
      table = _mm512_mul_ps(centred, _mm512_set1_ps(half_at(block)));
    }
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + BYTES - 16)));
    *low = _mm512_permutexvar_ps(bytes, table);
    *high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  };
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc[ROWS][2 * CHAINS];
    for (int64_t m = 0; m < ROWS; ++m) {
      for (int64_t c = 0; c < 2 * CHAINS; ++c) acc[m][c] = _mm512_setzero_ps();
    }
    const uint8_t* row = w + n * row_bytes;
    const auto step = [&](int64_t b, int64_t chain) {
      __m512 low, high;
      block_weights(row + b * BYTES, &low, &high);
      for (int64_t m = 0; m < ROWS; ++m) {
        const float* xm = x + m * k + b * 32;
        acc[m][2 * chain] = _mm512_fmadd_ps(low, _mm512_loadu_ps(xm), acc[m][2 * chain]);
        acc[m][2 * chain + 1] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xm + 16), acc[m][2 * chain + 1]);
      }
    };
    int64_t b = 0;
    for (; b + CHAINS <= blocks; b += CHAINS) {
      for (int64_t c = 0; c < CHAINS; ++c) step(b + c, c);
    }
    for (; b < blocks; ++b) step(b, 0);
    for (int64_t m = 0; m < ROWS; ++m) {
      __m512 sum = _mm512_add_ps(acc[m][0], acc[m][1]);
      for (int64_t c = 2; c < 2 * CHAINS; ++c) sum = _mm512_add_ps(sum, acc[m][c]);
      out[m * out_stride + n] = _mm512_reduce_add_ps(sum);
    }
  }
}
#endif

// matvec_rows for Q4_K and Q5_K the same way: each sub-block of 32 weights is d * scale * q - dmin * min, so
// its dot with x is d * scale * (q . x) - dmin * min * sum(x).
template <int64_t ROWS, bool FIVE_BITS>
void matvec_rows_k_quant(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n_begin,
                         int64_t n_end, float* out, int64_t out_stride) {
  constexpr int64_t BYTES = FIVE_BITS ? 176 : 144;
  const int64_t subs = k / 32;
  const std::vector<float> xsum = sums_of_32(x, ROWS * subs);
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[ROWS];
    float offsets[ROWS];
    for (int64_t m = 0; m < ROWS; ++m) {
      acc[m] = _mm256_setzero_ps();
      offsets[m] = 0.f;
    }
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < k / 256; ++b) {
      const uint8_t* block = row + b * BYTES;
      const float d = half_at(block), dmin = half_at(block + 2);
      for (int pair = 0; pair < 4; ++pair) {
        __m256i ints[2];
        k_quant_ints<FIVE_BITS>(block, pair, ints);
        for (int h = 0; h < 2; ++h) {
          const int64_t sub = 8 * b + 2 * pair + h;
          float sc, mn;
          scale_min(block + 4, 2 * pair + h, &sc, &mn);
          __m256 qf[4];
          bytes_as_floats<false>(ints[h], qf);
          const __m256 scale = _mm256_set1_ps(d * sc);
          const float offset = -dmin * mn;
          for (int64_t m = 0; m < ROWS; ++m) {
            const float* xm = x + m * k + sub * 32;
            __m256 t = _mm256_mul_ps(qf[0], _mm256_loadu_ps(xm));
            t = _mm256_fmadd_ps(qf[1], _mm256_loadu_ps(xm + 8), t);
            t = _mm256_fmadd_ps(qf[2], _mm256_loadu_ps(xm + 16), t);
            t = _mm256_fmadd_ps(qf[3], _mm256_loadu_ps(xm + 24), t);
            acc[m] = _mm256_fmadd_ps(t, scale, acc[m]);
            offsets[m] += offset * xsum[m * subs + sub];
          }
        }
      }
    }
    for (int64_t m = 0; m < ROWS; ++m) out[m * out_stride + n] = hsum(acc[m]) + offsets[m];
  }
}

// matvec_rows for Q6_K: each 16 weights are d * scale * q, so their dot with x is d * scale * (q . x).
template <int64_t ROWS>
void matvec_rows_q6_k(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n_begin,
                      int64_t n_end, float* out, int64_t out_stride) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[ROWS];
    for (int64_t m = 0; m < ROWS; ++m) acc[m] = _mm256_setzero_ps();
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < k / 256; ++b) {
      const uint8_t* block = row + b * 210;
      const float d = half_at(block + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
      for (int half = 0; half < 2; ++half) {
        for (int quarter = 0; quarter < 4; ++quarter) {
          __m256 qf[4];
          bytes_as_floats<true>(q6_k_ints(block, half, quarter), qf);
          const int s = 8 * half + 2 * quarter;
          const __m256 first = _mm256_set1_ps(d * sc[s]), second = _mm256_set1_ps(d * sc[s + 1]);
          for (int64_t m = 0; m < ROWS; ++m) {
            const float* xm = x + m * k + 256 * b + 128 * half + 32 * quarter;
            const __m256 t0 = _mm256_fmadd_ps(qf[1], _mm256_loadu_ps(xm + 8), _mm256_mul_ps(qf[0], _mm256_loadu_ps(xm)));
            const __m256 t1 = _mm256_fmadd_ps(qf[3], _mm256_loadu_ps(xm + 24), _mm256_mul_ps(qf[2], _mm256_loadu_ps(xm + 16)));
            acc[m] = _mm256_fmadd_ps(t1, second, _mm256_fmadd_ps(t0, first, acc[m]));
          }
        }
      }
    }
    for (int64_t m = 0; m < ROWS; ++m) out[m * out_stride + n] = hsum(acc[m]);
  }
}
#endif

// matvec_rows for a row count known only at run time: 1 .. MAX_ROWS.
template <int64_t TYPE, int64_t ROWS = 1>
void matvec_any_rows(int64_t rows, const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n_begin,
                     int64_t n_end, float* out, int64_t out_stride) {
  if (rows == ROWS) {
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (small_blocks(TYPE)) {
#if defined(__AVX512F__)
      if constexpr (TYPE != Q8_0) {
        matvec_rows_nibbles_avx512<ROWS, TYPE>(x, k, w, row_bytes, n_begin, n_end, out, out_stride);
        return;
      }
#endif
      matvec_rows_fused<ROWS, TYPE>(x, k, w, row_bytes, n_begin, n_end, out, out_stride);
      return;
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
      matvec_rows_k_quant<ROWS, TYPE == Q5_K>(x, k, w, row_bytes, n_begin, n_end, out, out_stride);
      return;
    } else if constexpr (TYPE == Q6_K) {
      matvec_rows_q6_k<ROWS>(x, k, w, row_bytes, n_begin, n_end, out, out_stride);
      return;
    }
#endif
    matvec_rows<ROWS, TYPE>(x, k, w, row_bytes, n_begin, n_end, out, out_stride);
  } else if constexpr (ROWS < MAX_ROWS) {
    matvec_any_rows<TYPE, ROWS + 1>(rows, x, k, w, row_bytes, n_begin, n_end, out, out_stride);
  }
}

// x: [M, K] float32; blocks: [N, row_bytes] uint8. Returns x @ W.T, [M, N] float32.
at::Tensor gguf_matvec(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a float32 [M, K] tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = blocks.size(0);
  check_gguf_blocks(blocks, type, k);
  at::Tensor out = at::empty({m_rows, n_rows}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  at::parallel_for(0, n_rows, 8, [&](int64_t begin, int64_t end) {
    lmgate::gguf_matvec_range(type, m_rows, xp, k, w, row_bytes, begin, end, op, n_rows);
  });
  return out;
}

// x: [M, K] float32, many rows; blocks: [N, row_bytes]. x @ W.T as gemm.cpp's float32 GEMM over panels of W
// expanded as they are needed: each weight is expanded once per call and used by all M rows.
at::Tensor gguf_matmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a float32 [M, K] tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = blocks.size(0);
  check_gguf_blocks(blocks, type, k);
  at::Tensor out = at::empty({m_rows, n_rows}, x.options());
  with_type(type, [&](auto t) {
    const lmgate::WeightRows rows{blocks.data_ptr<uint8_t>(), blocks.size(1), &expand_rows<decltype(t)::value>};
    lmgate::panel_gemm(x.data_ptr<float>(), m_rows, k, n_rows, rows, out.data_ptr<float>());
  });
  return out;
}

}  // namespace

namespace lmgate {

void check_gguf_blocks(const at::Tensor& blocks, int64_t type, int64_t k) {
  const Layout l = layout_of(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(k % l.weights == 0 && blocks.size(1) == k / l.weights * l.bytes,
              "a row of ", k, " weights of type ", type, " takes ", k / l.weights * l.bytes, " bytes, got ",
              blocks.size(1));
}

// out[m, n] = x[m] . W[n] for rows n_begin .. n_end of W and all `rows` (any number) rows of x; the caller
// parallelizes (decode_layers.cpp splits W's rows over its threads).
void gguf_matvec_range(int64_t type, int64_t rows, const float* x, int64_t k, const uint8_t* w, int64_t row_bytes,
                       int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  with_type(type, [&](auto t) {
    for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS) {
      matvec_any_rows<decltype(t)::value>(std::min(MAX_ROWS, rows - m0), x + m0 * k, k, w, row_bytes, n_begin, n_end,
                                          out + m0 * out_stride, out_stride);
    }
  });
}

}  // namespace lmgate

TORCH_LIBRARY_FRAGMENT(lmgate, m) {
  m.def("gguf_dequantize(Tensor blocks, int type, Tensor(a!) out) -> ()");
  m.def("gguf_matvec(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("gguf_matmul(Tensor x, Tensor blocks, int type) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmgate, CPU, m) {
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_matvec", &gguf_matvec);
  m.impl("gguf_matmul", &gguf_matmul);
}
