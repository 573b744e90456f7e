// Forward and backward against the float64 oracle, over the sweep of issue #2
// (tests/core/sweep.hpp), on the CPU backend. A failing case prints itself
// (PrintTo) with every field and its seeds.
#include <gtest/gtest.h>

#include "sweep.hpp"

namespace kvcomp::test {
namespace {

Status on_host(ForwardRun& r, const Options& o) { return r.run(o); }
Status on_host(BackwardRun& r, const Options& o) { return r.run(o); }

class Sweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(Sweep, ForwardMatchesOracle) {
  check_forward(GetParam(), [](ForwardRun& r, const Options& o) { return on_host(r, o); });
}

TEST_P(Sweep, BackwardThreeWay) {
  check_backward(GetParam(), [](BackwardRun& r, const Options& o) { return on_host(r, o); });
}

INSTANTIATE_TEST_SUITE_P(Issue2, Sweep, ::testing::ValuesIn(sweep()),
                         [](const auto& tp) { return tp.param.name; });

}  // namespace
}  // namespace kvcomp::test
