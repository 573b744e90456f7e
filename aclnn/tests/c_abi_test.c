/* Plain C11 client of the C ABI: includes the C headers, runs the forward
 * (gradEnabled) and then the backward on its saved outputs, and checks an
 * error path. It keeps the headers and the exported symbols C-clean. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "acl/acl.h"
#include "aclnnop/aclnn_compressor.h"
#include "aclnnop/aclnn_compressor_grad.h"

#define CHECK(cond)                                                                \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      const char* msg_ = aclGetRecentErrMsg();                                     \
      fprintf(stderr, "%s:%d: check failed: %s (%s)\n", __FILE__, __LINE__, #cond, \
              msg_ ? msg_ : "no message");                                         \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

/* C4Li under the NPU's ranges, kept small: BSH, B 1, S 8, H 1024, D 128. */
enum { B = 1, S = 8, H = 1024, D = 128, COFF = 2, R = 4, C = COFF * D, SR = (S + R - 1) / R, BLOCK = 8 };

/* fp16 bits of a float that fp16 holds exactly (the inputs below are k/64). */
static uint16_t exact_fp16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) == 0) return (uint16_t)(bits >> 16);
  return (uint16_t)(((bits >> 16) & 0x8000u) | ((((bits >> 23) & 0xffu) - 112u) << 10) |
                    ((bits >> 13) & 0x3ffu));
}

static int fp16_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

typedef struct {
  void* addr;
  aclTensor* tensor;
  size_t bytes;
} Buffer;

/* A device buffer of `bytes` filled from `host` (or zeroed) and a contiguous ND view of it. */
static Buffer make(const int64_t* shape, uint64_t rank, aclDataType dt, size_t elem, const void* host) {
  Buffer b;
  int64_t strides[4];
  int64_t n = 1;
  for (int i = (int)rank - 1; i >= 0; --i) {
    strides[i] = n;
    n *= shape[i];
  }
  b.bytes = (size_t)n * elem;
  CHECK(aclrtMalloc(&b.addr, b.bytes, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS);
  if (host) {
    CHECK(aclrtMemcpy(b.addr, b.bytes, host, b.bytes, ACL_MEMCPY_HOST_TO_DEVICE) == ACL_SUCCESS);
  } else {
    void* zeros = calloc(1, b.bytes);
    CHECK(zeros != NULL);
    CHECK(aclrtMemcpy(b.addr, b.bytes, zeros, b.bytes, ACL_MEMCPY_HOST_TO_DEVICE) == ACL_SUCCESS);
    free(zeros);
  }
  b.tensor = aclCreateTensor(shape, rank, dt, strides, 0, ACL_FORMAT_ND, shape, rank, b.addr);
  CHECK(b.tensor != NULL);
  return b;
}

static void release(Buffer* b) {
  CHECK(aclDestroyTensor(b->tensor) == ACLNN_SUCCESS);
  CHECK(aclrtFree(b->addr) == ACL_SUCCESS);
}

static void* read_back(const Buffer* b) {
  void* host = malloc(b->bytes);
  CHECK(host != NULL);
  CHECK(aclrtMemcpy(host, b->bytes, b->addr, b->bytes, ACL_MEMCPY_DEVICE_TO_HOST) == ACL_SUCCESS);
  return host;
}

static uint16_t* fp16_values(size_t n, int seed) {
  uint16_t* v = malloc(n * sizeof *v);
  CHECK(v != NULL);
  for (size_t i = 0; i < n; ++i)
    v[i] = exact_fp16((float)((int)((i * 7u + (size_t)seed * 13u) % 65u) - 32) / 64.0f);
  return v;
}

static float* f32_values(size_t n, int seed) {
  float* v = malloc(n * sizeof *v);
  CHECK(v != NULL);
  for (size_t i = 0; i < n; ++i) v[i] = (float)((int)((i * 5u + (size_t)seed) % 33u) - 16) / 32.0f;
  return v;
}

int main(void) {
  aclrtContext context = NULL;
  aclrtStream stream = NULL;
  CHECK(aclInit(NULL) == ACL_SUCCESS);
  CHECK(aclrtSetDevice(0) == ACL_SUCCESS);
  CHECK(aclrtCreateContext(&context, 0) == ACL_SUCCESS);
  CHECK(aclrtSetCurrentContext(context) == ACL_SUCCESS);
  CHECK(aclrtCreateStream(&stream) == ACL_SUCCESS);

  const int64_t x_shape[] = {B, S, H}, w_shape[] = {C, H}, cache_shape[] = {2, BLOCK, 2 * C};
  const int64_t ape_shape[] = {R, C}, table_shape[] = {B, 1}, cmp_shape[] = {B, SR, D};
  const int64_t saved_shape[] = {B, SR, COFF * R, D};
  const int32_t table[] = {1}; /* block 0 is never written */
  uint16_t* x_host = fp16_values((size_t)B * S * H, 1);
  uint16_t* wkv_host = fp16_values((size_t)C * H, 2);
  uint16_t* wgate_host = fp16_values((size_t)C * H, 3);
  float* cache_host = f32_values((size_t)2 * BLOCK * 2 * C, 4);
  float* ape_host = f32_values((size_t)R * C, 5);

  Buffer x = make(x_shape, 3, ACL_FLOAT16, 2, x_host);
  Buffer wkv = make(w_shape, 2, ACL_FLOAT16, 2, wkv_host);
  Buffer wgate = make(w_shape, 2, ACL_FLOAT16, 2, wgate_host);
  Buffer cache = make(cache_shape, 3, ACL_FLOAT, 4, cache_host);
  Buffer ape = make(ape_shape, 2, ACL_FLOAT, 4, ape_host);
  Buffer block_table = make(table_shape, 2, ACL_INT32, 4, table);
  Buffer cmp_kv = make(cmp_shape, 3, ACL_FLOAT16, 2, NULL);
  Buffer softmax_score = make(saved_shape, 4, ACL_FLOAT, 4, NULL);
  Buffer kv = make(saved_shape, 4, ACL_FLOAT, 4, NULL);

  /* Forward, saving softmax_score and kv. */
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = NULL;
  CHECK(aclnnCompressorGetWorkspaceSize(x.tensor, wkv.tensor, wgate.tensor, cache.tensor, ape.tensor,
                                        block_table.tensor, NULL, NULL, NULL, R, COFF, 1, 0, true,
                                        cmp_kv.tensor, softmax_score.tensor, kv.tensor, &workspace_size,
                                        &executor) == ACLNN_SUCCESS);
  void* workspace = NULL;
  CHECK(aclrtMalloc(&workspace, workspace_size, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS);
  CHECK(aclnnCompressor(workspace, workspace_size, executor, stream) == ACLNN_SUCCESS);
  CHECK(aclrtSynchronizeStream(stream) == ACL_SUCCESS);
  CHECK(aclrtFree(workspace) == ACL_SUCCESS);

  uint16_t* cmp = read_back(&cmp_kv);
  int nonzero = 0;
  for (size_t i = 0; i < (size_t)B * SR * D; ++i) {
    CHECK(fp16_finite(cmp[i]));
    nonzero += (cmp[i] & 0x7fffu) != 0;
  }
  CHECK(nonzero > 0);
  free(cmp);

  /* Backward from the saved intermediates. */
  uint16_t* d_cmp_host = fp16_values((size_t)B * SR * D, 6);
  Buffer d_cmp_kv = make(cmp_shape, 3, ACL_FLOAT16, 2, d_cmp_host);
  Buffer d_x = make(x_shape, 3, ACL_FLOAT16, 2, NULL);
  Buffer d_wkv = make(w_shape, 2, ACL_FLOAT16, 2, NULL);
  Buffer d_wgate = make(w_shape, 2, ACL_FLOAT16, 2, NULL);
  Buffer d_ape = make(ape_shape, 2, ACL_FLOAT, 4, NULL);
  CHECK(aclnnCompressorGradGetWorkspaceSize(x.tensor, wkv.tensor, wgate.tensor, d_cmp_kv.tensor,
                                            softmax_score.tensor, kv.tensor, NULL, NULL, NULL, R, COFF,
                                            d_x.tensor, d_wkv.tensor, d_wgate.tensor, d_ape.tensor,
                                            &workspace_size, &executor) == ACLNN_SUCCESS);
  CHECK(aclrtMalloc(&workspace, workspace_size, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS);
  CHECK(aclnnCompressorGrad(workspace, workspace_size, executor, stream) == ACLNN_SUCCESS);
  CHECK(aclrtSynchronizeStream(stream) == ACL_SUCCESS);

  uint16_t* dx = read_back(&d_x);
  float* dape = read_back(&d_ape);
  nonzero = 0;
  for (size_t i = 0; i < (size_t)B * S * H; ++i) {
    CHECK(fp16_finite(dx[i]));
    nonzero += (dx[i] & 0x7fffu) != 0;
  }
  CHECK(nonzero > 0);
  double ape_abs = 0.0;
  for (size_t i = 0; i < (size_t)R * C; ++i) {
    CHECK(isfinite(dape[i]));
    ape_abs += fabs((double)dape[i]);
  }
  CHECK(ape_abs > 0.0);
  free(dx);
  free(dape);

  /* A launched executor is spent; a missing tensor is reported by name. */
  CHECK(aclnnCompressorGrad(workspace, workspace_size, executor, stream) == ACLNN_ERR_PARAM_INVALID);
  CHECK(aclGetRecentErrMsg() != NULL);
  CHECK(aclGetRecentErrMsg() == NULL); /* reading clears it */
  CHECK(aclnnCompressorGradGetWorkspaceSize(NULL, wkv.tensor, wgate.tensor, d_cmp_kv.tensor,
                                            softmax_score.tensor, kv.tensor, NULL, NULL, NULL, R, COFF,
                                            d_x.tensor, d_wkv.tensor, d_wgate.tensor, d_ape.tensor,
                                            &workspace_size, &executor) == ACLNN_ERR_PARAM_NULLPTR);
  const char* msg = aclGetRecentErrMsg();
  CHECK(msg != NULL && strstr(msg, "x must not be null") != NULL);
  CHECK(aclrtFree(workspace) == ACL_SUCCESS);

  Buffer* all[] = {&x,  &wkv,      &wgate, &cache, &ape,     &block_table, &cmp_kv, &softmax_score,
                   &kv, &d_cmp_kv, &d_x,   &d_wkv, &d_wgate, &d_ape};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) release(all[i]);
  free(x_host);
  free(wkv_host);
  free(wgate_host);
  free(cache_host);
  free(ape_host);
  free(d_cmp_host);
  CHECK(aclrtDestroyStream(stream) == ACL_SUCCESS);
  CHECK(aclrtDestroyContext(context) == ACL_SUCCESS);
  CHECK(aclrtResetDevice(0) == ACL_SUCCESS);
  CHECK(aclFinalize() == ACL_SUCCESS);
  printf("C ABI: forward and backward ran; error path reported\n");
  return 0;
}
