// Validation of both operators: every rule of spec section 4 (the Ascend
// tiling checks) plus the doc-only data checks the NPU skips (4.4), so that
// nothing out of bounds is ever read or written for an input that passes.
//
// Codes: null required pointer 161001; dtype / rank / attribute / profile
// range / data value 161002; shapes inconsistent with each other or empty
// where not allowed 561002. One sentence per rejection:
//   "[kvcomp] <parameter> (= <value seen>) must <rule>".
#pragma once

#include "kvcomp/kvcomp.hpp"
#include "plan/block_plan.hpp"

namespace kvcomp::detail {

// Static checks (no data read except the int32 sequence tensors) and the block
// plan. On success *plan describes the call.
Status validate_forward(const ForwardArgs& args, const Options& options, BlockPlan* plan);
Status validate_backward(const BackwardArgs& args, const Options& options, BlockPlan* plan);

}  // namespace kvcomp::detail
