#include "cpu/convert.hpp"

#include <xmmintrin.h>

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

// A tile of 16 source rows of 64 values is widened row by row into `tile`, then written out transposed:
// whole tiles as 4 x 4 blocks through SSE registers (faster than value by value), the ragged edges
// value by value.
void rows_to_f32_transposed(const void* src, DType dt, std::int64_t rows, std::int64_t cols,
                            std::int64_t src_ld, float* dst, std::int64_t ld, int num_threads) {
  constexpr std::int64_t kRows = 16, kCols = 64;
  const auto* bytes = static_cast<const unsigned char*>(src);
  const std::size_t size = dtype_size(dt);
  const SimdKernels& k = simd_kernels();
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t j0 = 0; j0 < cols; j0 += kCols) {
    const std::int64_t w = std::min(kCols, cols - j0);
    alignas(64) float tile[kRows][kCols];
    for (std::int64_t i0 = 0; i0 < rows; i0 += kRows) {
      const std::int64_t h = std::min(kRows, rows - i0);
      for (std::int64_t i = 0; i < h; ++i)
        k.to_f32(bytes + static_cast<std::size_t>((i0 + i) * src_ld + j0) * size, dt, tile[i], w);
      float* const out = dst + j0 * ld + i0;
      if (h == kRows && w == kCols) {
        for (std::int64_t j = 0; j < kCols; j += 4)
          for (std::int64_t i = 0; i < kRows; i += 4) {
            __m128 r0 = _mm_load_ps(&tile[i][j]), r1 = _mm_load_ps(&tile[i + 1][j]);
            __m128 r2 = _mm_load_ps(&tile[i + 2][j]), r3 = _mm_load_ps(&tile[i + 3][j]);
            _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
            _mm_storeu_ps(out + j * ld + i, r0);
            _mm_storeu_ps(out + (j + 1) * ld + i, r1);
            _mm_storeu_ps(out + (j + 2) * ld + i, r2);
            _mm_storeu_ps(out + (j + 3) * ld + i, r3);
          }
      } else {
        for (std::int64_t j = 0; j < w; ++j)
          for (std::int64_t i = 0; i < h; ++i) out[j * ld + i] = tile[i][j];
      }
    }
  }
}

void from_f32(const float* src, void* dst, DType dt, std::int64_t n) {
  simd_kernels().from_f32(src, dst, dt, n);
}

}  // namespace kvcomp::detail
