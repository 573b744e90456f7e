// The model-level epilogue (RMSNorm + RoPE after the pooling; kvcomp.hpp's Epilogue) and the calls
// without APE: the forward against the float64 reference's epilogue in the model's arithmetic, the
// backward against the float64 oracle, the bits across thread counts, the rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "epilogue_check.hpp"
#include "harness.hpp"

namespace kvcomp::test {
namespace {

TEST(Epilogue, ForwardIsTheModelsArithmeticOnThePooledRows) {
  for (DType io : {DType::bf16, DType::f16, DType::f32})
    for (bool th : {false, true})
      for (const Variant v : kVariants) {
        auto rc = make_random_case(epilogue_case(th), 3 + static_cast<std::uint64_t>(v.pairs));
        round_io_inputs(rc.in, io);
        const ref::Problem& p = rc.problem;
        ForwardRun plain(p, rc.in, io), fused(p, rc.in, io);
        EpilogueData e = make_epilogue(p, v.norm, v.pairs, 7);
        attach(fused.args, e, p);
        e.pooled = Buffer::filled(fused.cmp_kv.size(), io, 5.0f);
        fused.args.pooled = compressed_tensor(e.pooled, p, false);
        ASSERT_TRUE(plain.run().ok());
        const Status st = fused.run();
        ASSERT_TRUE(st.ok()) << st.message;
        // `pooled` is the call without the epilogue, bit for bit.
        EXPECT_EQ(e.pooled.values(), plain.cmp_kv.values());
        // cmp_kv: the reference's epilogue (float64 steps, each rounded to the io dtype) on those rows.
        ref::ForwardInputs<double> copy = rc.in;
        const auto fwd = ref::forward<double>(p, copy);
        std::vector<double> expect = plain.cmp_kv.values();
        ref::epilogue_forward<double>(p, e.reference(io), fwd.position, expect);
        const std::vector<double> got = fused.cmp_kv.values();
        // fp32 steps against float64 ones: at most one rounding apart in the io dtype (fp32: a few ulps).
        // fp32 io: fp32 rotations against float64 ones, which cancel where a pair's two terms do.
        if (io == DType::f32) {
          EXPECT_LE(relative_error(got, expect), 1e-6)
              << (th ? "TH" : "BSH") << " norm " << v.norm << " pairs " << v.pairs;
        } else {
          EXPECT_LE(max_ulps(got, expect, io), 1.0)
              << dtype_name(io) << (th ? " TH" : " BSH") << " norm " << v.norm << " pairs " << v.pairs;
        }
        std::size_t same = 0;
        for (std::size_t i = 0; i < got.size(); ++i) same += got[i] == expect[i];
        if (io != DType::f32) {
          EXPECT_GE(static_cast<double>(same), 0.97 * static_cast<double>(got.size()));
        }
      }
}

TEST(Epilogue, BackwardMatchesTheFloat64Oracle) {
  for (DType io : {DType::bf16, DType::f32})
    for (bool th : {false, true})
      for (const Variant v : kVariants) {
        auto rc = make_random_case(epilogue_case(th), 21 + static_cast<std::uint64_t>(v.pairs));
        round_io_inputs(rc.in, io);
        const ref::Problem& p = rc.problem;
        auto run = epilogue_backward(rc, io, v);
        const Status st = run->bwd->run();
        ASSERT_TRUE(st.ok()) << st.message;
        // The oracle: the epilogue's exact backward at kvcomp's pooled rows, then the pooling's backward.
        ref::ForwardInputs<double> copy = rc.in;
        const auto fwd = ref::forward<double>(p, copy);
        std::vector<double> d_pooled = run->d_out, d_norm;
        ref::epilogue_backward<double>(p, run->e.reference(io), fwd.position, run->e.pooled.values(),
                                       d_pooled, v.norm ? &d_norm : nullptr);
        ref::BackwardInputs<double> bin{rc.in.x,
                                        rc.in.wkv,
                                        rc.in.wgate,
                                        d_pooled,
                                        run->fwd->softmax_score.values(),
                                        run->fwd->kv.values()};
        const auto oracle = ref::backward<double>(p, bin);
        const double tol = io == DType::bf16 ? 1.0 / 64 : 1e-5;
        EXPECT_LE(relative_error(run->bwd->d_x.values(), oracle.d_x), tol) << "d_x";
        EXPECT_LE(relative_error(run->bwd->d_wkv.values(), oracle.d_wkv), tol) << "d_wkv";
        EXPECT_LE(relative_error(run->bwd->d_wgate.values(), oracle.d_wgate), tol) << "d_wgate";
        EXPECT_LE(relative_error(run->bwd->d_ape.values(), oracle.d_ape), 1e-5) << "d_ape";
        if (v.norm) {
          EXPECT_LE(relative_error(run->e.d_norm_weight.values(), d_norm), 1e-6) << "d_norm_weight";
        }
      }
}

TEST(Epilogue, BitwiseAcrossThreadCounts) {
  auto rc = make_random_case(chunked_case(), 5);
  round_io_inputs(rc.in, DType::bf16);
  std::vector<double> dx, dnorm, cmp;
  for (int threads : {1, 2, 3, 7}) {
    auto run = epilogue_backward(rc, DType::bf16, {true, 8});
    Options o;
    o.num_threads = threads;
    ASSERT_TRUE(run->bwd->run(o).ok());
    if (threads == 1) {
      dx = run->bwd->d_x.values();
      dnorm = run->e.d_norm_weight.values();
      cmp = run->fwd->cmp_kv.values();
      continue;
    }
    ForwardRun again(rc.problem, rc.in, DType::bf16);
    attach(again.args, run->e, rc.problem);
    Buffer pooled = Buffer::filled(again.cmp_kv.size(), DType::bf16, 0.0f);
    again.args.pooled = compressed_tensor(pooled, rc.problem, false);
    ASSERT_TRUE(again.run(o).ok());
    EXPECT_EQ(again.cmp_kv.values(), cmp) << threads << " threads";
    EXPECT_EQ(run->bwd->d_x.values(), dx) << threads << " threads";
    EXPECT_EQ(run->e.d_norm_weight.values(), dnorm) << threads << " threads";
  }
}

TEST(NoApe, IsTheZeroBiasAndLeavesDApeOut) {
  for (bool th : {false, true}) {
    auto rc = make_random_case(epilogue_case(th), 31);
    round_io_inputs(rc.in, DType::bf16);
    const ref::Problem& p = rc.problem;
    std::fill(rc.in.ape.begin(), rc.in.ape.end(), 0.0);
    ForwardRun zero(p, rc.in, DType::bf16), none(p, rc.in, DType::bf16);
    none.args.ape = Tensor{};
    ASSERT_TRUE(zero.run().ok());
    const Status st = none.run();
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_EQ(none.cmp_kv.values(), zero.cmp_kv.values());
    EXPECT_EQ(none.cache.values(), zero.cache.values());
    BackwardData bd;
    bd.softmax_score = zero.softmax_score.values();
    bd.kv = zero.kv.values();
    bd.d_cmp_kv = zero.cmp_kv.values();
    BackwardRun with(p, rc.in, bd, DType::bf16), without(p, rc.in, bd, DType::bf16);
    without.args.d_ape = Tensor{};
    ASSERT_TRUE(with.run().ok());
    ASSERT_TRUE(without.run().ok());
    EXPECT_EQ(without.d_x.values(), with.d_x.values());
    EXPECT_EQ(without.d_wgate.values(), with.d_wgate.values());
    // The NPU's profile requires both.
    Options aclnn;
    aclnn.profile = Profile::aclnn;
    EXPECT_EQ(none.run(aclnn).code, StatusCode::null_pointer);
  }
}

TEST(Epilogue, RulesOfItsArguments) {
  auto rc = make_random_case(epilogue_case(false), 41);
  const ref::Problem& p = rc.problem;
  const auto forward_status = [&](auto change) {
    ForwardRun f(p, rc.in, DType::bf16);
    EpilogueData e = make_epilogue(p, true, 8, 1);
    attach(f.args, e, p);
    e.pooled = Buffer::filled(f.cmp_kv.size(), DType::bf16, 0.0f);
    f.args.pooled = compressed_tensor(e.pooled, p, false);
    Options o;
    change(f.args, e, o);
    const std::vector<double> before = f.cmp_kv.values();
    const Status s = f.run(o);
    if (!s.ok()) {
      EXPECT_EQ(f.cmp_kv.values(), before) << "a refused call writes nothing";
    }
    return s;
  };
  using A = ForwardArgs;
  EXPECT_TRUE(forward_status([](A&, EpilogueData&, Options&) {}).ok());
  const Status short_table = forward_status([&](A& a, EpilogueData& e, Options&) {
    a.epilogue.rope_cos = tensor(e.cos, {4, e.pairs});
    a.epilogue.rope_sin = tensor(e.sin, {4, e.pairs});
  });
  EXPECT_EQ(short_table.code, StatusCode::invalid_param);
  EXPECT_NE(short_table.message.find("must cover position"), std::string::npos) << short_table.message;
  EXPECT_EQ(forward_status([&](A& a, EpilogueData& e, Options&) {
              a.epilogue.rope_cos = tensor(e.cos, {1, p.D});  // rd = 2 D
              a.epilogue.rope_sin = tensor(e.sin, {1, p.D});
            }).code,
            StatusCode::shape_error);
  EXPECT_EQ(forward_status([](A& a, EpilogueData&, Options&) { a.epilogue.rope_sin.reset(); }).code,
            StatusCode::null_pointer);
  EXPECT_EQ(forward_status([](A& a, EpilogueData&, Options&) { a.epilogue.norm_eps = 0.0f; }).code,
            StatusCode::invalid_param);
  EXPECT_EQ(forward_status([](A& a, EpilogueData&, Options&) { a.epilogue.norm_eps = NAN; }).code,
            StatusCode::invalid_param);
  EXPECT_EQ(forward_status([&](A& a, EpilogueData& e, Options&) {
              a.epilogue.norm_weight = tensor(e.norm_weight, {p.D - 1});
            }).code,
            StatusCode::shape_error);
  EXPECT_EQ(forward_status([&](A& a, EpilogueData& e, Options&) {
              a.epilogue.norm_weight = Tensor(e.norm_weight.data(), DType::f16, {p.D});
            }).code,
            StatusCode::invalid_param);
  EXPECT_EQ(forward_status([](A& a, EpilogueData&, Options&) { a.pooled = Tensor{}; }).code,
            StatusCode::null_pointer);
  EXPECT_EQ(forward_status([](A& a, EpilogueData&, Options& o) {
              a.pooled = Tensor{};
              a.grad_enabled = false;
              (void)o;
            }).code,
            StatusCode::ok);
  EXPECT_EQ(forward_status([](A&, EpilogueData&, Options& o) { o.profile = Profile::aclnn; }).code,
            StatusCode::invalid_param);
  // The backward: d_norm_weight and pooled are required with the epilogue.
  auto rc2 = make_random_case(epilogue_case(true), 43);
  auto run = epilogue_backward(rc2, DType::bf16, {true, 4});
  run->bwd->args.d_norm_weight = Tensor{};
  EXPECT_EQ(run->bwd->run().code, StatusCode::null_pointer);
  run = epilogue_backward(rc2, DType::bf16, {true, 4});
  run->bwd->args.pooled = Tensor{};
  EXPECT_EQ(run->bwd->run().code, StatusCode::null_pointer);
}

// The cases of the CUDA suites (epilogue_cases: every epilogue, with and without APE, every io dtype,
// both layouts, coff 1 and 2, ratio 1 without a gate) on the CPU backend.
class CpuEpilogue : public ::testing::TestWithParam<EpilogueCase> {};

TEST_P(CpuEpilogue, ForwardMatchesTheReference) {
  check_epilogue_forward([](ForwardRun& r, const Options& o) { return run_on_cpu(r, o); }, GetParam());
}

TEST_P(CpuEpilogue, BackwardMatchesTheOracle) {
  check_epilogue_backward([](ForwardRun& r, const Options& o) { return run_on_cpu(r, o); },
                          [](BackwardRun& r, const Options& o) { return run_on_cpu(r, o); }, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Epilogue, CpuEpilogue, ::testing::ValuesIn(epilogue_cases()),
                         [](const auto& tp) { return param_name(tp.param); });

}  // namespace
}  // namespace kvcomp::test
