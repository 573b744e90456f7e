/* aclnnCompressorGrad: the KV compressor backward (spec section 3.1), two-phase.
 *
 * Phase one validates every parameter with the Ascend 950's ranges (D in
 * {128, 512}, H in [1024, 10240] and a multiple of 512, cmpRatio in [2, 128],
 * coff in {1, 2}) and returns the workspace size and a one-shot executor;
 * nothing is written. Phase two runs it on the CPU before returning; any
 * launch consumes the executor. Every tensor must be a contiguous ND view and
 * none may be empty (the operator has no empty-tensor path). */
#ifndef KVCOMP_ACLNNOP_ACLNN_COMPRESSOR_GRAD_H_
#define KVCOMP_ACLNNOP_ACLNN_COMPRESSOR_GRAD_H_

#include "aclnn/acl_meta.h"

#ifdef __cplusplus
extern "C" {
#endif

KVCOMP_ACL_API aclnnStatus aclnnCompressorGradGetWorkspaceSize(
    const aclTensor* x, const aclTensor* wkv, const aclTensor* wgate, const aclTensor* dCmpKv,
    const aclTensor* softmaxScore, const aclTensor* kv, const aclTensor* cuSeqlensOptional,
    const aclTensor* sequsedOptional, const aclTensor* startPosOptional, int64_t cmpRatio, int64_t coff,
    const aclTensor* dXOut, const aclTensor* dWkvOut, const aclTensor* dWgateOut, const aclTensor* dApeOut,
    uint64_t* workspaceSize, aclOpExecutor** executor);

/* workspaceSize must be at least what phase one returned (otherwise
 * ACLNN_ERR_PARAM_INVALID and nothing is written). stream may be NULL. */
KVCOMP_ACL_API aclnnStatus aclnnCompressorGrad(void* workspace, uint64_t workspaceSize,
                                               aclOpExecutor* executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif /* KVCOMP_ACLNNOP_ACLNN_COMPRESSOR_GRAD_H_ */
