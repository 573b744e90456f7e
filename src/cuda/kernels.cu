// The CUDA backend's kernels: one thread per element of each phase, the
// thread's work in cuda/kernel_bodies.hpp. Compiled with --fmad=false
// (src/CMakeLists.txt): no multiply-add contraction, so each operation rounds
// as written, as on the CPU.
#include <algorithm>
#include <utility>

#include "cuda/common.hpp"
#include "cuda/epilogue_bodies.hpp"
#include "cuda/kernel_bodies.hpp"
#include "cuda/kernels.hpp"

namespace kvcomp::detail::cuda {

namespace {

using i64 = std::int64_t;
constexpr int kThreads = 128;

unsigned blocks_for(i64 n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }
unsigned grid_stride_blocks(i64 n) { return static_cast<unsigned>(std::min<i64>(blocks_for(n), 4096)); }
__device__ i64 column() { return static_cast<i64>(blockIdx.y) * kThreads + threadIdx.x; }

__global__ void forward_blocks_kernel(ForwardKernelArgs p, i64 g_lo) {
  body::forward_block(p, g_lo + blockIdx.x, column());
}

__global__ void cache_writes_kernel(ForwardKernelArgs p, i64 row_lo) {
  body::cache_write(p, row_lo + blockIdx.x, column());
}

__global__ void zero_padding_kernel(ForwardKernelArgs p) { body::zero_padding(p, blockIdx.x, column()); }

__global__ void backward_blocks_kernel(BackwardKernelArgs p, i64 g_lo, i64 a, i64 b_end) {
  body::backward_block(p, g_lo, g_lo + blockIdx.x, column(), a, b_end);
}

// 32 threads per CTA: r*C elements (4096 for C4A, 1024 for C4Li) make 128 / 32 CTAs, spread over that
// many SMs, instead of 32 / 8 CTAs of 128 threads.
constexpr int kDapeThreads = 32;

__global__ void dape_accumulate_kernel(const double* partials, i64 blocks, i64 n, double* dape) {
  body::dape_accumulate(partials, blocks, n, dape, static_cast<i64>(blockIdx.x) * kDapeThreads + threadIdx.x);
}

__global__ void gradient_rows_kernel(Geometry g, const void* src, bool src_f32, void* dst, i64 a, i64 H) {
  body::gradient_row(g, src, src_f32, dst, a, H, blockIdx.x, column());
}

__global__ void narrow_kernel(const float* src, void* dst, DType io, i64 n) {
  for (i64 i = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<i64>(gridDim.x) * kThreads)
    body::narrow(src, dst, io, i);
}

__global__ void plain_gemm_kernel(LtCall c) {
  const i64 n = c.m * c.n;
  for (i64 e = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += static_cast<i64>(gridDim.x) * kThreads)
    body::plain_gemm_element(c, e % c.m, e / c.m);
}

__global__ void f64_to_f32_kernel(const double* src, float* dst, i64 n) {
  for (i64 i = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<i64>(gridDim.x) * kThreads)
    dst[i] = static_cast<float>(src[i]);
}

__global__ void epilogue_forward_stats_kernel(EpilogueKernelArgs e) {
  body::epilogue_forward_stats(e, static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x);
}

__global__ void epilogue_forward_kernel(EpilogueKernelArgs e) {
  body::epilogue_forward_element(e, blockIdx.x, column());
}

__global__ void epilogue_backward_stats_kernel(EpilogueKernelArgs e) {
  body::epilogue_backward_stats(e, static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x);
}

__global__ void epilogue_backward_kernel(EpilogueKernelArgs e) {
  body::epilogue_backward_element(e, blockIdx.x, column());
}

__global__ void epilogue_weight_terms_kernel(EpilogueKernelArgs e, i64 row_lo) {
  body::epilogue_weight_term(e, row_lo, row_lo + blockIdx.x, column());
}

__global__ void f64_narrow_kernel(const double* src, void* dst, DType dt, i64 n) {
  for (i64 i = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<i64>(gridDim.x) * kThreads)
    body::f64_narrow(src, dst, dt, i);
}

// Launches kernel and reports its own launch error (cudaLaunchKernelEx
// returns it), never one left pending by an earlier call, the caller's or
// ours. A failed launch also records its error in the thread's state: that
// one is reported here, so it is cleared here (cuda_error).
template <typename... Params, typename... Args>
Status launch_with(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t s,
                   Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return e == cudaSuccess ? Status::success() : cuda_error(what, e);  // cuda_error clears it
}

template <typename... Params, typename... Args>
Status launch(const char* what, void (*kernel)(Params...), dim3 grid, cudaStream_t s, Args&&... args) {
  return launch_with(what, kernel, grid, dim3(kThreads), s, std::forward<Args>(args)...);
}

}  // namespace

Status launch_forward_blocks(const ForwardKernelArgs& p, std::int64_t g_lo, std::int64_t g_hi,
                             cudaStream_t s) {
  if (g_hi <= g_lo || p.g.D == 0) return Status::success();
  return launch("the forward block kernel launch", forward_blocks_kernel,
                dim3(static_cast<unsigned>(g_hi - g_lo), blocks_for(p.g.D)), s, p, g_lo);
}

Status launch_cache_writes(const ForwardKernelArgs& p, std::int64_t row_lo, std::int64_t row_hi,
                           cudaStream_t s) {
  if (row_hi <= row_lo) return Status::success();
  return launch("the cache write kernel launch", cache_writes_kernel,
                dim3(static_cast<unsigned>(row_hi - row_lo), blocks_for(2 * p.g.C)), s, p, row_lo);
}

Status launch_zero_padding(const ForwardKernelArgs& p, cudaStream_t s) {
  if (p.out_rows == 0 || p.g.D == 0) return Status::success();
  return launch("the padding kernel launch", zero_padding_kernel,
                dim3(static_cast<unsigned>(p.out_rows), blocks_for(p.g.D)), s, p);
}

Status launch_backward_blocks(const BackwardKernelArgs& p, std::int64_t g_lo, std::int64_t g_hi,
                              std::int64_t a, std::int64_t b, cudaStream_t s) {
  if (g_hi <= g_lo) return Status::success();
  return launch("the backward block kernel launch", backward_blocks_kernel,
                dim3(static_cast<unsigned>(g_hi - g_lo), blocks_for(p.g.D)), s, p, g_lo, a, b);
}

Status launch_dape_accumulate(const double* partials, std::int64_t blocks, std::int64_t n, double* dape,
                              cudaStream_t s) {
  if (blocks == 0 || n == 0) return Status::success();
  return launch_with("the d_ape kernel launch", dape_accumulate_kernel,
                     static_cast<unsigned>((n + kDapeThreads - 1) / kDapeThreads), dim3(kDapeThreads), s,
                     partials, blocks, n, dape);
}

Status launch_gradient_rows(const Geometry& g, const void* src, bool src_f32, void* dst, std::int64_t a,
                            std::int64_t b, std::int64_t H, cudaStream_t s) {
  if (b <= a || H == 0) return Status::success();
  return launch("the gradient row kernel launch", gradient_rows_kernel,
                dim3(static_cast<unsigned>(b - a), blocks_for(H)), s, g, src, src_f32, dst, a, H);
}

Status launch_narrow(const float* src, void* dst, DType io, std::int64_t n, cudaStream_t s) {
  if (n == 0) return Status::success();
  return launch("the narrowing kernel launch", narrow_kernel, grid_stride_blocks(n), s, src, dst, io, n);
}

Status launch_plain_gemm(const LtCall& c, cudaStream_t s) {
  if (c.m == 0 || c.n == 0) return Status::success();
  return launch("the plain product kernel launch", plain_gemm_kernel, grid_stride_blocks(c.m * c.n), s, c);
}

Status launch_f64_to_f32(const double* src, float* dst, std::int64_t n, cudaStream_t s) {
  if (n == 0) return Status::success();
  return launch("the d_ape narrowing kernel launch", f64_to_f32_kernel, grid_stride_blocks(n), s, src, dst,
                n);
}

Status launch_epilogue_forward(const EpilogueKernelArgs& e, cudaStream_t s) {
  if (e.rows == 0 || e.g.D == 0) return Status::success();
  if (e.ep.norm_weight)
    if (auto st = launch("the epilogue's row statistics kernel launch", epilogue_forward_stats_kernel,
                         blocks_for(e.rows), s, e);
        !st.ok())
      return st;
  return launch("the epilogue kernel launch", epilogue_forward_kernel,
                dim3(static_cast<unsigned>(e.rows), blocks_for(e.g.D)), s, e);
}

Status launch_epilogue_backward(const EpilogueKernelArgs& e, cudaStream_t s) {
  if (e.rows == 0 || e.g.D == 0) return Status::success();
  if (e.ep.norm_weight)
    if (auto st = launch("the epilogue's row statistics kernel launch", epilogue_backward_stats_kernel,
                         blocks_for(e.rows), s, e);
        !st.ok())
      return st;
  return launch("the epilogue backward kernel launch", epilogue_backward_kernel,
                dim3(static_cast<unsigned>(e.rows), blocks_for(e.g.D)), s, e);
}

Status launch_epilogue_weight_terms(const EpilogueKernelArgs& e, std::int64_t row_lo, std::int64_t row_hi,
                                    cudaStream_t s) {
  if (row_hi <= row_lo || e.g.D == 0) return Status::success();
  return launch("the norm weight gradient kernel launch", epilogue_weight_terms_kernel,
                dim3(static_cast<unsigned>(row_hi - row_lo), blocks_for(e.g.D)), s, e, row_lo);
}

Status launch_f64_narrow(const double* src, void* dst, DType dt, std::int64_t n, cudaStream_t s) {
  if (n == 0) return Status::success();
  return launch("the norm weight gradient narrowing kernel launch", f64_narrow_kernel, grid_stride_blocks(n),
                s, src, dst, dt, n);
}

}  // namespace kvcomp::detail::cuda
