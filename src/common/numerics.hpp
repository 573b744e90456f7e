// The scalar arithmetic both backends' element-wise kernels share: the
// branch-free 16-bit io conversions and the float64 exp of the softmax.
// Written once, compiled by g++ for the CPU kernels (cpu/simd/body.inl, once
// per ISA) and by nvcc for the CUDA kernels (cuda/kernels.cu), so that both
// backends round alike: the GPU's block phases give the CPU's bits.
//
// Everything here has internal linkage (an unnamed namespace): a copy
// compiled with AVX-512 flags can never be picked by the linker for the
// scalar path. Rules that keep every copy bitwise equal: plain IEEE
// operations in a fixed order (fma_d, correctly rounded, among them), no
// other libm function, and no FMA contraction in the files that include this
// (-ffp-contract=off, nvcc --fmad=false): a fused multiply-add only where
// fma_d writes it.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcomp/kvcomp.hpp"

#if defined(__CUDACC__)
#define KVCOMP_HD __host__ __device__ __forceinline__
#else
#define KVCOMP_HD inline
#endif

namespace kvcomp::detail {
namespace {

KVCOMP_HD std::uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
KVCOMP_HD float u2f(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
KVCOMP_HD std::uint64_t d2u(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(d));
#else
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}
KVCOMP_HD double u2d(std::uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

// ---- 16-bit io conversions, branch-free (kvcomp/half.hpp is the branchy
// reference; tests/kernels compares the two on every 16-bit pattern and on
// float edge cases).

KVCOMP_HD float bf16_to_f32(std::uint16_t h) { return u2f(static_cast<std::uint32_t>(h) << 16); }

KVCOMP_HD std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t bits = f2u(f);
  const std::uint32_t rounded =
      (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // nearest even; carries into the exponent
  const std::uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

KVCOMP_HD float fp16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  const std::uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  const std::uint32_t special = 0x7f800000u | (mant << 13);  // Inf / NaN
  // Subnormal or zero: mant * 2^-24, exact in float and never a float
  // subnormal itself, so flush-to-zero modes cannot touch it.
  const std::uint32_t small =
      f2u(static_cast<float>(static_cast<std::int32_t>(mant)) * 5.9604644775390625e-8f);
  return u2f(sign | (exp == 0x1fu ? special : (exp == 0 ? small : normal)));
}

KVCOMP_HD std::uint16_t f32_to_fp16(float f) {
  const std::uint32_t bits = f2u(f);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t abs = bits & 0x7fffffffu;
  const std::uint32_t nan = 0x7e00u | ((abs >> 13) & 0x3ffu);
  // Normal range: rebias the exponent (127 -> 15), round the 13 dropped bits.
  const std::uint32_t v = abs - 0x38000000u;
  const std::uint32_t normal = (v + 0xfffu + ((v >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5f aligns the value to the fp16 subnormal unit
  // 2^-24 and the float addition rounds it to nearest even; the bits above
  // those of 0.5f count the units. Values below 2^-25 round to 0.
  const std::uint32_t small = f2u(u2f(abs < 0x38800000u ? abs : 0u) + 0.5f) - 0x3f000000u;
  const std::uint32_t mag =
      abs > 0x7f800000u ? nan : (abs >= 0x477ff000u ? 0x7c00u : (abs < 0x38800000u ? small : normal));
  return static_cast<std::uint16_t>(sign | mag);
}

// v rounded to the io dtype kDt and back (identity for f32).
template <DType kDt>
KVCOMP_HD float round_io(float v) {
  if constexpr (kDt == DType::bf16)
    return bf16_to_f32(f32_to_bf16(v));
  else if constexpr (kDt == DType::f16)
    return fp16_to_f32(f32_to_fp16(v));
  else
    return v;
}

// ---- exp in float64 for x <= 0 (softmax arguments), plain arithmetic.

// a * b + c rounded once: an IEEE 754 operation like + and *, so every
// conforming implementation gives the same bits (the vector FMA of the AVX2
// and AVX-512 kernels, libm's fma in the scalar ones, the GPU's DFMA). Only
// written out, never contracted from a * b + c (see the rules above).
KVCOMP_HD double fma_d(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return fma(a, b, c);
#else
  return __builtin_fma(a, b, c);
#endif
}

// x = k ln2 + r with |r| <= ln2/2 (Cody-Waite, ln2 split so k * kLn2Hi is
// exact), e^r by its Taylor series to r^13 (truncation < 2e-16 relative) in
// Horner form, one fma per term (half the operations of a multiply and an
// add, and one rounding instead of two), 2^k put into the exponent field.
// Within 1 ulp of exp (tests/kernels, ExpNonpositive); exp(-inf) = 0, NaN
// stays NaN; results below 2^-1022 flush to 0 (they are < 1e-307 of the
// block's largest weight, which is 1).
KVCOMP_HD double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 33 significant bits
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const double xc = x < -708.0 ? -708.0 : x;       // keeps 2^k normal; NaN passes through the compare as NaN
  const double t = xc * kLog2e + kShifter;
  const double k = t - kShifter;
  const double r = (xc - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = fma_d(p, r, 1.0 / 479001600.0);
  p = fma_d(p, r, 1.0 / 39916800.0);
  p = fma_d(p, r, 1.0 / 3628800.0);
  p = fma_d(p, r, 1.0 / 362880.0);
  p = fma_d(p, r, 1.0 / 40320.0);
  p = fma_d(p, r, 1.0 / 5040.0);
  p = fma_d(p, r, 1.0 / 720.0);
  p = fma_d(p, r, 1.0 / 120.0);
  p = fma_d(p, r, 1.0 / 24.0);
  p = fma_d(p, r, 1.0 / 6.0);
  p = fma_d(p, r, 0.5);
  p = fma_d(p, r, 1.0);
  p = fma_d(p, r, 1.0);
  // The low bits of t hold k as an integer (two's complement, |k| < 2^51).
  const std::uint64_t ki = d2u(t) - d2u(kShifter);
  const double scale = u2d((ki + 1023u) << 52);
  const double y = p * scale;
  return x < -708.0 ? 0.0 : y;  // x = NaN: the compare is false, y is NaN
}

}  // namespace
}  // namespace kvcomp::detail
