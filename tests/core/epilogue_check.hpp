// The model-level epilogue's cases and their checks against the float64 reference, shared by the CPU
// suite (tests/core/test_epilogue.cpp) and the CUDA suites (tests/cuda: the host emulation and the
// GPU): each passes runners that execute the calls on its backend and leave the results in the runs'
// host buffers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "sweep.hpp"

namespace kvcomp::test {

// The epilogue's inputs: norm weight [D] (f32), a RoPE table of `positions` rows and rd / 2 = pairs.
struct EpilogueData {
  Buffer norm_weight, cos, sin, pooled, d_norm_weight;
  std::int64_t pairs = 0, positions = 0;
  bool norm = false;
  ref::Epilogue<double> reference(DType io) const {
    ref::Epilogue<double> e;
    if (norm) e.norm_weight = norm_weight.values();
    e.eps = 1e-6;
    if (pairs > 0) {
      e.cos = cos.values();
      e.sin = sin.values();
      e.pairs = pairs;
    }
    e.round = [io](double v) { return round_to_dtype(v, io); };
    return e;
  }
};

inline EpilogueData make_epilogue(const ref::Problem& p, bool norm, std::int64_t pairs, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> w(0.5, 1.5);
  EpilogueData e;
  e.norm = norm;
  e.pairs = pairs;
  std::vector<double> nw(static_cast<std::size_t>(p.D));
  for (double& v : nw) v = w(rng);
  e.norm_weight = Buffer::of(nw, DType::f32);
  e.positions = 1024;  // past the last block of every case here
  std::vector<double> c(static_cast<std::size_t>(e.positions * std::max<std::int64_t>(pairs, 1))), s = c;
  for (std::int64_t pos = 0; pos < e.positions; ++pos)
    for (std::int64_t i = 0; i < pairs; ++i) {
      const double theta = static_cast<double>(pos) * std::pow(10000.0, -2.0 * static_cast<double>(i) / 16.0);
      c[static_cast<std::size_t>(pos * pairs + i)] = static_cast<float>(std::cos(theta));
      s[static_cast<std::size_t>(pos * pairs + i)] = static_cast<float>(std::sin(theta));
    }
  e.cos = Buffer::of(c, DType::f32);
  e.sin = Buffer::of(s, DType::f32);
  return e;
}

inline void attach(SequenceArgs& a, EpilogueData& e, const ref::Problem& p) {
  if (e.norm) a.epilogue.norm_weight = tensor(e.norm_weight, {p.D});
  if (e.pairs > 0) {
    a.epilogue.rope_cos = tensor(e.cos, {e.positions, e.pairs});
    a.epilogue.rope_sin = tensor(e.sin, {e.positions, e.pairs});
  }
}

inline RandomOptions epilogue_case(bool th, std::int64_t coff = 2) {
  RandomOptions o;
  o.th = th;
  o.B = 3;
  o.S = 37;
  o.H = 24;
  o.D = 40;  // three column slices, and a RoPE part that starts inside one
  o.coff = coff;
  o.r = 4;
  o.max_start_pos = 16;
  o.block_size = 64;
  return o;
}

// The largest distance between a and b in units of the io dtype's spacing at b.
inline double max_ulps(const std::vector<double>& a, const std::vector<double>& b, DType io) {
  const int bits = io == DType::bf16 ? 8 : io == DType::f16 ? 11 : 24;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double m = std::max(std::abs(b[i]), io == DType::f16 ? 6.1e-5 : 1e-30);
    const double ulp = std::ldexp(1.0, std::ilogb(m) - bits + 1);
    worst = std::max(worst, std::abs(a[i] - b[i]) / ulp);
  }
  return worst;
}

inline double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

struct Variant {
  bool norm;
  std::int64_t pairs;
};
inline constexpr Variant kVariants[] = {{true, 0}, {false, 4}, {true, 8}, {true, 20}};  // rd = 40 = D: all

inline Status run_on_cpu(ForwardRun& r, const Options& o) { return r.run(o); }
inline Status run_on_cpu(BackwardRun& r, const Options& o) { return r.run(o); }

// One backward with the epilogue, its inputs from the forward `fwd` runs.
struct EpilogueBackward {
  std::unique_ptr<ForwardRun> fwd;
  EpilogueData e;
  std::unique_ptr<BackwardRun> bwd;
  std::vector<double> d_out;
};

// gate false: a call without wgate (and d_wgate; cmp_ratio 1, coff 1).
inline std::unique_ptr<EpilogueBackward> epilogue_backward(
    const RandomCase<double>& rc, DType io, Variant v, bool with_ape = true,
    const ForwardRunner& fwd = [](ForwardRun& r, const Options& o) { return run_on_cpu(r, o); },
    bool gate = true) {
  const ref::Problem& p = rc.problem;
  auto r = std::make_unique<EpilogueBackward>();
  r->fwd = std::make_unique<ForwardRun>(p, rc.in, io);
  r->e = make_epilogue(p, v.norm, v.pairs, 9);
  attach(r->fwd->args, r->e, p);
  if (!with_ape) r->fwd->args.ape = Tensor{};
  if (!gate) r->fwd->args.wgate = Tensor{};
  r->e.pooled = Buffer::filled(r->fwd->cmp_kv.size(), io, 5.0f);
  r->fwd->args.pooled = compressed_tensor(r->e.pooled, p, false);
  const Status st = fwd(*r->fwd, {});
  EXPECT_TRUE(st.ok()) << st.message;
  BackwardData bd;
  bd.softmax_score = r->fwd->softmax_score.values();
  bd.kv = r->fwd->kv.values();
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<double> dist(-1, 1);
  r->d_out.resize(r->fwd->cmp_kv.size());
  for (double& g : r->d_out) g = round_to_dtype(dist(rng), io);
  bd.d_cmp_kv = r->d_out;
  r->bwd = std::make_unique<BackwardRun>(p, rc.in, bd, io);
  attach(r->bwd->args, r->e, p);
  r->bwd->args.pooled = compressed_tensor(r->e.pooled, p, false);
  r->e.d_norm_weight = Buffer::filled(static_cast<std::size_t>(p.D), DType::f32, 3.0f);
  if (v.norm) r->bwd->args.d_norm_weight = tensor(r->e.d_norm_weight, {p.D});
  if (!with_ape) r->bwd->args.d_ape = Tensor{};
  if (!gate) {
    r->bwd->args.wgate = Tensor{};
    r->bwd->args.d_wgate = Tensor{};
  }
  return r;
}

// One case of the checks below: the io dtype, the layout, coff, the epilogue (none: {false, 0}),
// whether the call has an APE term, and whether it has a gate (without: cmp_ratio 1, coff 1).
struct EpilogueCase {
  DType io = DType::bf16;
  bool th = false;
  std::int64_t coff = 2;
  Variant v{true, 8};
  bool with_ape = true;
  std::uint64_t seed = 3;
  bool gate = true;
};

inline std::string describe(const EpilogueCase& c) {
  return std::string(dtype_name(c.io)) + (c.th ? " TH" : " BSH") + " coff " + std::to_string(c.coff) +
         " norm " + std::to_string(c.v.norm) + " pairs " + std::to_string(c.v.pairs) +
         (c.with_ape ? "" : " no APE") + (c.gate ? "" : " no gate (ratio 1)");
}
inline void PrintTo(const EpilogueCase& c, std::ostream* os) { *os << describe(c) << " seed " << c.seed; }
// The case's name in a parameterized suite.
inline std::string param_name(const EpilogueCase& c) {
  return std::string(dtype_name(c.io)) + (c.th ? "_th" : "_bsh") + "_coff" + std::to_string(c.coff) +
         (c.v.norm ? "_norm" : "") + "_rope" + std::to_string(2 * c.v.pairs) + (c.with_ape ? "" : "_noape") +
         (c.gate ? "" : "_nogate_r1");
}
// The random problem of a case: epilogue_case, at ratio 1 without a gate.
inline RandomOptions case_options(const EpilogueCase& c) {
  RandomOptions o = epilogue_case(c.th, c.coff);
  if (!c.gate) o.r = 1;
  return o;
}

// The forward: the pooled rows (without APE: a zero bias) against the float64 oracle, `pooled` the
// same call without the epilogue bit for bit, and cmp_kv the reference's epilogue (float64 steps, each
// rounded to the io dtype) on those rows, within one rounding in the io dtype.
inline void check_epilogue_forward(const ForwardRunner& run, const EpilogueCase& c) {
  SCOPED_TRACE(describe(c));
  auto rc = make_random_case(case_options(c), c.seed);
  round_io_inputs(rc.in, c.io);
  if (!c.with_ape) std::fill(rc.in.ape.begin(), rc.in.ape.end(), 0.0);
  const ref::Problem& p = rc.problem;
  ForwardRun plain(p, rc.in, c.io), fused(p, rc.in, c.io);
  EpilogueData e = make_epilogue(p, c.v.norm, c.v.pairs, 7);
  attach(fused.args, e, p);
  if (!c.with_ape) fused.args.ape = Tensor{};
  if (!c.gate) plain.args.wgate = fused.args.wgate = Tensor{};
  e.pooled = Buffer::filled(fused.cmp_kv.size(), c.io, 5.0f);
  fused.args.pooled = compressed_tensor(e.pooled, p, false);
  const Status sp = run(plain, {});
  ASSERT_TRUE(sp.ok()) << sp.message;
  const Status st = run(fused, {});
  ASSERT_TRUE(st.ok()) << st.message;
  ref::ForwardInputs<double> copy = rc.in;
  if (!c.gate) copy.wgate.clear();
  const auto fwd = ref::forward<double>(p, copy);
  const double pool_tol = c.io == DType::bf16 ? 1.0 / 128 : c.io == DType::f16 ? 1.0 / 1024 : 1e-5;
  EXPECT_LE(relative_error(plain.cmp_kv.values(), fwd.cmp_kv), pool_tol) << "pooled rows";
  const bool any = c.v.norm || c.v.pairs > 0;
  if (!any) {
    EXPECT_LE(relative_error(fused.cmp_kv.values(), fwd.cmp_kv), pool_tol) << "cmp_kv";
    EXPECT_EQ(fused.cmp_kv.values(), plain.cmp_kv.values()) << "no APE must be the zero bias";
    return;
  }
  EXPECT_EQ(e.pooled.values(), plain.cmp_kv.values());
  std::vector<double> expect = plain.cmp_kv.values();
  ref::epilogue_forward<double>(p, e.reference(c.io), fwd.position, expect);
  const std::vector<double> got = fused.cmp_kv.values();
  // fp32 steps against float64 ones: at most one rounding apart in the io dtype; fp32 io: fp32
  // rotations against float64 ones, which cancel where a pair's two terms do.
  if (c.io == DType::f32) {
    EXPECT_LE(relative_error(got, expect), 1e-6);
  } else {
    EXPECT_LE(max_ulps(got, expect, c.io), 1.0);
    std::size_t same = 0;
    for (std::size_t i = 0; i < got.size(); ++i) same += got[i] == expect[i];
    EXPECT_GE(static_cast<double>(same), 0.97 * static_cast<double>(got.size()));
  }
}

// The backward: its gradients against the float64 oracle, the epilogue's exact backward at the forward's
// pooled rows followed by the pooling's backward.
inline void check_epilogue_backward(const ForwardRunner& fwd_run, const BackwardRunner& bwd_run,
                                    const EpilogueCase& c) {
  SCOPED_TRACE(describe(c));
  auto rc = make_random_case(case_options(c), c.seed + 18);
  round_io_inputs(rc.in, c.io);
  if (!c.with_ape) std::fill(rc.in.ape.begin(), rc.in.ape.end(), 0.0);
  if (!c.gate) rc.in.wgate.clear();  // the oracle's call without a gate (the runs' wgate is left out)
  const ref::Problem& p = rc.problem;
  auto run = epilogue_backward(rc, c.io, c.v, c.with_ape, fwd_run, c.gate);
  const Status st = bwd_run(*run->bwd, {});
  ASSERT_TRUE(st.ok()) << st.message;
  ref::ForwardInputs<double> copy = rc.in;
  const auto fwd = ref::forward<double>(p, copy);
  std::vector<double> d_pooled = run->d_out, d_norm;
  const bool any = c.v.norm || c.v.pairs > 0;
  if (any)
    ref::epilogue_backward<double>(p, run->e.reference(c.io), fwd.position, run->e.pooled.values(), d_pooled,
                                   c.v.norm ? &d_norm : nullptr);
  ref::BackwardInputs<double> bin{
      rc.in.x, rc.in.wkv, rc.in.wgate, d_pooled, run->fwd->softmax_score.values(), run->fwd->kv.values()};
  const auto oracle = ref::backward<double>(p, bin);
  const double tol = c.io == DType::f32 ? 1e-5 : c.io == DType::bf16 ? 1.0 / 64 : 1.0 / 256;
  EXPECT_LE(relative_error(run->bwd->d_x.values(), oracle.d_x), tol) << "d_x";
  EXPECT_LE(relative_error(run->bwd->d_wkv.values(), oracle.d_wkv), tol) << "d_wkv";
  if (c.gate) {
    EXPECT_LE(relative_error(run->bwd->d_wgate.values(), oracle.d_wgate), tol) << "d_wgate";
  } else {
    EXPECT_EQ(run->bwd->d_wgate.values(), std::vector<double>(run->bwd->d_wgate.size(), 3.0))
        << "no gate: d_wgate's buffer is not written";
  }
  if (c.with_ape) {
    EXPECT_LE(relative_error(run->bwd->d_ape.values(), oracle.d_ape), 1e-5) << "d_ape";
  } else {
    EXPECT_EQ(run->bwd->d_ape.values(), std::vector<double>(run->bwd->d_ape.size(), 3.0))
        << "d_ape left out: its buffer is not written";
  }
  if (c.v.norm) {
    EXPECT_LE(relative_error(run->e.d_norm_weight.values(), d_norm), 1e-6) << "d_norm_weight";
  }
}

// The cases of the CUDA suites: every epilogue (and none) with and without APE, every io dtype, both
// layouts, coff 1 and 2; start_pos drawn from [0, 16] per batch.
inline std::vector<EpilogueCase> epilogue_cases() {
  std::vector<EpilogueCase> v;
  std::uint64_t seed = 3;
  for (DType io : {DType::bf16, DType::f16, DType::f32})
    for (bool th : {false, true})
      for (std::int64_t coff : {1, 2}) {
        for (const Variant var : kVariants) v.push_back({io, th, coff, var, true, seed++});
        v.push_back({io, th, coff, {true, 8}, false, seed++});   // the model without APE (V4.1)
        v.push_back({io, th, coff, {false, 0}, false, seed++});  // no APE, no epilogue
      }
  // DeepSeek-V4.1's ratio 1: no gate (cmp_ratio 1, coff 1), with the norm; and with APE and RoPE too.
  for (DType io : {DType::bf16, DType::f16, DType::f32})
    for (bool th : {false, true}) {
      v.push_back({io, th, 1, {true, 0}, false, seed++, false});
      v.push_back({io, th, 1, {true, 8}, true, seed++, false});
    }
  return v;
}

}  // namespace kvcomp::test
