// Element conversions between the io dtypes and fp32 (round to nearest even).
#pragma once

#include <cstdint>

#include "kvcomp/half.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

inline float load_io(const void* base, DType dt, std::int64_t i) {
  switch (dt) {
    case DType::bf16:
      return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::f16:
      return fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

// Rounds a float to the io dtype and back (identity for f32).
inline float round_to_io(float v, DType dt) {
  switch (dt) {
    case DType::bf16:
      return bf16_to_float(float_to_bf16(v));
    case DType::f16:
      return fp16_to_float(float_to_fp16(v));
    default:
      return v;
  }
}

void to_f32(const void* src, DType dt, float* dst, std::int64_t n);
// A row-major [rows, cols] io matrix into fp32 rows with leading dimension ld.
void rows_to_f32(const void* src, DType dt, std::int64_t rows, std::int64_t cols, float* dst, std::int64_t ld,
                 int num_threads);
void from_f32(const float* src, void* dst, DType dt, std::int64_t n);

}  // namespace kvcomp::detail
