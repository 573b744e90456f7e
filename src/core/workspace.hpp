// Workspace layout shared by the backends: the caller's workspace (sized by
// plan_*, passed to execute) is carved into aligned arrays.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcomp::detail {

// Carves a workspace into 64-byte aligned arrays; the same code sizes and
// places them, so the two never disagree.
class WorkspaceLayout {
 public:
  explicit WorkspaceLayout(void* base = nullptr) : base_(static_cast<unsigned char*>(base)) {}
  template <typename T>
  T* take(std::int64_t count) {
    const std::size_t at = offset_;
    offset_ += (static_cast<std::size_t>(count) * sizeof(T) + 63) / 64 * 64;
    return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }
  std::size_t size() const { return offset_ + 64; }  // + slack to align an unaligned base

  static void* align(void* p) {
    auto v = reinterpret_cast<std::uintptr_t>(p);
    return reinterpret_cast<void*>((v + 63) / 64 * 64);
  }

 private:
  unsigned char* base_;
  std::size_t offset_ = 0;
};

}  // namespace kvcomp::detail
