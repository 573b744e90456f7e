// What the CUDA backend's translation units share: error reporting, the
// device guard, the block plan as the kernels read it, and the DevicePlan.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/backend.hpp"

namespace kvcomp::detail::cuda {

// "[kvcomp] <what> (= cudaErrorX: message) must succeed", 361001.
Status cuda_error(const char* what, cudaError_t e);
Status cublas_error(const char* what, cublasStatus_t e);

// The error of the kernels launched since the last check (launch
// configuration, not execution: execution errors surface at the caller's
// next synchronisation, as for any asynchronous CUDA call).
Status launch_status(const char* what);

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
Status lt_handle(cublasLtHandle_t* out);

// One batch as the kernels read it (BatchSpan plus its first block index).
struct DevBatch {
  long long base, len, sp, used, limit, k0, nblocks, out_row, first_block;
};

// One chunk of token rows [a, b) and the blocks its kernels visit.
struct Chunk {
  std::int64_t a = 0, b = 0;
  std::int64_t g_lo = 0, g_hi = 0;  // global block indices [g_lo, g_hi)
  bool has_grad = false;            // backward: some row of the chunk receives gradient
  bool all_grad = false;            // backward: every row does
};

// The device arrays are stream-ordered allocations on the plan's stream, freed
// on it when the plan goes: a one-call entry point can drop its plan right
// after queueing the work, without waiting for it.
struct DevicePlan {
  int device = 0;
  cudaStream_t stream = nullptr;
  DevBatch* batches = nullptr;          // device [B]
  std::int32_t* block_batch = nullptr;  // device [total_blocks]: the batch of each block
  std::vector<DevBatch> host_batches;
  std::int64_t total_blocks = 0;
  std::int64_t chunk_rows = 0;
  std::vector<Chunk> chunks;
  std::int64_t max_chunk_blocks = 0;
  bool serial = false;  // forward: cache slots alias, so writes and reads keep the spec's order

  DevicePlan() = default;
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;
  ~DevicePlan();
};

// Token rows per chunk of each operator. Fixed (never chosen at run time), so
// results depend on the inputs only and the workspace is bounded.
constexpr std::int64_t kForwardChunkRows = 16384;
constexpr std::int64_t kBackwardChunkRows = 4096;

// The device plan shared by both operators; forward chunks visit the blocks
// whose last row lies in the chunk, backward chunks those with a gradient row
// in it.
Status build_device_plan(const BlockPlan& plan, Device dev, void* stream, std::int64_t chunk_rows,
                         bool forward, DevicePlan* out);

}  // namespace kvcomp::detail::cuda
