// The element-wise kernels that run once per 16-column slice of a block, and
// the io conversions, compiled three times (simd/kernels_{scalar,avx2,avx512}.cpp,
// each from simd/body.inl with its own ISA flags) and picked at run time.
//
// Every variant performs the same IEEE operations in the same order per
// element (no FMA contraction, no libm calls): the three give bitwise equal
// results, so the choice of ISA never changes an output (tests/kernels checks
// this for every path the CPU can run).
#pragma once

#include <cstdint>

#include "cpu/isa.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

// Columns per work item of the block phases: a multiple of the widest SIMD
// register in floats, and one 64-byte cache line of fp32.
inline constexpr std::int64_t kSlice = 16;
// Columns per call of the forward's block softmax: a whole number of slices, wide enough that each row
// of a block is read as one run of cache lines (the rows lie a page or more apart, and a run per row is
// what the hardware prefetchers follow), small enough that the block's exponentials stay in L2.
inline constexpr std::int64_t kSoftmaxChunk = 16 * kSlice;
// Doubles from one row of the block softmax's scratch to the next: a chunk and a cache line, so that a
// row's store and the sums' load never sit a multiple of 4 KiB apart (a false store-forwarding stall).
inline constexpr std::int64_t kSoftmaxPitch = kSoftmaxChunk + 8;

struct SimdKernels {
  Isa isa;
  // wsum[i] = sum_j S[j*ld + i] * K[j*ld + i] over `rows` rows, in float64
  // (products of two floats are exact in float64), i < w <= kSlice.
  void (*block_dot)(const float* S, const float* K, std::int64_t rows, std::int64_t ld, std::int64_t w,
                    double* wsum);
  // One slot of a block (spec 6.1): dk = dc * S (fp32), dz = S * dc * (K - wsum)
  // (float64), written as fp32, rounded to `parity` first unless it is f32
  // (npu_parity); ape[i] += dz.
  void (*slot_grad)(const float* S, const float* K, const float* dc, const double* wsum, std::int64_t w,
                    DType parity, float* dk_out, float* dz_out, double* ape);
  // The same with bf16 io on the bf16 units, dk and dz written as bf16. dk_lo and dz_lo null
  // (npu_parity): the bits slot_grad's rounded values have as bf16. Else (precise): the two parts of
  // the fp32 values that split_bf16 gives, hi to dk_out / dz_out and lo to dk_lo / dz_lo.
  void (*slot_grad_bf16)(const float* S, const float* K, const float* dc, const double* wsum, std::int64_t w,
                         std::uint16_t* dk_out, std::uint16_t* dz_out, std::uint16_t* dk_lo,
                         std::uint16_t* dz_lo, double* ape);
  // Softmax over the cr rows of one block for w <= kSoftmaxChunk columns, in
  // float64. sc[j] / kv[j]: the rows (already offset to the chunk), nullptr
  // for a placeholder row (weight exactly 0). Writes softmax_score / kv rows
  // (s_out / k_out with row stride ld_out, either may be null) and the
  // pooled row to cmp (io dtype). e: scratch of (cr + 1) * kSoftmaxPitch
  // doubles. The s_out / k_out rows are streamed (cpu/stream_store.hpp): the
  // caller fences before another thread reads them.
  void (*block_softmax)(const float* const* sc, const float* const* kv, std::int64_t cr, std::int64_t w,
                        double* e, float* s_out, float* k_out, std::int64_t ld_out, void* cmp, DType io);
  // io dtype <-> fp32, n elements (round to nearest even when narrowing).
  void (*to_f32)(const void* src, DType dt, float* dst, std::int64_t n);
  void (*from_f32)(const float* src, void* dst, DType dt, std::int64_t n);
  // The precise backward's two bf16 parts of fp32 values (products/onednn_bf16.hpp): hi = bf16(v) and
  // lo = bf16(v - hi), lo zero where hi is not finite (exponent bits all ones), n elements. The
  // backward's blocks write these parts themselves (slot_grad_bf16, through the same per-element
  // steps); this array form is their definition, tested on special values (tests/kernels).
  void (*split_bf16)(const float* src, std::uint16_t* hi, std::uint16_t* lo, std::int64_t n);
  // y[i] = exp_nonpositive(x[i]) (common/numerics.hpp), n elements, through the vector form the
  // block softmax runs (AVX2, AVX-512: intrinsics); tests hold it bitwise to the scalar function.
  void (*exp)(const double* x, double* y, std::int64_t n);
};

// The table for one ISA (the scalar one when the build lacks that variant).
const SimdKernels& simd_kernels(Isa isa);
// The table of active_isa(), chosen once per process.
const SimdKernels& simd_kernels();

}  // namespace kvcomp::detail
