// GGUF's block layouts, shared by the kernels that read quantized weights (quantized_matmul.cpp with float32
// activations, int8_matmul.cpp with int8 ones).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace lmgate {

// ggml's type numbers (gguf.GGMLQuantizationType).
enum QuantType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Layout {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

inline Layout layout_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "unsupported GGUF quantization type ", type);
}

// f(std::integral_constant<int64_t, TYPE>{}): the type becomes a template argument once per call, so that
// no block pays for a switch.
template <typename F>
void with_type(int64_t type, F&& f) {
  switch (type) {
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q8_0: return f(std::integral_constant<int64_t, Q8_0>{});
    case Q4_K: return f(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int64_t, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int64_t, Q6_K>{});
  }
  TORCH_CHECK(false, "unsupported GGUF quantization type ", type);
}

// A [N, row_bytes] tensor of rows of K weights of `type`, or a clear error.
void check_gguf_blocks(const at::Tensor& blocks, int64_t type, int64_t k);

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K block, packed into 12 bytes.
inline void scale_min(const uint8_t* s, int j, float* scale, float* min) {
  if (j < 4) {
    *scale = static_cast<float>(s[j] & 63);
    *min = static_cast<float>(s[j + 4] & 63);
  } else {
    *scale = static_cast<float>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    *min = static_cast<float>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

#if defined(__AVX2__)
// Q4_K / Q5_K, weights 64 * pair .. 64 * pair + 63 of a block as two vectors of 32 integers: the low nibbles of
// 32 bytes are one sub-block, their high nibbles the next; Q5_K adds bit 2 * pair (and 2 * pair + 1) of each
// byte of qh as the fifth bit.
template <bool FIVE_BITS>
inline void k_quant_ints(const uint8_t* b, int pair, __m256i out[2]) {
  const __m256i mask = _mm256_set1_epi8(0xF);
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (FIVE_BITS ? 48 : 16) + 32 * pair));
  out[0] = _mm256_and_si256(q, mask);
  out[1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
  if constexpr (FIVE_BITS) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int h = 0; h < 2; ++h) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (2 * pair + h)));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
      out[h] = _mm256_or_si256(out[h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
  }
}
#endif

}  // namespace lmgate
