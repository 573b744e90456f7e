/* Entry header of the acl runtime subset kvcomp provides (see acl_rt.h). */
#ifndef KVCOMP_ACL_ACL_H_
#define KVCOMP_ACL_ACL_H_

/* CANN samples call printf having included only acl/acl.h and C++ headers. */
#include <stdio.h>

#include "acl/acl_base.h"
#include "acl/acl_rt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* configPath may be NULL; its contents are not read (there is nothing to
 * configure on the CPU). A second aclInit without aclFinalize returns
 * ACL_ERROR_REPEAT_INITIALIZE, an aclFinalize without aclInit
 * ACL_ERROR_REPEAT_FINALIZE, as in CANN. */
KVCOMP_ACL_API aclError aclInit(const char* configPath);
KVCOMP_ACL_API aclError aclFinalize(void);

/* The message of the last failed acl/aclnn call of this thread, and clears it:
 * NULL when there is none. The pointer stays valid until the next
 * aclGetRecentErrMsg call of this thread. Messages are one sentence,
 * "[kvcomp] <parameter> (= <value>) must <rule>"; operator parameters are
 * named as in the operator definition (d_cmp_kv for dCmpKv, state_cache for
 * stateCacheRef, ...). */
KVCOMP_ACL_API const char* aclGetRecentErrMsg(void);

#ifdef __cplusplus
}
#endif

#endif /* KVCOMP_ACL_ACL_H_ */
