#include "cpu/epilogue.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvcomp/half.hpp"

namespace kvcomp::detail {

namespace {

float load(const void* p, DType dt, std::int64_t i) {
  switch (dt) {
    case DType::bf16:
      return bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case DType::f16:
      return fp16_to_float(static_cast<const std::uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

void store(void* p, DType dt, std::int64_t i, float v) {
  switch (dt) {
    case DType::bf16:
      static_cast<std::uint16_t*>(p)[i] = float_to_bf16(v);
      break;
    case DType::f16:
      static_cast<std::uint16_t*>(p)[i] = float_to_fp16(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// The compressed block an output row holds: its position (its first token's, k * r), or -1 where the row
// holds none (BSH padding, TH rows past the blocks). Batches are in output-row order.
std::int64_t row_position(const BlockPlan& plan, std::int64_t row) {
  const auto& bs = plan.batches;
  auto it = std::upper_bound(bs.begin(), bs.end(), row,
                             [](std::int64_t r, const BatchSpan& s) { return r < s.out_row; });
  if (it == bs.begin()) return -1;
  const BatchSpan& s = *(it - 1);
  if (row >= s.out_row + s.nblocks) return -1;
  return (s.k0 + row - s.out_row) * plan.dims.r;
}

// RMSNorm's 1 / sqrt(mean(p^2) + eps) of a row: the mean in float64 (the model's is fp32).
double inverse_rms(const void* row, DType io, std::int64_t D, float eps) {
  double ss = 0.0;
  for (std::int64_t i = 0; i < D; ++i) {
    const double v = load(row, io, i);
    ss += v * v;
  }
  return 1.0 / std::sqrt(ss / static_cast<double>(D) + static_cast<double>(eps));
}

}  // namespace

std::size_t epilogue_backward_bytes(std::int64_t rows, std::int64_t D) {
  const std::size_t bytes = static_cast<std::size_t>(rows) * sizeof(float) +  // the rows' fp32 rstd
                            static_cast<std::size_t>(D) * sizeof(double);     // d_norm_weight's sums
  return (bytes + 63) / 64 * 64;
}

void epilogue_forward(const BlockPlan& plan, const EpilogueView& ep, std::int64_t rows, void* cmp_kv,
                      void* pooled, int num_threads) {
  const DType io = plan.dims.io;
  const std::int64_t D = plan.dims.D, io_size = static_cast<std::int64_t>(dtype_size(io));
  const std::int64_t rope_from = D - 2 * ep.pairs;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t row = 0; row < rows; ++row) {
    unsigned char* out = static_cast<unsigned char*>(cmp_kv) + row * D * io_size;
    if (pooled)
      std::memcpy(static_cast<unsigned char*>(pooled) + row * D * io_size, out,
                  static_cast<std::size_t>(D * io_size));
    const std::int64_t pos = row_position(plan, row);
    if (pos < 0) continue;
    if (ep.norm_weight) {
      // The model's RMSNorm: x_hat = p * rstd in fp32, (weight * x_hat) rounded to the io dtype.
      const auto rstd = static_cast<float>(inverse_rms(out, io, D, ep.eps));
      for (std::int64_t i = 0; i < D; ++i) {
        const float x_hat = load(out, io, i) * rstd;
        store(out, io, i, load(ep.norm_weight, ep.norm_dtype, i) * x_hat);
      }
    }
    if (ep.cos) {
      // The rotation of each adjacent pair in fp32, on the rounded values, rounded again.
      const float* c = ep.cos + pos * ep.pairs;
      const float* s = ep.sin + pos * ep.pairs;
      for (std::int64_t p = 0; p < ep.pairs; ++p) {
        const std::int64_t i = rope_from + 2 * p;
        const float a = load(out, io, i), b = load(out, io, i + 1);
        const float ac = a * c[p], bs = b * s[p], as = a * s[p], bc = b * c[p];
        store(out, io, i, ac - bs);
        store(out, io, i + 1, as + bc);
      }
    }
  }
}

void epilogue_backward(const BlockPlan& plan, const EpilogueView& ep, std::int64_t rows, const void* pooled,
                       const void* d_cmp_kv, float* dp, void* d_norm_weight, void* scratch, int num_threads) {
  const DType io = plan.dims.io;
  const std::int64_t D = plan.dims.D, io_size = static_cast<std::int64_t>(dtype_size(io));
  const std::int64_t rope_from = D - 2 * ep.pairs;
  auto* rstd_of = static_cast<float*>(scratch);  // [rows]: the forward's fp32 rstd
  auto* wsum = reinterpret_cast<double*>(static_cast<unsigned char*>(scratch) +
                                         (static_cast<std::size_t>(rows) * sizeof(float) + 7) / 8 * 8);
  // dy (the gradient of the normed row) at column i of a row at position pos: the inverse rotation of
  // d_cmp_kv, in float64.
  const auto dy_at = [&](const void* dz, std::int64_t pos, std::int64_t i) -> double {
    if (!ep.cos || i < rope_from) return load(dz, io, i);
    const std::int64_t p = (i - rope_from) / 2;
    const double c = ep.cos[pos * ep.pairs + p], s = ep.sin[pos * ep.pairs + p];
    const std::int64_t even = rope_from + 2 * p;
    const double ga = load(dz, io, even), gb = load(dz, io, even + 1);
    return i == even ? ga * c + gb * s : gb * c - ga * s;
  };
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t row = 0; row < rows; ++row) {
    float* g = dp + row * D;
    const std::int64_t pos = row_position(plan, row);
    if (pos < 0) {
      std::fill(g, g + D, 0.0f);
      rstd_of[row] = 0.0f;
      continue;
    }
    const auto* dz = static_cast<const unsigned char*>(d_cmp_kv) + row * D * io_size;
    if (!ep.norm_weight) {
      for (std::int64_t i = 0; i < D; ++i) g[i] = static_cast<float>(dy_at(dz, pos, i));
      continue;
    }
    // y = w * x_hat, x_hat = p * rstd(p), rstd = (mean(p^2) + eps)^(-1/2):
    // dp = rstd * (w dy - x_hat * mean(w dy x_hat)), in float64 from the rounded pooled row.
    const auto* p = static_cast<const unsigned char*>(pooled) + row * D * io_size;
    const double rstd = inverse_rms(p, io, D, ep.eps);
    rstd_of[row] = static_cast<float>(rstd);
    double m = 0.0;
    for (std::int64_t i = 0; i < D; ++i)
      m += dy_at(dz, pos, i) * load(ep.norm_weight, ep.norm_dtype, i) * (load(p, io, i) * rstd);
    m /= static_cast<double>(D);
    for (std::int64_t i = 0; i < D; ++i) {
      const double x_hat = load(p, io, i) * rstd;
      g[i] =
          static_cast<float>(rstd * (dy_at(dz, pos, i) * load(ep.norm_weight, ep.norm_dtype, i) - x_hat * m));
    }
  }
  if (!ep.norm_weight) return;
    // d_norm_weight[i] = sum over the rows, in order, of dy * x_hat (the forward's fp32 x_hat): one thread
    // per column run.
#pragma omp parallel num_threads(num_threads)
  {
    const std::int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const std::int64_t lo = D * tid / nt, hi = D * (tid + 1) / nt;
    std::fill(wsum + lo, wsum + hi, 0.0);
    for (std::int64_t row = 0; row < rows && lo < hi; ++row) {
      const std::int64_t pos = row_position(plan, row);
      if (pos < 0) continue;
      const auto* dz = static_cast<const unsigned char*>(d_cmp_kv) + row * D * io_size;
      const auto* p = static_cast<const unsigned char*>(pooled) + row * D * io_size;
      for (std::int64_t i = lo; i < hi; ++i) wsum[i] += dy_at(dz, pos, i) * (load(p, io, i) * rstd_of[row]);
    }
    for (std::int64_t i = lo; i < hi; ++i)
      store(d_norm_weight, ep.norm_dtype, i, static_cast<float>(wsum[i]));
  }
}

}  // namespace kvcomp::detail
