// The CPU backend as api/api.cpp sees it: its workspace sizes and the two
// operator drivers (cpu/forward.cpp, cpu/backward.cpp), chunked over token
// rows, GEMMs through cpu/gemm, the block phases (cache writes, block
// assembly, the walk over batches) through cpu/block_phases, io conversions
// through cpu/convert.
#pragma once

#include <cstddef>
#include <string>

#include "common/backward_path.hpp"
#include "common/workspace.hpp"
#include "cpu/products/onednn_bf16.hpp"
#include "cpu/products/onednn_f32.hpp"
#include "kvcomp/kvcomp.hpp"
#include "plan/block_plan.hpp"

namespace kvcomp::detail {

// Token rows per chunk (the most: a forward on the bf16 units takes fewer
// on few threads, cpu/forward.cpp). Bounded, so the workspace does not grow
// with T; the backward's is fixed, and its weight gradients sum chunk by
// chunk, so their bits depend on nothing but the inputs.
constexpr std::int64_t kChunkRows = 1024;

// Leading dimension of our fp32 work matrices: a multiple of 16 floats plus
// 16, or plus 32 where that would be a multiple of 256 (n in (224, 240] modulo
// 256, e.g. 4080): never a multiple of a large power of two. With ld = 4096
// floats every row of a tile maps to the same cache sets and oneDNN's sgemm
// ran at half speed. oneDNN 2.6's
// AVX-512 sgemm also calls a leading dimension that is a multiple of 256 "bad"
// (1024: "very bad") and then picks its copy-based kernel by other rules, by
// row count among them: the d_x product's rows summed in one order in calls
// of up to 100 rows and in another beyond (products/onednn_f32.cpp, row stability).
inline std::int64_t padded_ld(std::int64_t n) {
  const std::int64_t ld = (n + 15) / 16 * 16 + 16;
  return ld % 256 == 0 ? ld + 16 : ld;
}

// Columns of the projection product [kv | score]: 2C, or C for a call without a gate (its scores are
// no product's: 0, + ape).
inline std::int64_t projection_columns(const Dims& d) { return d.gate ? 2 * d.C : d.C; }

// What a CPU call's plan decides about its products, once (plan_forward / plan_backward), and hands to
// the sizing and to the run.
struct ForwardDecision {
  F32Tiling tiling;  // row stability (Options::row_stable) and oneDNN's sgemm
  Bf16Kernels bf16;
  bool bf16_products = false;       // the projections on the bf16 units (bf16 io, the CPU has them)
  bool bf16_rows_kernel = false;    // kvcomp's AVX512-BF16 rows kernel may run (per-shape probes decide)
  bool bf16_decode_panels = false;  // a long call without prepared panels writes them
};
struct BackwardDecision {
  F32Tiling tiling;
  Bf16Kernels bf16;
  BackwardPath path = BackwardPath::f32;
  std::int64_t epilogue_rows = 0;  // the output rows where the call has an epilogue (its gradient's rows)
};
ForwardDecision decide_forward(const Dims& d, const Options& options);
// The first line of a planned call's verbose report (KVCOMP_VERBOSE=1): the op and the call's shape.
std::string plan_report_head(const char* op, const Dims& d, int num_threads, bool row_stable);
// What the process's product kernels are (kvcomp::product_kernels(); products/config.hpp).
const char* product_kernels();
BackwardDecision decide_backward(const Dims& d, const Options& options);

// Workspace bytes (*size) for a call run with num_threads threads (execute uses the thread count
// resolved when planning). The forward's depends on its prepared_weights (null: none; validated): no
// room for the form of the weights the blob holds. Fails (runtime_error) where oneDNN cannot make the
// call's bf16 products now, e.g. out of memory: their packed sizes are part of the size, and a plan
// sized without them would not fit the call that execute runs.
Status forward_workspace_size(const Dims& d, const ForwardDecision& call, const void* prepared_weights,
                              int num_threads, std::size_t* size);
Status backward_workspace_size(const Dims& d, const BackwardDecision& call, int num_threads,
                               std::size_t* size);

// workspace_size: the size planned (the run refuses if its own layout needs
// more: the bf16 products' packed sizes are queried from oneDNN again, and a
// forward's blob may have been swapped for one that holds less: the buffer is
// never overflowed).
Status run_forward(const ForwardArgs& args, const BlockPlan& plan, const ForwardDecision& call,
                   int num_threads, void* workspace, std::size_t workspace_size);
Status run_backward(const BackwardArgs& args, const BlockPlan& plan, const BackwardDecision& call,
                    int num_threads, void* workspace, std::size_t workspace_size);

}  // namespace kvcomp::detail
