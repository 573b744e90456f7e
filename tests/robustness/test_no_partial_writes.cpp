// Nothing lost on failure: every failing call, whatever the reason, leaves
// every output and the state cache byte-for-byte as they were. Validation
// runs to the end before the first write, and execute() re-validates the
// int32 data, so a table or sequence tensor spoiled between the two phases is
// caught before anything is touched.
#include <gtest/gtest.h>

#include <climits>
#include <cstring>
#include <functional>
#include <limits>

#include "harness.hpp"

namespace kvcomp::test {
namespace {

RandomOptions small(bool th, int cache_mode) {
  RandomOptions o;
  o.th = th;
  o.B = 3;
  o.S = 12;
  o.H = 16;
  o.D = 4;
  o.coff = 2;
  o.r = 4;
  o.cache_mode = cache_mode;
  o.max_start_pos = 9;
  o.random_seqused = false;  // every batch writes the cache
  o.allow_empty_segments = false;
  return o;
}

// Byte image of a buffer.
std::vector<unsigned char> bytes(Buffer& b) {
  const auto* p = static_cast<const unsigned char*>(b.data());
  return {p, p + b.size() * (b.dtype == DType::bf16 || b.dtype == DType::f16 ? 2 : 4)};
}

struct ForwardCase {
  RandomCase<double> rc;
  std::unique_ptr<ForwardRun> run;
  ForwardCase(bool th, int cache_mode) : rc(make_random_case(small(th, cache_mode), 77)) {
    round_io_inputs(rc.in, DType::bf16);
    run = std::make_unique<ForwardRun>(rc.problem, rc.in, DType::bf16);
  }
  std::vector<std::vector<unsigned char>> image() {
    return {bytes(run->cache), bytes(run->cmp_kv), bytes(run->softmax_score), bytes(run->kv)};
  }
};

struct BackwardCase {
  RandomCase<double> rc;
  BackwardData bd;
  std::unique_ptr<BackwardRun> run;
  static RandomOptions options(bool th) {
    RandomOptions o = small(th, 1);
    o.random_seqused = true;
    if (th) o.lengths = {12, 12, 12};
    return o;
  }
  explicit BackwardCase(bool th) : rc(make_random_case(options(th), 78)) {
    round_io_inputs(rc.in, DType::bf16);
    bd = make_backward_data(rc.problem, rc.in, DType::bf16, 79);
    run = std::make_unique<BackwardRun>(rc.problem, rc.in, bd, DType::bf16);
  }
  std::vector<std::vector<unsigned char>> image() {
    return {bytes(run->d_x), bytes(run->d_wkv), bytes(run->d_wgate), bytes(run->d_ape)};
  }
};

std::int32_t* ints(std::optional<Tensor>& t) { return static_cast<std::int32_t*>(t->data); }

// A fault planted in the LAST batch (or the last check of validation), so
// that a library validating batch by batch while writing would already have
// written the earlier batches when it noticed.
struct ForwardFault {
  const char* name;
  bool th;
  int cache_mode;
  std::function<void(ForwardArgs&)> spoil;
  StatusCode code;
};

const std::vector<ForwardFault>& forward_faults() {
  static const std::vector<ForwardFault> f = {
      {"last_table_id_out_of_range", false, 1,
       [](ForwardArgs& a) {
         auto* t = ints(a.state_block_table);
         const std::int64_t cols = a.state_block_table->dim(1);
         for (std::int64_t c = 0; c < cols; ++c) t[2 * cols + c] = INT_MAX;
       },
       StatusCode::invalid_param},
      {"last_ring_id_negative", false, 2, [](ForwardArgs& a) { ints(a.state_block_table)[2] = -5; },
       StatusCode::invalid_param},
      {"last_start_pos_negative", false, 1, [](ForwardArgs& a) { ints(a.start_pos)[2] = -1; },
       StatusCode::invalid_param},
      {"last_start_pos_overflows_int32", true, 1, [](ForwardArgs& a) { ints(a.start_pos)[2] = INT_MAX - 1; },
       StatusCode::invalid_param},
      {"last_cu_seqlens_not_T", true, 1, [](ForwardArgs& a) { ints(a.cu_seqlens)[3] += 1; },
       StatusCode::invalid_param},
      {"cu_seqlens_decreasing", true, 1,
       [](ForwardArgs& a) { ints(a.cu_seqlens)[2] = ints(a.cu_seqlens)[1] - 1; }, StatusCode::invalid_param},
      {"ring_block_too_small", false, 2, [](ForwardArgs& a) { a.state_cache.shape[1] = 2; },
       StatusCode::invalid_param},
      {"kv_rows_mismatch", false, 1, [](ForwardArgs& a) { a.kv.shape[1] -= 1; }, StatusCode::shape_error},
      {"table_too_narrow", false, 1, [](ForwardArgs& a) { a.state_block_table->shape[1] = 1; },
       StatusCode::invalid_param},
  };
  return f;
}

void PrintTo(const ForwardFault& f, std::ostream* os) { *os << f.name; }

class ForwardNothingLost : public ::testing::TestWithParam<ForwardFault> {};

TEST_P(ForwardNothingLost, OneCallAndTwoPhase) {
  const ForwardFault& fault = GetParam();
  ForwardCase c(fault.th, fault.cache_mode);
  ForwardArgs args = c.run->args;
  args.seqused.reset();
  ASSERT_TRUE(args.start_pos.has_value());
  fault.spoil(args);
  const auto before = c.image();
  const Status s = compressor_forward(args);
  EXPECT_EQ(s.code, fault.code) << s.message;
  EXPECT_EQ(c.image(), before) << "a failing one-call forward wrote an output or the cache";
  ForwardPlan plan;
  EXPECT_EQ(plan_forward(args, {}, &plan).code, fault.code);
  EXPECT_FALSE(plan.valid());
  EXPECT_EQ(c.image(), before);
}

INSTANTIATE_TEST_SUITE_P(Issue5, ForwardNothingLost, ::testing::ValuesIn(forward_faults()),
                         [](const auto& tp) { return std::string(tp.param.name); });

// Valid at plan time, spoiled before execute: execute re-reads the int32 data
// and refuses before writing.
TEST(ForwardNothingLost, DataSpoiledBetweenPlanAndExecute) {
  for (const auto& fault : forward_faults()) {
    if (fault.code != StatusCode::invalid_param || std::string(fault.name) == "ring_block_too_small" ||
        std::string(fault.name) == "table_too_narrow")
      continue;  // shape faults live in the plan's copy of the args; data faults are what can change
    SCOPED_TRACE(fault.name);
    ForwardCase c(fault.th, fault.cache_mode);
    c.run->args.seqused.reset();
    ForwardPlan plan;
    ASSERT_TRUE(plan_forward(c.run->args, {}, &plan).ok());
    fault.spoil(c.run->args);  // the plan holds views: this edits the data it will read
    const auto before = c.image();
    std::vector<unsigned char> ws(plan.workspace_size() + 1);
    EXPECT_EQ(execute(plan, ws.data(), ws.size()).code, StatusCode::invalid_param);
    EXPECT_EQ(c.image(), before);
  }
}

TEST(ForwardNothingLost, WorkspaceTooSmallOrNull) {
  ForwardCase c(false, 1);
  ForwardPlan plan;
  ASSERT_TRUE(plan_forward(c.run->args, {}, &plan).ok());
  ASSERT_GT(plan.workspace_size(), 0u);
  const auto before = c.image();
  std::vector<unsigned char> ws(plan.workspace_size());
  EXPECT_EQ(execute(plan, ws.data(), ws.size() - 1).code, StatusCode::invalid_param);
  EXPECT_EQ(execute(plan, nullptr, ws.size()).code, StatusCode::null_pointer);
  ForwardPlan empty;
  EXPECT_EQ(execute(empty, ws.data(), ws.size()).code, StatusCode::invalid_param);
  EXPECT_EQ(c.image(), before);
  // The failures consumed nothing: the same plan still runs, and then writes.
  ASSERT_TRUE(execute(plan, ws.data(), ws.size()).ok());
  EXPECT_NE(c.image(), before);
}

struct BackwardFault {
  const char* name;
  bool th;
  std::function<void(BackwardArgs&)> spoil;
  StatusCode code;
};

const std::vector<BackwardFault>& backward_faults() {
  static const std::vector<BackwardFault> f = {
      {"last_seqused_too_big", false, [](BackwardArgs& a) { ints(a.seqused)[2] = 13; },
       StatusCode::invalid_param},
      {"last_seqused_negative", true, [](BackwardArgs& a) { ints(a.seqused)[2] = -1; },
       StatusCode::invalid_param},
      {"last_start_pos_negative", false, [](BackwardArgs& a) { ints(a.start_pos)[2] = INT_MIN; },
       StatusCode::invalid_param},
      {"last_cu_seqlens_not_T", true, [](BackwardArgs& a) { ints(a.cu_seqlens)[3] -= 1; },
       StatusCode::invalid_param},
      {"d_ape_shape", false, [](BackwardArgs& a) { a.d_ape.shape[1] += 1; }, StatusCode::shape_error},
      {"d_x_dtype", false, [](BackwardArgs& a) { a.d_x.dtype = DType::f16; }, StatusCode::invalid_param},
      {"th_kv_rows_too_few", true,
       [](BackwardArgs& a) {
         for (int b = 0; b < 3; ++b) ints(a.seqused)[b] = 12;  // every block of every batch is used
         a.kv.shape[0] = 1;
       },
       StatusCode::invalid_param},
  };
  return f;
}

void PrintTo(const BackwardFault& f, std::ostream* os) { *os << f.name; }

class BackwardNothingLost : public ::testing::TestWithParam<BackwardFault> {};

TEST_P(BackwardNothingLost, OneCallTwoPhaseAndSpoiledBeforeExecute) {
  const BackwardFault& fault = GetParam();
  BackwardCase c(fault.th);
  ASSERT_TRUE(c.run->args.seqused.has_value());
  BackwardArgs args = c.run->args;
  fault.spoil(args);
  const auto before = c.image();
  EXPECT_EQ(compressor_backward(args).code, fault.code);
  BackwardPlan plan;
  EXPECT_EQ(plan_backward(args, {}, &plan).code, fault.code);
  EXPECT_EQ(c.image(), before);
}

INSTANTIATE_TEST_SUITE_P(Issue5, BackwardNothingLost, ::testing::ValuesIn(backward_faults()),
                         [](const auto& tp) { return std::string(tp.param.name); });

TEST(BackwardNothingLost, SequenceDataSpoiledBetweenPlanAndExecute) {
  BackwardCase c(true);
  BackwardPlan plan;
  ASSERT_TRUE(plan_backward(c.run->args, {}, &plan).ok());
  std::vector<unsigned char> ws(plan.workspace_size());
  const auto before = c.image();
  ints(c.run->args.cu_seqlens)[1] = -3;  // the plan holds a view of this tensor
  EXPECT_EQ(execute(plan, ws.data(), ws.size()).code, StatusCode::invalid_param);
  EXPECT_EQ(c.image(), before);
  EXPECT_EQ(execute(plan, ws.data(), ws.size() - 1).code, StatusCode::invalid_param);
  EXPECT_EQ(execute(plan, nullptr, ws.size()).code, StatusCode::null_pointer);
  EXPECT_EQ(c.image(), before);
}

}  // namespace
}  // namespace kvcomp::test
