// The matrix products of the CUDA backend: cuBLASLt, tensor cores with fp32
// accumulation for bf16 / fp16 inputs, plain fp32 (no TF32) for fp32 inputs.
//
// Written in row-major terms: D[m, n] = alpha * op(A)[m, k] * op(B)[k, n]
// + beta * D, every matrix row-major with its leading dimension (elements
// between rows), D in fp32 or `out`. The algorithm comes from cuBLASLt's heuristic
// with split-K reductions excluded (no atomics, no reduction kernel), so the
// same shapes give the same bits on the same GPU and CUDA version.
//
// lt_call() turns a GemmCall into the column-major call cuBLASLt gets (types,
// layouts, transposes): plain C++, so the host emulation of the drivers
// (tests/cuda/test_cuda_logic.cpp) runs exactly that call with cuBLAS's
// semantics and refuses what gemm() refuses.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail::cuda {

struct MatRef {
  const void* data;
  std::int64_t ld;
  bool transposed;  // op(X) = X^T
};

struct GemmCall {
  std::int64_t m, n, k;
  DType in;  // dtype of A and B
  MatRef a, b;
  void* d;
  std::int64_t ldd;
  float alpha = 1.0f, beta = 0.0f;
  DType out = DType::f32;  // dtype of D (and C)
};

// One matrix as cuBLASLt sees it: column-major [rows, cols], element (i, j)
// at data + (i + j * ld) elements of `type`.
struct LtMatrix {
  const void* data = nullptr;
  DType type = DType::f32;
  std::int64_t rows = 0, cols = 0, ld = 0;
  // Bytes from data to one past the last element.
  std::size_t extent_bytes() const {
    if (rows == 0 || cols == 0) return 0;
    return static_cast<std::size_t>((cols - 1) * ld + rows) * dtype_size(type);
  }
};

// D = alpha op(A) op(B) + beta C in cuBLAS's column-major terms (C is D).
struct LtCall {
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  LtMatrix a, b, d;
  float alpha = 1.0f, beta = 0.0f;
};

// The (A/B, C/D) types cuBLASLt runs with CUBLAS_COMPUTE_32F and fp32
// scales: 16-bit inputs with fp32 or the same 16-bit output, fp32 with fp32.
inline bool gemm_types_supported(DType in, DType out) {
  if (in == DType::f32) return out == DType::f32;
  if (in == DType::bf16 || in == DType::f16) return out == DType::f32 || out == in;
  return false;
}

// Row-major D = op(A) op(B) is column-major D^T = op(B)^T op(A)^T: cuBLAS
// multiplies B's view by A's view, each transpose flag kept. Refuses types
// cuBLASLt has no kernel for, and leading dimensions shorter than a row.
inline Status lt_call(const GemmCall& g, LtCall* out) {
  auto refuse = [](const std::string& what) { return Status{StatusCode::invalid_param, "[kvcomp] " + what}; };
  if (!gemm_types_supported(g.in, g.out))
    return refuse(std::string("product output (= ") + dtype_name(g.out) + " from " + dtype_name(g.in) +
                  " inputs) must be fp32, or the inputs' 16-bit dtype");
  // Stored (row-major) shapes of our A and B.
  const std::int64_t a_rows = g.a.transposed ? g.k : g.m, a_cols = g.a.transposed ? g.m : g.k;
  const std::int64_t b_rows = g.b.transposed ? g.n : g.k, b_cols = g.b.transposed ? g.k : g.n;
  if (g.a.ld < a_cols || g.b.ld < b_cols || g.ldd < g.n)
    return refuse("product leading dimension (= " + std::to_string(g.a.ld) + ", " + std::to_string(g.b.ld) +
                  ", " + std::to_string(g.ldd) + ") must be at least its row's length");
  LtCall c;
  c.m = g.n;
  c.n = g.m;
  c.k = g.k;
  c.trans_a = g.b.transposed;
  c.trans_b = g.a.transposed;
  c.a = {g.b.data, g.in, b_cols, b_rows, g.b.ld};
  c.b = {g.a.data, g.in, a_cols, a_rows, g.a.ld};
  c.d = {g.d, g.out, g.n, g.m, g.ldd};
  c.alpha = g.alpha;
  c.beta = g.beta;
  *out = c;
  return Status::success();
}

// Split-K over fixed K chunks (the switch KVCOMP_KERNELS=+splitk, for
// the first GPU run to measure against the default): a product with an fp32
// D and K > kSplitKChunk runs as one cuBLASLt call per chunk of kSplitKChunk
// (the last one shorter), in K order, each adding its part to D in fp32 in
// the epilogue (beta = 1 after the first; the epilogue runs on CUDA cores with
// round-to-nearest). Tensor cores then accumulate at most kSplitKChunk
// products per partial sum, and the partial sums add as a sequential fp32
// sum: the error model of the fp32-projection bound. Fixed chunks, fixed
// order: deterministic as the single call is.
constexpr std::int64_t kSplitKChunk = 256;

// The calls that make g under split-K with chunks of `chunk` (g itself when
// it is not split: 16-bit D, or K <= chunk).
inline std::vector<GemmCall> split_k(const GemmCall& g, std::int64_t chunk) {
  if (g.out != DType::f32 || g.k <= chunk || chunk <= 0) return {g};
  const std::size_t es = dtype_size(g.in);
  auto advance = [es](const void* p, std::int64_t elems) {
    return static_cast<const unsigned char*>(p) + static_cast<std::size_t>(elems) * es;
  };
  std::vector<GemmCall> calls;
  for (std::int64_t k0 = 0; k0 < g.k; k0 += chunk) {
    GemmCall c = g;
    c.k = std::min(chunk, g.k - k0);
    // op(A) columns k0.. : A stored [m, k] (k0 columns in) or [k, m] (k0 rows down).
    c.a.data = advance(g.a.data, g.a.transposed ? k0 * g.a.ld : k0);
    // op(B) rows k0.. : B stored [k, n] (k0 rows down) or [n, k] (k0 columns in).
    c.b.data = advance(g.b.data, g.b.transposed ? k0 : k0 * g.b.ld);
    if (k0 > 0) c.beta = 1.0f;
    calls.push_back(c);
  }
  return calls;
}

// cuBLASLt's workspace (part of ours): what its Hopper kernels ask for.
constexpr std::size_t kGemmWorkspace = std::size_t{32} << 20;

// no_algorithm: when given, a shape cuBLASLt has no algorithm for (without
// split-K; possible for 16-bit rows whose pitch is not a multiple of 16
// bytes) sets it and queues nothing, so that the caller runs the plain
// kernel (launch_plain_gemm); without it, that case is an error.
Status gemm(const GemmCall& g, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
            bool* no_algorithm = nullptr);

// How many product plans (descriptors + one heuristic query) this process has made: one per distinct
// shape, however often it runs (tests/cuda/test_gemm_cache.cpp).
std::size_t lt_plans_made();

// Whether the products run split-K (KVCOMP_KERNELS=+splitk; read once
// per process; anything else, or unset: one cuBLASLt call per product).
bool split_k_products();

}  // namespace kvcomp::detail::cuda
