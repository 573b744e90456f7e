// aclnnCompressor (the forward) called the way CANN programs call it, with
// gradEnabled so that it also saves softmax_score and kv for
// aclnnCompressorGrad. Built against kvcomp, the same source runs on any
// x86-64 CPU.
//
// Case: C4Li (D 128, coff 2, cmp_ratio 4), TH layout with two sequences of 5
// and 7 tokens, bf16, H 1024, start_pos {3, 0}, a paged state cache
// (cache_mode 1) of 4-token blocks (see example_data.hpp for the values).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_compressor.h"
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

  // 2. Shapes and host data. TH: x is [T, H] and cu_seqlens [B+1] gives the
  //    sequences; outputs have min(T, T/cmp_ratio + B) rows.
  const example::ForwardCase c;
  const int64_t C = c.coff * c.D, rows = c.coff * c.cmpRatio, outRows = c.cmpRows();
  const bool gradEnabled = true;
  std::vector<bfloat16> cmpKvHost(static_cast<size_t>(outRows * c.D), bfloat16(0.0f));
  std::vector<float> savedHost(static_cast<size_t>(outRows * rows * c.D), 0.0f);

  // 3. Device tensors. seqused is left out (whole sequences).
  DeviceTensor x, wkv, wgate, stateCache, ape, blockTable, cuSeqlens, startPos, cmpKv, softmaxScore, kv;
  ret = CreateDeviceTensor(ToBf16(c.x), {c.T(), c.H}, aclDataType::ACL_BF16, &x);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(ToBf16(c.wkv), {C, c.H}, aclDataType::ACL_BF16, &wkv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(ToBf16(c.wgate), {C, c.H}, aclDataType::ACL_BF16, &wgate);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret =
      CreateDeviceTensor(c.stateCache, {c.blockNum, c.blockSize, 2 * C}, aclDataType::ACL_FLOAT, &stateCache);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(c.ape, {c.cmpRatio, C}, aclDataType::ACL_FLOAT, &ape);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(c.blockTable, {c.B(), c.tableCols()}, aclDataType::ACL_INT32, &blockTable);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(c.cuSeqlens, {c.B() + 1}, aclDataType::ACL_INT32, &cuSeqlens);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(c.startPos, {c.B()}, aclDataType::ACL_INT32, &startPos);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(cmpKvHost, {outRows, c.D}, aclDataType::ACL_BF16, &cmpKv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(savedHost, {outRows, rows, c.D}, aclDataType::ACL_FLOAT, &softmaxScore);
  CHECK_RET(ret == ACL_SUCCESS, return ret);
  ret = CreateDeviceTensor(savedHost, {outRows, rows, c.D}, aclDataType::ACL_FLOAT, &kv);
  CHECK_RET(ret == ACL_SUCCESS, return ret);

  // 4. Phase one. The cache is contiguous, so its dim-0 stride is
  //    block_size * 2 * coff * D (0 would say the same).
  const int64_t stateCacheStrideDim0 = c.blockSize * 2 * C;
  uint64_t workspaceSize = 0;
  aclOpExecutor* executor = nullptr;
  ret = aclnnCompressorGetWorkspaceSize(
      x.tensor, wkv.tensor, wgate.tensor, stateCache.tensor, ape.tensor, blockTable.tensor, cuSeqlens.tensor,
      nullptr, startPos.tensor, c.cmpRatio, c.coff, c.cacheMode, stateCacheStrideDim0, gradEnabled,
      cmpKv.tensor, softmaxScore.tensor, kv.tensor, &workspaceSize, &executor);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclnnCompressorGetWorkspaceSize", ret); return ret);

  // 5. Phase two on the stream.
  void* workspace = nullptr;
  if (workspaceSize > 0) {
    ret = aclrtMalloc(&workspace, workspaceSize, ACL_MEM_MALLOC_HUGE_FIRST);
    CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtMalloc", ret); return ret);
  }
  ret = aclnnCompressor(workspace, workspaceSize, executor, stream);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclnnCompressor", ret); return ret);
  ret = aclrtSynchronizeStream(stream);
  CHECK_RET(ret == ACL_SUCCESS, PrintError("aclrtSynchronizeStream", ret); return ret);

  // 6. Results: the compressed kv, the two saved intermediates, and the
  //    state cache as the call left it.
  std::vector<bfloat16> cmpKvOut;
  std::vector<float> softmaxOut, kvOut, stateCacheOut;
  CHECK_RET(CopyToHost(cmpKv, &cmpKvOut) == ACL_SUCCESS, return 1);
  CHECK_RET(CopyToHost(softmaxScore, &softmaxOut) == ACL_SUCCESS, return 1);
  CHECK_RET(CopyToHost(kv, &kvOut) == ACL_SUCCESS, return 1);
  CHECK_RET(CopyToHost(stateCache, &stateCacheOut) == ACL_SUCCESS, return 1);
  std::printf("Compressor execution succeeded.\n");
  example::PrintSummary("cmpKv", ToFloat(cmpKvOut));
  example::PrintSummary("softmaxScore", softmaxOut);
  example::PrintSummary("kv", kvOut);
  example::PrintSummary("stateCache", stateCacheOut);

  // 7. Release.
  for (DeviceTensor* t : {&x, &wkv, &wgate, &stateCache, &ape, &blockTable, &cuSeqlens, &startPos, &cmpKv,
                          &softmaxScore, &kv}) {
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
