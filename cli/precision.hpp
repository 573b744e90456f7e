// The precision figures `kvcomp demo` prints: the three-party check of spec
// 7.2 (A = kvcomp, B = the fp32 "same" golden, C = the float64 truth rounded
// to the output dtype) and the two-party check of spec 7.1 used for the state
// cache.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::cli {

struct ThreeWay {
  std::size_t n = 0, n_large = 0;
  double mare_a = 0, mare_b = 0;  // max relative error over large elements
  double mere_a = 0, mere_b = 0;  // mean relative error
  double rmse_a = 0, rmse_b = 0;
  std::size_t small_bad_a = 0, small_bad_b = 0;
  bool pass = true;  // the spec 7.2 rule, as upstream applies it
  std::string why;   // the first failed condition
  // When B equals C on every large element the ratio rule compares against
  // the floor `err` and fails A for a single last-place flip, which then says
  // nothing about A. These two let the caller see that case.
  bool b_exact = false;       // B == C on every large element
  bool a_within_ulp = false;  // |A - C| <= one unit in the last place of dt, everywhere
};

// All three spans have the same length; dt is the dtype of the output.
ThreeWay three_way(std::span<const float> a, std::span<const float> b, std::span<const float> c, DType dt);

struct TwoParty {
  std::size_t n = 0, n_bad = 0;
  double pass_rate = 1;
  double max_rel = 0;  // of the failing points, spec 7.1 definition
  bool pass = true;
};

// `dt` selects the rtol/atol pair of spec 7.1.
TwoParty two_party(std::span<const float> actual, std::span<const float> expected, DType dt);

// v rounded once to dt (nearest, ties to even), returned as float.
float round_to(double v, DType dt);
float round_to(float v, DType dt);

}  // namespace kvcomp::cli
