/* The acl runtime calls the aclnn sample programs make. kvcomp runs on the
 * host: "device" memory is host memory (64-byte aligned), every device id names
 * the CPU, and an operator finishes before its launch call returns. */
#ifndef KVCOMP_ACL_ACL_RT_H_
#define KVCOMP_ACL_ACL_RT_H_

#include "acl/acl_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum aclrtMemMallocPolicy {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_MEM_MALLOC_HUGE_ONLY = 1,
  ACL_MEM_MALLOC_NORMAL_ONLY = 2
} aclrtMemMallocPolicy;

typedef enum aclrtMemcpyKind {
  ACL_MEMCPY_HOST_TO_HOST = 0,
  ACL_MEMCPY_HOST_TO_DEVICE = 1,
  ACL_MEMCPY_DEVICE_TO_HOST = 2,
  ACL_MEMCPY_DEVICE_TO_DEVICE = 3
} aclrtMemcpyKind;

/* deviceId >= 0; every id names the host CPU. */
KVCOMP_ACL_API aclError aclrtSetDevice(int32_t deviceId);
KVCOMP_ACL_API aclError aclrtResetDevice(int32_t deviceId);

KVCOMP_ACL_API aclError aclrtCreateContext(aclrtContext* context, int32_t deviceId);
KVCOMP_ACL_API aclError aclrtSetCurrentContext(aclrtContext context);
KVCOMP_ACL_API aclError aclrtDestroyContext(aclrtContext context);

KVCOMP_ACL_API aclError aclrtCreateStream(aclrtStream* stream);
/* stream may be NULL (the default stream). */
KVCOMP_ACL_API aclError aclrtSynchronizeStream(aclrtStream stream);
KVCOMP_ACL_API aclError aclrtDestroyStream(aclrtStream stream);

/* size > 0. The memory is not initialised, as on the device. */
KVCOMP_ACL_API aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy policy);
/* devPtr must come from aclrtMalloc. */
KVCOMP_ACL_API aclError aclrtFree(void* devPtr);
/* count <= destMax. The side(s) the kind calls "device" must lie inside one
 * aclrtMalloc block, so that a wrong kind fails here as it would on the NPU. */
KVCOMP_ACL_API aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count,
                                    aclrtMemcpyKind kind);

#ifdef __cplusplus
}
#endif

#endif /* KVCOMP_ACL_ACL_RT_H_ */
