// The acl runtime on the host: init/finalize, devices, contexts, streams and
// "device" memory. Work launched on a stream has finished when the launch
// returns, so a stream only has to be a valid handle.
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>

#include "acl/acl.h"
#include "executor.hpp"
#include "registry.hpp"
#include "status.hpp"

namespace kvcomp::aclnn {

namespace {

struct Context {
  std::int32_t device = 0;
};
struct Stream {};

// Never destroyed: callers may release handles from their static destructors.
Registry<Context>& contexts() {
  static auto* registry = new Registry<Context>;
  return *registry;
}
Registry<Stream>& streams() {
  static auto* registry = new Registry<Stream>;
  return *registry;
}

// aclrtMalloc blocks by start address, so that aclrtFree and aclrtMemcpy can
// tell device memory from anything else.
class DeviceMemory {
 public:
  static constexpr std::align_val_t kAlign{64};  // what the operators' tiles like best

  void* allocate(std::size_t size) {
    void* p = ::operator new(size, kAlign, std::nothrow);
    if (!p) return nullptr;
    std::lock_guard lock(mutex_);
    blocks_.emplace(reinterpret_cast<std::uintptr_t>(p), size);
    return p;
  }

  bool release(void* p) {
    {
      std::lock_guard lock(mutex_);
      if (blocks_.erase(reinterpret_cast<std::uintptr_t>(p)) == 0) return false;
    }
    ::operator delete(p, kAlign);
    return true;
  }

  // [p, p + count) lies inside one block.
  bool contains(const void* p, std::size_t count) const {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(mutex_);
    auto it = blocks_.upper_bound(a);
    if (it == blocks_.begin()) return false;
    --it;
    return a - it->first <= it->second && count <= it->second - (a - it->first);
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> blocks_;
};

DeviceMemory& device_memory() {
  static auto* memory = new DeviceMemory;
  return *memory;
}

std::mutex init_mutex;
bool initialized = false;

int check_device(std::int32_t id) {
  if (id < 0)
    return fail(ACL_ERROR_RT_INVALID_DEVICEID, "deviceId (= " + std::to_string(id) + ") must be >= 0");
  return ACL_SUCCESS;
}

const char* kind_name(aclrtMemcpyKind kind) {
  switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST:
      return "ACL_MEMCPY_HOST_TO_HOST";
    case ACL_MEMCPY_HOST_TO_DEVICE:
      return "ACL_MEMCPY_HOST_TO_DEVICE";
    case ACL_MEMCPY_DEVICE_TO_HOST:
      return "ACL_MEMCPY_DEVICE_TO_HOST";
    case ACL_MEMCPY_DEVICE_TO_DEVICE:
      return "ACL_MEMCPY_DEVICE_TO_DEVICE";
  }
  return "?";
}

}  // namespace

bool live_stream(const void* stream) { return streams().contains(stream); }

}  // namespace kvcomp::aclnn

using namespace kvcomp::aclnn;

extern "C" {

aclError aclInit(const char* /*configPath: nothing to configure on the CPU*/) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    std::lock_guard lock(init_mutex);
    if (initialized)
      return fail(ACL_ERROR_REPEAT_INITIALIZE,
                  "aclInit (= called again) must be called once before aclFinalize");
    initialized = true;
    return ACL_SUCCESS;
  });
}

aclError aclFinalize(void) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    std::lock_guard lock(init_mutex);
    if (!initialized)
      return fail(ACL_ERROR_REPEAT_FINALIZE, "aclFinalize (= without aclInit) must follow an aclInit");
    initialized = false;
    return ACL_SUCCESS;
  });
}

aclError aclrtSetDevice(int32_t deviceId) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&] { return check_device(deviceId); });
}

aclError aclrtResetDevice(int32_t deviceId) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&] { return check_device(deviceId); });
}

aclError aclrtCreateContext(aclrtContext* context, int32_t deviceId) {
  return guarded(ACL_ERROR_BAD_ALLOC, [&]() -> int {
    if (!context) return fail(ACL_ERROR_INVALID_PARAM, "context must not be null");
    if (int rc = check_device(deviceId); rc != ACL_SUCCESS) return rc;
    auto c = std::make_unique<Context>();
    c->device = deviceId;
    *context = contexts().add(std::move(c));
    return ACL_SUCCESS;
  });
}

aclError aclrtSetCurrentContext(aclrtContext context) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    if (!contexts().contains(context))
      return fail(ACL_ERROR_INVALID_RESOURCE_HANDLE,
                  "context (= " + address(context) + ") must be a live context from aclrtCreateContext");
    return ACL_SUCCESS;
  });
}

aclError aclrtDestroyContext(aclrtContext context) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    if (!contexts().take(context))
      return fail(ACL_ERROR_INVALID_RESOURCE_HANDLE,
                  "context (= " + address(context) + ") must be a live context from aclrtCreateContext");
    return ACL_SUCCESS;
  });
}

aclError aclrtCreateStream(aclrtStream* stream) {
  return guarded(ACL_ERROR_BAD_ALLOC, [&]() -> int {
    if (!stream) return fail(ACL_ERROR_INVALID_PARAM, "stream must not be null");
    *stream = streams().add(std::make_unique<Stream>());
    return ACL_SUCCESS;
  });
}

aclError aclrtSynchronizeStream(aclrtStream stream) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    if (stream && !streams().contains(stream))
      return fail(ACL_ERROR_INVALID_RESOURCE_HANDLE,
                  "stream (= " + address(stream) + ") must be NULL or a live stream from aclrtCreateStream");
    return ACL_SUCCESS;
  });
}

aclError aclrtDestroyStream(aclrtStream stream) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    if (!streams().take(stream))
      return fail(ACL_ERROR_INVALID_RESOURCE_HANDLE,
                  "stream (= " + address(stream) + ") must be a live stream from aclrtCreateStream");
    return ACL_SUCCESS;
  });
}

aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy policy) {
  return guarded(ACL_ERROR_BAD_ALLOC, [&]() -> int {
    if (!devPtr) return fail(ACL_ERROR_INVALID_PARAM, "devPtr must not be null");
    if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, "size (= 0) must be > 0");
    if (policy != ACL_MEM_MALLOC_HUGE_FIRST && policy != ACL_MEM_MALLOC_HUGE_ONLY &&
        policy != ACL_MEM_MALLOC_NORMAL_ONLY)
      return fail(ACL_ERROR_INVALID_PARAM, "policy (= " + std::to_string(static_cast<int>(policy)) +
                                               ") must be an aclrtMemMallocPolicy value");
    void* p = device_memory().allocate(size);
    if (!p)
      return fail(ACL_ERROR_BAD_ALLOC, "size (= " + std::to_string(size) + " bytes) must be allocatable");
    *devPtr = p;
    return ACL_SUCCESS;
  });
}

aclError aclrtFree(void* devPtr) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    if (!device_memory().release(devPtr))
      return fail(ACL_ERROR_INVALID_PARAM,
                  "devPtr (= " + address(devPtr) + ") must be an address from aclrtMalloc, not yet freed");
    return ACL_SUCCESS;
  });
}

aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind) {
  return guarded(ACL_ERROR_INTERNAL_ERROR, [&]() -> int {
    if (!dst || !src) return fail(ACL_ERROR_INVALID_PARAM, "dst and src must not be null");
    if (count > destMax)
      return fail(ACL_ERROR_INVALID_PARAM, "count (= " + std::to_string(count) +
                                               ") must be <= destMax (= " + std::to_string(destMax) + ")");
    if (kind != ACL_MEMCPY_HOST_TO_HOST && kind != ACL_MEMCPY_HOST_TO_DEVICE &&
        kind != ACL_MEMCPY_DEVICE_TO_HOST && kind != ACL_MEMCPY_DEVICE_TO_DEVICE)
      return fail(ACL_ERROR_INVALID_PARAM,
                  "kind (= " + std::to_string(static_cast<int>(kind)) + ") must be an aclrtMemcpyKind value");
    const bool dst_device = kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
    const bool src_device = kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
    if (dst_device && !device_memory().contains(dst, count))
      return fail(ACL_ERROR_INVALID_PARAM, "dst (= " + address(dst) + ") must hold " + std::to_string(count) +
                                               " bytes of aclrtMalloc memory for " + kind_name(kind));
    if (src_device && !device_memory().contains(src, count))
      return fail(ACL_ERROR_INVALID_PARAM, "src (= " + address(src) + ") must hold " + std::to_string(count) +
                                               " bytes of aclrtMalloc memory for " + kind_name(kind));
    std::memmove(dst, src, count);
    return ACL_SUCCESS;
  });
}

}  // extern "C"
