#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/block_phases.hpp"
#include "cpu/backend.hpp"
#include "cpu/convert.hpp"
#include "cpu/gemm.hpp"

namespace kvcomp::detail {

namespace {

struct BackwardBuffers {
  std::int64_t R, ld_h, ld_c2, ld_r;  // chunk rows and padded leading dimensions
  float* wcat;                        // [2C, ld_h]: wkv rows then wgate rows, fp32
  float* dwcat;                       // [2C, ld_h]: d_wkv rows then d_wgate rows, fp32 accumulators
  float* xf;                          // [R, ld_h]: the chunk's x rows in fp32 (rows without gradient zeroed)
  float* dnew;                        // [R, ld_c2]: d_new_kv | d_new_score
  float* dnew_t;  // [2C, ld_r]: its transpose (oneDNN's transposed-A path runs at half speed)
  float* dxf;     // [R, ld_h]: d_x of the chunk before narrowing
  double* dape;   // [r, C]
  std::size_t size;

  BackwardBuffers(const Dims& d, void* base) {
    WorkspaceLayout ws(base);
    R = std::min(kChunkRows, std::max<std::int64_t>(d.T, 1));
    // dnew and dxf hold the rows of the d_x product padded for row stability (gemm.hpp).
    const std::int64_t Rp = gemm_row_capacity(R);
    ld_h = padded_ld(d.H);
    ld_c2 = padded_ld(2 * d.C);
    ld_r = padded_ld(R);
    wcat = ws.take<float>(2 * d.C * ld_h);
    dwcat = ws.take<float>(2 * d.C * ld_h);
    xf = ws.take<float>(R * ld_h);
    dnew = ws.take<float>(Rp * ld_c2);
    dnew_t = ws.take<float>(2 * d.C * ld_r);
    dxf = ws.take<float>(Rp * ld_h);
    dape = ws.take<double>(d.r * d.C);
    size = ws.size();
  }
};

// dst[c, i] = src[i, c]; cache-blocked, parallel over column blocks. A pure
// copy: no rounding, so the thread count cannot matter.
void transpose(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t ld_src, float* dst,
               std::int64_t ld_dst, int num_threads) {
  constexpr std::int64_t kBlock = 32;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t c0 = 0; c0 < cols; c0 += kBlock)
    for (std::int64_t r0 = 0; r0 < rows; r0 += kBlock)
      for (std::int64_t c = c0; c < std::min(cols, c0 + kBlock); ++c)
        for (std::int64_t i = r0; i < std::min(rows, r0 + kBlock); ++i)
          dst[c * ld_dst + i] = src[i * ld_src + c];
}

// Rows of [a, b) that receive gradient: tokens inside their batch's
// compressed region (s < limit - sp). Everything else gets an exact zero row.
void mark_gradient_rows(const BlockPlan& plan, std::int64_t a, std::int64_t b, std::vector<char>& mark) {
  std::fill(mark.begin(), mark.end(), 0);
  for (std::size_t bi = first_batch_ending_after(plan, a);
       bi < plan.batches.size() && plan.batches[bi].base < b; ++bi) {
    const BatchSpan& s = plan.batches[bi];
    const std::int64_t lo = std::max(a, s.base),
                       hi = std::min({b, s.base + s.len, s.base + (s.limit - s.sp)});
    for (std::int64_t row = lo; row < hi; ++row) mark[static_cast<std::size_t>(row - a)] = 1;
  }
}

void zero_bytes(void* p, std::int64_t elements, std::size_t elem_size) {
  std::memset(p, 0, static_cast<std::size_t>(elements) * elem_size);
}

}  // namespace

std::size_t backward_workspace_size(const Dims& d, int /*num_threads*/) {
  return BackwardBuffers(d, nullptr).size;
}

Status run_backward(const BackwardArgs& args, const BlockPlan& plan, Precision precision, int num_threads,
                    void* workspace) {
  const Dims& d = plan.dims;
  const std::int64_t H = d.H, C = d.C;
  const std::size_t io_size = dtype_size(d.io);

  if (plan.total_blocks == 0) {  // spec 2.7: four all-zero outputs, whatever the memory held
    zero_bytes(args.d_x.data, args.d_x.numel(), io_size);
    zero_bytes(args.d_wkv.data, args.d_wkv.numel(), dtype_size(args.d_wkv.dtype));
    zero_bytes(args.d_wgate.data, args.d_wgate.numel(), dtype_size(args.d_wgate.dtype));
    zero_bytes(args.d_ape.data, args.d_ape.numel(), sizeof(float));
    return Status::success();
  }

  BackwardBuffers buf(d, WorkspaceLayout::align(workspace));
  rows_to_f32(args.wkv.data, d.io, C, H, buf.wcat, buf.ld_h, num_threads);
  rows_to_f32(args.wgate.data, d.io, C, H, buf.wcat + C * buf.ld_h, buf.ld_h, num_threads);
  std::fill(buf.dape, buf.dape + d.r * C, 0.0);

  const BackwardBlockInputs in{args.d_cmp_kv.data, static_cast<const float*>(args.softmax_score.data),
                               static_cast<const float*>(args.kv.data)};
  const bool parity = precision == Precision::npu_parity;
  std::vector<char> mark(static_cast<std::size_t>(buf.R));
  // The first chunk with gradient writes the weight-gradient accumulators,
  // later ones add to them (chunks without gradient rows are skipped).
  bool dw_written = false;
  for (std::int64_t a = 0; a < d.T; a += kChunkRows) {
    const std::int64_t b = std::min(d.T, a + kChunkRows), n = b - a;
    mark_gradient_rows(plan, a, b, mark);
    auto* dx_rows = static_cast<unsigned char*>(args.d_x.data) + static_cast<std::size_t>(a * H) * io_size;
    if (std::none_of(mark.begin(), mark.begin() + n, [](char m) { return m != 0; })) {
      zero_bytes(dx_rows, n * H, io_size);
      continue;
    }
    // Zeroed up to the padded row count of the d_x product (its padding rows stay zero).
    const std::int64_t n_pad = gemm_padded_rows(n, false);
    for (std::int64_t i = 0; i < n_pad; ++i)
      std::fill(buf.dnew + i * buf.ld_c2, buf.dnew + i * buf.ld_c2 + 2 * C, 0.0f);
    backward_blocks(plan, in, a, b, buf.dnew, buf.ld_c2, buf.dape, parity, num_threads);

    // x rows without gradient are zeroed so that 0 * Inf/NaN in them cannot
    // leak into d_wkv / d_wgate (the NPU kernel does the same).
    const auto* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(a * H) * io_size;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) {
      float* dst = buf.xf + i * buf.ld_h;
      if (mark[static_cast<std::size_t>(i)])
        to_f32(x_rows + static_cast<std::size_t>(i * H) * io_size, d.io, dst, H);
      else
        std::fill(dst, dst + H, 0.0f);
    }

    // d_x rows = [d_new_kv | d_new_score] . [wkv ; wgate]
    if (!gemm_f32(n_pad, H, 2 * C, {buf.dnew, buf.ld_c2, false}, {buf.wcat, buf.ld_h, false}, buf.dxf, buf.ld_h,
                  false, num_threads))
      return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for d_x failed"};
    // [d_wkv ; d_wgate] += [d_new_kv | d_new_score]^T . x
    transpose(buf.dnew, n, 2 * C, buf.ld_c2, buf.dnew_t, buf.ld_r, num_threads);
    if (!gemm_f32(2 * C, H, n, {buf.dnew_t, buf.ld_r, false}, {buf.xf, buf.ld_h, false}, buf.dwcat, buf.ld_h,
                  dw_written, num_threads))
      return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for d_wkv/d_wgate failed"};
    dw_written = true;

#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) {
      unsigned char* dst = dx_rows + static_cast<std::size_t>(i * H) * io_size;
      if (mark[static_cast<std::size_t>(i)])
        from_f32(buf.dxf + i * buf.ld_h, dst, d.io, H);
      else
        zero_bytes(dst, H, io_size);
    }
  }
  auto* dwkv = static_cast<unsigned char*>(args.d_wkv.data);
  auto* dwgate = static_cast<unsigned char*>(args.d_wgate.data);
  const DType w_dt = args.d_wkv.dtype;  // the io dtype, or fp32 (validated: the same for d_wgate)
  const std::size_t w_size = dtype_size(w_dt);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t c = 0; c < C; ++c) {
    from_f32(buf.dwcat + c * buf.ld_h, dwkv + static_cast<std::size_t>(c * H) * w_size, w_dt, H);
    from_f32(buf.dwcat + (C + c) * buf.ld_h, dwgate + static_cast<std::size_t>(c * H) * w_size, w_dt, H);
  }
  auto* dape = static_cast<float*>(args.d_ape.data);
  const bool parts = args.d_ape.rank == 3;  // [2, r, C]: hi, then lo = the rest of the float64 sum
  for (std::int64_t i = 0; i < d.r * C; ++i) {
    dape[i] = static_cast<float>(buf.dape[i]);
    if (parts) dape[d.r * C + i] = static_cast<float>(buf.dape[i] - static_cast<double>(dape[i]));
  }
  return Status::success();
}

}  // namespace kvcomp::detail
