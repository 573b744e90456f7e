// One test per validation rule: the status code and the sentence naming the
// parameter, and nothing written.
#include <gtest/gtest.h>

#include <climits>
#include <functional>
#include <limits>

#include "harness.hpp"

namespace kvcomp::test {
namespace {

constexpr StatusCode kNull = StatusCode::null_pointer;
constexpr StatusCode kInvalid = StatusCode::invalid_param;
constexpr StatusCode kShape = StatusCode::shape_error;

RandomOptions small(bool th) { return small_rule_options(th); }

struct BackwardFixture {
  RandomCase<double> rc;
  BackwardData bd;
  std::unique_ptr<BackwardRun> run;
  explicit BackwardFixture(bool th) : rc(make_random_case(small(th), 42)) {
    round_io_inputs(rc.in, DType::bf16);
    bd = make_backward_data(rc.problem, rc.in, DType::bf16, 43);
    run = std::make_unique<BackwardRun>(rc.problem, rc.in, bd, DType::bf16);
  }
};

struct ForwardFixture {
  RandomCase<double> rc;
  std::unique_ptr<ForwardRun> run;
  explicit ForwardFixture(bool th, int cache_mode = 1) {
    auto o = small(th);
    o.cache_mode = cache_mode;
    o.random_seqused = false;  // every batch touches the cache
    rc = make_random_case(o, 44);
    round_io_inputs(rc.in, DType::bf16);
    run = std::make_unique<ForwardRun>(rc.problem, rc.in, DType::bf16);
  }
};

struct Rule {
  const char* name;
  bool th;
  std::function<void(BackwardArgs&, Options&)> mutate;
  StatusCode code;
  const char* says;  // a fragment the sentence must contain
};

void expect_rejected(const Status& s, StatusCode code, const char* says) {
  EXPECT_EQ(s.code, code) << s.message;
  EXPECT_NE(s.message.find(says), std::string::npos) << "message: " << s.message << " | expected: " << says;
  EXPECT_EQ(s.message.rfind("[kvcomp] ", 0), 0u) << s.message;
}

std::int32_t* ints(std::optional<Tensor>& t) { return static_cast<std::int32_t*>(t->data); }

const std::vector<Rule>& backward_rules() {
  static const std::vector<Rule> rules = {
      {"x_null", false, [](auto& a, auto&) { a.x.data = nullptr; }, kNull, "x must not be null"},
      {"wkv_null", false, [](auto& a, auto&) { a.wkv.data = nullptr; }, kNull, "wkv must not be null"},
      {"wgate_null", false, [](auto& a, auto&) { a.wgate.data = nullptr; }, kNull, "wgate must not be null"},
      {"d_cmp_kv_null", false, [](auto& a, auto&) { a.d_cmp_kv.data = nullptr; }, kNull,
       "d_cmp_kv must not be null"},
      {"softmax_null", false, [](auto& a, auto&) { a.softmax_score.data = nullptr; }, kNull,
       "softmax_score must not"},
      {"kv_null", false, [](auto& a, auto&) { a.kv.data = nullptr; }, kNull, "kv must not be null"},
      {"d_x_null", false, [](auto& a, auto&) { a.d_x.data = nullptr; }, kNull, "d_x must not be null"},
      {"d_wkv_null", false, [](auto& a, auto&) { a.d_wkv.data = nullptr; }, kNull, "d_wkv must not be null"},
      {"d_wgate_null", false, [](auto& a, auto&) { a.d_wgate.data = nullptr; }, kNull,
       "d_wgate must not be null"},
      {"d_ape_null", false, [](auto& a, auto&) { a.d_ape.data = nullptr; }, kNull, "d_ape must not be null"},
      {"cu_seqlens_null_data", true, [](auto& a, auto&) { a.cu_seqlens->data = nullptr; }, kNull,
       "cu_seqlens"},
      {"x_rank", false,
       [](auto& a, auto&) {
         a.x.rank = 4;
         a.x.shape[3] = 1;
       },
       kInvalid, "x (rank 4)"},
      {"x_dtype", false, [](auto& a, auto&) { a.x.dtype = DType::i32; }, kInvalid, "x (dtype int32)"},
      {"x_f32_aclnn", false,
       [](auto& a, auto& o) {
         a.x.dtype = DType::f32;
         o.profile = Profile::aclnn;
       },
       kInvalid, "under the aclnn profile"},
      {"wkv_dtype", false, [](auto& a, auto&) { a.wkv.dtype = DType::f16; }, kInvalid, "wkv (dtype fp16)"},
      {"cu_seqlens_for_bsh", false, [](auto& a, auto&) { a.cu_seqlens = a.x; }, kInvalid,
       "cu_seqlens (= given)"},
      {"cu_seqlens_missing_th", true, [](auto& a, auto&) { a.cu_seqlens.reset(); }, kInvalid,
       "cu_seqlens (= absent)"},
      {"cmp_ratio_zero", false, [](auto& a, auto&) { a.cmp_ratio = 0; }, kInvalid, "cmp_ratio (= 0)"},
      {"cmp_ratio_big", false, [](auto& a, auto&) { a.cmp_ratio = 1025; }, kInvalid, "cmp_ratio (= 1025)"},
      {"cmp_ratio_aclnn", false,
       [](auto& a, auto& o) {
         a.cmp_ratio = 129;
         o.profile = Profile::aclnn;
       },
       kInvalid, "[2, 128]"},
      {"coff_3", false, [](auto& a, auto&) { a.coff = 3; }, kInvalid, "coff (= 3) must be 1 or 2"},
      {"wkv_rows_odd", false, [](auto& a, auto&) { a.wkv.shape[0] = 7; }, kShape, "multiple of coff"},
      {"aclnn_D", false, [](auto&, auto& o) { o.profile = Profile::aclnn; }, kInvalid, "must be 128 or 512"},
      {"wgate_shape", false, [](auto& a, auto&) { a.wgate.shape[1] = 15; }, kShape, "wgate (shape [8,15])"},
      {"wkv_cols", false, [](auto& a, auto&) { a.wkv.shape[1] = 17; }, kShape, "wkv (shape [8,17])"},
      {"seqused_len", false, [](auto& a, auto&) { a.seqused->shape[0] = 3; }, kShape, "seqused (shape [3])"},
      {"start_pos_len", false, [](auto& a, auto&) { a.start_pos->shape[0] = 1; }, kShape,
       "start_pos (shape [1])"},
      {"seqused_dtype", false, [](auto& a, auto&) { a.seqused->dtype = DType::f32; }, kInvalid,
       "seqused (dtype fp32)"},
      {"x_empty", false, [](auto& a, auto&) { a.x.shape[1] = 0; }, kShape, "must not be empty"},
      {"d_cmp_kv_rank", false, [](auto& a, auto&) { a.d_cmp_kv.rank = 2; }, kInvalid, "d_cmp_kv (rank 2)"},
      {"d_cmp_kv_rows", false, [](auto& a, auto&) { a.d_cmp_kv.shape[1] = 3; }, kShape,
       "d_cmp_kv (shape [2,3,4])"},
      {"d_cmp_kv_dtype", false, [](auto& a, auto&) { a.d_cmp_kv.dtype = DType::f16; }, kInvalid,
       "d_cmp_kv (dtype"},
      {"softmax_dtype", false, [](auto& a, auto&) { a.softmax_score.dtype = DType::bf16; }, kInvalid,
       "softmax_score (dtype bf16)"},
      {"softmax_block_rows", false, [](auto& a, auto&) { a.softmax_score.shape[2] = 6; }, kShape,
       "softmax_score (shape [2,2,6,4])"},
      {"kv_D", false, [](auto& a, auto&) { a.kv.shape[3] = 5; }, kShape, "kv (shape [2,2,8,5])"},
      {"d_x_shape", false, [](auto& a, auto&) { a.d_x.shape[1] = 7; }, kShape, "d_x (shape [2,7,16])"},
      {"d_x_dtype", false, [](auto& a, auto&) { a.d_x.dtype = DType::f32; }, kInvalid, "d_x (dtype fp32)"},
      {"d_wkv_shape", false, [](auto& a, auto&) { a.d_wkv.shape[0] = 4; }, kShape, "d_wkv (shape [4,16])"},
      {"d_wgate_shape", false, [](auto& a, auto&) { a.d_wgate.shape[1] = 8; }, kShape,
       "d_wgate (shape [8,8])"},
      {"d_ape_shape", false, [](auto& a, auto&) { a.d_ape.shape[0] = 3; }, kShape, "d_ape (shape [3,8])"},
      {"d_ape_dtype", false, [](auto& a, auto&) { a.d_ape.dtype = DType::bf16; }, kInvalid,
       "d_ape (dtype bf16)"},
      {"start_pos_negative", false, [](auto& a, auto&) { ints(a.start_pos)[1] = -1; }, kInvalid,
       "start_pos[1] (= -1) must be >= 0"},
      {"start_pos_overflow", false, [](auto& a, auto&) { ints(a.start_pos)[0] = INT_MAX - 2; }, kInvalid,
       "must fit in int32"},
      {"seqused_negative", false, [](auto& a, auto&) { ints(a.seqused)[0] = -2; }, kInvalid,
       "seqused[0] (= -2)"},
      {"seqused_too_big", false, [](auto& a, auto&) { ints(a.seqused)[1] = 9; }, kInvalid,
       "seqused[1] (= 9) must be in [0, 8]"},
      {"cu_first_nonzero", true, [](auto& a, auto&) { ints(a.cu_seqlens)[0] = 1; }, kInvalid,
       "cu_seqlens[0] (= 1) must be 0"},
      {"cu_last_not_T", true, [](auto& a, auto&) { ints(a.cu_seqlens)[2] -= 1; }, kInvalid,
       "must equal the token count"},
      {"cu_decreasing", true, [](auto& a, auto&) { ints(a.cu_seqlens)[1] = ints(a.cu_seqlens)[2] + 1; },
       kInvalid, "must be >= cu_seqlens[1]"},
      {"th_rows_too_few", true,
       [](auto& a, auto&) {
         a.softmax_score.shape[0] = 0;
         a.kv.shape[0] = 0;
       },
       kShape, "must not be empty"},
  };
  return rules;
}

class BackwardRule : public ::testing::TestWithParam<Rule> {};

TEST_P(BackwardRule, RejectedWithCodeAndSentence) {
  const Rule& rule = GetParam();
  BackwardFixture f(rule.th);
  BackwardArgs args = f.run->args;
  Options o;
  rule.mutate(args, o);
  const auto before = f.run->d_x.half;
  const auto ape_before = f.run->d_ape.f32;
  BackwardPlan plan;
  expect_rejected(plan_backward(args, o, &plan), rule.code, rule.says);
  expect_rejected(compressor_backward(args, o), rule.code, rule.says);
  EXPECT_EQ(f.run->d_x.half, before) << "a rejected call wrote d_x";
  EXPECT_EQ(f.run->d_ape.f32, ape_before) << "a rejected call wrote d_ape";
}

INSTANTIATE_TEST_SUITE_P(Issue2, BackwardRule, ::testing::ValuesIn(backward_rules()),
                         [](const auto& tp) { return std::string(tp.param.name); });

TEST(BackwardRuleTh, FewerRowsThanBlocks) {
  auto o = small(true);
  o.lengths = {8, 8};  // 2 + 2 blocks with start_pos 0
  o.start_pos = {0, 0};
  o.random_seqused = false;
  auto rc = make_random_case(o, 5);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 6);
  BackwardRun run(rc.problem, rc.in, bd, DType::bf16);
  BackwardArgs args = run.args;
  args.kv.shape[0] = 1;
  expect_rejected(compressor_backward(args), kInvalid,
                  "kv rows (= 1) must be >= the number of compressed blocks");
}

struct ForwardRule {
  const char* name;
  bool th;
  int cache_mode;
  std::function<void(ForwardArgs&, Options&)> mutate;
  StatusCode code;
  const char* says;
};

const std::vector<ForwardRule>& forward_rules() {
  static const std::vector<ForwardRule> rules = {
      {"state_cache_null", false, 1, [](auto& a, auto&) { a.state_cache.data = nullptr; }, kNull,
       "state_cache must"},
      {"ape_null", false, 1, [](auto& a, auto&) { a.ape.data = nullptr; }, kNull, "ape must not be null"},
      {"table_absent", false, 1, [](auto& a, auto&) { a.state_block_table.reset(); }, kNull,
       "state_block_table"},
      {"cmp_kv_null", false, 1, [](auto& a, auto&) { a.cmp_kv.data = nullptr; }, kNull,
       "cmp_kv must not be null"},
      {"softmax_null_grad", false, 1, [](auto& a, auto&) { a.softmax_score.data = nullptr; }, kNull,
       "softmax_score"},
      {"cache_mode_3", false, 1, [](auto& a, auto&) { a.cache_mode = 3; }, kInvalid, "cache_mode (= 3)"},
      {"cache_dtype", false, 1, [](auto& a, auto&) { a.state_cache.dtype = DType::bf16; }, kInvalid,
       "state_cache (dtype bf16)"},
      {"cache_last_dim", false, 1, [](auto& a, auto&) { a.state_cache.shape[2] = 8; }, kShape,
       "last dim 2*coff*D"},
      {"ape_shape", false, 1, [](auto& a, auto&) { a.ape.shape[0] = 3; }, kShape, "ape (shape [3,8])"},
      {"ape_dtype", false, 1, [](auto& a, auto&) { a.ape.dtype = DType::bf16; }, kInvalid,
       "ape (dtype bf16)"},
      {"table_rank_paged", false, 1, [](auto& a, auto&) { a.state_block_table->rank = 1; }, kInvalid,
       "state_block_table (rank 1)"},
      {"table_rows", false, 1, [](auto& a, auto&) { a.state_block_table->shape[0] = 1; }, kShape,
       "must have 2 rows"},
      {"table_id_range", false, 1,
       [](auto& a, auto&) {
         auto* t = static_cast<std::int32_t*>(a.state_block_table->data);
         for (std::int64_t i = 0; i < a.state_block_table->numel(); ++i) t[i] = 1000;
       },
       kInvalid, "must be a block id in [0,"},
      {"table_id_negative", false, 1,
       [](auto& a, auto&) {
         auto* t = static_cast<std::int32_t*>(a.state_block_table->data);
         for (std::int64_t i = 0; i < a.state_block_table->numel(); ++i) t[i] = -1;
       },
       kInvalid, "(= -1) must be a block id"},
      {"table_narrow", false, 1, [](auto& a, auto&) { a.state_block_table->shape[1] = 1; }, kInvalid,
       "state_block_table columns (= 1)"},
      {"ring_too_small", false, 2, [](auto& a, auto&) { a.state_cache.shape[1] = 4; }, kInvalid,
       "in ring mode (cache_mode 2)"},
      {"ring_blocks_lt_B", false, 2, [](auto& a, auto&) { a.state_cache.shape[0] = 1; }, kShape,
       "must be >= B"},
      {"ring_table_rank", false, 2,
       [](auto& a, auto&) {
         a.state_block_table->rank = 2;
         a.state_block_table->shape[1] = 1;
       },
       kInvalid, "state_block_table (rank 2)"},
      {"stride0_overflow", false, 1,
       [](auto& a, auto&) { a.state_cache_stride0 = std::numeric_limits<std::int64_t>::max() / 4; }, kInvalid,
       "byte extent within int64"},
      {"stride0_small", false, 1, [](auto& a, auto&) { a.state_cache_stride0 = 5; }, kInvalid,
       "state_cache_stride0 (= 5)"},
      {"aclnn_block_size", false, 1,
       [](auto& a, auto& o) {
         o.profile = Profile::aclnn;
         a.state_cache.shape[1] = 2048;
       },
       kInvalid, "must be 128 or 512"},
      {"cmp_kv_shape", false, 1, [](auto& a, auto&) { a.cmp_kv.shape[2] = 3; }, kShape,
       "cmp_kv (shape [2,2,3])"},
      {"cmp_kv_dtype", false, 1, [](auto& a, auto&) { a.cmp_kv.dtype = DType::f16; }, kInvalid,
       "cmp_kv (dtype"},
      {"kv_rank", false, 1, [](auto& a, auto&) { a.kv.rank = 3; }, kInvalid, "kv (rank 3)"},
      {"th_cu_missing", true, 1, [](auto& a, auto&) { a.cu_seqlens.reset(); }, kInvalid,
       "cu_seqlens (= absent)"},
  };
  return rules;
}

class ForwardRuleTest : public ::testing::TestWithParam<ForwardRule> {};

TEST_P(ForwardRuleTest, RejectedWithCodeAndSentenceAndCacheUntouched) {
  const ForwardRule& rule = GetParam();
  ForwardFixture f(rule.th, rule.cache_mode);
  ForwardArgs args = f.run->args;
  Options o;
  rule.mutate(args, o);
  const auto cache_before = f.run->cache.f32;
  const auto out_before = f.run->cmp_kv.half;
  expect_rejected(compressor_forward(args, o), rule.code, rule.says);
  EXPECT_EQ(f.run->cache.f32, cache_before) << "a rejected call wrote the state cache";
  EXPECT_EQ(f.run->cmp_kv.half, out_before) << "a rejected call wrote cmp_kv";
}

INSTANTIATE_TEST_SUITE_P(Issue2, ForwardRuleTest, ::testing::ValuesIn(forward_rules()),
                         [](const auto& tp) { return std::string(tp.param.name); });

// The forward accepts an empty x (B = S = T = 0) and leaves the cache alone.
TEST(ForwardEmpty, EmptyInputIsAcceptedAndTouchesNothing) {
  ForwardFixture f(false);
  ForwardArgs args = f.run->args;
  args.x.shape[1] = 0;  // S = 0
  args.cmp_kv.shape[1] = 0;
  args.softmax_score.shape[1] = 0;
  args.kv.shape[1] = 0;
  const auto cache_before = f.run->cache.f32;
  const Status s = compressor_forward(args);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(f.run->cache.f32, cache_before);
}

}  // namespace
}  // namespace kvcomp::test
