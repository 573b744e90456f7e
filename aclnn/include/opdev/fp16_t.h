// op::fp16_t, the host-side IEEE half of CANN's sample programs. From float it
// rounds to nearest, ties to even (overflow to +-Inf, subnormals exact),
// exactly as the kvcomp operators narrow their outputs. C++ only.
#ifndef KVCOMP_OPDEV_FP16_T_H_
#define KVCOMP_OPDEV_FP16_T_H_

#ifndef __cplusplus
#error "opdev/fp16_t.h is a C++ header; C code passes fp16 data as uint16_t bit patterns"
#endif

#include <cstdint>
#include <type_traits>

#include "kvcomp/half.hpp"

namespace op {

struct fp16_t {
  std::uint16_t val = 0;  // the raw bits

  fp16_t() = default;
  // Any arithmetic value, through float (a double is thus rounded twice).
  template <typename T, typename = typename std::enable_if<std::is_arithmetic<T>::value>::type>
  fp16_t(T v) : val(kvcomp::float_to_fp16(static_cast<float>(v))) {}

  operator float() const { return kvcomp::fp16_to_float(val); }

  static fp16_t from_bits(std::uint16_t bits) {
    fp16_t h;
    h.val = bits;
    return h;
  }
};

static_assert(sizeof(fp16_t) == 2, "fp16 tensors are arrays of 2-byte elements");

}  // namespace op

#endif  // KVCOMP_OPDEV_FP16_T_H_
