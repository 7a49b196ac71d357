// int8_matmul.cpp's few-row path, for decode_layers.cpp: x rounded to int8 per block of 32, times GGUF blocks.
#pragma once

#include <cstdint>

namespace lmgate {

// Whether the int8 kernels read blocks of this GGUF type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K).
bool int8_type(int64_t type);

// Whether this CPU runs vpdpbusd on 256-bit registers (AVX512-VNNI with VL).
bool vnni_runs();

// `rows` rows of K floats rounded to int8 per block of 32 (q), each block's scale and rounded sum side by side
// (scale_sum: rows * K / 32 pairs). On the calling thread.
void quantize_int8(const float* x, int64_t rows, int64_t k, int8_t* q, float* scale_sum);

// out[m, n] = x[m] . W[n] for rows n_begin .. n_end of W and `rows` rows of x as quantize_int8 rounded them;
// the caller parallelizes.
void gguf_matvec_int8_range(int64_t type, int64_t rows, const int8_t* xq, const float* scale_sum, int64_t k,
                            const uint8_t* w, int64_t row_bytes, int64_t n_begin, int64_t n_end, bool vnni, float* out,
                            int64_t out_stride);

}  // namespace lmgate
