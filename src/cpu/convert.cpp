#include "cpu/convert.hpp"

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

void from_f32(const float* src, void* dst, DType dt, std::int64_t n) {
  simd_kernels().from_f32(src, dst, dt, n);
}

}  // namespace kvcomp::detail
