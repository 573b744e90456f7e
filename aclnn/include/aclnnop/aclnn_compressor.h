/* aclnnCompressor: the KV compressor forward (spec section 3.2), two-phase.
 *
 * Phase one validates every parameter with the Ascend 950's ranges (D in
 * {128, 512}, H in [1024, 10240] and a multiple of 512, cmpRatio in [2, 128],
 * coff in {1, 2}, cacheMode in {1, 2}, block_size in [1, 1024]) and returns
 * the workspace size and a one-shot executor; nothing is written. Phase two
 * runs it on the CPU before returning; any launch consumes the executor.
 *
 * All tensors are contiguous ND views except stateCacheRef, whose dim 0 may
 * have any stride of at least block_size * 2 * coff * D elements (given by the
 * view's strides; stateCacheStrideDim0 must be 0 or that same stride).
 * stateBlockTableOptional is required, as on the 950. softmaxScoreOut and kvOut
 * are required; they are written only when gradEnabled is true. B = S = T = 0
 * is accepted: nothing is computed and the state cache is left untouched. */
#ifndef KVCOMP_ACLNNOP_ACLNN_COMPRESSOR_H_
#define KVCOMP_ACLNNOP_ACLNN_COMPRESSOR_H_

#ifndef __cplusplus
#include <stdbool.h>
#endif

#include "aclnn/acl_meta.h"

#ifdef __cplusplus
extern "C" {
#endif

KVCOMP_ACL_API aclnnStatus aclnnCompressorGetWorkspaceSize(
    const aclTensor* x, const aclTensor* wkv, const aclTensor* wgate, aclTensor* stateCacheRef,
    const aclTensor* ape, const aclTensor* stateBlockTableOptional, const aclTensor* cuSeqlensOptional,
    const aclTensor* sequsedOptional, const aclTensor* startPosOptional, int64_t cmpRatio, int64_t coff,
    int64_t cacheMode, int64_t stateCacheStrideDim0, bool gradEnabled, const aclTensor* cmpKvOut,
    const aclTensor* softmaxScoreOut, const aclTensor* kvOut, uint64_t* workspaceSize,
    aclOpExecutor** executor);

/* workspaceSize must be at least what phase one returned (otherwise
 * ACLNN_ERR_PARAM_INVALID and nothing is written). stream may be NULL. */
KVCOMP_ACL_API aclnnStatus aclnnCompressor(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                           aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif /* KVCOMP_ACLNNOP_ACLNN_COMPRESSOR_H_ */
