// The product plans of the CUDA backend (cuBLASLt descriptors and one heuristic query) are made once
// per shape and reused by every later product of that shape (issue 19 item 10: before, each product
// made three descriptors and asked the heuristic, 64 times per precise backward at T = 65536).
// Runs the library's own gemm() (the kvcomp_cuda_core objects) on a GPU; skipped without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/gemm.hpp"
#include "kvcomp/kvcomp.hpp"

namespace {

using namespace ::kvcomp::detail::cuda;
using ::kvcomp::DType;

struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(std::size_t n) {
    EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, n), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

TEST(CudaProducts, AShapeMakesItsPlanOnce) {
  if (::kvcomp::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device (or driver) on this machine";
  constexpr std::int64_t m = 64, n = 128, k = 256;
  DeviceBytes a(m * k * 2), b(k * n * 2), d(m * n * 4), ws(kGemmWorkspace);
  const GemmCall g{m, n, k, DType::bf16, {a.p, k, false}, {b.p, n, false}, d.p, n};
  const std::size_t before = lt_plans_made();
  for (int call = 0; call < 5; ++call) {
    const auto s = gemm(g, ws.p, kGemmWorkspace, nullptr, nullptr);
    ASSERT_TRUE(s.ok()) << s.message;
    EXPECT_EQ(lt_plans_made(), before + 1) << "call " << call;
  }
  GemmCall other = g;  // another shape: one more plan, made once too
  other.n = 64;
  other.ldd = 64;
  for (int call = 0; call < 3; ++call) ASSERT_TRUE(gemm(other, ws.p, kGemmWorkspace, nullptr, nullptr).ok());
  EXPECT_EQ(lt_plans_made(), before + 2);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
