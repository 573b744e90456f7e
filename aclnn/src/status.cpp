#include "status.hpp"

#include <cinttypes>
#include <cstdio>

#include "acl/acl.h"

namespace kvcomp::aclnn {

namespace {

// The recent error is per thread, as in CANN's default err_msg_mode; `handed`
// keeps the string a caller is still reading after aclGetRecentErrMsg.
thread_local std::string recent;
thread_local std::string handed;

}  // namespace

int fail(int code, const std::string& sentence) {
  recent = "[kvcomp] " + sentence;
  return code;
}

int fail(const Status& status) {
  recent = status.message;
  return status.value();
}

std::string address(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<std::uintptr_t>(p));
  return buf;
}

}  // namespace kvcomp::aclnn

extern "C" const char* aclGetRecentErrMsg(void) {
  using namespace kvcomp::aclnn;
  if (recent.empty()) return nullptr;
  handed.swap(recent);
  recent.clear();
  return handed.c_str();
}
