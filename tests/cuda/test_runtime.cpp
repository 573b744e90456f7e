// The CUDA backend on a GPU (ctest label cuda). Without a device every test
// reports itself skipped, with the reason, never passed.
#include <gtest/gtest.h>

#include "kvcomp/kvcomp.hpp"

namespace {

#define KVCOMP_REQUIRE_GPU()                                                                            \
  do {                                                                                                  \
    if (kvcomp::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device (or driver) on this machine"; \
  } while (0)

TEST(CudaRuntime, BuildHasTheBackend) { EXPECT_TRUE(kvcomp::has_cuda_backend()); }

TEST(CudaRuntime, SeesTheDevices) {
  KVCOMP_REQUIRE_GPU();
  EXPECT_GE(kvcomp::cuda_device_count(), 1);
}

}  // namespace
