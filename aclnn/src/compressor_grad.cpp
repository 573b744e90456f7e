// aclnnCompressorGradGetWorkspaceSize / aclnnCompressorGrad over kvcomp::plan_backward.
#include <utility>

#include "aclnnop/aclnn_compressor_grad.h"
#include "executor.hpp"
#include "status.hpp"
#include "tensor.hpp"

using namespace kvcomp::aclnn;

extern "C" aclnnStatus aclnnCompressorGradGetWorkspaceSize(
    const aclTensor* x, const aclTensor* wkv, const aclTensor* wgate, const aclTensor* dCmpKv,
    const aclTensor* softmaxScore, const aclTensor* kv, const aclTensor* cuSeqlensOptional,
    const aclTensor* sequsedOptional, const aclTensor* startPosOptional, int64_t cmpRatio, int64_t coff,
    const aclTensor* dXOut, const aclTensor* dWkvOut, const aclTensor* dWgateOut, const aclTensor* dApeOut,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return guarded(ACLNN_ERR_RUNTIME_ERROR, [&]() -> int {
    if (workspaceSize) *workspaceSize = 0;
    if (executor) *executor = nullptr;
    // Parameter order, so the first missing one is the one reported.
    const std::pair<const char*, const aclTensor*> required[] = {{"x", x},
                                                                 {"wkv", wkv},
                                                                 {"wgate", wgate},
                                                                 {"d_cmp_kv", dCmpKv},
                                                                 {"softmax_score", softmaxScore},
                                                                 {"kv", kv},
                                                                 {"d_x", dXOut},
                                                                 {"d_wkv", dWkvOut},
                                                                 {"d_wgate", dWgateOut},
                                                                 {"d_ape", dApeOut}};
    for (const auto& [name, t] : required)
      if (!t) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(name) + " must not be null");
    if (!workspaceSize) return fail(ACLNN_ERR_PARAM_NULLPTR, "workspaceSize must not be null");
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor must not be null");

    kvcomp::BackwardArgs a;
    for (const kvcomp::Status& s :
         {bind("x", x, Expect::io, &a.x), bind("wkv", wkv, Expect::io, &a.wkv),
          bind("wgate", wgate, Expect::io, &a.wgate), bind("d_cmp_kv", dCmpKv, Expect::io, &a.d_cmp_kv),
          bind("softmax_score", softmaxScore, Expect::f32, &a.softmax_score),
          bind("kv", kv, Expect::f32, &a.kv),
          bind_optional("cu_seqlens", cuSeqlensOptional, Expect::i32, &a.cu_seqlens),
          bind_optional("seqused", sequsedOptional, Expect::i32, &a.seqused),
          bind_optional("start_pos", startPosOptional, Expect::i32, &a.start_pos),
          bind("d_x", dXOut, Expect::io, &a.d_x), bind("d_wkv", dWkvOut, Expect::io, &a.d_wkv),
          bind("d_wgate", dWgateOut, Expect::io, &a.d_wgate), bind("d_ape", dApeOut, Expect::f32, &a.d_ape)})
      if (!s.ok()) return fail(s);
    a.cmp_ratio = cmpRatio;
    a.coff = coff;

    auto ex = std::make_unique<aclOpExecutor>();
    ex->op = aclOpExecutor::Op::compressor_grad;
    if (const kvcomp::Status s = kvcomp::plan_backward(a, aclnn_options(), &ex->backward); !s.ok())
      return fail(s);
    return publish(std::move(ex), workspaceSize, executor);
  });
}

extern "C" aclnnStatus aclnnCompressorGrad(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                           aclrtStream stream) {
  return guarded(ACLNN_ERR_RUNTIME_ERROR, [&] {
    return launch(aclOpExecutor::Op::compressor_grad, workspace, workspaceSize, executor, stream);
  });
}
