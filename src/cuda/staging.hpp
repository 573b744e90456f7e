// Device copies of a call whose tensors sit in host memory, for front doors
// that read and write files (the CLI): stage() rewrites the Args' tensors to
// device copies on one CUDA device, copy_back() copies every tensor back to
// its host memory. A separate static library (kvcomp_cuda_staging), built
// with the CUDA backend; the operators themselves never copy to or from the
// host.
#pragma once

#include <vector>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::staging {

class DeviceCopies {
 public:
  explicit DeviceCopies(Device device) : device_(device) {}
  ~DeviceCopies();
  DeviceCopies(const DeviceCopies&) = delete;
  DeviceCopies& operator=(const DeviceCopies&) = delete;

  // Every tensor of the call (outputs included: they are copied too, so the
  // device sees what the host buffers held) moved to the device. A host
  // buffer staged before (by this object, for another call) keeps its one
  // device copy, so a backward staged after its forward reads the forward's
  // device outputs.
  Status stage(ForwardArgs& a);
  Status stage(BackwardArgs& a);
  // Waits for the device, then copies every staged tensor back.
  Status copy_back();
  // Waits for the device (for timing).
  Status synchronize();

 private:
  Status move(Tensor& t);
  Status move(std::optional<Tensor>& t) { return t ? move(*t) : Status::success(); }
  Status move_sequence(SequenceArgs& a);
  struct Entry {
    void* host;
    void* dev;
    std::size_t bytes;
  };
  Device device_;
  std::vector<Entry> entries_;
};

}  // namespace kvcomp::staging
