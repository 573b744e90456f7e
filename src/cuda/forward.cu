// The CUDA forward: planning (the chunk plan on the device, whether cache
// slots alias, the workspace size) and execution (cuda/drivers.hpp on the
// call's stream).
#include "cuda/cuda_exec.hpp"

namespace kvcomp::detail::cuda {

Status prepare_forward(const ForwardArgs& args, const Options& options, const BlockPlan& plan,
                       const std::vector<std::int32_t>& block_table, std::shared_ptr<const DevicePlan>* out,
                       std::size_t* workspace) {
  auto dp = std::make_shared<DevicePlan>();
  if (auto s = build_device_plan(plan, args.x.device, options.stream, kForwardChunkRows, true, dp.get());
      !s.ok())
    return s;
  dp->serial = cache_slots_alias(plan, cache_geometry(args, block_table.data()));
  *workspace = ForwardBuffers(plan.dims, epilogue_rows(args, args.cmp_kv, plan.dims), nullptr).size;
  *out = std::move(dp);
  return Status::success();
}

Status run_forward(const ForwardArgs& args, const Options& options, const BlockPlan& plan,
                   const DevicePlan& dev, void* workspace) {
  DeviceGuard guard(dev.device);
  if (!guard.status().ok()) return guard.status();
  if (auto s = check_execute_stream(options.stream); !s.ok()) return s;
  CudaExec ex{static_cast<cudaStream_t>(options.stream),
              ForwardBuffers(plan.dims, epilogue_rows(args, args.cmp_kv, plan.dims),
                             AlignedLayout<256>::align(workspace))
                  .gemm_ws};
  return run_forward_chunks(ex, args, plan, dev, dev.dev_batches, dev.dev_block_batch, workspace);
}

}  // namespace kvcomp::detail::cuda
