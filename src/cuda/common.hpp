// What the CUDA backend's translation units share: error reporting, the
// device guard, the block plan as the kernels read it, and the DevicePlan.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/backward_path.hpp"
#include "cuda/backend.hpp"
#include "cuda/chunk_plan.hpp"

namespace kvcomp::detail::cuda {

// "[kvcomp] <what> (= cudaErrorX: message) must succeed", 361001.
Status cuda_error(const char* what, cudaError_t e);
Status cublas_error(const char* what, cublasStatus_t e);

// Errors: every CUDA call of the backend is checked by its own return value
// (kernels are launched with cudaLaunchKernelEx, which returns the launch's
// error). cuda_error() clears the thread's error state of the error it
// reports; an error the backend ignores (a free when a plan goes) is cleared
// where it happens. cudaGetLastError is never read for a status, so an error
// left by the caller's own code (or an earlier call) is never reported as
// this call's. Execution errors surface at the caller's next
// synchronisation, as for any asynchronous CUDA call.

// Makes `device` current for its lifetime, restoring the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  Status status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

// The cuBLASLt handle of the current device, created once per device and
// process (kept until exit: handles are thread-safe for concurrent matmuls).
// Loads cuBLASLt first (load_cublaslt).
Status lt_handle(cublasLtHandle_t* out);

// Loads cuBLASLt and resolves the functions the backend calls (cublaslt_loader.cpp), once per
// process; 361001 with the loader's reason when the library cannot be found.
Status load_cublaslt();

// The chunk plan and its device copy. The device arrays are stream-ordered
// allocations on the plan's stream, freed on it when the plan goes: a
// one-call entry point can drop its plan right after queueing the work,
// without waiting for it.
struct DevicePlan : ChunkPlan {
  int device = 0;
  cudaStream_t stream = nullptr;
  DevBatch* dev_batches = nullptr;          // device copy of batches
  std::int32_t* dev_block_batch = nullptr;  // device copy of block_batch
  BackwardPath path = BackwardPath::f32;    // a backward's staging of d_new, decided when planning

  DevicePlan() = default;
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;
  ~DevicePlan();
};

// The chunk plan (make_chunk_plan) and its copy on the device.
Status build_device_plan(const BlockPlan& plan, Device dev, void* stream, std::int64_t chunk_rows,
                         bool forward, DevicePlan* out);

}  // namespace kvcomp::detail::cuda
