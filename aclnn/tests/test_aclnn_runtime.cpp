// The acl runtime subset, aclCreateTensor's checks, and the opdev host types.
#include <cmath>
#include <limits>

#include "aclnn_cases.hpp"
#include "opdev/bfloat16.h"
#include "opdev/fp16_t.h"

namespace kvcomp::aclnn_test {
namespace {

void expect_failure(aclError status, aclError code, const std::string& fragment) {
  EXPECT_EQ(status, code);
  const std::string msg = recent_message();
  EXPECT_NE(msg.find(fragment), std::string::npos) << "message: " << msg;
}

TEST(AclRuntime, InitIsCountedOnce) {
  // The test environment already called aclInit.
  expect_failure(aclInit(nullptr), ACL_ERROR_REPEAT_INITIALIZE, "aclInit");
  ASSERT_EQ(aclFinalize(), ACL_SUCCESS);
  expect_failure(aclFinalize(), ACL_ERROR_REPEAT_FINALIZE, "aclFinalize");
  ASSERT_EQ(aclInit(nullptr), ACL_SUCCESS);
}

TEST(AclRuntime, DevicesContextsStreams) {
  EXPECT_EQ(aclrtSetDevice(0), ACL_SUCCESS);
  EXPECT_EQ(aclrtSetDevice(3), ACL_SUCCESS);  // every id names the CPU
  expect_failure(aclrtSetDevice(-1), ACL_ERROR_RT_INVALID_DEVICEID, "deviceId (= -1) must be >= 0");
  EXPECT_EQ(aclrtResetDevice(3), ACL_SUCCESS);

  aclrtContext context = nullptr;
  ASSERT_EQ(aclrtCreateContext(&context, 0), ACL_SUCCESS);
  EXPECT_EQ(aclrtSetCurrentContext(context), ACL_SUCCESS);
  EXPECT_EQ(aclrtDestroyContext(context), ACL_SUCCESS);
  expect_failure(aclrtSetCurrentContext(context), ACL_ERROR_INVALID_RESOURCE_HANDLE, "context (= 0x");
  expect_failure(aclrtDestroyContext(context), ACL_ERROR_INVALID_RESOURCE_HANDLE, "context (= 0x");
  expect_failure(aclrtCreateContext(nullptr, 0), ACL_ERROR_INVALID_PARAM, "context must not be null");

  aclrtStream stream = nullptr;
  ASSERT_EQ(aclrtCreateStream(&stream), ACL_SUCCESS);
  EXPECT_EQ(aclrtSynchronizeStream(stream), ACL_SUCCESS);
  EXPECT_EQ(aclrtSynchronizeStream(nullptr), ACL_SUCCESS);  // the default stream
  EXPECT_EQ(aclrtDestroyStream(stream), ACL_SUCCESS);
  expect_failure(aclrtSynchronizeStream(stream), ACL_ERROR_INVALID_RESOURCE_HANDLE, "stream (= 0x");
  expect_failure(aclrtDestroyStream(stream), ACL_ERROR_INVALID_RESOURCE_HANDLE, "stream (= 0x");
}

TEST(AclRuntime, MallocFreeMemcpy) {
  void* dev = nullptr;
  ASSERT_EQ(aclrtMalloc(&dev, 256, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(dev) % 64, 0u);
  std::vector<unsigned char> host(256), back(256, 0);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<unsigned char>(i * 7);

  EXPECT_EQ(aclrtMemcpy(dev, 256, host.data(), 256, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
  EXPECT_EQ(aclrtMemcpy(back.data(), 256, dev, 256, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
  EXPECT_EQ(back, host);
  EXPECT_EQ(aclrtMemcpy(static_cast<unsigned char*>(dev) + 128, 128, dev, 128, ACL_MEMCPY_DEVICE_TO_DEVICE),
            ACL_SUCCESS);
  EXPECT_EQ(aclrtMemcpy(back.data(), 256, host.data(), 256, ACL_MEMCPY_HOST_TO_HOST), ACL_SUCCESS);

  expect_failure(aclrtMemcpy(dev, 100, host.data(), 200, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM,
                 "count (= 200) must be <= destMax (= 100)");
  // A wrong direction, or a range past the end of the block, fails as on the NPU.
  expect_failure(aclrtMemcpy(back.data(), 256, host.data(), 256, ACL_MEMCPY_HOST_TO_DEVICE),
                 ACL_ERROR_INVALID_PARAM, "dst (= 0x");
  expect_failure(
      aclrtMemcpy(back.data(), 256, static_cast<unsigned char*>(dev) + 1, 256, ACL_MEMCPY_DEVICE_TO_HOST),
      ACL_ERROR_INVALID_PARAM, "src (= 0x");
  expect_failure(aclrtMemcpy(nullptr, 256, host.data(), 256, ACL_MEMCPY_HOST_TO_HOST),
                 ACL_ERROR_INVALID_PARAM, "dst and src must not be null");

  expect_failure(aclrtMalloc(&dev, 0, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM, "size (= 0)");
  expect_failure(aclrtMalloc(nullptr, 8, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM, "devPtr");
  expect_failure(aclrtMalloc(&dev, 8, static_cast<aclrtMemMallocPolicy>(3)), ACL_ERROR_INVALID_PARAM,
                 "policy (= 3)");
  EXPECT_EQ(aclrtFree(dev), ACL_SUCCESS);
  expect_failure(aclrtFree(dev), ACL_ERROR_INVALID_PARAM, "must be an address from aclrtMalloc");
  expect_failure(aclrtFree(host.data()), ACL_ERROR_INVALID_PARAM, "must be an address from aclrtMalloc");
}

TEST(AclTensor, InconsistentDescriptionsAreRefused) {
  std::vector<float> storage(16);
  const std::int64_t shape[] = {4, 4}, strides[] = {4, 1}, small[] = {15}, negative[] = {-1, 4};
  // The view reaches element 15 of a 15-element storage.
  EXPECT_EQ(aclCreateTensor(shape, 2, ACL_FLOAT, strides, 0, ACL_FORMAT_ND, small, 1, storage.data()),
            nullptr);
  EXPECT_NE(recent_message().find("[kvcomp] tensor (shape [4,4], strides [4,1], offset 0, storage [15], "
                                  "ACL_FLOAT) must lie inside its storage"),
            std::string::npos)
      << recent_message();
  EXPECT_EQ(aclCreateTensor(negative, 2, ACL_FLOAT, strides, 0, ACL_FORMAT_ND, shape, 2, storage.data()),
            nullptr);
  EXPECT_NE(recent_message().find("tensor (shape [-1,4], strides [4,1], offset 0, storage [4,4], ACL_FLOAT) "
                                  "must have non-negative view dims"),
            std::string::npos)
      << recent_message();
  EXPECT_EQ(aclCreateTensor(shape, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, shape, 2, storage.data()),
            nullptr);
  EXPECT_NE(recent_message().find("stride must not be null"), std::string::npos);
  EXPECT_EQ(aclCreateTensor(shape, 2, static_cast<aclDataType>(13), strides, 0, ACL_FORMAT_ND, shape, 2,
                            storage.data()),
            nullptr);
  EXPECT_NE(recent_message().find("dataType of the aclDataType enum"), std::string::npos);
  aclTensor* ok = aclCreateTensor(shape, 2, ACL_FLOAT, strides, 0, ACL_FORMAT_ND, shape, 2, storage.data());
  ASSERT_NE(ok, nullptr);
  EXPECT_EQ(aclDestroyTensor(ok), ACLNN_SUCCESS);
}

TEST(AclTensor, FractalFormatRejectedByOperators) {
  GradCase c;
  const std::int64_t shape[] = {256, 1024}, strides[] = {1024, 1};
  aclTensor* w =
      aclCreateTensor(shape, 2, ACL_BF16, strides, 0, ACL_FORMAT_FRACTAL_NZ, shape, 2, c.wkv.bytes().data());
  ASSERT_NE(w, nullptr);
  c.args[1] = w;
  std::uint64_t size;
  aclOpExecutor* ex;
  EXPECT_EQ(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID);
  EXPECT_NE(recent_message().find("[kvcomp] wkv (aclFormat 29) must be ACL_FORMAT_ND"), std::string::npos)
      << recent_message();
  EXPECT_EQ(aclDestroyTensor(w), ACLNN_SUCCESS);
}

// Both narrowings round to nearest, ties to even, like the operators' outputs.
TEST(OpdevTypes, RoundToNearestEven) {
  using op::bfloat16;
  using op::fp16_t;
  EXPECT_EQ(static_cast<float>(bfloat16(1.0f + 1.0f / 256)), 1.0f);                             // tie -> even
  EXPECT_EQ(static_cast<float>(bfloat16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);                 // tie -> even
  EXPECT_EQ(static_cast<float>(bfloat16(1.0f + 1.0f / 256 + 1.0f / 4096)), 1.0f + 1.0f / 128);  // above tie
  EXPECT_EQ(bfloat16(-2.5f).value, 0xc020);
  EXPECT_TRUE(std::isnan(static_cast<float>(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(bfloat16(3)), 3.0f);
  EXPECT_EQ(static_cast<float>(fp16_t(1.0f + 1.0f / 2048)), 1.0f);  // tie -> even
  EXPECT_EQ(static_cast<float>(fp16_t(65520.0f)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp16_t(0.5f).val, 0x3800);
  EXPECT_EQ(sizeof(bfloat16), 2u);
  EXPECT_EQ(sizeof(fp16_t), 2u);
  std::vector<bfloat16> v(3, bfloat16(0.1f));
  EXPECT_EQ(static_cast<float>(v[2]), kvcomp::bf16_to_float(kvcomp::float_to_bf16(0.1f)));
}

}  // namespace
}  // namespace kvcomp::aclnn_test
