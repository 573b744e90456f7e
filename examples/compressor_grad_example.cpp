// aclnnCompressorGrad called the way CANN programs call it: acl init, device
// buffers, aclTensors, the two-phase call, synchronise, read back, release.
// Built against kvcomp, the same source runs on any x86-64 CPU.
//
// Case: C4A (D 512, coff 2, cmp_ratio 4), BSH layout, bf16, B 1, S 8, H 1024,
// start_pos 2 (see example_data.hpp for the input values).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_compressor_grad.h"
#include "example_data.hpp"
#include "opdev/bfloat16.h"

#define CHECK_RET(cond, on_failure) \
  do {                              \
    if (!(cond)) {                  \
      on_failure;                   \
    }                               \
  } while (0)

namespace {

using op::bfloat16;

int64_t ElementCount(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void PrintError(const char* call, int ret) {
  const char* msg = aclGetRecentErrMsg();
  std::printf("%s failed. ERROR: %d %s\n", call, ret, msg ? msg : "");
}

int InitAcl(int32_t deviceId, aclrtContext* context, aclrtStream* stream) {
  int ret = aclInit(nullptr);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclInit", ret); return ret);
  ret = aclrtSetDevice(deviceId);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtSetDevice", ret); return ret);
  ret = aclrtCreateContext(context, deviceId);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtCreateContext", ret); return ret);
  ret = aclrtSetCurrentContext(*context);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtSetCurrentContext", ret); return ret);
  ret = aclrtCreateStream(stream);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtCreateStream", ret); return ret);
  return ACL_SUCCESS;
}

// A device buffer holding `host`, and a contiguous ND aclTensor viewing it.
struct DeviceTensor {
  void* addr = nullptr;
  aclTensor* tensor = nullptr;
  std::vector<int64_t> shape;
};

template <typename T>
int CreateDeviceTensor(const std::vector<T>& host, const std::vector<int64_t>& shape, aclDataType dataType,
                       DeviceTensor* out) {
  out->shape = shape;
  const size_t bytes = static_cast<size_t>(ElementCount(shape)) * sizeof(T);
  if (bytes > 0) {
    int ret = aclrtMalloc(&out->addr, bytes, ACL_MEM_MALLOC_HUGE_FIRST);
    CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtMalloc", ret); return ret);
    ret = aclrtMemcpy(out->addr, bytes, host.data(), bytes, ACL_MEMCPY_HOST_TO_DEVICE);
    CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtMemcpy", ret); return ret);
  }
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i)
    strides[static_cast<size_t>(i)] = shape[static_cast<size_t>(i + 1)] * strides[static_cast<size_t>(i + 1)];
  out->tensor = aclCreateTensor(shape.data(), shape.size(), dataType, strides.data(), 0,
                                aclFormat::ACL_FORMAT_ND, shape.data(), shape.size(), out->addr);
  CHECK_RET(out->tensor != nullptr, PrintError("aclCreateTensor", -1); return -1);
  return ACL_SUCCESS;
}

template <typename T>
int CopyToHost(const DeviceTensor& t, std::vector<T>* host) {
  host->resize(static_cast<size_t>(ElementCount(t.shape)));
  const size_t bytes = host->size() * sizeof(T);
  int ret = aclrtMemcpy(host->data(), bytes, t.addr, bytes, ACL_MEMCPY_DEVICE_TO_HOST);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtMemcpy", ret); return ret);
  return ACL_SUCCESS;
}

std::vector<bfloat16> ToBf16(const std::vector<float>& v) {
  return std::vector<bfloat16>(v.begin(), v.end());
}
std::vector<float> ToFloat(const std::vector<bfloat16>& v) { return std::vector<float>(v.begin(), v.end()); }

}  // namespace

int main() {
  // 1. Runtime.
  int32_t deviceId = 0;
  aclrtContext context = nullptr;
  aclrtStream stream = nullptr;
  int ret = InitAcl(deviceId, &context, &stream);
  CHECK_RET(ret == ACL_SUCCESS, return ret);

  // 2. Shapes and host data.
  const example::GradCase c;
  const int64_t C = c.coff * c.D, rows = c.coff * c.cmpRatio;
  std::vector<bfloat16> dXHost(static_cast<size_t>(c.B * c.S * c.H), bfloat16(0.0f));
  std::vector<bfloat16> dWHost(static_cast<size_t>(C * c.H), bfloat16(0.0f));
  std::vector<float> dApeHost(static_cast<size_t>(c.cmpRatio * C), 0.0f);

  // 3. Device tensors. BSH layout: cuSeqlens must be absent; seqused is left
  //    out (whole sequences); startPos is given.
  DeviceTensor x, wkv, wgate, dCmpKv, softmaxScore, kv, startPos, dX, dWkv, dWgate, dApe;
  ret = CreateDeviceTensor(ToBf16(c.x), {c.B, c.S, c.H}, aclDataType::ACL_BF16, &x);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(ToBf16(c.wkv), {C, c.H}, aclDataType::ACL_BF16, &wkv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(ToBf16(c.wgate), {C, c.H}, aclDataType::ACL_BF16, &wgate);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(ToBf16(c.dCmpKv), {c.B, c.Sr(), c.D}, aclDataType::ACL_BF16, &dCmpKv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(c.softmaxScore, {c.B, c.Sr(), rows, c.D}, aclDataType::ACL_FLOAT, &softmaxScore);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(c.kv, {c.B, c.Sr(), rows, c.D}, aclDataType::ACL_FLOAT, &kv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(c.startPos, {c.B}, aclDataType::ACL_INT32, &startPos);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(dXHost, {c.B, c.S, c.H}, aclDataType::ACL_BF16, &dX);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(dWHost, {C, c.H}, aclDataType::ACL_BF16, &dWkv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(dWHost, {C, c.H}, aclDataType::ACL_BF16, &dWgate);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(dApeHost, {c.cmpRatio, C}, aclDataType::ACL_FLOAT, &dApe);
  CHECK_RET(ret == ACL_SUCCESS, return ret);

  // 4. Phase one: validate, size the workspace, get the executor.
  uint64_t workspaceSize = 0;
  aclOpExecutor* executor = nullptr;
  ret = aclnnCompressorGradGetWorkspaceSize(x.tensor, wkv.tensor, wgate.tensor, dCmpKv.tensor,
                                            softmaxScore.tensor, kv.tensor, nullptr, nullptr, startPos.tensor,
                                            c.cmpRatio, c.coff, dX.tensor, dWkv.tensor, dWgate.tensor,
                                            dApe.tensor, &workspaceSize, &executor);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclnnCompressorGradGetWorkspaceSize", ret); return ret);

  // 5. Phase two on the stream, with a workspace of the size asked for.
  void* workspace = nullptr;
  if (workspaceSize > 0) {
    ret = aclrtMalloc(&workspace, workspaceSize, ACL_MEM_MALLOC_HUGE_FIRST);
    CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtMalloc", ret); return ret);
  }
  ret = aclnnCompressorGrad(workspace, workspaceSize, executor, stream);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclnnCompressorGrad", ret); return ret);
  ret = aclrtSynchronizeStream(stream);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtSynchronizeStream", ret); return ret);

  // 6. Results.
  std::vector<bfloat16> dXOut, dWkvOut, dWgateOut;
  std::vector<float> dApeOut;
  CHECK_RET(CopyToHost(dX, &dXOut) == ACL_SUCCESS, return 1);
  CHECK_RET(CopyToHost(dWkv, &dWkvOut) == ACL_SUCCESS, return 1);
  CHECK_RET(CopyToHost(dWgate, &dWgateOut) == ACL_SUCCESS, return 1);
  CHECK_RET(CopyToHost(dApe, &dApeOut) == ACL_SUCCESS, return 1);
  std::printf("CompressorGrad execution succeeded.\n");
  example::PrintSummary("dX", ToFloat(dXOut));
  example::PrintSummary("dWkv", ToFloat(dWkvOut));
  example::PrintSummary("dWgate", ToFloat(dWgateOut));
  example::PrintSummary("dApe", dApeOut);

  // 7. Release.
  for (DeviceTensor* t :
       {&x, &wkv, &wgate, &dCmpKv, &softmaxScore, &kv, &startPos, &dX, &dWkv, &dWgate, &dApe}) {
    aclDestroyTensor(t->tensor);
    if (t->addr) aclrtFree(t->addr);
  }
  if (workspace) aclrtFree(workspace);
  aclrtDestroyStream(stream);
  aclrtDestroyContext(context);
  aclrtResetDevice(deviceId);
  aclFinalize();
  return 0;
}
