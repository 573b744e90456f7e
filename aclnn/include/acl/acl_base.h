/* Types, enums and status values shared by the acl runtime calls and the aclnn
 * operators, with the numbers CANN uses, so that code written for CANN
 * compiles unchanged against kvcomp. Plain C: the ABI stays callable from C. */
#ifndef KVCOMP_ACL_ACL_BASE_H_
#define KVCOMP_ACL_ACL_BASE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVCOMP_ACL_API __attribute__((visibility("default")))
#else
#define KVCOMP_ACL_API
#endif

typedef int aclError;

/* Opaque handles. On the CPU a stream runs its work at launch time, so
 * synchronising it only checks the handle. */
typedef void* aclrtStream;
typedef void* aclrtContext;

#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_REPEAT_FINALIZE 100037
#define ACL_ERROR_BAD_ALLOC 200000
#define ACL_ERROR_INVALID_RESOURCE_HANDLE 200005
#define ACL_ERROR_INTERNAL_ERROR 500000
#define ACL_ERROR_RT_INVALID_DEVICEID 107001

typedef enum aclDataType {
  ACL_DT_UNDEFINED = -1,
  ACL_FLOAT = 0,
  ACL_FLOAT16 = 1,
  ACL_INT8 = 2,
  ACL_INT32 = 3,
  ACL_UINT8 = 4,
  ACL_INT16 = 6,
  ACL_UINT16 = 7,
  ACL_UINT32 = 8,
  ACL_INT64 = 9,
  ACL_UINT64 = 10,
  ACL_DOUBLE = 11,
  ACL_BOOL = 12,
  ACL_BF16 = 27
} aclDataType;

/* Both operators take ND tensors. The other plain layouts are listed because
 * frameworks tag 4-D tensors NCHW without changing their memory order; the
 * fractal (blocked) layouts are rejected by the operators. */
typedef enum aclFormat {
  ACL_FORMAT_UNDEFINED = -1,
  ACL_FORMAT_NCHW = 0,
  ACL_FORMAT_NHWC = 1,
  ACL_FORMAT_ND = 2,
  ACL_FORMAT_NC1HWC0 = 3,
  ACL_FORMAT_FRACTAL_Z = 4,
  ACL_FORMAT_FRACTAL_NZ = 29,
  ACL_FORMAT_NC = 35,
  ACL_FORMAT_NCL = 47
} aclFormat;

#ifdef __cplusplus
}
#endif

#endif /* KVCOMP_ACL_ACL_BASE_H_ */
