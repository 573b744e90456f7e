// aclnnCompressorGetWorkspaceSize / aclnnCompressor over kvcomp::plan_forward.
#include <string>
#include <utility>

#include "aclnnop/aclnn_compressor.h"
#include "executor.hpp"
#include "status.hpp"
#include "tensor.hpp"

using namespace kvcomp::aclnn;

extern "C" aclnnStatus aclnnCompressorGetWorkspaceSize(
    const aclTensor* x, const aclTensor* wkv, const aclTensor* wgate, aclTensor* stateCacheRef,
    const aclTensor* ape, const aclTensor* stateBlockTableOptional, const aclTensor* cuSeqlensOptional,
    const aclTensor* sequsedOptional, const aclTensor* startPosOptional, int64_t cmpRatio, int64_t coff,
    int64_t cacheMode, int64_t stateCacheStrideDim0, bool gradEnabled, const aclTensor* cmpKvOut,
    const aclTensor* softmaxScoreOut, const aclTensor* kvOut, uint64_t* workspaceSize,
    aclOpExecutor** executor) {
  return guarded(ACLNN_ERR_RUNTIME_ERROR, [&]() -> int {
    if (workspaceSize) *workspaceSize = 0;
    if (executor) *executor = nullptr;
    // Parameter order, so the first missing one is the one reported. The 950
    // tiling requires the block table and both saved outputs, whatever the
    // "Optional" in a name or gradEnabled say.
    const std::pair<const char*, const aclTensor*> required[] = {
        {"x", x},
        {"wkv", wkv},
        {"wgate", wgate},
        {"state_cache", stateCacheRef},
        {"ape", ape},
        {"state_block_table", stateBlockTableOptional},
        {"cmp_kv", cmpKvOut},
        {"softmax_score", softmaxScoreOut},
        {"kv", kvOut}};
    for (const auto& [name, t] : required)
      if (!t) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(name) + " must not be null");
    if (!workspaceSize) return fail(ACLNN_ERR_PARAM_NULLPTR, "workspaceSize must not be null");
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor must not be null");

    kvcomp::ForwardArgs a;
    kvcomp::Tensor softmax_score, kv;
    std::int64_t cache_stride0 = 0;
    for (const kvcomp::Status& s :
         {bind("x", x, Expect::io, &a.x), bind("wkv", wkv, Expect::io, &a.wkv),
          bind("wgate", wgate, Expect::io, &a.wgate),
          bind_strided_dim0("state_cache", stateCacheRef, Expect::f32, &a.state_cache, &cache_stride0),
          bind("ape", ape, Expect::f32, &a.ape),
          bind_optional("state_block_table", stateBlockTableOptional, Expect::i32, &a.state_block_table),
          bind_optional("cu_seqlens", cuSeqlensOptional, Expect::i32, &a.cu_seqlens),
          bind_optional("seqused", sequsedOptional, Expect::i32, &a.seqused),
          bind_optional("start_pos", startPosOptional, Expect::i32, &a.start_pos),
          bind("cmp_kv", cmpKvOut, Expect::io, &a.cmp_kv),
          bind("softmax_score", softmaxScoreOut, Expect::f32, &softmax_score),
          bind("kv", kvOut, Expect::f32, &kv)})
      if (!s.ok()) return fail(s);

    // The attribute restates the view's dim-0 stride (the torch glue passes
    // state_cache.stride(0)); a different value would describe other memory.
    if (stateCacheStrideDim0 != 0 && stateCacheStrideDim0 != cache_stride0)
      return fail(ACLNN_ERR_PARAM_INVALID,
                  "state_cache_stride_dim0 (= " + std::to_string(stateCacheStrideDim0) +
                      ") must be 0 or the dim-0 stride of stateCacheRef (= " + std::to_string(cache_stride0) +
                      ")");
    const std::int64_t contiguous_stride0 = a.state_cache.dim(1) * a.state_cache.dim(2);
    a.state_cache_stride0 =
        a.state_cache.dim(0) > 1 && cache_stride0 != contiguous_stride0 ? cache_stride0 : 0;

    if (gradEnabled) {
      a.softmax_score = softmax_score;
      a.kv = kv;
    } else {
      // Not written, so only what the 950 tiling checks of them applies.
      for (const auto& [name, t] : {std::pair{"softmax_score", &softmax_score}, std::pair{"kv", &kv}})
        if (t->dtype != kvcomp::DType::f32 || (t->rank != 3 && t->rank != 4))
          return fail(ACLNN_ERR_PARAM_INVALID, std::string(name) + " (dtype " + kvcomp::dtype_name(t->dtype) +
                                                   ", rank " + std::to_string(t->rank) +
                                                   ") must have dtype fp32 and rank 3 or 4");
    }
    a.cmp_ratio = cmpRatio;
    a.coff = coff;
    a.cache_mode = cacheMode;
    a.grad_enabled = gradEnabled;

    auto ex = std::make_unique<aclOpExecutor>();
    ex->op = aclOpExecutor::Op::compressor;
    if (const kvcomp::Status s = kvcomp::plan_forward(a, aclnn_options(), &ex->forward); !s.ok())
      return fail(s);
    return publish(std::move(ex), workspaceSize, executor);
  });
}

extern "C" aclnnStatus aclnnCompressor(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                       aclrtStream stream) {
  return guarded(ACLNN_ERR_RUNTIME_ERROR, [&] {
    return launch(aclOpExecutor::Op::compressor, workspace, workspaceSize, executor, stream);
  });
}
