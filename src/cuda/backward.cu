// The CUDA backward: planning (the chunk plan on the device, the workspace
// size) and execution (cuda/drivers.hpp on the call's stream).
#include "cuda/cuda_exec.hpp"

namespace kvcomp::detail::cuda {

Status prepare_backward(const BackwardArgs& args, const Options& options, const BlockPlan& plan,
                        std::shared_ptr<const DevicePlan>* out, std::size_t* workspace) {
  auto dp = std::make_shared<DevicePlan>();
  if (auto s = build_device_plan(plan, args.x.device, options.stream, kBackwardChunkRows, false, dp.get());
      !s.ok())
    return s;
  dp->path = backward_path(plan.dims, options.precision);  // once, kept in the plan
  *workspace = BackwardBuffers(plan.dims, dp->path, dp->max_chunk_blocks,
                               epilogue_rows(args, args.d_cmp_kv, plan.dims), nullptr)
                   .size;
  *out = std::move(dp);
  return Status::success();
}

Status run_backward(const BackwardArgs& args, const Options& options, const BlockPlan& plan,
                    const DevicePlan& dev, void* workspace) {
  DeviceGuard guard(dev.device);
  if (!guard.status().ok()) return guard.status();
  if (auto s = check_execute_stream(options.stream); !s.ok()) return s;
  const Dims& d = plan.dims;
  CudaExec ex{static_cast<cudaStream_t>(options.stream),
              BackwardBuffers(d, dev.path, dev.max_chunk_blocks, epilogue_rows(args, args.d_cmp_kv, d),
                              AlignedLayout<256>::align(workspace))
                  .gemm_ws};
  return run_backward_chunks(ex, args, plan, dev.path, dev, dev.dev_batches, dev.dev_block_batch, workspace);
}

}  // namespace kvcomp::detail::cuda
