#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

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

// The descriptors and the algorithm of one product shape, made once (the
// heuristic query and four descriptor creations cost more host time than a
// small product): cached per shape, so a precise backward at T = 65536 (64
// products) queries the heuristic once per distinct shape, not per call.
struct LtPlan {
  OpDesc op;
  Layout la, lb, ld;
  cublasLtMatmulAlgo_t algo{};
  bool no_algorithm = false;  // the heuristic found none for this shape (kept, so it is asked once)
};

// What the descriptors and the heuristic's choice depend on (the pointers
// only through their alignment; alpha and beta are passed per call).
struct PlanKey {
  int device = 0;
  std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0;
  bool trans_a = false, trans_b = false;
  DType in = DType::f32, out = DType::f32;
  std::uint32_t align_a = 0, align_b = 0, align_d = 0;
  std::size_t workspace_bytes = 0;
  auto tie() const {
    return std::tie(device, m, n, k, lda, ldb, ldd, trans_a, trans_b, in, out, align_a, align_b, align_d,
                    workspace_bytes);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

Status make_lt_plan(const LtCall& c, const PlanKey& key, cublasLtHandle_t handle, LtPlan* p) {
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // fp32 inputs: no TF32
  auto check = [](cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; };
  cublasLtMatmulDesc_t op_raw = nullptr;
  if (cublasStatus_t s = cublasLtMatmulDescCreate(&op_raw, compute, CUDA_R_32F); !check(s))
    return cublas_error("cublasLtMatmulDescCreate", s);
  p->op.reset(op_raw);
  const cublasOperation_t ta = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(p->op.get(), CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  cublasLtMatmulDescSetAttribute(p->op.get(), CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  if (cublasStatus_t s = layout(&p->la, c.a); !check(s)) return cublas_error("layout", s);
  if (cublasStatus_t s = layout(&p->lb, c.b); !check(s)) return cublas_error("layout", s);
  if (cublasStatus_t s = layout(&p->ld, c.d); !check(s)) return cublas_error("layout", s);

  cublasLtMatmulPreference_t pref_raw = nullptr;
  if (cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref_raw); !check(s))
    return cublas_error("cublasLtMatmulPreferenceCreate", s);
  Pref pref(pref_raw);
  const std::uint32_t no_split_k = CUBLASLT_REDUCTION_SCHEME_NONE;
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &key.workspace_bytes, sizeof key.workspace_bytes);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split_k,
                                       sizeof no_split_k);
  // Rows of a chunk and halves of a panel start anywhere: tell the heuristic.
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a,
                                       sizeof key.align_a);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b,
                                       sizeof key.align_b);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_d,
                                       sizeof key.align_d);
  cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d,
                                       sizeof key.align_d);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(
      handle, p->op.get(), p->la.get(), p->lb.get(), p->ld.get(), p->ld.get(), pref.get(), 1, &result,
      &found);
  if (!check(hs)) return cublas_error("cublasLtMatmulAlgoGetHeuristic", hs);
  p->no_algorithm = found == 0;
  p->algo = result.algo;
  return Status::success();
}

// Bounded: a process cycling through many shapes starts over past this many
// (plans in use stay alive through their shared_ptr).
constexpr std::size_t kMaxCachedPlans = 512;
std::atomic<std::size_t> g_plans_made{0};  // a counter for tests, not part of any result

Status cached_lt_plan(const LtCall& c, const PlanKey& key, cublasLtHandle_t handle,
                      std::shared_ptr<const LtPlan>* out) {
  static std::mutex mutex;
  static std::map<PlanKey, std::shared_ptr<const LtPlan>> plans;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = plans.find(key); it != plans.end()) {
      *out = it->second;
      return Status::success();
    }
  }
  auto p = std::make_shared<LtPlan>();
  if (auto s = make_lt_plan(c, key, handle, p.get()); !s.ok()) return s;
  g_plans_made.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex);
  if (plans.size() >= kMaxCachedPlans) plans.clear();
  *out = plans.emplace(key, std::move(p)).first->second;  // another thread's, if it came first
  return Status::success();
}

}  // namespace

std::size_t lt_plans_made() { return g_plans_made.load(std::memory_order_relaxed); }

Status gemm(const GemmCall& g, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
            bool* no_algorithm) {
  if (no_algorithm) *no_algorithm = false;
  LtCall c;
  if (auto s = lt_call(g, &c); !s.ok()) return s;  // before the empty-product exit: refused either way
  if (c.m == 0 || c.n == 0) return Status::success();
  cublasLtHandle_t handle = nullptr;
  if (auto s = lt_handle(&handle); !s.ok()) return s;
  PlanKey key;
  if (cudaError_t e = cudaGetDevice(&key.device); e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  key.m = c.m;
  key.n = c.n;
  key.k = c.k;
  key.lda = c.a.ld;
  key.ldb = c.b.ld;
  key.ldd = c.d.ld;
  key.trans_a = c.trans_a;
  key.trans_b = c.trans_b;
  key.in = c.a.type;
  key.out = c.d.type;
  key.align_a = alignment(c.a.data);
  key.align_b = alignment(c.b.data);
  key.align_d = alignment(c.d.data);
  key.workspace_bytes = workspace_bytes;
  std::shared_ptr<const LtPlan> p;
  if (auto s = cached_lt_plan(c, key, handle, &p); !s.ok()) return s;
  if (p->no_algorithm) {
    if (no_algorithm) {  // the caller runs its fallback
      *no_algorithm = true;
      return Status::success();
    }
    return cublas_error("cublasLtMatmulAlgoGetHeuristic (no algorithm without split-K)",
                        CUBLAS_STATUS_NOT_SUPPORTED);
  }
  if (cublasStatus_t s =
          cublasLtMatmul(handle, p->op.get(), &c.alpha, c.a.data, p->la.get(), c.b.data, p->lb.get(), &c.beta,
                         g.d, p->ld.get(), g.d, p->ld.get(), &p->algo, workspace, workspace_bytes, stream);
      s != CUBLAS_STATUS_SUCCESS)
    return cublas_error("cublasLtMatmul", s);
  return Status::success();
}

}  // namespace kvcomp::detail::cuda
