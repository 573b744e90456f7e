// Conversions between the io dtypes and fp32 (round to nearest even), through
// the run-time dispatched kernels of cpu/simd.
#pragma once

#include <cstdint>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

void to_f32(const void* src, DType dt, float* dst, std::int64_t n);
// A row-major [rows, cols] io matrix into fp32 rows with leading dimension ld.
void rows_to_f32(const void* src, DType dt, std::int64_t rows, std::int64_t cols, float* dst, std::int64_t ld,
                 int num_threads);
// The same matrix transposed, its rows src_ld values apart: dst[j * ld + i] = src[i * src_ld + j] in fp32,
// for i < rows, j < cols.
void rows_to_f32_transposed(const void* src, DType dt, std::int64_t rows, std::int64_t cols,
                            std::int64_t src_ld, float* dst, std::int64_t ld, int num_threads);
void from_f32(const float* src, void* dst, DType dt, std::int64_t n);

}  // namespace kvcomp::detail
