// The phase clock (kvcomp::set_phase_timing, phase_times): off by default, the phases of each
// operator in the order a call runs them, their sum within the call's wall time, and no result
// changed by timing a call.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "harness.hpp"

namespace kvcomp::test {
namespace {

// Seconds summed over op's phases, and the timed calls of op.
struct OpTotals {
  double seconds = 0;
  std::int64_t calls = -1;
  int phases = 0;
};
OpTotals totals(const std::string& op) {
  OpTotals t;
  for (const PhaseTime& p : phase_times())
    if (op == p.op) {
      EXPECT_GE(p.seconds, 0.0) << p.op << " " << p.phase;
      t.seconds += p.seconds;
      t.calls = p.calls;
      ++t.phases;
    }
  return t;
}

double wall_seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct PhaseTimingOff {  // every test leaves the clock off and the totals empty
  ~PhaseTimingOff() {
    set_phase_timing(false);
    reset_phase_times();
  }
};

TEST(PhaseClock, ListsEveryPhaseOnceInCallOrder) {
  const std::vector<PhaseTime> all = phase_times();
  std::vector<std::string> fwd, bwd;
  bool backward_seen = false;
  for (const PhaseTime& p : all) {
    ASSERT_NE(p.op, nullptr);
    ASSERT_NE(p.phase, nullptr);
    if (std::string(p.op) == "forward") {
      EXPECT_FALSE(backward_seen) << "the forward's phases come first";
      fwd.push_back(p.phase);
    } else {
      ASSERT_EQ(std::string(p.op), "backward");
      backward_seen = true;
      bwd.push_back(p.phase);
    }
  }
  EXPECT_EQ(fwd, (std::vector<std::string>{"weights", "x rows", "products", "ape", "blocks", "rows"}));
  EXPECT_EQ(bwd, (std::vector<std::string>{"weights", "blocks", "x rows", "d_new", "d_x products",
                                           "d_w products", "outputs"}));
}

TEST(PhaseClock, OffByDefaultAndCountsNothing) {
  const PhaseTimingOff guard;
  reset_phase_times();
  auto rc = make_random_case(chunked_case(), 31);
  round_io_inputs(rc.in, DType::bf16);
  ForwardRun f(rc.problem, rc.in, DType::bf16);
  ASSERT_TRUE(f.run().ok());
  const OpTotals t = totals("forward");
  EXPECT_EQ(t.calls, 0);
  EXPECT_EQ(t.seconds, 0.0);
}

// Timed calls: counted per operator, each operator's phases summing to at most the call's wall time
// and to most of it (the rest is validation, planning and the workspace), the other operator's
// untouched, and the outputs bitwise those of an untimed call.
TEST(PhaseClock, TimesEachCallsPhasesWithinItsWallTime) {
  const PhaseTimingOff guard;
  for (const DType io : {DType::bf16, DType::f16}) {
    auto rc = make_random_case(chunked_case(), 32);
    round_io_inputs(rc.in, io);
    const BackwardData bd = make_backward_data(rc.problem, rc.in, io, 33);
    ForwardRun plain_f(rc.problem, rc.in, io);
    ASSERT_TRUE(plain_f.run().ok());
    BackwardRun plain_b(rc.problem, rc.in, bd, io);
    ASSERT_TRUE(plain_b.run().ok());

    reset_phase_times();
    set_phase_timing(true);
    ForwardRun f(rc.problem, rc.in, io);
    const double f_wall = wall_seconds_of([&] { ASSERT_TRUE(f.run().ok()); });
    const OpTotals after_f = totals("forward");
    EXPECT_EQ(after_f.calls, 1);
    EXPECT_EQ(after_f.phases, 6);
    EXPECT_GT(after_f.seconds, 0.0);
    EXPECT_LE(after_f.seconds, f_wall);
    EXPECT_EQ(totals("backward").calls, 0);
    EXPECT_EQ(totals("backward").seconds, 0.0);

    BackwardRun b(rc.problem, rc.in, bd, io);
    const double b_wall = wall_seconds_of([&] { ASSERT_TRUE(b.run().ok()); });
    const double b_wall2 = wall_seconds_of([&] { ASSERT_TRUE(b.run().ok()); });
    set_phase_timing(false);
    const OpTotals after_b = totals("backward");
    EXPECT_EQ(after_b.calls, 2);
    EXPECT_EQ(after_b.phases, 7);
    EXPECT_GT(after_b.seconds, 0.0);
    EXPECT_LE(after_b.seconds, b_wall + b_wall2);
    EXPECT_EQ(totals("forward").seconds, after_f.seconds) << "a backward adds to the backward's phases only";

    // Off again: another call adds nothing.
    ForwardRun f2(rc.problem, rc.in, io);
    ASSERT_TRUE(f2.run().ok());
    EXPECT_EQ(totals("forward").calls, 1);

    EXPECT_TRUE(bitwise_equal(f.cmp_kv.half, plain_f.cmp_kv.half));
    EXPECT_TRUE(bitwise_equal(f.softmax_score.f32, plain_f.softmax_score.f32));
    EXPECT_TRUE(bitwise_equal(f.kv.f32, plain_f.kv.f32));
    EXPECT_TRUE(bitwise_equal(f.cache.f32, plain_f.cache.f32));
    EXPECT_TRUE(bitwise_equal(b.d_x.half, plain_b.d_x.half));
    EXPECT_TRUE(bitwise_equal(b.d_wkv.half, plain_b.d_wkv.half));
    EXPECT_TRUE(bitwise_equal(b.d_wgate.half, plain_b.d_wgate.half));
    EXPECT_TRUE(bitwise_equal(b.d_ape.f32, plain_b.d_ape.f32));

    reset_phase_times();
    EXPECT_EQ(totals("forward").calls, 0);
    EXPECT_EQ(totals("forward").seconds, 0.0);
    EXPECT_EQ(totals("backward").seconds, 0.0);
  }
}

// The products are timed as products: in a call whose projections dominate (H = 4096: 2 x 2C x H
// flops per token against the block phase's coff x r x D exponentials per block), they outweigh the
// phases whose work does not grow with H (ape, blocks, rows), even where sanitizers slow kvcomp's own
// code (not oneDNN's). The weights and x rows phases grow with H: under KVCOMP_ISA=scalar, converting
// x to fp32 one element at a time took longer than the fp32 products.
TEST(PhaseClock, ProductsOutweighTheBlockPhasesOfAWideForward) {
  const PhaseTimingOff guard;
  RandomOptions o = chunked_case();
  o.H = 4096;
  o.D = 64;
  auto rc = make_random_case(o, 34);
  round_io_inputs(rc.in, DType::bf16);
  // One thread: no OpenMP barrier, whose wait on a loaded machine (ctest -j) would land in some phase.
  Options one;
  one.num_threads = 1;
  ForwardRun f(rc.problem, rc.in, DType::bf16);
  ASSERT_TRUE(f.run(one).ok());  // untimed: primitives made, pages touched
  // The least of three timed calls on each side: a stall (another test's process, ctest -j) only ever
  // adds time, and in one call it could land in any phase (once: ape 4.7 ms against blocks 2.7 ms, in
  // a sanitizer build).
  double products = 1e30, per_block = 1e30;
  std::string all;
  for (int rep = 0; rep < 3; ++rep) {
    reset_phase_times();
    set_phase_timing(true);
    ForwardRun g(rc.problem, rc.in, DType::bf16);
    ASSERT_TRUE(g.run(one).ok());
    set_phase_timing(false);
    double prod = 0, blocks = 0;
    for (const PhaseTime& p : phase_times())
      if (std::string(p.op) == "forward") {
        const std::string name = p.phase;
        all += name + " " + std::to_string(p.seconds) + " s; ";
        if (name == "products") prod = p.seconds;
        if (name == "ape" || name == "blocks" || name == "rows") blocks += p.seconds;
      }
    all += "| ";
    products = std::min(products, prod);
    per_block = std::min(per_block, blocks);
  }
  EXPECT_GT(products, per_block) << all;
}

}  // namespace
}  // namespace kvcomp::test
