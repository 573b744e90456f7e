// op::bfloat16, the host-side bf16 of CANN's sample programs: two bytes, the
// upper half of an IEEE float. From float it rounds to nearest, ties to even
// (NaN stays NaN), exactly as the kvcomp operators narrow their outputs, so
// host data and operator results round alike. C++ only.
#ifndef KVCOMP_OPDEV_BFLOAT16_H_
#define KVCOMP_OPDEV_BFLOAT16_H_

#ifndef __cplusplus
#error "opdev/bfloat16.h is a C++ header; C code passes bf16 data as uint16_t bit patterns"
#endif

#include <cstdint>
#include <type_traits>

#include "kvcomp/half.hpp"

namespace op {

struct bfloat16 {
  std::uint16_t value = 0;  // the raw bits

  bfloat16() = default;
  // Any arithmetic value, through float (a double is thus rounded twice).
  template <typename T, typename = typename std::enable_if<std::is_arithmetic<T>::value>::type>
  bfloat16(T v) : value(kvcomp::float_to_bf16(static_cast<float>(v))) {}

  operator float() const { return kvcomp::bf16_to_float(value); }

  static bfloat16 from_bits(std::uint16_t bits) {
    bfloat16 b;
    b.value = bits;
    return b;
  }
};

static_assert(sizeof(bfloat16) == 2, "bf16 tensors are arrays of 2-byte elements");

}  // namespace op

#endif  // KVCOMP_OPDEV_BFLOAT16_H_
