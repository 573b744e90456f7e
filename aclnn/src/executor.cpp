#include "executor.hpp"

#include <string>

#include "registry.hpp"
#include "status.hpp"

namespace kvcomp::aclnn {

namespace {

// Never destroyed: callers may launch from their static destructors.
Registry<aclOpExecutor>& executors() {
  static auto* registry = new Registry<aclOpExecutor>;
  return *registry;
}

const char* maker(aclOpExecutor::Op op) {
  return op == aclOpExecutor::Op::compressor ? "aclnnCompressorGetWorkspaceSize"
                                             : "aclnnCompressorGradGetWorkspaceSize";
}

}  // namespace

Options aclnn_options() {
  Options o;
  o.profile = Profile::aclnn;
  return o;
}

int publish(std::unique_ptr<aclOpExecutor> executor, std::uint64_t* workspace_size, aclOpExecutor** out) {
  const std::size_t size = executor->op == aclOpExecutor::Op::compressor
                               ? executor->forward.workspace_size()
                               : executor->backward.workspace_size();
  *out = executors().add(std::move(executor));
  *workspace_size = size;
  return ACLNN_SUCCESS;
}

int launch(aclOpExecutor::Op op, void* workspace, std::uint64_t workspace_size, aclOpExecutor* executor,
           aclrtStream stream) {
  if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor must not be null");
  bool other_op = false;
  auto ex = executors().take_unless(executor, [&](const aclOpExecutor& e) {
    other_op = e.op != op;
    return other_op;
  });
  if (other_op)
    return fail(ACLNN_ERR_PARAM_INVALID,
                "executor (= " + address(executor) + ") must come from " + maker(op) + ", not " +
                    maker(op == aclOpExecutor::Op::compressor ? aclOpExecutor::Op::compressor_grad
                                                              : aclOpExecutor::Op::compressor));
  if (!ex)
    return fail(ACLNN_ERR_PARAM_INVALID, "executor (= " + address(executor) + ") must come from " +
                                             maker(op) +
                                             " and not have been launched (an executor runs once)");
  if (stream && !live_stream(stream))
    return fail(ACLNN_ERR_PARAM_INVALID,
                "stream (= " + address(stream) + ") must be NULL or a live stream from aclrtCreateStream");
  const Status s = op == aclOpExecutor::Op::compressor
                       ? execute(ex->forward, workspace, static_cast<std::size_t>(workspace_size))
                       : execute(ex->backward, workspace, static_cast<std::size_t>(workspace_size));
  return s.ok() ? ACLNN_SUCCESS : fail(s);
}

}  // namespace kvcomp::aclnn
