// The executor of cuda/drivers.hpp on a GPU: each phase one kernel launch,
// each product one cuBLASLt call, all queued on the call's stream.
#pragma once

#include "cuda/common.hpp"
#include "cuda/drivers.hpp"

namespace kvcomp::detail::cuda {

struct CudaExec {
  cudaStream_t stream;
  void* gemm_ws;

  Status gemm(const GemmCall& g) {
    if (!split_k_products()) return one_gemm(g);
    for (const GemmCall& part : split_k(g, kSplitKChunk))
      if (auto s = one_gemm(part); !s.ok()) return s;
    return Status::success();
  }
  // cuBLASLt, or the plain kernel where cuBLASLt has no algorithm.
  Status one_gemm(const GemmCall& g) {
    bool none = false;
    if (auto s = cuda::gemm(g, gemm_ws, kGemmWorkspace, stream, &none); !s.ok() || !none) return s;
    LtCall c;
    if (auto s = lt_call(g, &c); !s.ok()) return s;
    return launch_plain_gemm(c, stream);
  }
  Status zero(void* p, std::size_t bytes) {
    if (bytes == 0) return Status::success();
    if (cudaError_t e = cudaMemsetAsync(p, 0, bytes, stream); e != cudaSuccess)
      return cuda_error("cudaMemsetAsync", e);
    return Status::success();
  }
  Status copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return Status::success();
    if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream); e != cudaSuccess)
      return cuda_error("cudaMemcpyAsync", e);
    return Status::success();
  }
  Status forward_blocks(const ForwardKernelArgs& p, std::int64_t lo, std::int64_t hi) {
    return launch_forward_blocks(p, lo, hi, stream);
  }
  Status cache_writes(const ForwardKernelArgs& p, std::int64_t lo, std::int64_t hi) {
    return launch_cache_writes(p, lo, hi, stream);
  }
  Status zero_padding(const ForwardKernelArgs& p) { return launch_zero_padding(p, stream); }
  Status backward_blocks(const BackwardKernelArgs& p, std::int64_t lo, std::int64_t hi, std::int64_t a,
                         std::int64_t b) {
    return launch_backward_blocks(p, lo, hi, a, b, stream);
  }
  Status dape_accumulate(const double* partials, std::int64_t blocks, std::int64_t n, double* dape) {
    return launch_dape_accumulate(partials, blocks, n, dape, stream);
  }
  Status gradient_rows(const Geometry& g, const void* src, bool src_f32, void* dst, std::int64_t a,
                       std::int64_t b, std::int64_t H) {
    return launch_gradient_rows(g, src, src_f32, dst, a, b, H, stream);
  }
  Status narrow(const float* src, void* dst, DType io, std::int64_t n) {
    return launch_narrow(src, dst, io, n, stream);
  }
  Status f64_to_f32(const double* src, float* dst, std::int64_t n) {
    return launch_f64_to_f32(src, dst, n, stream);
  }
  Status epilogue_forward(const EpilogueKernelArgs& e) { return launch_epilogue_forward(e, stream); }
  Status epilogue_backward(const EpilogueKernelArgs& e) { return launch_epilogue_backward(e, stream); }
  Status epilogue_weight_terms(const EpilogueKernelArgs& e, std::int64_t lo, std::int64_t hi) {
    return launch_epilogue_weight_terms(e, lo, hi, stream);
  }
  Status f64_narrow(const double* src, void* dst, DType dt, std::int64_t n) {
    return launch_f64_narrow(src, dst, dt, n, stream);
  }
};

}  // namespace kvcomp::detail::cuda
