// The CUDA backend as the entry points (api/api.cpp) see it (plain C++: no
// CUDA header here, so api/ compiles with the host compiler). Only built
// with KVCOMP_HAVE_CUDA.
//
// A call on a CUDA device goes: validate (shared rules; the index tensors are
// copied to the host once, through device_access()) -> prepare_* (the device copy
// of the block plan, owned by the plan, and the workspace size) -> run_*
// (kernels and cuBLASLt products queued on the caller's stream: nothing
// allocated, no host synchronisation, so it can be captured in a CUDA graph).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/device_access.hpp"
#include "kvcomp/kvcomp.hpp"
#include "plan/block_plan.hpp"

namespace kvcomp::detail::cuda {

// What validation needs of this backend's memory: device checks of a call's
// tensors and the host copies of its index tensors (planning refuses a stream
// being captured into a CUDA graph, since the copies wait for the stream).
const DeviceAccess& device_access();

// Execute queues on the plan's stream (Options::stream when planning): the
// stream must be usable now. Refused: the legacy default stream while
// another stream captures (the work could only run outside the graph, and
// CUDA would invalidate that capture), and a stream whose capture was
// invalidated. A capture on some other stream cannot be seen from here: the
// work then runs at once, outside that graph (docs/cuda-design.md).
Status check_execute_stream(void* stream);

// The block plan on the device and what the drivers need to walk it; built
// when planning, read-only afterwards. Frees its device memory when the last
// plan holding it goes.
struct DevicePlan;

// Build the device plan of a validated call and size its workspace (device
// memory, passed to execute). block_table: the host copy of
// state_block_table (forward only).
Status prepare_forward(const ForwardArgs& args, const Options& options, const BlockPlan& plan,
                       const std::vector<std::int32_t>& block_table, std::shared_ptr<const DevicePlan>* out,
                       std::size_t* workspace);
Status prepare_backward(const BackwardArgs& args, const Options& options, const BlockPlan& plan,
                        std::shared_ptr<const DevicePlan>* out, std::size_t* workspace);

Status run_forward(const ForwardArgs& args, const Options& options, const BlockPlan& plan,
                   const DevicePlan& dev, void* workspace);
Status run_backward(const BackwardArgs& args, const Options& options, const BlockPlan& plan,
                    const DevicePlan& dev, void* workspace);

// Stream-ordered device memory for the one-call entry points (cudaMallocAsync
// / cudaFreeAsync on the call's stream and device).
Status allocate_async(Device dev, void* stream, std::size_t bytes, void** out);
// The memory comes from a pool of the library's own per device that keeps
// what it holds between calls; release_workspace_pools() gives it back
// (kvcomp::release_cached_workspace calls it).
void free_async(Device dev, void* stream, void* p);
void release_workspace_pools();

}  // namespace kvcomp::detail::cuda
