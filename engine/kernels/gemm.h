// gemm.cpp's float32 GEMMs: over rows a kernel expands from its own kind of weights (quantized_matmul.cpp), and
// over column panels, plain or gated (decode_layers.cpp).
#pragma once

#include <cstdint>

namespace lmgate {

// W by rows of `row_bytes`, quantized rows that `expand` writes out as `count` float32 rows of K.
struct WeightRows {
  const uint8_t* data;
  int64_t row_bytes;
  void (*expand)(const uint8_t* rows, int64_t count, int64_t row_bytes, int64_t k, float* out);
};

// out[M, N] = x[M, K] @ W.T, W's N rows taken a panel at a time.
void panel_gemm(const float* x, int64_t m_rows, int64_t k, int64_t n_rows, const WeightRows& w, float* out);

// Columns per panel of `pack_columns`' layout in this build (48 with AVX-512, 24 with AVX2), and activations
// per pair of panels of a gated pack (`pack_gated_columns`).
int64_t column_width();

// out[m * out_stride + c] = x[m] . W[c] for the columns c in [begin, end) of an n-column W packed by
// `pack_columns`, on the calling thread; begin a multiple of column_width(), end one too or n.
void column_range(const float* x, int64_t m_rows, int64_t k, const float* packed, int64_t n, int64_t begin,
                  int64_t end, float* out, int64_t out_stride);

// out[m * out_stride + c] = silu(x[m] . Wgate[c]) * (x[m] . Wup[c]) for the activations c in [begin, end) of a
// gate_up W of n activations packed by `pack_gated_columns`, on the calling thread; begin a multiple of
// column_width(), end one too or n.
void gated_range(const float* x, int64_t m_rows, int64_t k, const float* packed, int64_t n, int64_t begin,
                 int64_t end, float* out, int64_t out_stride);

}  // namespace lmgate
