#include <memory>

#include "cuda/common.hpp"
#include "cuda/gemm.hpp"

namespace kvcomp::detail::cuda {

namespace {

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// Owners of the cuBLASLt descriptors of one call.
struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* p) const { cublasLtMatmulDescDestroy(p); }
  void operator()(cublasLtMatrixLayoutOpaque_t* p) const { cublasLtMatrixLayoutDestroy(p); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using OpDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Pref = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

// A row-major [rows, cols] matrix with leading dimension ld is, to cuBLAS's
// column-major eyes, its transpose: [cols, rows] with the same ld.
cublasStatus_t layout(Layout* out, cudaDataType_t t, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  const cublasStatus_t s = cublasLtMatrixLayoutCreate(&l, t, static_cast<std::uint64_t>(cols),
                                                      static_cast<std::uint64_t>(rows), ld);
  out->reset(l);
  return s;
}

// The alignment cuBLASLt may assume for a pointer: the largest power of two
// dividing its address, up to the 256 bytes its heuristic assumes by default.
std::uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

}  // namespace

Status gemm(const GemmCall& g, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return Status::success();
  cublasLtHandle_t handle = nullptr;
  if (auto s = lt_handle(&handle); !s.ok()) return s;
  // Row-major D = op(A) op(B) is column-major D^T = op(B)^T op(A)^T: cuBLAS
  // multiplies B's view by A's view, with each transpose flag kept.
  const cudaDataType_t in = cuda_type(g.in);
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // fp32 inputs: no TF32
  auto check = [](cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; };
  cublasLtMatmulDesc_t op_raw = nullptr;
  if (cublasStatus_t s = cublasLtMatmulDescCreate(&op_raw, compute, CUDA_R_32F); !check(s))
    return cublas_error("cublasLtMatmulDescCreate", s);
  OpDesc op(op_raw);
  const cublasOperation_t ta = g.b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS's A is our B
  const cublasOperation_t tb = g.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op.get(), CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  cublasLtMatmulDescSetAttribute(op.get(), CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  Layout la, lb, ld;
  // Stored shapes (row-major) of our A and B.
  const std::int64_t a_rows = g.a.transposed ? g.k : g.m, a_cols = g.a.transposed ? g.m : g.k;
  const std::int64_t b_rows = g.b.transposed ? g.n : g.k, b_cols = g.b.transposed ? g.k : g.n;
  if (cublasStatus_t s = layout(&la, in, b_rows, b_cols, g.b.ld); !check(s)) return cublas_error("layout", s);
  if (cublasStatus_t s = layout(&lb, in, a_rows, a_cols, g.a.ld); !check(s)) return cublas_error("layout", s);
  if (cublasStatus_t s = layout(&ld, CUDA_R_32F, g.m, g.n, g.ldd); !check(s))
    return cublas_error("layout", s);

  cublasLtMatmulPreference_t pref_raw = nullptr;
  if (cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref_raw); !check(s))
    return cublas_error("cublasLtMatmulPreferenceCreate", s);
  Pref pref(pref_raw);
  const std::uint32_t no_split_k = CUBLASLT_REDUCTION_SCHEME_NONE;
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                       sizeof workspace_bytes);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split_k,
                                       sizeof no_split_k);
  // Rows of a chunk and halves of a panel start anywhere: tell the heuristic.
  const std::uint32_t align_a = alignment(g.b.data), align_b = alignment(g.a.data), align_d = alignment(g.d);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                       sizeof align_a);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                       sizeof align_b);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                       sizeof align_d);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                       sizeof align_d);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, op.get(), la.get(), lb.get(), ld.get(),
                                                        ld.get(), pref.get(), 1, &result, &found);
      !check(s) || found == 0)
    return cublas_error("cublasLtMatmulAlgoGetHeuristic (no algorithm without split-K)",
                        check(s) ? CUBLAS_STATUS_NOT_SUPPORTED : s);
  if (cublasStatus_t s =
          cublasLtMatmul(handle, op.get(), &g.alpha, g.b.data, la.get(), g.a.data, lb.get(), &g.beta, g.d,
                         ld.get(), g.d, ld.get(), &result.algo, workspace, workspace_bytes, stream);
      !check(s))
    return cublas_error("cublasLtMatmul", s);
  return Status::success();
}

}  // namespace kvcomp::detail::cuda
