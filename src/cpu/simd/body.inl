// The element-wise kernels, written once as plain loops over the columns of
// a slice that the compiler vectorises for the ISA of the including file.
// Included by simd/kernels_*.cpp inside their own namespace
// (KVCOMP_SIMD_NS), so the three compilations never share a symbol: an
// inline function compiled with AVX-512 flags cannot be picked by the linker
// for the scalar path.
//
// Rules that keep the three variants bitwise equal: each element sees the
// same operations in the same order; no FMA contraction (-ffp-contract=off);
// no libm but fma (exp_nonpositive, common/numerics.hpp, is plain arithmetic); selects
// instead of branches. The one exception to plain loops: the softmax's exp, which
// the AVX2 and AVX-512 variants write in intrinsics (the compiler does not
// vectorise its bit steps), each the same IEEE operation as the scalar code's.

#ifndef KVCOMP_SIMD_NS
#error "define KVCOMP_SIMD_NS before including body.inl"
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "common/numerics.hpp"
#include "cpu/simd/kernels.hpp"
#include "cpu/stream_store.hpp"

namespace kvcomp::detail::KVCOMP_SIMD_NS {
namespace {

using i64 = std::int64_t;

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

// The low part of the precise backward's two bf16 parts of v (split_bf16 below), hi = bf16(v) given:
// bf16(v - hi), zero where hi is not finite (computed first, then selected: no branch).
inline std::uint16_t bf16_lo(float v, std::uint16_t hi) {
  const std::uint16_t l = f32_to_bf16(v - bf16_to_f32(hi));
  return (hi & 0x7f80u) == 0x7f80u ? std::uint16_t{0} : l;
}

// The outputs never overlap one another or the inputs: __restrict says so, or the compiler, left to
// check six pointers against each other at run time, keeps the precise variant scalar.
template <bool kLo, i64 kW>
void slot_grad_bf16_impl(const float* S, const float* K, const float* dc, const double* wsum, i64 w_rt,
                         std::uint16_t* __restrict dk_out, std::uint16_t* __restrict dz_out,
                         std::uint16_t* __restrict dk_lo, std::uint16_t* __restrict dz_lo,
                         double* __restrict ape) {
  const i64 w = kW > 0 ? kW : w_rt;
  for (i64 i = 0; i < w; ++i) {
    const float sv = S[i];
    const double dz =
        static_cast<double>(sv) * static_cast<double>(dc[i]) * (static_cast<double>(K[i]) - wsum[i]);
    const float dkf = dc[i] * sv, dzf = static_cast<float>(dz);
    const std::uint16_t hk = f32_to_bf16(dkf), hz = f32_to_bf16(dzf);
    dk_out[i] = hk;
    dz_out[i] = hz;
    if constexpr (kLo) {
      dk_lo[i] = bf16_lo(dkf, hk);
      dz_lo[i] = bf16_lo(dzf, hz);
    }
    ape[i] += dz;
  }
}

template <bool kLo>
void slot_grad_bf16_w(const float* S, const float* K, const float* dc, const double* wsum, i64 w,
                      std::uint16_t* dk_out, std::uint16_t* dz_out, std::uint16_t* dk_lo,
                      std::uint16_t* dz_lo, double* ape) {
  if (w == kSlice)
    return slot_grad_bf16_impl<kLo, kSlice>(S, K, dc, wsum, w, dk_out, dz_out, dk_lo, dz_lo, ape);
  slot_grad_bf16_impl<kLo, 0>(S, K, dc, wsum, w, dk_out, dz_out, dk_lo, dz_lo, ape);
}

void slot_grad_bf16(const float* S, const float* K, const float* dc, const double* wsum, i64 w,
                    std::uint16_t* dk_out, std::uint16_t* dz_out, std::uint16_t* dk_lo, std::uint16_t* dz_lo,
                    double* ape) {
  if (dk_lo) return slot_grad_bf16_w<true>(S, K, dc, wsum, w, dk_out, dz_out, dk_lo, dz_lo, ape);
  slot_grad_bf16_w<false>(S, K, dc, wsum, w, dk_out, dz_out, dk_lo, dz_lo, ape);
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

void split_bf16(const float* src, std::uint16_t* hi, std::uint16_t* lo, i64 n) {
  for (i64 i = 0; i < n; ++i) {
    const std::uint16_t h = f32_to_bf16(src[i]);
    hi[i] = h;
    lo[i] = bf16_lo(src[i], h);
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

// Software prefetch of the cache lines of row[0, w) (a hint; null: nothing).
constexpr i64 kRowsAhead = 4;
inline void prefetch_run(const float* row, i64 w) {
  for (i64 i = 0; row && i < w; i += kSlice) __builtin_prefetch(row + i);
}

// ---- the block softmax

#if defined(__AVX512F__)
// exp_nonpositive (common/numerics.hpp) on 8 lanes, step by step the same IEEE operations. vscalefpd
// multiplies by 2^k exactly, as the exponent bits do; where they differ (x < -708) the result is 0.
inline __m512d exp_nonpositive_v(__m512d x) {
  const __m512d t = _mm512_fmadd_pd(x, _mm512_set1_pd(kExpLog2e), _mm512_set1_pd(kExpShifter));
  const __m512d k = _mm512_sub_pd(t, _mm512_set1_pd(kExpShifter));
  const __m512d r =
      _mm512_fmadd_pd(k, _mm512_set1_pd(-kExpLn2Lo), _mm512_fmadd_pd(k, _mm512_set1_pd(-kExpLn2Hi), x));
  __m512d p = _mm512_fmadd_pd(_mm512_set1_pd(kExpG9), r, _mm512_set1_pd(kExpG8));
  for (const double g : {kExpG7, kExpG6, kExpG5, kExpG4, kExpG3, kExpG2, kExpG1, kExpG0, 1.0, 1.0})
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(g));
  const __mmask8 kept = _mm512_cmp_pd_mask(x, _mm512_set1_pd(kExpLowest), _CMP_NLT_UQ);  // NaN kept
  return _mm512_maskz_scalef_pd(kept, p, k);
}
constexpr int kLanes = 8;
using VecD = __m512d;
// maskz: the plain form reads an undefined register, which gcc 12 warns of (maybe-uninitialized).
inline VecD load_f32_as_f64(const float* s) { return _mm512_maskz_cvtps_pd(0xff, _mm256_loadu_ps(s)); }
inline VecD vload(const double* p) { return _mm512_loadu_pd(p); }
inline void vstore(double* p, VecD v) { _mm512_storeu_pd(p, v); }
inline VecD vadd(VecD a, VecD b) { return _mm512_add_pd(a, b); }
inline VecD vsub(VecD a, VecD b) { return _mm512_sub_pd(a, b); }
#elif defined(__AVX2__)
// The same on 4 lanes, 2^k from t's bits as in exp_nonpositive.
inline __m256d exp_nonpositive_v(__m256d x) {
  const __m256d t = _mm256_fmadd_pd(x, _mm256_set1_pd(kExpLog2e), _mm256_set1_pd(kExpShifter));
  const __m256d k = _mm256_sub_pd(t, _mm256_set1_pd(kExpShifter));
  const __m256d r =
      _mm256_fmadd_pd(k, _mm256_set1_pd(-kExpLn2Lo), _mm256_fmadd_pd(k, _mm256_set1_pd(-kExpLn2Hi), x));
  __m256d p = _mm256_fmadd_pd(_mm256_set1_pd(kExpG9), r, _mm256_set1_pd(kExpG8));
  for (const double g : {kExpG7, kExpG6, kExpG5, kExpG4, kExpG3, kExpG2, kExpG1, kExpG0, 1.0, 1.0})
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(g));
  const __m256d scale = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 52));
  const __m256d under = _mm256_cmp_pd(x, _mm256_set1_pd(kExpLowest), _CMP_LT_OQ);
  return _mm256_andnot_pd(under, _mm256_mul_pd(p, scale));
}
constexpr int kLanes = 4;
using VecD = __m256d;
inline VecD load_f32_as_f64(const float* s) { return _mm256_cvtps_pd(_mm_loadu_ps(s)); }
inline VecD vload(const double* p) { return _mm256_loadu_pd(p); }
inline void vstore(double* p, VecD v) { _mm256_storeu_pd(p, v); }
inline VecD vadd(VecD a, VecD b) { return _mm256_add_pd(a, b); }
inline VecD vsub(VecD a, VecD b) { return _mm256_sub_pd(a, b); }
#endif

// One row's exponentials, e[i] = exp(s[i] - mx[i]), added to the column sums, i < w.
inline void exp_row(const float* __restrict s, const double* __restrict mx, double* __restrict e,
                    double* __restrict sum, i64 w) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const i64 nv = w / kLanes * kLanes;
  for (i64 i = 0; i < nv; i += kLanes) {
    const VecD v = exp_nonpositive_v(vsub(load_f32_as_f64(s + i), vload(mx + i)));
    vstore(e + i, v);
    vstore(sum + i, vadd(vload(sum + i), v));
  }
#else
  const i64 nv = 0;
#endif
  for (i64 i = nv; i < w; ++i) {
    e[i] = exp_nonpositive(static_cast<double>(s[i]) - mx[i]);
    sum[i] += e[i];
  }
}

// The softmax's exp on an array: the vector form exp_row uses, the scalar one for a tail.
void exp_n(const double* x, double* y, i64 n) {
  i64 i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, exp_nonpositive_v(vload(x + i)));
#endif
  for (; i < n; ++i) y[i] = exp_nonpositive(x[i]);
}

template <i64 kW>
void block_softmax_impl(const float* const* sc, const float* const* kv, i64 cr, i64 w_rt, double* e,
                        float* s_out, float* k_out, i64 ld_out, void* cmp, DType io) {
  constexpr i64 kN = kSoftmaxChunk, kP = kSoftmaxPitch;
  const i64 w = kW > 0 ? kW : w_rt;
  // Each pass walks the rows in order and each row's columns as one run. Per column the operations
  // and their order are those of a column on its own: the maximum (in float: the largest of some
  // floats is one of them, so the same value as in float64), exponentials and their sum, one
  // division, then the weighted sum in row order.
  float mxf[kN];
  for (i64 i = 0; i < w; ++i) mxf[i] = -__builtin_inff();
  for (i64 j = 0; j < cr && j < kRowsAhead; ++j) prefetch_run(sc[j], w);
  for (i64 j = 0; j < cr; ++j) {
    // The rows lie a page or more apart: fetch a few rows ahead, so that their misses overlap.
    if (j + kRowsAhead < cr) prefetch_run(sc[j + kRowsAhead], w);
    const float* s = sc[j];
    if (!s) continue;
    for (i64 i = 0; i < w; ++i) mxf[i] = s[i] > mxf[i] ? s[i] : mxf[i];  // NaN never wins (as fmax)
  }
  double mx[kN];
  for (i64 i = 0; i < w; ++i) mx[i] = static_cast<double>(mxf[i]);
  double* sum = e + cr * kP;  // e's last row: the sums, then the pooled row
  for (i64 i = 0; i < w; ++i) sum[i] = 0.0;
  for (i64 j = 0; j < cr; ++j) {
    double* ej = e + j * kP;
    prefetch_run(kv[j], w);  // read by the last pass; the exponentials hide the misses
    const float* s = sc[j];
    if (!s) {
      for (i64 i = 0; i < w; ++i) ej[i] = 0.0;
      continue;
    }
    exp_row(s, mx, ej, sum, w);
  }
  // One division per column, then products: within 1 ulp of e / sum in
  // float64, far below the fp32 the weights are stored in.
  double inv[kN];
  for (i64 i = 0; i < w; ++i) inv[i] = 1.0 / sum[i];
  double* out = sum;
  for (i64 i = 0; i < w; ++i) out[i] = 0.0;
  for (i64 j = 0; j < cr; ++j) {
    const double* ej = e + j * kP;
    const float* k = kv[j];
    float* so = s_out ? s_out + j * ld_out : nullptr;
    float* ko = k_out ? k_out + j * ld_out : nullptr;
    if (!k) {  // placeholder: weight and value exactly 0
      for (i64 i = 0; so && i < w; ++i) so[i] = 0.0f;
      for (i64 i = 0; ko && i < w; ++i) ko[i] = 0.0f;
      continue;
    }
    for (i64 i = 0; i < w; ++i) out[i] += (ej[i] * inv[i]) * static_cast<double>(k[i]);
    // The exported rows are read by the backward, long after this call: streamed (stream_store.hpp).
    if (so) {
      float sf[kN];
      for (i64 i = 0; i < w; ++i) sf[i] = static_cast<float>(ej[i] * inv[i]);
      stream_floats(so, sf, w);
    }
    if (ko) stream_floats(ko, k, w);
  }
  float outf[kN];
  for (i64 i = 0; i < w; ++i) outf[i] = static_cast<float>(out[i]);
  from_f32(outf, cmp, io, w);
}

void block_softmax(const float* const* sc, const float* const* kv, i64 cr, i64 w, double* e, float* s_out,
                   float* k_out, i64 ld_out, void* cmp, DType io) {
  // The widths a thread's columns take at D = 512 or 128 (C4A, C128A, C4Li) on 1 to 8 threads, compiled
  // for: a runtime width cost more per element at 64 and 32 columns.
  if (w == kSoftmaxChunk)
    return block_softmax_impl<kSoftmaxChunk>(sc, kv, cr, w, e, s_out, k_out, ld_out, cmp, io);
  if (w == 128) return block_softmax_impl<128>(sc, kv, cr, w, e, s_out, k_out, ld_out, cmp, io);
  if (w == 64) return block_softmax_impl<64>(sc, kv, cr, w, e, s_out, k_out, ld_out, cmp, io);
  if (w == 32) return block_softmax_impl<32>(sc, kv, cr, w, e, s_out, k_out, ld_out, cmp, io);
  block_softmax_impl<0>(sc, kv, cr, w, e, s_out, k_out, ld_out, cmp, io);
}

}  // namespace

extern const SimdKernels kTable{
    Isa::KVCOMP_SIMD_NS, block_dot, slot_grad, slot_grad_bf16, block_softmax, to_f32, from_f32,
    split_bf16,          exp_n};

}  // namespace kvcomp::detail::KVCOMP_SIMD_NS
