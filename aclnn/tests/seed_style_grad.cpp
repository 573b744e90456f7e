// Written the way the CompressorGrad sample of the CANN documentation is
// written (same headers, macros, helper shapes, types and call sequence, same
// case: C4A, BSH, bf16, B 1, S 4, H 4096, every input 0.1, start_pos 0, first
// 10 values of each output printed with %f), so that the test suite proves
// that such a program compiles unchanged against kvcomp and prints what the
// C++ API computes. Constructs it relies on: `using op::bfloat16`,
// bfloat16(0.1f), static_cast<float>(bf16), std::vector<float_t>,
// aclFormat::ACL_FORMAT_ND, aclDataType::ACL_BF16, `auto ret = aclInit(...)`
// later assigned aclnnStatus values, printf reached through acl/acl.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <numeric>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_compressor_grad.h"
#include "opdev/bfloat16.h"

#define CHECK_RET(cond, return_expr) \
  do {                               \
    if (!(cond)) {                   \
      return_expr;                   \
    }                                \
  } while (0)

#define LOG_PRINT(message, ...)     \
  do {                              \
    printf(message, ##__VA_ARGS__); \
  } while (0)

namespace {

using op::bfloat16;

int64_t GetShapeSize(const std::vector<int64_t>& shape) {
  int64_t shapeSize = 1;
  for (auto dim : shape) {
    shapeSize *= dim;
  }
  return shapeSize;
}

int Init(int32_t deviceId, aclrtContext* context, aclrtStream* stream) {
  auto ret = aclInit(nullptr);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclInit failed. ERROR: %d\n", ret); return ret);
  ret = aclrtSetDevice(deviceId);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclrtSetDevice failed. ERROR: %d\n", ret); return ret);
  ret = aclrtCreateContext(context, deviceId);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclrtCreateContext failed. ERROR: %d\n", ret); return ret);
  ret = aclrtSetCurrentContext(*context);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclrtSetCurrentContext failed. ERROR: %d\n", ret); return ret);
  ret = aclrtCreateStream(stream);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclrtCreateStream failed. ERROR: %d\n", ret); return ret);
  return 0;
}

template <typename T>
int CreateAclTensor(const std::vector<T>& hostData, const std::vector<int64_t>& shape, void** deviceAddr,
                    aclDataType dataType, aclTensor** tensor) {
  auto size = GetShapeSize(shape) * sizeof(T);
  if (size > 0) {
    auto ret = aclrtMalloc(deviceAddr, size, ACL_MEM_MALLOC_HUGE_FIRST);
    CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclrtMalloc failed. ERROR: %d\n", ret); return ret);
    ret = aclrtMemcpy(*deviceAddr, size, hostData.data(), size, ACL_MEMCPY_HOST_TO_DEVICE);
    CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclrtMemcpy failed. ERROR: %d\n", ret); return ret);
  } else {
    *deviceAddr = nullptr;
  }
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; i--) {
    strides[i] = shape[i + 1] * strides[i + 1];
  }
  *tensor = aclCreateTensor(shape.data(), shape.size(), dataType, strides.data(), 0, aclFormat::ACL_FORMAT_ND,
                            shape.data(), shape.size(), *deviceAddr);
  return 0;
}

template <typename Host>
void PrintResult(const std::vector<int64_t>& shape, void** deviceAddr) {
  auto size = GetShapeSize(shape);
  std::vector<Host> resultData(size, Host(0.0f));
  auto ret = aclrtMemcpy(resultData.data(), resultData.size() * sizeof(resultData[0]), *deviceAddr,
                         size * sizeof(resultData[0]), ACL_MEMCPY_DEVICE_TO_HOST);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("copy result from device to host failed. ERROR: %d\n", ret);
            return );
  for (int64_t i = 0; i < size && i < 10; i++) {
    LOG_PRINT("result[%ld] is: %f\n", i, static_cast<float>(resultData[i]));
  }
}

}  // namespace

int main() {
  int32_t deviceId = 0;
  aclrtContext context = nullptr;
  aclrtStream stream = nullptr;
  auto ret = Init(deviceId, &context, &stream);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("Init acl failed. ERROR: %d\n", ret); return ret);

  int64_t B = 1, S = 4, hiddenSize = 4096, headDim = 512, coff = 2, cmpRatio = 4;
  int64_t coffD = coff * headDim;
  int64_t Sr = (S + cmpRatio - 1) / cmpRatio;
  std::vector<int64_t> xShape = {B, S, hiddenSize};
  std::vector<int64_t> wShape = {coffD, hiddenSize};
  std::vector<int64_t> dCmpKvShape = {B, Sr, headDim};
  std::vector<int64_t> savedShape = {B, Sr, coff * cmpRatio, headDim};
  std::vector<int64_t> startPosShape = {B};
  std::vector<int64_t> dApeShape = {cmpRatio, coffD};

  std::vector<bfloat16> xHostData(GetShapeSize(xShape), bfloat16(0.1f));
  std::vector<bfloat16> wHostData(GetShapeSize(wShape), bfloat16(0.1f));
  std::vector<bfloat16> dCmpKvHostData(GetShapeSize(dCmpKvShape), bfloat16(0.1f));
  std::vector<float_t> savedHostData(GetShapeSize(savedShape), 0.1f);
  std::vector<int32_t> startPosHostData(B, 0);
  std::vector<bfloat16> dXHostData(GetShapeSize(xShape), bfloat16(0.0f));
  std::vector<bfloat16> dWHostData(GetShapeSize(wShape), bfloat16(0.0f));
  std::vector<float_t> dApeHostData(GetShapeSize(dApeShape), 0.0f);

  void* xDeviceAddr = nullptr;
  void* wkvDeviceAddr = nullptr;
  void* wgateDeviceAddr = nullptr;
  void* dCmpKvDeviceAddr = nullptr;
  void* softmaxScoreDeviceAddr = nullptr;
  void* kvDeviceAddr = nullptr;
  void* startPosDeviceAddr = nullptr;
  void* dXDeviceAddr = nullptr;
  void* dWkvDeviceAddr = nullptr;
  void* dWgateDeviceAddr = nullptr;
  void* dApeDeviceAddr = nullptr;
  aclTensor* x = nullptr;
  aclTensor* wkv = nullptr;
  aclTensor* wgate = nullptr;
  aclTensor* dCmpKv = nullptr;
  aclTensor* softmaxScore = nullptr;
  aclTensor* kv = nullptr;
  aclTensor* startPos = nullptr;
  aclTensor* dX = nullptr;
  aclTensor* dWkv = nullptr;
  aclTensor* dWgate = nullptr;
  aclTensor* dApe = nullptr;
  ret = CreateAclTensor(xHostData, xShape, &xDeviceAddr, aclDataType::ACL_BF16, &x);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(wHostData, wShape, &wkvDeviceAddr, aclDataType::ACL_BF16, &wkv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(wHostData, wShape, &wgateDeviceAddr, aclDataType::ACL_BF16, &wgate);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(dCmpKvHostData, dCmpKvShape, &dCmpKvDeviceAddr, aclDataType::ACL_BF16, &dCmpKv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(savedHostData, savedShape, &softmaxScoreDeviceAddr, aclDataType::ACL_FLOAT,
                        &softmaxScore);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(savedHostData, savedShape, &kvDeviceAddr, aclDataType::ACL_FLOAT, &kv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(startPosHostData, startPosShape, &startPosDeviceAddr, aclDataType::ACL_INT32,
                        &startPos);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(dXHostData, xShape, &dXDeviceAddr, aclDataType::ACL_BF16, &dX);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(dWHostData, wShape, &dWkvDeviceAddr, aclDataType::ACL_BF16, &dWkv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(dWHostData, wShape, &dWgateDeviceAddr, aclDataType::ACL_BF16, &dWgate);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateAclTensor(dApeHostData, dApeShape, &dApeDeviceAddr, aclDataType::ACL_FLOAT, &dApe);
  CHECK_RET(ret == ACL_SUCCESS, return ret);

  uint64_t workspaceSize = 0;
  aclOpExecutor* executor = nullptr;
  ret =
      aclnnCompressorGradGetWorkspaceSize(x, wkv, wgate, dCmpKv, softmaxScore, kv, nullptr, nullptr, startPos,
                                          cmpRatio, coff, dX, dWkv, dWgate, dApe, &workspaceSize, &executor);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclnnCompressorGradGetWorkspaceSize failed. ERROR: %d\n", ret);
            return ret);
  void* workspaceAddr = nullptr;
  if (workspaceSize > 0) {
    ret = aclrtMalloc(&workspaceAddr, workspaceSize, ACL_MEM_MALLOC_HUGE_FIRST);
    CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("allocate workspace failed. ERROR: %d\n", ret); return ret);
  }
  ret = aclnnCompressorGrad(workspaceAddr, workspaceSize, executor, stream);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclnnCompressorGrad failed. ERROR: %d\n", ret); return ret);
  ret = aclrtSynchronizeStream(stream);
  CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("aclrtSynchronizeStream failed. ERROR: %d\n", ret); return ret);

  LOG_PRINT("CompressorGrad execution succeeded.\n");
  PrintResult<bfloat16>(xShape, &dXDeviceAddr);
  PrintResult<bfloat16>(wShape, &dWkvDeviceAddr);
  PrintResult<bfloat16>(wShape, &dWgateDeviceAddr);
  PrintResult<float_t>(dApeShape, &dApeDeviceAddr);

  for (aclTensor* t : {x, wkv, wgate, dCmpKv, softmaxScore, kv, startPos, dX, dWkv, dWgate, dApe}) {
    aclDestroyTensor(t);
  }
  for (void* p :
       {xDeviceAddr, wkvDeviceAddr, wgateDeviceAddr, dCmpKvDeviceAddr, softmaxScoreDeviceAddr, kvDeviceAddr,
        startPosDeviceAddr, dXDeviceAddr, dWkvDeviceAddr, dWgateDeviceAddr, dApeDeviceAddr}) {
    aclrtFree(p);
  }
  if (workspaceSize > 0) {
    aclrtFree(workspaceAddr);
  }
  aclrtDestroyStream(stream);
  aclrtDestroyContext(context);
  aclrtResetDevice(deviceId);
  aclFinalize();
  return 0;
}
