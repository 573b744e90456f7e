// The precision criteria for the tests: the shared implementation in
// src/reference/precision.hpp (also used by `kvcomp demo`), under the names
// the tests use.
#pragma once

#include "reference/precision.hpp"

namespace kvcomp::test {

using ref::AccuracyResult;
using ref::fp32_projection_accuracy;
using ref::round_to_dtype;
using ref::three_way_compare;
using ref::three_way_thresholds;
using ref::ThreeWayResult;
using ref::ThreeWayThresholds;
using ref::two_way_compare;
using ref::two_way_thresholds;
using ref::TwoWayResult;
using ref::TwoWayThresholds;

}  // namespace kvcomp::test
