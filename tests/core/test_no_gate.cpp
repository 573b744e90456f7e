// Calls without a gate projection (DeepSeek-V4.1's ratio 1: wgate and d_wgate left out, cmp_ratio 1,
// coff 1): against the float64 oracle without one, forward and backward, with and without APE; the
// bits across thread counts over several chunks; the rules. With the epilogue: epilogue_cases()'s
// no-gate cases (test_epilogue.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "epilogue_check.hpp"
#include "harness.hpp"

namespace kvcomp::test {
namespace {

RandomOptions no_gate_case(bool th) {
  RandomOptions o = epilogue_case(th, 1);
  o.r = 1;
  return o;
}

// Tolerance of an output of the io dtype against the float64 value: its rounding, and the fp32 sums
// before it.
double io_tolerance(DType io) { return io == DType::bf16 ? 1.0 / 128 : io == DType::f16 ? 1.0 / 1024 : 1e-5; }

TEST(NoGate, MatchesTheFloat64OracleForwardAndBackward) {
  for (DType io : {DType::bf16, DType::f16, DType::f32})
    for (bool th : {false, true})
      for (bool with_ape : {false, true}) {
        auto rc = make_random_case(no_gate_case(th), 51 + (th ? 1 : 0) + (with_ape ? 2 : 0));
        round_io_inputs(rc.in, io);
        const ref::Problem& p = rc.problem;
        ForwardRun f(p, rc.in, io);
        f.args.wgate = Tensor{};
        if (!with_ape) f.args.ape = Tensor{};
        const Status st = f.run();
        ASSERT_TRUE(st.ok()) << st.message;
        ref::ForwardInputs<double> in = rc.in;  // the oracle without a gate (and without APE)
        in.wgate.clear();
        if (!with_ape) in.ape.clear();
        ref::ForwardInputs<double> copy = in;
        const auto oracle = ref::forward<double>(p, copy);
        // A block of one token: its weight is exactly 1, so the pooled row is the projection row.
        EXPECT_EQ(f.softmax_score.values(), oracle.softmax_score) << dtype_name(io);
        if (io == DType::f32) {
          EXPECT_LE(relative_error(f.cmp_kv.values(), oracle.cmp_kv), 1e-6);
        } else {
          // The fp32 sum rounded to the io dtype against the float64 one: one step apart at most.
          EXPECT_LE(max_ulps(f.cmp_kv.values(), round_all(oracle.cmp_kv, io), io), 1.0) << dtype_name(io);
        }
        // The state cache holds the scores the call meant: 0 (+ ape), and the kv rows.
        EXPECT_LE(relative_error(f.cache.values(), copy.cache.data), 1e-6) << dtype_name(io);

        const BackwardData bd = make_backward_data(p, in, io, 7);
        BackwardRun b(p, rc.in, bd, io);
        b.args.wgate = Tensor{};
        b.args.d_wgate = Tensor{};
        if (!with_ape) b.args.d_ape = Tensor{};
        const std::vector<double> d_wgate_before = b.d_wgate.values();
        const Status sb = b.run();
        ASSERT_TRUE(sb.ok()) << sb.message;
        const ref::BackwardInputs<double> bin{in.x, in.wkv, {}, bd.d_cmp_kv, bd.softmax_score, bd.kv};
        const auto go = ref::backward<double>(p, bin);
        EXPECT_TRUE(go.d_wgate.empty());
        const double tol = io_tolerance(io);
        EXPECT_LE(relative_error(b.d_x.values(), go.d_x), tol) << "d_x " << dtype_name(io);
        EXPECT_LE(relative_error(b.d_wkv.values(), go.d_wkv), tol) << "d_wkv " << dtype_name(io);
        EXPECT_EQ(b.d_wgate.values(), d_wgate_before) << "no d_wgate is written";
        if (with_ape) {
          const std::vector<double> d_ape = b.d_ape.values();
          EXPECT_TRUE(std::all_of(d_ape.begin(), d_ape.end(), [](double v) { return v == 0.0; }))
              << "one token's softmax has no gradient";
        }
      }
}

TEST(NoGate, BitwiseAcrossThreadCountsOverSeveralChunks) {
  RandomOptions o = no_gate_case(true);
  o.B = 2;
  o.S = 2600;  // two sequences of up to 2600 tokens: more than one chunk of rows
  o.H = 64;
  o.D = 48;
  o.block_size = 4096;
  auto rc = make_random_case(o, 71);
  round_io_inputs(rc.in, DType::bf16);
  const ref::Problem& p = rc.problem;
  ref::ForwardInputs<double> in = rc.in;
  in.wgate.clear();
  const BackwardData bd = make_backward_data(p, in, DType::bf16, 9);
  std::vector<double> cmp, dx, dwkv;
  for (int threads : {1, 2, 3}) {
    Options opt;
    opt.num_threads = threads;
    ForwardRun f(p, rc.in, DType::bf16);
    f.args.wgate = Tensor{};
    ASSERT_TRUE(f.run(opt).ok());
    BackwardRun b(p, rc.in, bd, DType::bf16);
    b.args.wgate = Tensor{};
    b.args.d_wgate = Tensor{};
    ASSERT_TRUE(b.run(opt).ok());
    if (threads == 1) {
      cmp = f.cmp_kv.values();
      dx = b.d_x.values();
      dwkv = b.d_wkv.values();
      continue;
    }
    EXPECT_EQ(f.cmp_kv.values(), cmp) << threads << " threads";
    EXPECT_EQ(b.d_x.values(), dx) << threads << " threads";
    EXPECT_EQ(b.d_wkv.values(), dwkv) << threads << " threads";
  }
}

TEST(NoGate, RulesOfLeavingItOut) {
  const auto forward_status = [](std::int64_t r, std::int64_t coff, const Options& o) {
    RandomOptions opts = epilogue_case(false, coff);
    opts.r = r;
    auto rc = make_random_case(opts, 81);
    ForwardRun f(rc.problem, rc.in, DType::bf16);
    f.args.wgate = Tensor{};
    const std::vector<double> before = f.cmp_kv.values();
    const Status s = f.run(o);
    if (!s.ok()) {
      EXPECT_EQ(f.cmp_kv.values(), before) << "a refused call writes nothing";
    }
    return s;
  };
  EXPECT_TRUE(forward_status(1, 1, {}).ok());
  const Status ratio4 = forward_status(4, 2, {});
  EXPECT_EQ(ratio4.code, StatusCode::invalid_param);
  EXPECT_NE(ratio4.message.find("cmp_ratio = 1 and coff = 1"), std::string::npos) << ratio4.message;
  EXPECT_EQ(forward_status(1, 2, {}).code, StatusCode::invalid_param);
  EXPECT_EQ(forward_status(2, 1, {}).code, StatusCode::invalid_param);
  Options aclnn;  // the NPU's operator requires wgate
  aclnn.profile = Profile::aclnn;
  EXPECT_EQ(forward_status(1, 1, aclnn).code, StatusCode::null_pointer);

  // The backward: d_wgate is left out exactly where wgate is.
  auto rc = make_random_case(no_gate_case(false), 83);
  round_io_inputs(rc.in, DType::bf16);
  ref::ForwardInputs<double> in = rc.in;
  in.wgate.clear();
  const BackwardData bd = make_backward_data(rc.problem, in, DType::bf16, 3);
  BackwardRun b(rc.problem, rc.in, bd, DType::bf16);
  b.args.wgate = Tensor{};
  const Status given = b.run();
  EXPECT_EQ(given.code, StatusCode::invalid_param);
  EXPECT_NE(given.message.find("d_wgate"), std::string::npos) << given.message;
  BackwardRun g(rc.problem, rc.in, bd, DType::bf16);
  g.args.d_wgate = Tensor{};  // wgate given, d_wgate not
  EXPECT_EQ(g.run().code, StatusCode::null_pointer);
}

}  // namespace
}  // namespace kvcomp::test
