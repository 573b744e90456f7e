#include "cpu/convert.hpp"

#include <algorithm>

#include "cpu/simd/kernels.hpp"

namespace kvcomp::detail {

void to_f32(const void* src, DType dt, float* dst, std::int64_t n) { simd_kernels().to_f32(src, dt, dst, n); }

void rows_to_f32(const void* src, DType dt, std::int64_t rows, std::int64_t cols, float* dst, std::int64_t ld,
                 int num_threads) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  const std::size_t row_bytes = static_cast<std::size_t>(cols) * dtype_size(dt);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t i = 0; i < rows; ++i)
    to_f32(bytes + static_cast<std::size_t>(i) * row_bytes, dt, dst + i * ld, cols);
}

void rows_to_f32_transposed(const void* src, DType dt, std::int64_t rows, std::int64_t cols,
                            std::int64_t src_ld, float* dst, std::int64_t ld, int num_threads) {
  constexpr std::int64_t kRows = 16, kCols = 64;  // a tile: 16 source rows of 64 values
  const auto* bytes = static_cast<const unsigned char*>(src);
  const std::size_t size = dtype_size(dt);
  const SimdKernels& k = simd_kernels();
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t j0 = 0; j0 < cols; j0 += kCols) {
    const std::int64_t w = std::min(kCols, cols - j0);
    float tile[kRows][kCols];
    for (std::int64_t i0 = 0; i0 < rows; i0 += kRows) {
      const std::int64_t h = std::min(kRows, rows - i0);
      for (std::int64_t i = 0; i < h; ++i)
        k.to_f32(bytes + static_cast<std::size_t>((i0 + i) * src_ld + j0) * size, dt, tile[i], w);
      for (std::int64_t j = 0; j < w; ++j)
        for (std::int64_t i = 0; i < h; ++i) dst[(j0 + j) * ld + i0 + i] = tile[i][j];
    }
  }
}

void from_f32(const float* src, void* dst, DType dt, std::int64_t n) {
  simd_kernels().from_f32(src, dst, dt, n);
}

}  // namespace kvcomp::detail
