/* aclnn tensors, executors and status codes (CANN numbers). */
#ifndef KVCOMP_ACLNN_ACL_META_H_
#define KVCOMP_ACLNN_ACL_META_H_

#include "acl/acl_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int aclnnStatus;

#define ACLNN_SUCCESS 0
/* a required tensor or output pointer is NULL */
#define ACLNN_ERR_PARAM_NULLPTR 161001
/* dtype, rank, layout, attribute or data value outside what the operator supports */
#define ACLNN_ERR_PARAM_INVALID 161002
/* allocation or execution failure */
#define ACLNN_ERR_RUNTIME_ERROR 361001
/* shapes inconsistent with each other, or an empty tensor where none is allowed */
#define ACLNN_ERR_INNER_TILING_ERROR 561002

typedef struct aclTensor aclTensor;
typedef struct aclOpExecutor aclOpExecutor;

/* A view of viewDimsNum dims with element strides `stride`, starting `offset`
 * elements after tensorData, inside a storage of storageDims. tensorData may be
 * NULL for an empty tensor. Returns NULL (message in aclGetRecentErrMsg) when
 * the description is inconsistent, e.g. a view reaching past its storage. */
KVCOMP_ACL_API aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType,
                                          const int64_t* stride, int64_t offset, aclFormat format,
                                          const int64_t* storageDims, uint64_t storageDimsNum,
                                          void* tensorData);
/* NULL is a no-op; a tensor destroyed twice gives ACLNN_ERR_PARAM_INVALID. */
KVCOMP_ACL_API aclnnStatus aclDestroyTensor(const aclTensor* tensor);

#ifdef __cplusplus
}
#endif

#endif /* KVCOMP_ACLNN_ACL_META_H_ */
