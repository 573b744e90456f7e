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

// The constants of exp_nonpositive, named for the vector kernels that repeat its steps (cpu/simd/body.inl).
// Adding kExpShifter (1.5 * 2^52 + 1023) to x log2(e) rounds it to an integer k and leaves k + 1023, the
// biased exponent of 2^k, in the low bits of the sum. ln2 in two parts: kExpLn2Hi has 33 significant
// bits, so k * kExpLn2Hi is exact. kExpG0..9: the polynomial g below. Scalars, not an array: nvcc lets
// device code read a host constexpr only where it is a scalar.
inline constexpr double kExpLog2e = 0x1.71547652b82fep+0;
inline constexpr double kExpShifter = 0x1.8p52 + 1023.0;
inline constexpr double kExpLn2Hi = 0x1.62e42fee00000p-1;
inline constexpr double kExpLn2Lo = 0x1.a39ef35793c76p-33;
inline constexpr double kExpLowest = -708.0;  // below it the result flushes to 0
inline constexpr double kExpG0 = 0x1.0000000000001p-1, kExpG1 = 0x1.5555555555556p-3;
inline constexpr double kExpG2 = 0x1.5555555553d4fp-5, kExpG3 = 0x1.11111111109adp-7;
inline constexpr double kExpG4 = 0x1.6c16c17893833p-10, kExpG5 = 0x1.a01a01a7c8d47p-13;
inline constexpr double kExpG6 = 0x1.a019b8ef67c6cp-16, kExpG7 = 0x1.71de0d9c145d0p-19;
inline constexpr double kExpG8 = 0x1.2891a8c1d838dp-22, kExpG9 = 0x1.af38d53857513p-26;

// x = k ln2 + r with |r| <= ln2/2 (Cody-Waite; each part of k ln2 taken off by one fma, the first
// exactly), e^r = 1 + r + r^2 g(r) with g of degree 9, fitted to (e^r - 1 - r) / r^2 on |r| <= ln2/2
// (a Chebyshev fit: relative error < 2e-17 with its coefficients rounded to double), in Horner form, one
// fma per term (half the operations of a multiply and an add, and one rounding instead of two), times
// 2^k built in the exponent field. Within 1 ulp of exp (tests/kernels, ExpNonpositive); exp(-inf) = 0,
// NaN stays NaN; results below 2^-1022 flush to 0 (they are < 1e-307 of the block's largest weight,
// which is 1).
KVCOMP_HD double exp_nonpositive(double x) {
  const double t = fma_d(x, kExpLog2e, kExpShifter);
  const double k = t - kExpShifter;
  const double r = fma_d(k, -kExpLn2Lo, fma_d(k, -kExpLn2Hi, x));  // -k would flip a NaN's sign
  double p = fma_d(kExpG9, r, kExpG8);
  p = fma_d(p, r, kExpG7);
  p = fma_d(p, r, kExpG6);
  p = fma_d(p, r, kExpG5);
  p = fma_d(p, r, kExpG4);
  p = fma_d(p, r, kExpG3);
  p = fma_d(p, r, kExpG2);
  p = fma_d(p, r, kExpG1);
  p = fma_d(p, r, kExpG0);
  p = fma_d(p, r, 1.0);
  p = fma_d(p, r, 1.0);
  // t's low bits hold k + 1023 as an integer: shifted up, the bits of 2^k (normal wherever x >= -708;
  // below, the value is discarded).
  const double scale = u2d(d2u(t) << 52);
  const double y = p * scale;
  return x < kExpLowest ? 0.0 : y;  // x = NaN: the compare is false, y is NaN
}

}  // namespace
}  // namespace kvcomp::detail
