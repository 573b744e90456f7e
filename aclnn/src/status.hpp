// How the C ABI reports: a status code for the caller, a one-sentence message
// for aclGetRecentErrMsg, and no exception ever crossing into C.
#pragma once

#include <exception>
#include <new>
#include <string>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::aclnn {

// Records "[kvcomp] <sentence>" as this thread's recent error; returns code.
int fail(int code, const std::string& sentence);
// A status from the core: its code is already the aclnn number.
int fail(const Status& status);

std::string address(const void* p);

// Runs body(); an exception escaping it (allocation failure) becomes `code`.
template <typename Body>
int guarded(int code, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    try {
      return fail(code, "host memory (= exhausted) must suffice for the call");
    } catch (...) {
      return code;
    }
  } catch (const std::exception& e) {
    try {
      return fail(code, std::string("internal step (= ") + e.what() + ") failed");
    } catch (...) {
      return code;
    }
  }
}

}  // namespace kvcomp::aclnn
