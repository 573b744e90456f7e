// The two operators through the C ABI: results equal the C++ API's, and every
// misuse returns its documented code with a message naming the parameter.
#include <thread>

#include "aclnn_cases.hpp"

namespace kvcomp::aclnn_test {
namespace {

// aclInit once per process, as a CANN program does.
class AclEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { ASSERT_EQ(aclInit(nullptr), ACL_SUCCESS); }
  void TearDown() override { EXPECT_EQ(aclFinalize(), ACL_SUCCESS); }
};
const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new AclEnvironment);

void expect_failure(aclnnStatus status, aclnnStatus code, const std::string& fragment) {
  EXPECT_EQ(status, code);
  const std::string msg = recent_message();
  EXPECT_NE(msg.find(fragment), std::string::npos) << "message: " << msg;
  EXPECT_EQ(msg.rfind("[kvcomp] ", 0), 0u) << "message: " << msg;
}

// ---- results ---------------------------------------------------------------

class GradLayout : public ::testing::TestWithParam<bool> {};

TEST_P(GradLayout, EqualsCppApiBitwise) {
  GradCase c(GetParam());
  ASSERT_EQ(c.run(), ACLNN_SUCCESS) << recent_message();
  HostTensor dx(c.d_x.shape(), ACL_BF16), dwkv(c.d_wkv.shape(), ACL_BF16),
      dwgate(c.d_wgate.shape(), ACL_BF16), dape(c.d_ape.shape(), ACL_FLOAT);
  const Status s = compressor_backward(c.cpp_args(dx, dwkv, dwgate, dape), aclnn_profile());
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(c.d_x.bytes(), dx.bytes());
  EXPECT_EQ(c.d_wkv.bytes(), dwkv.bytes());
  EXPECT_EQ(c.d_wgate.bytes(), dwgate.bytes());
  EXPECT_EQ(c.d_ape.bytes(), dape.bytes());
}

INSTANTIATE_TEST_SUITE_P(Aclnn, GradLayout, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "th" : "bsh"; });

class ForwardLayout : public ::testing::TestWithParam<bool> {};

TEST_P(ForwardLayout, EqualsCppApiBitwise) {
  ForwardCase c(GetParam());
  auto cache = c.state_cache.bytes();
  ASSERT_EQ(c.run(), ACLNN_SUCCESS) << recent_message();

  HostTensor cmp(c.cmp_kv.shape(), ACL_BF16), sm(c.softmax_score.shape(), ACL_FLOAT),
      kv(c.kv.shape(), ACL_FLOAT);
  HostTensor cache_copy(c.state_cache.shape(), ACL_FLOAT);
  cache_copy.bytes() = cache;
  ForwardArgs a;
  a.x = c.x.view();
  a.wkv = c.wkv.view();
  a.wgate = c.wgate.view();
  a.state_cache = cache_copy.view();
  a.ape = c.ape.view();
  a.state_block_table = c.block_table.view();
  if (c.th) a.cu_seqlens = c.cu_seqlens.view();
  a.start_pos = c.start_pos.view();
  a.cmp_ratio = c.r;
  a.coff = c.coff;
  a.grad_enabled = true;
  a.cmp_kv = cmp.view();
  a.softmax_score = sm.view();
  a.kv = kv.view();
  const Status s = compressor_forward(a, aclnn_profile());
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(c.cmp_kv.bytes(), cmp.bytes());
  EXPECT_EQ(c.softmax_score.bytes(), sm.bytes());
  EXPECT_EQ(c.kv.bytes(), kv.bytes());
  EXPECT_EQ(c.state_cache.bytes(), cache_copy.bytes());
  EXPECT_NE(c.state_cache.bytes(), cache);  // the call did update the cache
}

INSTANTIATE_TEST_SUITE_P(Aclnn, ForwardLayout, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "th" : "bsh"; });

// A state cache whose blocks lie apart (dim-0 stride > block_size*2C) gives
// the same results as a contiguous one; the gaps are never touched.
TEST(AclnnForward, StridedStateCacheMatchesContiguous) {
  constexpr std::int64_t kPad = 96;
  for (std::int64_t attr : {std::int64_t{0}, std::int64_t{-1}}) {
    ForwardCase dense(true), strided(true, kPad);
    const std::int64_t block = strided.block_size * 2 * strided.coff * strided.D;
    strided.stride_attr = attr < 0 ? block + kPad : 0;  // the stride restated, or 0
    const auto gaps_before = strided.state_cache.bytes();
    ASSERT_EQ(dense.run(), ACLNN_SUCCESS) << recent_message();
    ASSERT_EQ(strided.run(), ACLNN_SUCCESS) << recent_message();
    EXPECT_EQ(dense.cmp_kv.bytes(), strided.cmp_kv.bytes());
    EXPECT_EQ(dense.softmax_score.bytes(), strided.softmax_score.bytes());
    EXPECT_EQ(dense.kv.bytes(), strided.kv.bytes());
    const auto* d = reinterpret_cast<const float*>(dense.state_cache.bytes().data());
    const auto* s = reinterpret_cast<const float*>(strided.state_cache.bytes().data());
    const auto* s0 = reinterpret_cast<const float*>(gaps_before.data());
    for (std::int64_t b = 0; b < strided.block_num; ++b) {
      for (std::int64_t i = 0; i < block; ++i) ASSERT_EQ(d[b * block + i], s[b * (block + kPad) + i]);
      for (std::int64_t i = block; i < block + kPad; ++i)
        ASSERT_EQ(s[b * (block + kPad) + i], s0[b * (block + kPad) + i]);
    }
  }
}

// The storage offset moves the view inside its storage.
TEST(AclnnGrad, StorageOffsetIsHonoured) {
  GradCase plain, shifted;
  constexpr std::int64_t kOffset = 40;
  HostTensor x(plain.x.shape(), ACL_BF16, row_major_strides(plain.x.shape()), kOffset,
               {count(plain.x.shape()) + kOffset});
  std::memcpy(x.at<unsigned char>(), plain.x.at<unsigned char>(), plain.x.bytes().size());
  shifted.args[0] = x.get();
  ASSERT_EQ(plain.run(), ACLNN_SUCCESS) << recent_message();
  ASSERT_EQ(shifted.run(), ACLNN_SUCCESS) << recent_message();
  EXPECT_EQ(plain.d_x.bytes(), shifted.d_x.bytes());
  EXPECT_EQ(plain.d_wkv.bytes(), shifted.d_wkv.bytes());
}

// gradEnabled false: softmaxScoreOut / kvOut are still required but only
// their dtype and rank are checked (as on the 950), and they are not written.
TEST(AclnnForward, GradDisabledLeavesSavedOutputsAlone) {
  ForwardCase c;
  c.grad_enabled = false;
  HostTensor small_sm({1, 1, 1, 1}, ACL_FLOAT), small_kv({1, 1, 1}, ACL_FLOAT);
  small_sm.fill({42.0f});
  small_kv.fill({43.0f});
  c.args[10] = small_sm.get();
  c.args[11] = small_kv.get();
  ASSERT_EQ(c.run(), ACLNN_SUCCESS) << recent_message();
  EXPECT_EQ(small_sm.at<float>()[0], 42.0f);
  EXPECT_EQ(small_kv.at<float>()[0], 43.0f);

  HostTensor flat({4, 4}, ACL_FLOAT);
  c.args[10] = flat.get();
  std::uint64_t size;
  aclOpExecutor* ex;
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "softmax_score (dtype fp32, rank 2)");
}

// B = S = T = 0: accepted, nothing computed, the state cache untouched.
TEST(AclnnForward, EmptyInputLeavesStateCacheUntouched) {
  struct Shape {
    std::vector<std::int64_t> x, cmp, saved, table;
    bool th;
  };
  const Shape shapes[] = {{{0, 8, 1024}, {0, 2, 128}, {0, 2, 8, 128}, {0, 3}, false},
                          {{1, 0, 1024}, {1, 0, 128}, {1, 0, 8, 128}, {1, 3}, false},
                          {{0, 1024}, {0, 128}, {0, 8, 128}, {2, 3}, true}};
  for (const Shape& sh : shapes) {
    ForwardCase c(sh.th);
    HostTensor x(sh.x, ACL_BF16), cmp(sh.cmp, ACL_BF16), sm(sh.saved, ACL_FLOAT), kv(sh.saved, ACL_FLOAT),
        table(sh.table, ACL_INT32), cu({3}, ACL_INT32);
    if (table.view_count() > 0) table.fill_ints(std::vector<std::int32_t>(table.view_count(), 1));
    c.args[0] = x.get();
    c.args[5] = table.get();
    c.args[6] = sh.th ? cu.get() : nullptr;  // cu_seqlens {0, 0, 0}: two empty sequences
    c.args[8] = nullptr;                     // start_pos
    c.args[9] = cmp.get();
    c.args[10] = sm.get();
    c.args[11] = kv.get();
    const auto cache = c.state_cache.bytes();
    EXPECT_EQ(c.run(), ACLNN_SUCCESS) << recent_message();
    EXPECT_EQ(c.state_cache.bytes(), cache);
  }
}

// ---- misuse: phase one -------------------------------------------------------

class GradNull : public ::testing::TestWithParam<int> {};

TEST_P(GradNull, RequiredArgumentIsReported) {
  GradCase c;
  std::uint64_t size = 0;
  aclOpExecutor* ex = nullptr;
  const int i = GetParam();
  if (i < 13) {
    c.args[static_cast<std::size_t>(i)] = nullptr;
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_NULLPTR,
                   std::string(GradCase::kNames[i]) + " must not be null");
  } else if (i == 13) {
    expect_failure(c.plan(nullptr, &ex), ACLNN_ERR_PARAM_NULLPTR, "workspaceSize must not be null");
  } else {
    expect_failure(c.plan(&size, nullptr), ACLNN_ERR_PARAM_NULLPTR, "executor must not be null");
  }
  EXPECT_EQ(ex, nullptr);
}

// Every required tensor (the three optional ones, 6..8, are skipped), then
// workspaceSize (13) and executor (14).
INSTANTIATE_TEST_SUITE_P(Aclnn, GradNull, ::testing::Values(0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14));

class ForwardNull : public ::testing::TestWithParam<int> {};

TEST_P(ForwardNull, RequiredArgumentIsReported) {
  ForwardCase c;
  std::uint64_t size = 0;
  aclOpExecutor* ex = nullptr;
  const int i = GetParam();
  if (i < 12) {
    c.args[static_cast<std::size_t>(i)] = nullptr;
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_NULLPTR,
                   std::string(ForwardCase::kNames[i]) + " must not be null");
  } else if (i == 12) {
    expect_failure(c.plan(nullptr, &ex), ACLNN_ERR_PARAM_NULLPTR, "workspaceSize must not be null");
  } else {
    expect_failure(c.plan(&size, nullptr), ACLNN_ERR_PARAM_NULLPTR, "executor must not be null");
  }
  EXPECT_EQ(ex, nullptr);
}

// The block table (5) and both saved outputs (10, 11) are required too, even
// with gradEnabled false.
INSTANTIATE_TEST_SUITE_P(Aclnn, ForwardNull, ::testing::Values(0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13));

TEST(AclnnForward, SavedOutputsRequiredWithoutGrad) {
  ForwardCase c;
  c.grad_enabled = false;
  c.args[11] = nullptr;
  std::uint64_t size;
  aclOpExecutor* ex;
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_NULLPTR, "kv must not be null");
}

TEST(AclnnGrad, WrongDtype) {
  std::uint64_t size;
  aclOpExecutor* ex;
  {
    GradCase c;
    HostTensor x(c.x.shape(), ACL_FLOAT);  // fp32 io: only the C++ API's extended profile takes it
    c.args[0] = x.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "x (dtype fp32) must be bf16 or fp16");
  }
  {
    GradCase c;
    HostTensor x(c.x.shape(), ACL_INT64);  // no kvcomp dtype at all
    c.args[0] = x.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "x (dtype ACL_INT64) must have dtype");
  }
  {
    GradCase c;
    HostTensor sm(c.softmax_score.shape(), ACL_FLOAT16);
    c.args[4] = sm.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "softmax_score (dtype fp16)");
  }
  {
    GradCase c;
    HostTensor dwkv(c.d_wkv.shape(), ACL_FLOAT16);  // io dtype of x is bf16
    c.args[10] = dwkv.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "d_wkv (dtype fp16) must have dtype bf16");
  }
}

TEST(AclnnForward, WrongDtype) {
  std::uint64_t size;
  aclOpExecutor* ex;
  ForwardCase c;
  HostTensor cache(c.state_cache.shape(), ACL_BF16);
  c.args[3] = cache.get();
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "state_cache (dtype bf16)");
  HostTensor table({1, 3}, ACL_INT64);
  ForwardCase d;
  d.args[5] = table.get();
  expect_failure(d.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "state_block_table (dtype ACL_INT64)");
}

TEST(AclnnGrad, WrongRank) {
  std::uint64_t size;
  aclOpExecutor* ex;
  {
    GradCase c;
    HostTensor wkv({1, 256, 1024}, ACL_BF16);
    c.args[1] = wkv.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "wkv (rank 3) must have rank 2");
  }
  {
    GradCase c;
    HostTensor x({1, 1, 8, 1024}, ACL_BF16);
    c.args[0] = x.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "x (rank 4) must have rank 2");
  }
  {
    GradCase c;
    HostTensor x({1, 1, 1, 8, 1024}, ACL_BF16);
    c.args[0] = x.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "x (rank 5) must have rank <= 4");
  }
}

TEST(AclnnForward, WrongRank) {
  std::uint64_t size;
  aclOpExecutor* ex;
  ForwardCase c;
  HostTensor ape({4 * 256}, ACL_FLOAT);
  c.args[4] = ape.get();
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "ape (rank 1) must have rank 2");
}

TEST(AclnnGrad, CuSeqlensFollowsLayout) {
  std::uint64_t size;
  aclOpExecutor* ex;
  GradCase bsh;
  HostTensor cu({2}, ACL_INT32);
  cu.fill_ints({0, 8});
  bsh.args[6] = cu.get();
  expect_failure(bsh.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "cu_seqlens (= given) must be absent");
  GradCase th(true);
  th.args[6] = nullptr;
  expect_failure(th.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "cu_seqlens (= absent) must be given");
}

TEST(AclnnForward, CuSeqlensFollowsLayout) {
  std::uint64_t size;
  aclOpExecutor* ex;
  ForwardCase bsh;
  HostTensor cu({2}, ACL_INT32);
  cu.fill_ints({0, 8});
  bsh.args[6] = cu.get();
  expect_failure(bsh.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "cu_seqlens (= given) must be absent");
  ForwardCase th(true);
  th.args[6] = nullptr;
  expect_failure(th.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "cu_seqlens (= absent) must be given");
}

// The front door uses the NPU's ranges: H = 512 is valid for the C++ API's
// extended profile but not here.
TEST(AclnnGrad, NpuRangesApply) {
  GradCase c;
  HostTensor x({1, 8, 512}, ACL_BF16), w({256, 512}, ACL_BF16), dx({1, 8, 512}, ACL_BF16);
  c.args[0] = x.get();
  c.args[1] = c.args[2] = w.get();
  c.args[9] = dx.get();
  c.args[10] = c.args[11] = w.get();
  std::uint64_t size;
  aclOpExecutor* ex;
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "H (= 512) must be in [1024, 10240]");
  c.cmp_ratio_attr = 1;
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "cmp_ratio (= 1) must be in [2, 128]");
}

TEST(AclnnGrad, EmptyTensorRejected) {
  GradCase c;
  HostTensor x({1, 0, 1024}, ACL_BF16), dx({1, 0, 1024}, ACL_BF16), dc({1, 0, 128}, ACL_BF16),
      sm({1, 0, 8, 128}, ACL_FLOAT), kv({1, 0, 8, 128}, ACL_FLOAT);
  c.args[0] = x.get();
  c.args[3] = dc.get();
  c.args[4] = sm.get();
  c.args[5] = kv.get();
  c.args[9] = dx.get();
  std::uint64_t size;
  aclOpExecutor* ex;
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_INNER_TILING_ERROR, "x (shape [1,0,1024]) must not be empty");
}

TEST(AclnnGrad, NonContiguousRejected) {
  GradCase c;
  // x [1, 8, 1024] viewed through transposed storage [1, 1024, 8].
  HostTensor x({1, 8, 1024}, ACL_BF16, {8192, 1, 8}, 0, {8192});
  c.args[0] = x.get();
  std::uint64_t size;
  aclOpExecutor* ex;
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID,
                 "x (strides [8192,1,8]) must be contiguous, i.e. [8192,1024,1]");
  GradCase d;
  // d_x with a padded row pitch.
  HostTensor dx({1, 8, 1024}, ACL_BF16, {8 * 1100, 1100, 1}, 0, {8 * 1100});
  d.args[9] = dx.get();
  expect_failure(d.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID,
                 "d_x (strides [8800,1100,1]) must be contiguous");
}

TEST(AclnnForward, StateCacheStrides) {
  std::uint64_t size;
  aclOpExecutor* ex;
  {
    ForwardCase c(false, 64);  // dim-0 stride 4*512+64, restated wrongly
    c.stride_attr = 4 * 512;
    expect_failure(
        c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID,
        "state_cache_stride_dim0 (= 2048) must be 0 or the dim-0 stride of stateCacheRef (= 2112)");
  }
  {
    ForwardCase c;
    // Padded rows inside a block: only dim 0 may be strided.
    HostTensor cache({4, 4, 512}, ACL_FLOAT, {4 * 520, 520, 1}, 0, {4 * 4 * 520});
    c.args[3] = cache.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID,
                   "state_cache (strides [2080,520,1]) must be contiguous except in dim 0");
  }
  {
    ForwardCase c;
    // Blocks overlapping each other.
    HostTensor cache({4, 4, 512}, ACL_FLOAT, {1024, 512, 1}, 0, {4 * 4 * 512});
    c.args[3] = cache.get();
    expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "state_cache_stride0 (= 1024)");
  }
}

// ---- misuse: tensors and executors -----------------------------------------

TEST(AclnnTensor, DestroyTwiceIsAnError) {
  GradCase c;
  aclTensor* x = c.x.get();
  EXPECT_EQ(aclDestroyTensor(x), ACLNN_SUCCESS);
  c.x.forget();
  expect_failure(aclDestroyTensor(x), ACLNN_ERR_PARAM_INVALID, "must be a live aclTensor");
  EXPECT_EQ(aclDestroyTensor(nullptr), ACLNN_SUCCESS);
  // A destroyed tensor handed to an operator is reported by name, not read.
  std::uint64_t size;
  aclOpExecutor* ex;
  expect_failure(c.plan(&size, &ex), ACLNN_ERR_PARAM_INVALID, "x (= 0x");
}

TEST(AclnnExecutor, RunsOnce) {
  GradCase c;
  std::uint64_t size = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(c.plan(&size, &ex), ACLNN_SUCCESS) << recent_message();
  std::vector<unsigned char> ws(size);
  ASSERT_EQ(aclnnCompressorGrad(ws.data(), size, ex, nullptr), ACLNN_SUCCESS) << recent_message();
  const auto dx = c.d_x.bytes();
  expect_failure(aclnnCompressorGrad(ws.data(), size, ex, nullptr), ACLNN_ERR_PARAM_INVALID,
                 "executor (= 0x");
  EXPECT_EQ(c.d_x.bytes(), dx);

  ForwardCase f;
  ASSERT_EQ(f.plan(&size, &ex), ACLNN_SUCCESS) << recent_message();
  ws.resize(size);
  ASSERT_EQ(aclnnCompressor(ws.data(), size, ex, nullptr), ACLNN_SUCCESS) << recent_message();
  expect_failure(aclnnCompressor(ws.data(), size, ex, nullptr), ACLNN_ERR_PARAM_INVALID,
                 "not have been launched");
  expect_failure(aclnnCompressor(ws.data(), size, nullptr, nullptr), ACLNN_ERR_PARAM_NULLPTR,
                 "executor must not be null");
}

TEST(AclnnExecutor, WorkspaceTooSmallWritesNothing) {
  GradCase c;
  std::uint64_t size = 0;
  aclOpExecutor* ex = nullptr;
  std::memset(c.d_x.bytes().data(), 0x5a, c.d_x.bytes().size());
  std::memset(c.d_ape.bytes().data(), 0x5a, c.d_ape.bytes().size());
  const auto dx = c.d_x.bytes(), dape = c.d_ape.bytes();
  ASSERT_EQ(c.plan(&size, &ex), ACLNN_SUCCESS) << recent_message();
  ASSERT_GT(size, 0u);
  std::vector<unsigned char> ws(size);
  expect_failure(aclnnCompressorGrad(ws.data(), size - 1, ex, nullptr), ACLNN_ERR_PARAM_INVALID,
                 "workspace_size (= " + std::to_string(size - 1) + ") must be >= " + std::to_string(size));
  EXPECT_EQ(c.d_x.bytes(), dx);
  EXPECT_EQ(c.d_ape.bytes(), dape);
  // The launch consumed the executor: a retry needs a new phase one.
  expect_failure(aclnnCompressorGrad(ws.data(), size, ex, nullptr), ACLNN_ERR_PARAM_INVALID, "executor");
}

TEST(AclnnExecutor, WrongOperatorIsRejectedWithoutConsuming) {
  ForwardCase f;
  std::uint64_t size = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(f.plan(&size, &ex), ACLNN_SUCCESS) << recent_message();
  std::vector<unsigned char> ws(size);
  expect_failure(aclnnCompressorGrad(ws.data(), size, ex, nullptr), ACLNN_ERR_PARAM_INVALID,
                 "must come from aclnnCompressorGradGetWorkspaceSize, not aclnnCompressorGetWorkspaceSize");
  EXPECT_EQ(aclnnCompressor(ws.data(), size, ex, nullptr), ACLNN_SUCCESS) << recent_message();
}

TEST(AclnnExecutor, DeadStreamIsRejected) {
  GradCase c;
  aclrtStream stream = nullptr;
  ASSERT_EQ(aclrtCreateStream(&stream), ACL_SUCCESS);
  ASSERT_EQ(aclrtDestroyStream(stream), ACL_SUCCESS);
  std::uint64_t size = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(c.plan(&size, &ex), ACLNN_SUCCESS) << recent_message();
  std::vector<unsigned char> ws(size);
  expect_failure(aclnnCompressorGrad(ws.data(), size, ex, stream), ACLNN_ERR_PARAM_INVALID, "stream (= 0x");
}

// ---- aclGetRecentErrMsg ------------------------------------------------------

TEST(AclRecentErrMsg, PerThreadAndClearedByReading) {
  GradCase c;
  c.args[0] = nullptr;
  std::uint64_t size;
  aclOpExecutor* ex;
  ASSERT_EQ(c.plan(&size, &ex), ACLNN_ERR_PARAM_NULLPTR);
  const char* other_thread = "unset";
  std::thread([&] { other_thread = aclGetRecentErrMsg(); }).join();
  EXPECT_EQ(other_thread, nullptr);
  const char* msg = aclGetRecentErrMsg();
  ASSERT_NE(msg, nullptr);
  EXPECT_STREQ(msg, "[kvcomp] x must not be null");
  EXPECT_EQ(aclGetRecentErrMsg(), nullptr);
}

}  // namespace
}  // namespace kvcomp::aclnn_test
