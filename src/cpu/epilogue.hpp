// The model-level epilogue on the CPU (kvcomp.hpp's Epilogue: RMSNorm over D, RoPE on the last rd
// channels): a pass over the output rows after the forward's pooling, and the backward's first step,
// which turns d_cmp_kv into the gradient of the pooled rows that the pooling's backward takes.
//
// Every output row is computed by one thread from that row alone, and d_norm_weight's sums run over
// the rows in order, one thread per column: the bits depend on no thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/epilogue_view.hpp"
#include "kvcomp/kvcomp.hpp"
#include "plan/block_plan.hpp"

namespace kvcomp::detail {

// Workspace bytes of epilogue_backward for `rows` output rows of D columns (a multiple of 64).
std::size_t epilogue_backward_bytes(std::int64_t rows, std::int64_t D);

// Every one of the `rows` rows of cmp_kv (io dtype [rows, D]) is copied into pooled (when not null);
// those that hold a compressed block of the plan are then replaced by the epilogue's rows.
void epilogue_forward(const BlockPlan& plan, const EpilogueView& ep, std::int64_t rows, void* cmp_kv,
                      void* pooled, int num_threads);

// The gradient of the pooled rows, dp [rows, D] fp32 (zero in rows without a block), from d_cmp_kv and
// the forward's pooled rows (io dtype [rows, D]), and d_norm_weight (norm on; norm_dtype [D]).
// scratch: epilogue_backward_bytes(rows, D).
void epilogue_backward(const BlockPlan& plan, const EpilogueView& ep, std::int64_t rows, const void* pooled,
                       const void* d_cmp_kv, float* dp, void* d_norm_weight, void* scratch, int num_threads);

}  // namespace kvcomp::detail
