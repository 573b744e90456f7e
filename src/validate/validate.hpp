// Validation of both operators: every rule of spec section 4 (the Ascend
// tiling checks) plus the doc-only data checks the NPU skips (4.4), so that
// nothing out of bounds is ever read or written for an input that passes.
//
// Codes: null required pointer 161001; dtype / rank / attribute / profile
// range / data value 161002; shapes inconsistent with each other or empty
// where not allowed 561002. One sentence per rejection:
//   "[kvcomp] <parameter> (= <value seen>) must <rule>".
#pragma once

#include <cstdint>
#include <vector>

#include "common/device_access.hpp"
#include "kvcomp/kvcomp.hpp"
#include "plan/block_plan.hpp"

namespace kvcomp::detail {

// Host copies of the index tensors (cu_seqlens, seqused, start_pos,
// state_block_table) of a call on a CUDA device. Validation fills them the
// first time (one synchronous copy on the call's stream, once the shapes are
// known to be right) and reads them from then on: planning fetches, execute
// re-validates from the copies without touching the device.
struct IndexCopies {
  bool fetched = false;
  std::vector<std::int32_t> cu_seqlens, seqused, start_pos, block_table;
};

// Static checks (no data read except the int32 index tensors) and the block
// plan. On success *plan describes the call. Index data is read through the
// tensors' pointers for a call in host memory, through *copies for a call on
// a CUDA device (required then). device: the backend's access to device
// memory (the entry points pass the CUDA backend's where the build has one);
// a call on a CUDA device without it is refused as this build's limit.
Status validate_forward(const ForwardArgs& args, const Options& options, BlockPlan* plan,
                        IndexCopies* copies = nullptr, const DeviceAccess* device = nullptr);
Status validate_backward(const BackwardArgs& args, const Options& options, BlockPlan* plan,
                         IndexCopies* copies = nullptr, const DeviceAccess* device = nullptr);

}  // namespace kvcomp::detail
