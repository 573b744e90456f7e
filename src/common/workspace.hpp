// Workspace layout shared by the backends: the caller's workspace (sized by
// plan_*, passed to execute) is carved into aligned arrays.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcomp::detail {

// Carves a workspace into aligned arrays (kAlign bytes: 64, a cache line, for
// the CPU; 256 for the GPU, what cuBLASLt's fastest kernels assume); the same
// code sizes and places them, so the two never disagree.
template <std::size_t kAlign = 64>
class AlignedLayout {
 public:
  explicit AlignedLayout(void* base = nullptr) : base_(static_cast<unsigned char*>(base)) {}
  template <typename T>
  T* take(std::int64_t count) {
    const std::size_t at = offset_;
    offset_ += (static_cast<std::size_t>(count) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }
  std::size_t size() const { return offset_ + kAlign; }  // + slack to align an unaligned base

  static void* align(void* p) {
    auto v = reinterpret_cast<std::uintptr_t>(p);
    return reinterpret_cast<void*>((v + kAlign - 1) / kAlign * kAlign);
  }

 private:
  unsigned char* base_;
  std::size_t offset_ = 0;
};
using WorkspaceLayout = AlignedLayout<64>;

}  // namespace kvcomp::detail
