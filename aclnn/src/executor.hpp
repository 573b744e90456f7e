// aclOpExecutor: a validated call of one operator, launched at most once.
#pragma once

#include <cstdint>
#include <memory>

#include "aclnn/acl_meta.h"
#include "kvcomp/kvcomp.hpp"

struct aclOpExecutor {
  enum class Op { compressor, compressor_grad };
  Op op = Op::compressor;
  kvcomp::ForwardPlan forward;    // op == compressor
  kvcomp::BackwardPlan backward;  // op == compressor_grad
};

namespace kvcomp::aclnn {

// What the aclnn front door promises: exactly the Ascend 950's ranges.
Options aclnn_options();

// Phase one's end: registers the executor and reports it with its size.
int publish(std::unique_ptr<aclOpExecutor> executor, std::uint64_t* workspace_size, aclOpExecutor** out);

// Phase two: consumes a live executor of `op` (whatever the outcome, so a
// launch is never repeated) and runs it.
int launch(aclOpExecutor::Op op, void* workspace, std::uint64_t workspace_size, aclOpExecutor* executor,
           aclrtStream stream);

// Streams are owned by the runtime part (runtime.cpp).
bool live_stream(const void* stream);

}  // namespace kvcomp::aclnn
