// The model-level epilogue of the CUDA backend (kvcomp.hpp's Epilogue: RMSNorm over D, RoPE on the
// last rd channels), one function per thread of each kernel (cuda/kernels.cu launches them; the host
// emulation in tests/cuda calls them in loops). The CPU backend's formulas (cpu/epilogue.cpp) in the
// same order per element: a row's sums over D run in column order inside one thread, each output
// element is written by one thread, and d_norm_weight's sum runs over the rows in row order
// (launch_dape_accumulate over the rows' terms), so the bits are the CPU's and depend on no launch
// shape. Include only from files compiled without multiply-add contraction.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/kernel_bodies.hpp"

namespace kvcomp::detail::cuda::body {

// sqrt correctly rounded on both sides (IEEE), so rstd is the CPU's to the bit.
KVCOMP_HD double sqrt_rn(double v) {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(v);
#else
  return std::sqrt(v);
#endif
}

// The position of the compressed block output row `row` holds (its first token's, k * r), or -1 where
// the row holds none (BSH padding, TH rows past the blocks). Batches are in output-row order.
KVCOMP_HD i64 row_position(const Geometry& g, i64 row) {
  i64 lo = 0, hi = g.B;  // the first batch starting past row
  while (lo < hi) {
    const i64 mid = (lo + hi) / 2;
    if (g.batches[mid].out_row <= row)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0) return -1;
  const DevBatch& s = g.batches[lo - 1];
  if (row >= s.out_row + s.nblocks) return -1;
  return (s.k0 + row - s.out_row) * g.r;
}

KVCOMP_HD i64 io_bytes(DType io) { return io == DType::f32 ? 4 : 2; }

// RMSNorm's 1 / sqrt(mean(p^2) + eps) of an io row, the mean in float64 in column order.
KVCOMP_HD double inverse_rms(const void* row, DType io, i64 D, float eps) {
  double ss = 0.0;
  for (i64 i = 0; i < D; ++i) {
    const double v = load_io(row, i, io);
    ss += v * v;
  }
  return 1.0 / sqrt_rn(ss / static_cast<double>(D) + static_cast<double>(eps));
}

// Element i of a row copied bit for bit (no conversion: NaN payloads stay).
KVCOMP_HD void copy_io(const void* src, void* dst, i64 i, DType io) {
  if (io == DType::f32)
    static_cast<std::uint32_t*>(dst)[i] = static_cast<const std::uint32_t*>(src)[i];
  else
    static_cast<std::uint16_t*>(dst)[i] = static_cast<const std::uint16_t*>(src)[i];
}

// Forward, output row `row`: its fp32 rstd (RMSNorm on, the row holds a block).
KVCOMP_HD void epilogue_forward_stats(const EpilogueKernelArgs& e, i64 row) {
  if (row >= e.rows || !e.ep.norm_weight) return;
  if (row_position(e.g, row) < 0) return;
  const void* out = static_cast<const unsigned char*>(e.cmp_kv) + row * e.g.D * io_bytes(e.g.io);
  e.rstd[row] = static_cast<float>(inverse_rms(out, e.g.io, e.g.D, e.ep.eps));
}

// Forward, output row `row`, column d: the thread of a rotated pair's even column does both columns
// (the odd one's thread returns), so no thread reads what another writes.
KVCOMP_HD void epilogue_forward_element(const EpilogueKernelArgs& e, i64 row, i64 d) {
  const Geometry& g = e.g;
  if (row >= e.rows || d >= g.D) return;
  const i64 rope_from = g.D - 2 * e.ep.pairs;
  const bool rotated = e.ep.cos && d >= rope_from;
  if (rotated && (d - rope_from) % 2 == 1) return;
  const i64 n = rotated ? 2 : 1;
  const i64 at = row * g.D + d;
  if (e.pooled)
    for (i64 j = 0; j < n; ++j) copy_io(e.cmp_kv, e.pooled, at + j, g.io);
  const i64 pos = row_position(g, row);
  if (pos < 0) return;
  float y[2] = {load_io(e.cmp_kv, at, g.io), rotated ? load_io(e.cmp_kv, at + 1, g.io) : 0.0f};
  if (e.ep.norm_weight) {
    // The model's RMSNorm: x_hat = p * rstd in fp32, (weight * x_hat) rounded to the io dtype.
    const float rstd = e.rstd[row];
    for (i64 j = 0; j < n; ++j) {
      const float x_hat = y[j] * rstd;
      y[j] = round_to(load_io(e.ep.norm_weight, d + j, e.ep.norm_dtype) * x_hat, g.io);
    }
  }
  if (!rotated) {
    if (e.ep.norm_weight) store_io(e.cmp_kv, at, g.io, y[0]);
    return;
  }
  // The rotation of the pair in fp32, on the rounded values, rounded again.
  const i64 pair = (d - rope_from) / 2;
  const float c = e.ep.cos[pos * e.ep.pairs + pair], s = e.ep.sin[pos * e.ep.pairs + pair];
  const float a = y[0], b = y[1];
  const float ac = a * c, bs = b * s, as = a * s, bc = b * c;
  store_io(e.cmp_kv, at, g.io, ac - bs);
  store_io(e.cmp_kv, at + 1, g.io, as + bc);
}

// Backward: dy (the gradient of the normed row) at column i of the row at position pos whose d_cmp_kv
// row is dz: the inverse rotation of dz, in float64.
KVCOMP_HD double epilogue_dy(const EpilogueKernelArgs& e, const void* dz, i64 pos, i64 i) {
  const DType io = e.g.io;
  const i64 rope_from = e.g.D - 2 * e.ep.pairs;
  if (!e.ep.cos || i < rope_from) return load_io(dz, i, io);
  const i64 p = (i - rope_from) / 2;
  const double c = e.ep.cos[pos * e.ep.pairs + p], s = e.ep.sin[pos * e.ep.pairs + p];
  const i64 even = rope_from + 2 * p;
  const double ga = load_io(dz, even, io), gb = load_io(dz, even + 1, io);
  return i == even ? ga * c + gb * s : gb * c - ga * s;
}

// Backward, output row `row` (RMSNorm on): stats[2 row] = rstd of the pooled row (float64),
// stats[2 row + 1] = mean over D of w dy x_hat; zeros in a row without a block.
KVCOMP_HD void epilogue_backward_stats(const EpilogueKernelArgs& e, i64 row) {
  if (row >= e.rows || !e.ep.norm_weight) return;
  const Geometry& g = e.g;
  const i64 pos = row_position(g, row);
  if (pos < 0) {
    e.stats[2 * row] = 0.0;
    e.stats[2 * row + 1] = 0.0;
    return;
  }
  const i64 io_size = io_bytes(g.io);
  const void* dz = static_cast<const unsigned char*>(e.d_cmp_kv) + row * g.D * io_size;
  const void* p = static_cast<const unsigned char*>(e.pooled_in) + row * g.D * io_size;
  const double rstd = inverse_rms(p, g.io, g.D, e.ep.eps);
  double m = 0.0;
  for (i64 i = 0; i < g.D; ++i)
    m += epilogue_dy(e, dz, pos, i) * load_io(e.ep.norm_weight, i, e.ep.norm_dtype) *
         (load_io(p, i, g.io) * rstd);
  m /= static_cast<double>(g.D);
  e.stats[2 * row] = rstd;
  e.stats[2 * row + 1] = m;
}

// Backward, output row `row`, column i: dp = rstd (w dy - x_hat m) in float64 from the rounded pooled
// row (RMSNorm on), else dy; 0 in a row without a block.
KVCOMP_HD void epilogue_backward_element(const EpilogueKernelArgs& e, i64 row, i64 i) {
  const Geometry& g = e.g;
  if (row >= e.rows || i >= g.D) return;
  float* out = e.dp + row * g.D + i;
  const i64 pos = row_position(g, row);
  if (pos < 0) {
    *out = 0.0f;
    return;
  }
  const i64 io_size = io_bytes(g.io);
  const void* dz = static_cast<const unsigned char*>(e.d_cmp_kv) + row * g.D * io_size;
  if (!e.ep.norm_weight) {
    *out = static_cast<float>(epilogue_dy(e, dz, pos, i));
    return;
  }
  const void* p = static_cast<const unsigned char*>(e.pooled_in) + row * g.D * io_size;
  const double rstd = e.stats[2 * row], m = e.stats[2 * row + 1];
  const double x_hat = load_io(p, i, g.io) * rstd;
  *out = static_cast<float>(
      rstd * (epilogue_dy(e, dz, pos, i) * load_io(e.ep.norm_weight, i, e.ep.norm_dtype) - x_hat * m));
}

// Row `row` (of the rows from row_lo), column i: its term of d_norm_weight[i], dy times the forward's
// fp32 x_hat (the pooled value times the fp32 rstd); 0 in a row without a block.
KVCOMP_HD void epilogue_weight_term(const EpilogueKernelArgs& e, i64 row_lo, i64 row, i64 i) {
  const Geometry& g = e.g;
  if (row >= e.rows || i >= g.D) return;
  double* out = e.wpart + (row - row_lo) * g.D + i;
  const i64 pos = row_position(g, row);
  if (pos < 0) {
    *out = 0.0;  // adds nothing: a sum from +0 in round-to-nearest is never -0
    return;
  }
  const i64 io_size = io_bytes(g.io);
  const void* dz = static_cast<const unsigned char*>(e.d_cmp_kv) + row * g.D * io_size;
  const void* p = static_cast<const unsigned char*>(e.pooled_in) + row * g.D * io_size;
  const auto rstd = static_cast<float>(e.stats[2 * row]);
  *out = epilogue_dy(e, dz, pos, i) * (load_io(p, i, g.io) * rstd);
}

// Element i of a float64 vector narrowed to dt through fp32 (the CPU's store of d_norm_weight).
KVCOMP_HD void f64_narrow(const double* src, void* dst, DType dt, i64 i) {
  store_io(dst, i, dt, static_cast<float>(src[i]));
}

}  // namespace kvcomp::detail::cuda::body
