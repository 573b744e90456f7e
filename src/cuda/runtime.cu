// The CUDA backend's view of the machine: whether there is a device to run
// on. (The operators themselves come next; until then validation refuses a
// call on a CUDA device with its own sentence, validate/validate.cpp.)
#include <cuda_runtime.h>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp {

bool has_cuda_backend() { return true; }

int cuda_device_count() {
  int n = 0;
  // No driver, no device, or a driver older than the runtime: no device to run on.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error state for the caller's next CUDA call
    return 0;
  }
  return n;
}

}  // namespace kvcomp
