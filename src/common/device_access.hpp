// What the shared code needs from a backend that owns memory the host cannot read: the facts
// validation checks about a call's tensors on a device, and the host copies of its index tensors.
// A device backend implements it (cuda/runtime.cu); the entry points (api/api.cpp) hand it to
// validation, which therefore never includes a backend. Plain C++: no device header here.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

class DeviceAccess {
 public:
  using NamedTensors = std::vector<std::pair<const char*, const Tensor*>>;
  virtual ~DeviceAccess() = default;

  // The device of `dev` exists and every non-empty tensor's memory is usable from it.
  virtual Status check_memory(const NamedTensors& tensors, Device dev) const = 0;
  // Reading index data waits for `stream`: refused while the stream is being captured.
  virtual Status check_not_capturing(void* stream) const = 0;
  // The int32 tensor t, on the device, copied to the host (ordered on `stream`, then waited for).
  virtual Status copy_index_to_host(const Tensor& t, void* stream, std::vector<std::int32_t>& out) const = 0;
};

}  // namespace kvcomp::detail
