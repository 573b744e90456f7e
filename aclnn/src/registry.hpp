// The objects handed to C callers (tensors, executors, streams, contexts) live
// in a registry, so that a handle used after destruction, or destroyed twice,
// is recognised and reported instead of dereferenced.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>

namespace kvcomp::aclnn {

template <typename T>
class Registry {
 public:
  T* add(std::unique_ptr<T> object) {
    T* raw = object.get();
    std::lock_guard lock(mutex_);
    live_.emplace(raw, std::move(object));
    return raw;
  }

  bool contains(const void* handle) const {
    std::lock_guard lock(mutex_);
    return live_.count(handle) != 0;
  }

  // Removes and returns the object if it is live and reject(object) is false;
  // otherwise leaves it in place and returns null.
  template <typename Reject>
  std::unique_ptr<T> take_unless(const void* handle, Reject&& reject) {
    std::lock_guard lock(mutex_);
    auto it = live_.find(handle);
    if (it == live_.end() || reject(*it->second)) return nullptr;
    std::unique_ptr<T> object = std::move(it->second);
    live_.erase(it);
    return object;
  }

  std::unique_ptr<T> take(const void* handle) {
    return take_unless(handle, [](const T&) { return false; });
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const void*, std::unique_ptr<T>> live_;
};

}  // namespace kvcomp::aclnn
