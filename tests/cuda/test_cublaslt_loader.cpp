// cuBLASLt is loaded at the first CUDA call, not with libkvcomp (src/cuda/cublaslt_loader.cpp): a
// process that runs only on the CPU never maps the 540 MB library. Runs without a GPU (the loading
// and the host-side descriptor calls need none): ctest runs it in CI.
#include <cublasLt.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "cuda/common.hpp"
#include "harness.hpp"

namespace {

bool cublaslt_mapped() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find("libcublasLt.so") != std::string::npos) return true;
  return false;
}

// Each test runs in a process of its own (gtest_discover_tests): what it finds mapped is its own doing.
TEST(CublasLtLoader, ACpuCallLeavesItUnloaded) {
  ASSERT_FALSE(cublaslt_mapped()) << "libcublasLt was loaded with the program";
  kvcomp::test::RandomOptions o;
  o.H = 32;
  o.D = 8;
  auto rc = kvcomp::test::make_random_case(o, 7);
  kvcomp::test::round_io_inputs(rc.in, kvcomp::DType::bf16);
  kvcomp::test::ForwardRun run(rc.problem, rc.in, kvcomp::DType::bf16);
  const kvcomp::Status s = kvcomp::compressor_forward(run.args);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_FALSE(cublaslt_mapped()) << "a CPU call loaded libcublasLt";
}

TEST(CublasLtLoader, TheFirstLoadResolvesEveryFunction) {
  ASSERT_FALSE(cublaslt_mapped());
  const kvcomp::Status s = kvcomp::detail::cuda::load_cublaslt();
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_TRUE(cublaslt_mapped());
  EXPECT_TRUE(kvcomp::detail::cuda::load_cublaslt().ok());  // once per process, then the same answer
  // The forwarders reach the library with their arguments in place: host-side descriptors, which
  // need no GPU (an attribute of the wrong size is refused).
  cublasLtMatrixLayout_t layout = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, 8, 4, 8), CUBLAS_STATUS_SUCCESS);
  EXPECT_NE(layout, nullptr);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(layout), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulDesc_t desc = nullptr;
  ASSERT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  const cublasOperation_t t = CUBLAS_OP_T;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, 1),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmulDescDestroy(desc), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulPreference_t pref = nullptr;
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  const std::uint64_t bytes = 1 << 20;
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes,
                                                 sizeof bytes),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
}

}  // namespace
