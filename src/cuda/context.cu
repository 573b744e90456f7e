// Errors, the current device and the cuBLASLt handle: what the backend's
// products and drivers share (also compiled into the CLI's GPU bench, with
// gemm.cu, as the object library kvcomp_cuda_core).
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/environment.hpp"
#include "cuda/common.hpp"
#include "cuda/gemm.hpp"

namespace kvcomp::detail::cuda {

Status cuda_error(const char* what, cudaError_t e) {
  // The failed call recorded e in the thread's error state too; reported
  // here, so cleared here, and never seen by a later check as its own. (A
  // sticky error, a fault of the context, stays whatever is done.)
  (void)cudaGetLastError();
  return {StatusCode::runtime_error, std::string("[kvcomp] ") + what + " (= " + cudaGetErrorName(e) + ": " +
                                         cudaGetErrorString(e) + ") must succeed"};
}

Status cublas_error(const char* what, cublasStatus_t e) {
  return {StatusCode::runtime_error, std::string("[kvcomp] ") + what + " (= cuBLAS status " +
                                         std::to_string(static_cast<int>(e)) + ") must succeed"};
}

DeviceGuard::DeviceGuard(int device) {
  if (cudaError_t e = cudaGetDevice(&previous_); e != cudaSuccess) {
    status_ = cuda_error("cudaGetDevice", e);
    return;
  }
  if (previous_ != device)
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) status_ = cuda_error("cudaSetDevice", e);
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_)
    if (cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();  // ours, unreported: cleared
}

bool split_k_products() { return kernel_switches().split_k; }

Status lt_handle(cublasLtHandle_t* out) {
  if (Status s = load_cublaslt(); !s.ok()) return s;
  static std::mutex mutex;
  static std::vector<cublasLtHandle_t> handles;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  std::lock_guard<std::mutex> lock(mutex);
  if (handles.size() <= static_cast<std::size_t>(device))
    handles.resize(static_cast<std::size_t>(device) + 1);
  cublasLtHandle_t& h = handles[static_cast<std::size_t>(device)];
  if (!h)
    if (cublasStatus_t s = cublasLtCreate(&h); s != CUBLAS_STATUS_SUCCESS) {
      h = nullptr;
      return cublas_error("cublasLtCreate", s);
    }
  *out = h;
  return Status::success();
}

}  // namespace kvcomp::detail::cuda
