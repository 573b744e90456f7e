// cuBLASLt, loaded when a CUDA call first needs it instead of when libkvcomp is loaded.
//
// libcublasLt is a 540 MB library whose loading touches about 100 MB of its pages: as a dependency
// of libkvcomp it would cost every process that loads kvcomp tens of milliseconds and over 100 MB of
// peak resident memory (docs/performance.md), though a process that never runs a CUDA call never
// calls it. So libkvcomp
// does not list it as a dependency. This file defines the eleven cuBLASLt functions the backend calls
// (gemm.cu, context.cu), hidden in libkvcomp (and in the CLI, which compiles the same objects), each
// forwarding to the real one; load_cublaslt() dlopens the library and resolves them, once per
// process, before the first handle is created. The library is found as a linked one would be: by
// its soname, through the RUNPATH of libkvcomp (the CUDA library folder this build linked libcudart
// from), LD_LIBRARY_PATH and the loader's cache; a copy the process already has (torch's) is reused.
#include <dlfcn.h>

#include <string>

#include "cuda/common.hpp"

namespace kvcomp::detail::cuda {
namespace {

#define KVCOMP_LT_STR2(x) #x
#define KVCOMP_LT_STR(x) KVCOMP_LT_STR2(x)
// The soname of the cuBLASLt this build was compiled against (its major version is its ABI).
constexpr const char* kSoname = "libcublasLt.so." KVCOMP_LT_STR(CUBLAS_VER_MAJOR);
#undef KVCOMP_LT_STR
#undef KVCOMP_LT_STR2

enum Entry : int {
  kCreate,
  kMatmul,
  kAlgoGetHeuristic,
  kDescCreate,
  kDescDestroy,
  kDescSetAttribute,
  kPrefCreate,
  kPrefDestroy,
  kPrefSetAttribute,
  kLayoutCreate,
  kLayoutDestroy,
  kEntries
};
constexpr const char* kNames[kEntries] = {
    "cublasLtCreate",
    "cublasLtMatmul",
    "cublasLtMatmulAlgoGetHeuristic",
    "cublasLtMatmulDescCreate",
    "cublasLtMatmulDescDestroy",
    "cublasLtMatmulDescSetAttribute",
    "cublasLtMatmulPreferenceCreate",
    "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute",
    "cublasLtMatrixLayoutCreate",
    "cublasLtMatrixLayoutDestroy",
};

struct Library {
  void* entries[kEntries] = {};
  std::string error;  // empty: every entry resolved
};

const Library& library() {
  static const Library lib = [] {
    Library r;
    // Never closed: the handles and descriptors made through it live until the process exits.
    void* h = ::dlopen(kSoname, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      r.error = std::string("[kvcomp] cuBLASLt (") + kSoname +
                ") must be loadable for a CUDA call: " + (e ? e : "dlopen failed") +
                " (the library folder of the CUDA toolkit, or of the nvidia-cublas wheel, must be on the "
                "library path)";
      return r;
    }
    for (int i = 0; i < kEntries; ++i) {
      r.entries[i] = ::dlsym(h, kNames[i]);
      if (!r.entries[i]) {
        r.error = std::string("[kvcomp] ") + kSoname + " must define " + kNames[i];
        for (void*& p : r.entries) p = nullptr;
        ::dlclose(h);
        return r;
      }
    }
    return r;
  }();
  return lib;
}

}  // namespace

Status load_cublaslt() {
  const Library& lib = library();
  if (!lib.error.empty()) return {StatusCode::runtime_error, lib.error};
  return Status::success();
}

// The real function of entry i as the type of its declaration in cublasLt.h (the first call loads
// the library); null when it could not be loaded: the forwarders then answer
// CUBLAS_STATUS_NOT_INITIALIZED (lt_handle reports load_cublaslt's reason before any of them runs).
template <typename F>
F cublaslt_entry(int i) {
  return reinterpret_cast<F>(library().entries[i]);
}

}  // namespace kvcomp::detail::cuda

// The forwarders: definitions of cublasLt.h's declarations, hidden by the target's visibility.
using kvcomp::detail::cuda::cublaslt_entry;
namespace lt = kvcomp::detail::cuda;

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  const auto f = cublaslt_entry<decltype(&cublasLtCreate)>(lt::kCreate);
  return f ? f(handle) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* a, cublasLtMatrixLayout_t la, const void* b,
                              cublasLtMatrixLayout_t lb, const void* beta, const void* c,
                              cublasLtMatrixLayout_t lc, void* d, cublasLtMatrixLayout_t ld,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmul)>(lt::kMatmul);
  return f ? f(handle, desc, alpha, a, la, b, lb, beta, c, lc, d, ld, algo, workspace, workspace_bytes,
               stream)
           : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                                              cublasLtMatrixLayout_t lc, cublasLtMatrixLayout_t ld,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmulAlgoGetHeuristic)>(lt::kAlgoGetHeuristic);
  return f ? f(handle, desc, la, lb, lc, ld, pref, requested, results, returned)
           : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmulDescCreate)>(lt::kDescCreate);
  return f ? f(desc, compute, scale) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmulDescDestroy)>(lt::kDescDestroy);
  return f ? f(desc) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmulDescSetAttribute)>(lt::kDescSetAttribute);
  return f ? f(desc, attr, buf, bytes) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmulPreferenceCreate)>(lt::kPrefCreate);
  return f ? f(pref) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmulPreferenceDestroy)>(lt::kPrefDestroy);
  return f ? f(pref) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t bytes) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatmulPreferenceSetAttribute)>(lt::kPrefSetAttribute);
  return f ? f(pref, attr, buf, bytes) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatrixLayoutCreate)>(lt::kLayoutCreate);
  return f ? f(layout, type, rows, cols, ld) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  const auto f = cublaslt_entry<decltype(&cublasLtMatrixLayoutDestroy)>(lt::kLayoutDestroy);
  return f ? f(layout) : CUBLAS_STATUS_NOT_INITIALIZED;
}

}  // extern "C"
