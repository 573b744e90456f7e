// The CUDA backward: per chunk of token rows, the slot gradients d_new by the
// block kernel, then d_x = d_new . [wkv ; wgate] and [d_wkv ; d_wgate] +=
// d_new^T . x by cuBLASLt; d_ape from per-block partials summed in block
// order. Everything queued on the caller's stream.
#include <algorithm>

#include "core/workspace.hpp"
#include "cuda/common.hpp"
#include "cuda/gemm.hpp"
#include "cuda/kernels.hpp"

namespace kvcomp::detail::cuda {

namespace {

DnewMode dnew_mode(const Dims& d, Precision p) {
  if (d.io == DType::f32) return DnewMode::f32;
  return p == Precision::npu_parity ? DnewMode::parity16 : DnewMode::precise16;
}

// precise16 keeps d_new as hi + lo / scale, both in the io dtype: scale is
// 2^(mantissa bits + 1) of the io dtype, so lo spans the bits below hi's.
float lo_scale(DType io) { return io == DType::f16 ? 2048.0f : 256.0f; }

struct BackwardBuffers {
  std::int64_t R = 0, dnew_ld = 0;
  std::size_t dnew_elem = 0;
  void* dnew_hi = nullptr;     // [R, dnew_ld]: d_new_kv | d_new_score (fp32, or io)
  void* dnew_lo = nullptr;     // precise16: the low parts
  void* xm = nullptr;          // [R, H] io: x rows, zero where a row gets no gradient
  float* dxf = nullptr;        // [R, H]: d_x of the chunk in fp32
  float* dwf = nullptr;        // [2C, H]: d_wkv rows then d_wgate rows, fp32 accumulators
  double* dape = nullptr;      // [r, C] float64 accumulator
  double* partials = nullptr;  // [max chunk blocks, r, C]
  void* gemm_ws = nullptr;
  std::size_t size = 0;

  BackwardBuffers(const Dims& d, DnewMode mode, std::int64_t max_chunk_blocks, void* base) {
    AlignedLayout<256> ws(base);
    R = std::min(kBackwardChunkRows, std::max<std::int64_t>(d.T, 1));
    dnew_ld = (2 * d.C + 7) / 8 * 8;  // 16-byte rows in any dtype
    dnew_elem = mode == DnewMode::f32 ? sizeof(float) : dtype_size(d.io);
    const auto dnew_bytes = static_cast<std::int64_t>(static_cast<std::size_t>(R * dnew_ld) * dnew_elem);
    dnew_hi = ws.take<unsigned char>(dnew_bytes);
    dnew_lo = mode == DnewMode::precise16 ? ws.take<unsigned char>(dnew_bytes) : nullptr;
    xm = ws.take<unsigned char>(
        static_cast<std::int64_t>(static_cast<std::size_t>(R * d.H) * dtype_size(d.io)));
    dxf = ws.take<float>(R * d.H);
    dwf = ws.take<float>(2 * d.C * d.H);
    dape = ws.take<double>(d.r * d.C);
    partials = ws.take<double>(std::max<std::int64_t>(1, max_chunk_blocks) * d.r * d.C);
    gemm_ws = ws.take<unsigned char>(static_cast<std::int64_t>(kGemmWorkspace));
    size = ws.size();
  }
};

Status zero(void* p, std::size_t bytes, cudaStream_t s) {
  if (bytes == 0) return Status::success();
  if (cudaError_t e = cudaMemsetAsync(p, 0, bytes, s); e != cudaSuccess)
    return cuda_error("cudaMemsetAsync", e);
  return Status::success();
}

}  // namespace

Status prepare_backward(const BackwardArgs& args, const Options& options, const BlockPlan& plan,
                        std::shared_ptr<const DevicePlan>* out, std::size_t* workspace) {
  auto dp = std::make_shared<DevicePlan>();
  if (auto s = build_device_plan(plan, args.x.device, options.stream, kBackwardChunkRows, false, dp.get());
      !s.ok())
    return s;
  *workspace =
      BackwardBuffers(plan.dims, dnew_mode(plan.dims, options.precision), dp->max_chunk_blocks, nullptr).size;
  *out = std::move(dp);
  return Status::success();
}

Status run_backward(const BackwardArgs& args, const Options& options, const BlockPlan& plan,
                    const DevicePlan& dev, void* workspace) {
  const Dims& d = plan.dims;
  const std::int64_t H = d.H, C = d.C;
  const std::size_t io_size = dtype_size(d.io);
  DeviceGuard guard(dev.device);
  if (!guard.status().ok()) return guard.status();
  const auto stream = static_cast<cudaStream_t>(options.stream);
  auto bytes = [](const Tensor& t) { return static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype); };

  if (plan.total_blocks == 0) {  // spec 2.7: four all-zero outputs, whatever the memory held
    for (const Tensor* t : {&args.d_x, &args.d_wkv, &args.d_wgate, &args.d_ape})
      if (auto s = zero(t->data, bytes(*t), stream); !s.ok()) return s;
    return Status::success();
  }

  const DnewMode mode = dnew_mode(d, options.precision);
  BackwardBuffers buf(d, mode, dev.max_chunk_blocks, AlignedLayout<256>::align(workspace));
  if (auto s = zero(buf.dwf, static_cast<std::size_t>(2 * C * H) * sizeof(float), stream); !s.ok()) return s;
  if (auto s = zero(buf.dape, static_cast<std::size_t>(d.r * C) * sizeof(double), stream); !s.ok()) return s;

  BackwardKernelArgs p;
  p.g = {dev.batches, dev.block_batch, d.B, d.D, C, d.r, d.coff, d.io};
  p.d_cmp_kv = args.d_cmp_kv.data;
  p.softmax_score = static_cast<const float*>(args.softmax_score.data);
  p.kv = static_cast<const float*>(args.kv.data);
  p.mode = mode;
  p.dnew_hi = buf.dnew_hi;
  p.dnew_lo = buf.dnew_lo;
  p.dnew_ld = buf.dnew_ld;
  p.lo_scale = lo_scale(d.io);
  p.partials = buf.partials;

  const DType gemm_in = d.io;  // f32 io: d_new in fp32 too
  auto at_col = [&](void* m, std::int64_t col) {
    return static_cast<unsigned char*>(m) + col * buf.dnew_elem;
  };
  const void* parts[2] = {buf.dnew_hi, buf.dnew_lo};
  const float alphas[2] = {1.0f, 1.0f / p.lo_scale};
  const int nparts = mode == DnewMode::precise16 ? 2 : 1;

  for (const Chunk& c : dev.chunks) {
    const std::int64_t n = c.b - c.a;
    auto* dx_rows = static_cast<unsigned char*>(args.d_x.data) + static_cast<std::size_t>(c.a * H) * io_size;
    if (!c.has_grad) {
      if (auto s = zero(dx_rows, static_cast<std::size_t>(n * H) * io_size, stream); !s.ok()) return s;
      continue;
    }
    const std::size_t dnew_bytes = static_cast<std::size_t>(n * buf.dnew_ld) * buf.dnew_elem;
    for (int i = 0; i < nparts; ++i)
      if (auto s = zero(const_cast<void*>(parts[i]), dnew_bytes, stream); !s.ok()) return s;
    if (auto s = launch_backward_blocks(p, c.g_lo, c.g_hi, c.a, c.b, stream); !s.ok()) return s;
    if (auto s = launch_dape_accumulate(buf.partials, c.g_hi - c.g_lo, d.r * C, buf.dape, stream); !s.ok())
      return s;

    // x rows without gradient are zeroed so that 0 * Inf/NaN in them cannot
    // leak into d_wkv / d_wgate (the NPU kernel does the same).
    const void* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(c.a * H) * io_size;
    if (!c.all_grad) {
      if (auto s = launch_gradient_rows(p.g, x_rows, false, buf.xm, c.a, c.b, H, stream); !s.ok()) return s;
      x_rows = buf.xm;
    }
    // d_x rows = sum over halves and parts of d_new[:, half] . w_half
    bool first = true;
    for (int i = 0; i < nparts; ++i)
      for (int half = 0; half < 2; ++half) {
        GemmCall g{n,
                   H,
                   C,
                   gemm_in,
                   {at_col(const_cast<void*>(parts[i]), half * C), buf.dnew_ld, false},
                   {half ? args.wgate.data : args.wkv.data, H, false},
                   buf.dxf,
                   H,
                   alphas[i],
                   first ? 0.0f : 1.0f};
        if (auto s = gemm(g, buf.gemm_ws, kGemmWorkspace, stream); !s.ok()) return s;
        first = false;
      }
    if (auto s = launch_gradient_rows(p.g, buf.dxf, true, dx_rows, c.a, c.b, H, stream); !s.ok()) return s;
    // [d_wkv ; d_wgate] += d_new[:, half]^T . x rows
    for (int i = 0; i < nparts; ++i)
      for (int half = 0; half < 2; ++half) {
        GemmCall g{C,
                   H,
                   n,
                   gemm_in,
                   {at_col(const_cast<void*>(parts[i]), half * C), buf.dnew_ld, true},
                   {x_rows, H, false},
                   buf.dwf + half * C * H,
                   H,
                   alphas[i],
                   1.0f};
        if (auto s = gemm(g, buf.gemm_ws, kGemmWorkspace, stream); !s.ok()) return s;
      }
  }
  if (auto s = launch_narrow(buf.dwf, args.d_wkv.data, d.io, C * H, stream); !s.ok()) return s;
  if (auto s = launch_narrow(buf.dwf + C * H, args.d_wgate.data, d.io, C * H, stream); !s.ok()) return s;
  return launch_f64_to_f32(buf.dape, static_cast<float*>(args.d_ape.data), d.r * C, stream);
}

}  // namespace kvcomp::detail::cuda
