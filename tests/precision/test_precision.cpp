// Sanity checks of the precision-criterion support (src/reference/precision.hpp)
// on hand-made vectors, and of the single rounding of a float64 truth to an
// output dtype. The verdicts every implementation of the rules must give are
// in verdict_table.txt (test_verdict_table.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "three_way.hpp"

namespace kvcomp::test {
namespace {

TEST(Support, ThreeWayCriterion) {
  std::vector<double> c = {1.0, -2.0, 0.5, 3.0, 0.0, 0.0};
  std::vector<double> b = {1.001, -2.002, 0.5005, 3.003, 0.0, 0.0};
  EXPECT_TRUE(three_way_compare(b, b, c, DType::bf16).pass);
  std::vector<double> a_bad = {1.01, -2.02, 0.505, 3.03, 0.0, 0.0};  // 10x the error of B everywhere
  const ThreeWayResult bad = three_way_compare(a_bad, b, c, DType::bf16);
  EXPECT_FALSE(bad.pass) << bad.summary();
  EXPECT_NE(bad.summary().find("MERE"), std::string::npos) << bad.summary();
  std::vector<double> a_nan = b;
  a_nan[2] = NAN;
  EXPECT_FALSE(three_way_compare(a_nan, b, c, DType::bf16).pass);
  std::vector<double> c_nan = c, a_both = b;
  c_nan[2] = NAN;
  a_both[2] = NAN;
  EXPECT_TRUE(three_way_compare(a_both, b, c_nan, DType::bf16).pass);
  // Small elements: A misses zeros that B gets right (2 bad vs max(0,1) = 1: ratio 2 fails; 1 would pass).
  std::vector<double> a_small = b;
  a_small[4] = 1e-12;
  EXPECT_TRUE(three_way_compare(a_small, b, c, DType::bf16).pass);
  a_small[5] = -1e-12;
  EXPECT_FALSE(three_way_compare(a_small, b, c, DType::bf16).pass);
  EXPECT_TRUE(three_way_compare(std::vector<double>{}, {}, {}, DType::f32).pass);
  EXPECT_FALSE(three_way_compare(std::vector<double>{1.0}, {1.0, 2.0}, {1.0}, DType::f32).pass);
}

TEST(Support, TwoWayCriterion) {
  std::vector<double> e(1000, 1.0);
  std::vector<double> a = e;
  a[0] = 1.05;  // one point out of 1000 off: 0.1% <= 0.5%
  EXPECT_TRUE(two_way_compare(a, e, DType::bf16).pass);
  EXPECT_FALSE(two_way_compare(a, e, DType::bf16, 0.0).pass);
  a[1] = 50.0;  // relative error 0.98: still < 10
  EXPECT_TRUE(two_way_compare(a, e, DType::f16).pass);
  a[2] = INFINITY;
  const TwoWayResult inf = two_way_compare(a, e, DType::f16);
  EXPECT_FALSE(inf.pass) << inf.summary();
  std::vector<double> a2 = e;
  for (std::size_t i = 0; i < 10; ++i) a2[i] = 1.1;  // 1% failing
  EXPECT_FALSE(two_way_compare(a2, e, DType::f32).pass);
}

TEST(Support, RoundToDtype) {
  EXPECT_EQ(round_to_dtype(1.0 + 1.0 / 512, DType::bf16), 1.0);             // below half an ulp (2^-8)
  EXPECT_EQ(round_to_dtype(1.0 + 3.0 / 256, DType::bf16), 1.0 + 1.0 / 64);  // tie to even
  EXPECT_EQ(round_to_dtype(1.0 + 1.0 / 4096, DType::f16), 1.0);
  EXPECT_EQ(round_to_dtype(65520.0, DType::f16), INFINITY);
}

}  // namespace
}  // namespace kvcomp::test
