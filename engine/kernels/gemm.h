// gemm.cpp's float32 GEMM, for the kernels that hand it their own kind of weight rows.
#pragma once

#include <cstdint>

namespace lmgate {

// W by rows of `row_bytes`: float32 rows read in place (`expand` null), or quantized rows that `expand`
// writes out as `count` float32 rows of K.
struct WeightRows {
  const uint8_t* data;
  int64_t row_bytes;
  void (*expand)(const uint8_t* rows, int64_t count, int64_t row_bytes, int64_t k, float* out);
};

// out[M, N] = x[M, K] @ W.T, W's N rows taken a panel at a time.
void panel_gemm(const float* x, int64_t m_rows, int64_t k, int64_t n_rows, const WeightRows& w, float* out);

}  // namespace lmgate
