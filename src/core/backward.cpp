#include <algorithm>
#include <cstring>
#include <vector>

#include "core/ops.hpp"
#include "kernels/convert.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/gemm.hpp"

namespace kvcomp::detail {

namespace {

struct BackwardBuffers {
  float* wcat;   // [2C, H]: wkv rows then wgate rows, fp32
  float* dwcat;  // [2C, H]: d_wkv rows then d_wgate rows, fp32 accumulators
  float* xf;     // [R, H]: the chunk's x rows in fp32 (rows without gradient zeroed)
  float* dnew;   // [R, 2C]: d_new_kv | d_new_score
  float* dxf;    // [R, H]: d_x of the chunk before narrowing
  double* dape;  // [r, C]

  BackwardBuffers(const Dims& d, void* base) {
    WorkspaceLayout ws(base);
    const std::int64_t R = std::min(kChunkRows, std::max<std::int64_t>(d.T, 1));
    wcat = ws.take<float>(2 * d.C * d.H);
    dwcat = ws.take<float>(2 * d.C * d.H);
    xf = ws.take<float>(R * d.H);
    dnew = ws.take<float>(R * 2 * d.C);
    dxf = ws.take<float>(R * d.H);
    dape = ws.take<double>(d.r * d.C);
    size = ws.size();
  }
  std::size_t size;
};

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

}  // namespace

std::size_t backward_workspace_size(const Dims& d) { return BackwardBuffers(d, nullptr).size; }

Status run_backward(const BackwardArgs& args, const BlockPlan& plan, Precision precision, int num_threads,
                    void* workspace) {
  const Dims& d = plan.dims;
  const std::int64_t H = d.H, C = d.C;
  BackwardBuffers buf(d, WorkspaceLayout::align(workspace));

  if (plan.total_blocks == 0) {  // spec 2.7: four all-zero outputs, whatever the memory held
    std::memset(args.d_x.data, 0, static_cast<std::size_t>(args.d_x.numel()) * dtype_size(d.io));
    std::memset(args.d_wkv.data, 0, static_cast<std::size_t>(args.d_wkv.numel()) * dtype_size(d.io));
    std::memset(args.d_wgate.data, 0, static_cast<std::size_t>(args.d_wgate.numel()) * dtype_size(d.io));
    std::memset(args.d_ape.data, 0, static_cast<std::size_t>(args.d_ape.numel()) * sizeof(float));
    return Status::success();
  }

  to_f32(args.wkv.data, d.io, buf.wcat, C * H);
  to_f32(args.wgate.data, d.io, buf.wcat + C * H, C * H);
  std::fill(buf.dape, buf.dape + d.r * C, 0.0);
  std::fill(buf.dwcat, buf.dwcat + 2 * C * H, 0.0f);

  const BackwardBlockInputs in{args.d_cmp_kv.data, static_cast<const float*>(args.softmax_score.data),
                               static_cast<const float*>(args.kv.data)};
  const bool parity = precision == Precision::npu_parity;
  const std::size_t io_size = dtype_size(d.io);
  std::vector<char> mark(static_cast<std::size_t>(std::min(kChunkRows, d.T)));
  for (std::int64_t a = 0; a < d.T; a += kChunkRows) {
    const std::int64_t b = std::min(d.T, a + kChunkRows), n = b - a;
    mark_gradient_rows(plan, a, b, mark);
    auto* dx_rows = static_cast<unsigned char*>(args.d_x.data) + static_cast<std::size_t>(a * H) * io_size;
    if (std::none_of(mark.begin(), mark.begin() + n, [](char m) { return m != 0; })) {
      std::memset(dx_rows, 0, static_cast<std::size_t>(n * H) * io_size);
      continue;
    }
    std::fill(buf.dnew, buf.dnew + n * 2 * C, 0.0f);
    backward_blocks(plan, in, a, b, buf.dnew, buf.dape, parity, num_threads);

    // x rows without gradient are zeroed so that 0 * Inf/NaN in them cannot
    // leak into d_wkv / d_wgate (the NPU kernel does the same).
    const auto* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(a * H) * io_size;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) {
      float* dst = buf.xf + i * H;
      if (mark[static_cast<std::size_t>(i)])
        to_f32(x_rows + static_cast<std::size_t>(i * H) * io_size, d.io, dst, H);
      else
        std::fill(dst, dst + H, 0.0f);
    }

    // d_x rows = [d_new_kv | d_new_score] . [wkv ; wgate]
    float* dx_out = d.io == DType::f32 ? reinterpret_cast<float*>(dx_rows) : buf.dxf;
    if (!gemm_f32(n, H, 2 * C, {buf.dnew, 2 * C, false}, {buf.wcat, H, false}, dx_out, H, false, num_threads))
      return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for d_x failed"};
    // [d_wkv ; d_wgate] += [d_new_kv | d_new_score]^T . x
    if (!gemm_f32(2 * C, H, n, {buf.dnew, 2 * C, true}, {buf.xf, H, false}, buf.dwcat, H, a > 0, num_threads))
      return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for d_wkv/d_wgate failed"};

#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) {
      unsigned char* dst = dx_rows + static_cast<std::size_t>(i * H) * io_size;
      if (!mark[static_cast<std::size_t>(i)])
        std::memset(dst, 0, static_cast<std::size_t>(H) * io_size);
      else if (d.io != DType::f32)
        from_f32(buf.dxf + i * H, dst, d.io, H);
    }
  }
  from_f32(buf.dwcat, args.d_wkv.data, d.io, C * H);
  from_f32(buf.dwcat + C * H, args.d_wgate.data, d.io, C * H);
  auto* dape = static_cast<float*>(args.d_ape.data);
  for (std::int64_t i = 0; i < d.r * C; ++i) dape[i] = static_cast<float>(buf.dape[i]);
  return Status::success();
}

}  // namespace kvcomp::detail
