// The matrix products of the CUDA backend: cuBLASLt, tensor cores with fp32
// accumulation for bf16 / fp16 inputs, plain fp32 (no TF32) for fp32 inputs.
//
// Written in row-major terms: D[m, n] = alpha * op(A)[m, k] * op(B)[k, n]
// + beta * D, every matrix row-major with its leading dimension (elements
// between rows), D in fp32 (or `out`). The algorithm comes from cuBLASLt's heuristic
// with split-K reductions excluded (no atomics, no reduction kernel), so the
// same shapes give the same bits on the same GPU and CUDA version.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

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

// cuBLASLt's workspace (part of ours): what its Hopper kernels ask for.
constexpr std::size_t kGemmWorkspace = std::size_t{32} << 20;

Status gemm(const GemmCall& g, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvcomp::detail::cuda
