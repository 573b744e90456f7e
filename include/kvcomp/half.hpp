// Conversions between float and the 16-bit io dtypes (bf16, fp16).
//
// Both narrowing conversions round to nearest, ties to even (the rounding
// PyTorch and the upstream "golden" references use). NaN stays NaN (quiet),
// overflow goes to +-Inf, fp16 subnormals are produced exactly.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvcomp {

inline float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  }
  const std::uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7fffu + lsb;  // round to nearest even; carries into the exponent
  return static_cast<std::uint16_t>(bits >> 16);
}

inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    std::uint32_t e = 113u;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline std::uint16_t float_to_fp16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {               // below the smallest normal fp16 (2^-14): subnormal or zero
    if (abs < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 itself ties to even 0)
    const std::uint32_t e = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // value = mant * 2^(e-150); fp16 subnormal unit is 2^-24
    const std::uint32_t q = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    std::uint32_t r = q;
    if (rem > half || (rem == half && (q & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  // normal range: rebias exponent and round the 13 dropped mantissa bits
  std::uint32_t v = abs - 0x38000000u;  // exponent bias 127 -> 15
  const std::uint32_t lsb = (v >> 13) & 1u;
  v += 0xfffu + lsb;
  return static_cast<std::uint16_t>(sign | (v >> 13));
}

}  // namespace kvcomp
