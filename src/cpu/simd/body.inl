// The element-wise kernels, written once as plain loops over the columns of
// a slice that the compiler vectorises for the ISA of the including file.
// Included by simd/kernels_*.cpp inside their own namespace
// (KVCOMP_SIMD_NS), so the three compilations never share a symbol: an
// inline function compiled with AVX-512 flags cannot be picked by the linker
// for the scalar path.
//
// Rules that keep the three variants bitwise equal: each element sees the
// same operations in the same order; no FMA contraction (-ffp-contract=off);
// no libm (exp below is plain arithmetic); selects instead of branches.

#ifndef KVCOMP_SIMD_NS
#error "define KVCOMP_SIMD_NS before including body.inl"
#endif

#include <cstdint>
#include <cstring>

#include "cpu/simd/kernels.hpp"

namespace kvcomp::detail::KVCOMP_SIMD_NS {
namespace {

using i64 = std::int64_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

inline u32 f2u(float f) {
  u32 u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float u2f(u32 u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline u64 d2u(double d) {
  u64 u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}
inline double u2d(u64 u) {
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}

// ---- 16-bit io conversions, branch-free (kvcomp/half.hpp is the branchy
// reference; tests/kernels compares the two on every 16-bit pattern and on
// float edge cases).

inline float bf16_to_f32(std::uint16_t h) { return u2f(static_cast<u32>(h) << 16); }

inline std::uint16_t f32_to_bf16(float f) {
  const u32 bits = f2u(f);
  const u32 rounded =
      (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // nearest even; carries into the exponent
  const u32 quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float fp16_to_f32(std::uint16_t h) {
  const u32 sign = static_cast<u32>(h & 0x8000u) << 16;
  const u32 exp = (h >> 10) & 0x1fu;
  const u32 mant = h & 0x3ffu;
  const u32 normal = ((exp + 112u) << 23) | (mant << 13);
  const u32 special = 0x7f800000u | (mant << 13);  // Inf / NaN
  // Subnormal or zero: mant * 2^-24, exact in float and never a float
  // subnormal itself, so flush-to-zero modes cannot touch it.
  const u32 small = f2u(static_cast<float>(static_cast<std::int32_t>(mant)) * 5.9604644775390625e-8f);
  return u2f(sign | (exp == 0x1fu ? special : (exp == 0 ? small : normal)));
}

inline std::uint16_t f32_to_fp16(float f) {
  const u32 bits = f2u(f);
  const u32 sign = (bits >> 16) & 0x8000u;
  const u32 abs = bits & 0x7fffffffu;
  const u32 nan = 0x7e00u | ((abs >> 13) & 0x3ffu);
  // Normal range: rebias the exponent (127 -> 15), round the 13 dropped bits.
  const u32 v = abs - 0x38000000u;
  const u32 normal = (v + 0xfffu + ((v >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5f aligns the value to the fp16 subnormal unit
  // 2^-24 and the float addition rounds it to nearest even; the bits above
  // those of 0.5f count the units. Values below 2^-25 round to 0.
  const u32 small = f2u(u2f(abs < 0x38800000u ? abs : 0u) + 0.5f) - 0x3f000000u;
  const u32 mag =
      abs > 0x7f800000u ? nan : (abs >= 0x477ff000u ? 0x7c00u : (abs < 0x38800000u ? small : normal));
  return static_cast<std::uint16_t>(sign | mag);
}

template <DType kDt>
inline float round_io(float v) {
  if constexpr (kDt == DType::bf16)
    return bf16_to_f32(f32_to_bf16(v));
  else if constexpr (kDt == DType::f16)
    return fp16_to_f32(f32_to_fp16(v));
  else
    return v;
}

// ---- exp in float64 for x <= 0 (softmax arguments), plain arithmetic.
// x = k ln2 + r with |r| <= ln2/2 (Cody-Waite, ln2 split so k * kLn2Hi is
// exact), e^r by its Taylor series to r^13 (truncation < 2e-16 relative),
// 2^k put into the exponent field. Within 2 ulp of exp; exp(-inf) = 0, NaN
// stays NaN; results below 2^-1022 flush to 0 (they are < 1e-307 of the
// block's largest weight, which is 1).
inline double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 33 significant bits
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const double xc = x < -708.0 ? -708.0 : x;       // keeps 2^k normal; NaN passes through the compare as NaN
  const double t = xc * kLog2e + kShifter;
  const double k = t - kShifter;
  const double r = (xc - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // The low bits of t hold k as an integer (two's complement, |k| < 2^51).
  const u64 ki = d2u(t) - d2u(kShifter);
  const double scale = u2d((ki + 1023u) << 52);
  const double y = p * scale;
  return x < -708.0 ? 0.0 : y;  // x = NaN: the compare is false, y is NaN
}

// ---- kernels

// Loops run to n = kW when kW > 0 (a full slice, known to the compiler:
// straight vector code), else to the run-time w (the last, partial slice).
template <i64 kW>
void block_dot_impl(const float* S, const float* K, i64 rows, i64 ld, i64 w_rt, double* wsum) {
  const i64 w = kW > 0 ? kW : w_rt;
  double acc[kSlice] = {};
  for (i64 j = 0; j < rows; ++j) {
    const float* s = S + j * ld;
    const float* k = K + j * ld;
    for (i64 i = 0; i < w; ++i) acc[i] += static_cast<double>(s[i]) * static_cast<double>(k[i]);
  }
  for (i64 i = 0; i < w; ++i) wsum[i] = acc[i];
}

void block_dot(const float* S, const float* K, i64 rows, i64 ld, i64 w, double* wsum) {
  if (w == kSlice) return block_dot_impl<kSlice>(S, K, rows, ld, w, wsum);
  block_dot_impl<0>(S, K, rows, ld, w, wsum);
}

template <DType kParity, i64 kW>
void slot_grad_impl(const float* S, const float* K, const float* dc, const double* wsum, i64 w_rt,
                    float* dk_out, float* dz_out, double* ape) {
  const i64 w = kW > 0 ? kW : w_rt;
  for (i64 i = 0; i < w; ++i) {
    const float sv = S[i];
    // dZ = S * dC * (K - w): K - w is formed in float64 where it is exact to
    // ~2^-53 relative, so no cancellation reaches fp32.
    const double dz =
        static_cast<double>(sv) * static_cast<double>(dc[i]) * (static_cast<double>(K[i]) - wsum[i]);
    dk_out[i] = round_io<kParity>(dc[i] * sv);
    dz_out[i] = round_io<kParity>(static_cast<float>(dz));
    ape[i] += dz;
  }
}

template <i64 kW>
void slot_grad_w(const float* S, const float* K, const float* dc, const double* wsum, i64 w, DType parity,
                 float* dk_out, float* dz_out, double* ape) {
  switch (parity) {
    case DType::bf16:
      return slot_grad_impl<DType::bf16, kW>(S, K, dc, wsum, w, dk_out, dz_out, ape);
    case DType::f16:
      return slot_grad_impl<DType::f16, kW>(S, K, dc, wsum, w, dk_out, dz_out, ape);
    default:
      return slot_grad_impl<DType::f32, kW>(S, K, dc, wsum, w, dk_out, dz_out, ape);
  }
}

void slot_grad(const float* S, const float* K, const float* dc, const double* wsum, i64 w, DType parity,
               float* dk_out, float* dz_out, double* ape) {
  if (w == kSlice) return slot_grad_w<kSlice>(S, K, dc, wsum, w, parity, dk_out, dz_out, ape);
  slot_grad_w<0>(S, K, dc, wsum, w, parity, dk_out, dz_out, ape);
}

void from_f32(const float* src, void* dst, DType dt, i64 n) {
  auto* h = static_cast<std::uint16_t*>(dst);
  switch (dt) {
    case DType::bf16:
      for (i64 i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]);
      break;
    case DType::f16:
      for (i64 i = 0; i < n; ++i) h[i] = f32_to_fp16(src[i]);
      break;
    default:
      std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
  }
}

void to_f32(const void* src, DType dt, float* dst, i64 n) {
  const auto* h = static_cast<const std::uint16_t*>(src);
  switch (dt) {
    case DType::bf16:
      for (i64 i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      break;
    case DType::f16:
      for (i64 i = 0; i < n; ++i) dst[i] = fp16_to_f32(h[i]);
      break;
    default:
      std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
  }
}

template <i64 kW>
void block_softmax_impl(const float* const* sc, const float* const* kv, i64 cr, i64 w_rt, double* e,
                        float* s_out, float* k_out, i64 ld_out, void* cmp, DType io) {
  const i64 w = kW > 0 ? kW : w_rt;
  double mx[kSlice], sum[kSlice] = {}, out[kSlice] = {};
  for (i64 i = 0; i < kSlice; ++i) mx[i] = -__builtin_inf();
  for (i64 j = 0; j < cr; ++j) {
    const float* s = sc[j];
    if (!s) continue;
    for (i64 i = 0; i < w; ++i) {
      const double v = s[i];
      mx[i] = v > mx[i] ? v : mx[i];  // NaN never wins (as fmax)
    }
  }
  for (i64 j = 0; j < cr; ++j) {
    double* ej = e + j * kSlice;
    const float* s = sc[j];
    if (!s) {
      for (i64 i = 0; i < w; ++i) ej[i] = 0.0;
      continue;
    }
    for (i64 i = 0; i < w; ++i) {
      ej[i] = exp_nonpositive(static_cast<double>(s[i]) - mx[i]);
      sum[i] += ej[i];
    }
  }
  // One division per column, then products: within 1 ulp of e / sum in
  // float64, far below the fp32 the weights are stored in.
  double inv[kSlice];
  for (i64 i = 0; i < w; ++i) inv[i] = 1.0 / sum[i];
  for (i64 j = 0; j < cr; ++j) {
    const double* ej = e + j * kSlice;
    const float* k = kv[j];
    float* so = s_out ? s_out + j * ld_out : nullptr;
    float* ko = k_out ? k_out + j * ld_out : nullptr;
    if (!k) {  // placeholder: weight and value exactly 0
      for (i64 i = 0; so && i < w; ++i) so[i] = 0.0f;
      for (i64 i = 0; ko && i < w; ++i) ko[i] = 0.0f;
      continue;
    }
    double sj[kSlice];
    for (i64 i = 0; i < w; ++i) {
      sj[i] = ej[i] * inv[i];
      out[i] += sj[i] * static_cast<double>(k[i]);
    }
    for (i64 i = 0; so && i < w; ++i) so[i] = static_cast<float>(sj[i]);
    for (i64 i = 0; ko && i < w; ++i) ko[i] = k[i];
  }
  float outf[kSlice];
  for (i64 i = 0; i < w; ++i) outf[i] = static_cast<float>(out[i]);
  from_f32(outf, cmp, io, w);
}

void block_softmax(const float* const* sc, const float* const* kv, i64 cr, i64 w, double* e, float* s_out,
                   float* k_out, i64 ld_out, void* cmp, DType io) {
  if (w == kSlice) return block_softmax_impl<kSlice>(sc, kv, cr, w, e, s_out, k_out, ld_out, cmp, io);
  block_softmax_impl<0>(sc, kv, cr, w, e, s_out, k_out, ld_out, cmp, io);
}

}  // namespace

extern const SimdKernels kTable{Isa::KVCOMP_SIMD_NS, block_dot, slot_grad, block_softmax, to_f32, from_f32};

}  // namespace kvcomp::detail::KVCOMP_SIMD_NS
