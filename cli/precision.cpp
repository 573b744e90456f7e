#include "precision.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvcomp/half.hpp"

namespace kvcomp::cli {

namespace {

// Spec 7.2: `err` splits large from small elements and floors the ratio
// denominators; `error` is the tolerance on small elements.
struct Thresholds {
  double err, error;
};

Thresholds thresholds(DType dt) {
  switch (dt) {
    case DType::bf16:
      return {2e-8, 2e-16};
    case DType::f16:
      return {2e-11, 2e-16};
    default:
      return {2e-14, 2e-30};
  }
}

// double -> float rounding toward zero with a sticky last bit ("round to
// odd"): rounding that float once more to bf16/fp16 then equals rounding the
// double directly, which a plain double -> float -> bf16 chain does not.
float to_float_odd(double v) {
  if (!std::isfinite(v)) return static_cast<float>(v);
  if (std::fabs(v) > static_cast<double>(std::numeric_limits<float>::max()))
    return std::copysign(std::numeric_limits<float>::infinity(), static_cast<float>(v));
  float f = static_cast<float>(v);
  if (static_cast<double>(f) == v) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= 1u;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One unit in the last place of dt at the magnitude of v.
double ulp(double v, DType dt) {
  const int frac = dt == DType::bf16 ? 7 : dt == DType::f16 ? 10 : 23;
  const int emin = dt == DType::f16 ? -14 : -126;  // subnormals share the smallest normal's spacing
  const int e = v == 0 ? emin : std::max(std::ilogb(v), emin);
  return std::ldexp(1.0, e - frac);
}

}  // namespace

float round_to(float v, DType dt) {
  switch (dt) {
    case DType::bf16:
      return bf16_to_float(float_to_bf16(v));
    case DType::f16:
      return fp16_to_float(float_to_fp16(v));
    default:
      return v;
  }
}

float round_to(double v, DType dt) {
  if (dt == DType::bf16 || dt == DType::f16) return round_to(to_float_odd(v), dt);
  if (std::isfinite(v) && std::fabs(v) > static_cast<double>(std::numeric_limits<float>::max()))
    return std::copysign(std::numeric_limits<float>::infinity(), static_cast<float>(v));
  return static_cast<float>(v);
}

ThreeWay three_way(std::span<const float> a, std::span<const float> b, std::span<const float> c, DType dt) {
  const Thresholds t = thresholds(dt);
  ThreeWay r;
  r.n = c.size();
  if (a.size() != c.size() || b.size() != c.size()) {
    r.pass = false;
    r.why = "size mismatch";
    return r;
  }
  double sum_a = 0, sum_b = 0, sq_a = 0, sq_b = 0;
  bool nonfinite_a = false;
  r.a_within_ulp = true;
  for (std::size_t i = 0; i < c.size(); ++i) {
    const double cv = c[i], av = a[i], bv = b[i];
    if (!std::isfinite(av) && !(av == cv || (std::isnan(av) && std::isnan(cv)))) nonfinite_a = true;
    if (!(std::fabs(av - cv) <= ulp(cv, dt))) r.a_within_ulp = false;
    if (std::fabs(cv) >= t.err) {
      ++r.n_large;
      const double den = std::max(std::fabs(cv), 1e-7);
      const double ra = std::fabs(av - cv) / den, rb = std::fabs(bv - cv) / den;
      if (std::isfinite(ra)) {
        r.mare_a = std::max(r.mare_a, ra);
        sum_a += ra;
        sq_a += (av - cv) * (av - cv);
      }
      if (std::isfinite(rb)) {
        r.mare_b = std::max(r.mare_b, rb);
        sum_b += rb;
        sq_b += (bv - cv) * (bv - cv);
      }
    } else {
      if (!(std::fabs(av - cv) <= t.error)) ++r.small_bad_a;
      if (!(std::fabs(bv - cv) <= t.error)) ++r.small_bad_b;
    }
  }
  r.b_exact = r.n_large > 0 && r.mare_b == 0;
  if (r.n_large) {
    const auto nl = static_cast<double>(r.n_large);
    r.mere_a = sum_a / nl;
    r.mere_b = sum_b / nl;
    r.rmse_a = std::sqrt(sq_a / nl);
    r.rmse_b = std::sqrt(sq_b / nl);
    if (!(r.mare_a / std::max(r.mare_b, t.err) < 10))
      r.why = "MARE ratio >= 10";
    else if (!(r.mere_a / std::max(r.mere_b, t.err) < 2))
      r.why = "MERE ratio >= 2";
    else if (!(r.rmse_a / std::max(r.rmse_b, t.err) < 2))
      r.why = "RMSE ratio >= 2";
  }
  if (r.why.empty() &&
      !(static_cast<double>(r.small_bad_a) / static_cast<double>(std::max<std::size_t>(r.small_bad_b, 1)) <
        2))
    r.why = "small-value error count ratio >= 2";
  if (r.why.empty() && nonfinite_a) r.why = "NaN/Inf where the truth is finite";
  r.pass = r.why.empty();
  return r;
}

TwoParty two_party(std::span<const float> actual, std::span<const float> expected, DType dt) {
  const double rtol = dt == DType::bf16 ? 0.0078125 : 0.005;
  const double atol = dt == DType::bf16 ? 1e-4 : 2.5e-5;
  TwoParty r;
  r.n = expected.size();
  if (actual.size() != expected.size()) {
    r.pass = false;
    return r;
  }
  bool forced_fail = false;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double a = actual[i], e = expected[i];
    if (std::isnan(a) && std::isnan(e)) continue;
    if (std::isinf(a) && a == e) continue;
    if (!std::isfinite(a)) forced_fail = true;
    if (std::fabs(a - e) <= atol + rtol * std::fabs(e)) continue;
    ++r.n_bad;
    const double rel =
        std::fabs(a - e) / (std::max({std::fabs(a), std::fabs(e), (1.0 / 16384.0) / 0.005}) + 2e-9);
    if (!(rel <= r.max_rel)) r.max_rel = std::isnan(rel) ? std::numeric_limits<double>::infinity() : rel;
  }
  r.pass_rate = r.n ? 1.0 - static_cast<double>(r.n_bad) / static_cast<double>(r.n) : 1.0;
  r.pass = !forced_fail && r.pass_rate >= 0.995 && r.max_rel < 10;
  return r;
}

}  // namespace kvcomp::cli
