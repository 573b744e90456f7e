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

cublasStatus_t layout(Layout* out, const LtMatrix& m) {
  cublasLtMatrixLayout_t l = nullptr;
  const cublasStatus_t s = cublasLtMatrixLayoutCreate(
      &l, cuda_type(m.type), static_cast<std::uint64_t>(m.rows), static_cast<std::uint64_t>(m.cols), m.ld);
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
  LtCall c;
  if (auto s = lt_call(g, &c); !s.ok()) return s;  // before the empty-product exit: refused either way
  if (c.m == 0 || c.n == 0) return Status::success();
  cublasLtHandle_t handle = nullptr;
  if (auto s = lt_handle(&handle); !s.ok()) return s;
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // fp32 inputs: no TF32
  auto check = [](cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; };
  cublasLtMatmulDesc_t op_raw = nullptr;
  if (cublasStatus_t s = cublasLtMatmulDescCreate(&op_raw, compute, CUDA_R_32F); !check(s))
    return cublas_error("cublasLtMatmulDescCreate", s);
  OpDesc op(op_raw);
  const cublasOperation_t ta = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op.get(), CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  cublasLtMatmulDescSetAttribute(op.get(), CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  Layout la, lb, ld;
  if (cublasStatus_t s = layout(&la, c.a); !check(s)) return cublas_error("layout", s);
  if (cublasStatus_t s = layout(&lb, c.b); !check(s)) return cublas_error("layout", s);
  if (cublasStatus_t s = layout(&ld, c.d); !check(s)) return cublas_error("layout", s);

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
  const std::uint32_t align_a = alignment(c.a.data), align_b = alignment(c.b.data);
  const std::uint32_t align_d = alignment(c.d.data);
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
          cublasLtMatmul(handle, op.get(), &c.alpha, c.a.data, la.get(), c.b.data, lb.get(), &c.beta, g.d,
                         ld.get(), g.d, ld.get(), &result.algo, workspace, workspace_bytes, stream);
      !check(s))
    return cublas_error("cublasLtMatmul", s);
  return Status::success();
}

}  // namespace kvcomp::detail::cuda
