// Tests of the plain reference (src/reference):
//  * its backward is the exact derivative of its forward (central differences
//    in float64) over layouts, coff, cmp_ratio, start_pos, seqused, cache modes;
//  * hand-derived facts of the spec worked example 2.8 (valid rows, cache
//    slots written / skipped / untouched, zero gradient rows, d_ape routing);
//  * forward invariants (softmax columns, cmp_kv = sum S*K, placeholders).
// The precision criteria are tested in tests/precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "random_problem.hpp"
#include "reference/reference.hpp"

namespace kvcomp::test {
namespace {

using ref::BackwardInputs;
using ref::BackwardOutputs;
using ref::ForwardInputs;
using ref::ForwardOutputs;
using ref::Problem;
using i64 = std::int64_t;

std::size_t u(i64 v) { return static_cast<std::size_t>(v); }

// loss = sum over valid rows of cmp_kv * G. The cache is copied so every
// evaluation starts from the same state.
double loss(const Problem& p, const ForwardInputs<double>& in, const std::vector<double>& G) {
  ForwardInputs<double> copy = in;
  const ForwardOutputs<double> f = ref::forward(p, copy);
  double l = 0;
  for (i64 row = 0; row < p.out_rows(); ++row) {
    if (!f.valid[u(row)]) continue;
    for (i64 d = 0; d < p.D; ++d) l += f.cmp_kv[u(row * p.D + d)] * G[u(row * p.D + d)];
  }
  return l;
}

struct Grads {
  BackwardOutputs<double> g;
  ForwardOutputs<double> f;
};

// Analytic gradient of loss(): backward fed with G everywhere, including the
// padding rows, which the backward must ignore.
Grads analytic(const Problem& p, const ForwardInputs<double>& in, const std::vector<double>& G) {
  ForwardInputs<double> copy = in;
  Grads r;
  r.f = ref::forward(p, copy);
  BackwardInputs<double> bi;
  bi.x = in.x;
  bi.wkv = in.wkv;
  bi.wgate = in.wgate;
  bi.d_cmp_kv = G;
  bi.softmax_score = r.f.softmax_score;
  bi.kv = r.f.kv;
  r.g = ref::backward(p, bi);
  return r;
}

bool any_valid(const ForwardOutputs<double>& f) {
  return std::any_of(f.valid.begin(), f.valid.end(), [](std::uint8_t v) { return v != 0; });
}

constexpr double kStep = 1e-6;
constexpr double kRelTol = 1e-6;

// Compares one parameter tensor's analytic gradient with central differences
// on a random subset of its entries (all of them when small).
void check_tensor(const char* name, const Problem& p, ForwardInputs<double>& in, std::vector<double>& param,
                  const std::vector<double>& grad, const std::vector<double>& G, std::mt19937_64& rng) {
  ASSERT_EQ(param.size(), grad.size()) << name;
  double scale = 1e-3;
  for (double g : grad) scale = std::max(scale, std::fabs(g));
  std::vector<std::size_t> idx(param.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  constexpr std::size_t kMaxChecked = 160;
  if (idx.size() > kMaxChecked) {
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(kMaxChecked);
  }
  for (std::size_t i : idx) {
    const double saved = param[i];
    param[i] = saved + kStep;
    const double lp = loss(p, in, G);
    param[i] = saved - kStep;
    const double lm = loss(p, in, G);
    param[i] = saved;
    const double fd = (lp - lm) / (2 * kStep);
    if (fd == 0.0) {
      // The loss does not depend on this entry at all: the gradient must be an exact zero
      // (dropped cache rows, tail tokens, tokens beyond seqused, unused d_ape slots).
      EXPECT_EQ(grad[i], 0.0) << name << "[" << i << "]";
    } else {
      EXPECT_NEAR(grad[i], fd, kRelTol * (std::fabs(fd) + scale)) << name << "[" << i << "]";
    }
  }
}

void check_gradients(const Problem& p, ForwardInputs<double> in, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> G(u(p.out_rows() * p.D));
  for (double& g : G) g = dist(rng);
  const Grads an = analytic(p, in, G);

  check_tensor("d_x", p, in, in.x, an.g.d_x, G, rng);
  check_tensor("d_wkv", p, in, in.wkv, an.g.d_wkv, G, rng);
  check_tensor("d_wgate", p, in, in.wgate, an.g.d_wgate, G, rng);
  check_tensor("d_ape", p, in, in.ape, an.g.d_ape, G, rng);

  // Directional derivatives along random directions of all parameters at once.
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::vector<double>> dir;
    double predicted = 0, mag = 0;
    std::vector<double>* params[] = {&in.x, &in.wkv, &in.wgate, &in.ape};
    const std::vector<double>* grads[] = {&an.g.d_x, &an.g.d_wkv, &an.g.d_wgate, &an.g.d_ape};
    for (int t = 0; t < 4; ++t) {
      std::vector<double> v(params[t]->size());
      for (std::size_t i = 0; i < v.size(); ++i) {
        v[i] = dist(rng);
        predicted += v[i] * (*grads[t])[i];
        mag += std::fabs(v[i] * (*grads[t])[i]);
      }
      dir.push_back(std::move(v));
    }
    auto shifted = [&](double h) {
      ForwardInputs<double> moved = in;
      std::vector<double>* mp[] = {&moved.x, &moved.wkv, &moved.wgate, &moved.ape};
      for (int t = 0; t < 4; ++t)
        for (std::size_t i = 0; i < mp[t]->size(); ++i) (*mp[t])[i] += h * dir[u(t)][i];
      return loss(p, moved, G);
    };
    const double fd = (shifted(kStep) - shifted(-kStep)) / (2 * kStep);
    EXPECT_NEAR(predicted, fd, kRelTol * (std::fabs(fd) + mag + 1e-3)) << "direction " << rep;
  }

  // Without any block every gradient is an exact zero (spec 2.7).
  if (!any_valid(an.f)) {
    for (const std::vector<double>* g : {&an.g.d_x, &an.g.d_wkv, &an.g.d_wgate, &an.g.d_ape})
      for (double v : *g) ASSERT_EQ(v, 0.0);
  }
}

// ---------------------------------------------------------------------------
// Finite-difference matrix.

struct GradCase {
  std::string name;
  RandomOptions opt;
  std::uint64_t seed = 1;
};

std::vector<GradCase> grad_cases() {
  std::vector<GradCase> cases;
  std::uint64_t seed = 1000;
  for (bool th : {false, true}) {
    for (i64 coff : {1, 2}) {
      for (i64 r : {1, 2, 3, 4, 5}) {
        for (int mode : {1, 2}) {
          GradCase c;
          RandomOptions& o = c.opt;
          o.th = th;
          o.coff = coff;
          o.r = r;
          o.cache_mode = mode;
          o.H = 8 + r;
          o.D = 2 + (r % 3);
          o.block_size = 3;
          const auto rr = static_cast<std::int32_t>(r);
          // Batch 0 aligned at 0, batch 1 unaligned (5), batch 2 beyond 2r and unaligned for r > 1.
          o.start_pos = {0, 5, 2 * rr + 3};
          if (th) {
            o.B = 4;
            o.start_pos.push_back(1);
            o.lengths = {7, 0, 9, 4};  // an empty segment in the middle
            o.seqused = {7, 0, static_cast<std::int32_t>(3 + r), 2};
          } else {
            o.B = 3;
            o.S = 9;
            // Batch 2 has seqused 0 in mode 2 (nothing compressed or cached for it).
            o.seqused = {9, static_cast<std::int32_t>(4 + r),
                         mode == 1 ? static_cast<std::int32_t>(r + 3) : 0};
          }
          c.seed = seed++;
          c.name = std::string(th ? "th" : "bsh") + "_coff" + std::to_string(coff) + "_r" +
                   std::to_string(r) + "_mode" + std::to_string(mode);
          cases.push_back(c);
        }
      }
    }
  }
  // Fully random draws (random start_pos, random partial seqused, random TH lengths incl. empty).
  for (int i = 0; i < 8; ++i) {
    GradCase c;
    c.opt.th = (i % 2) == 1;
    c.opt.coff = 1 + (i / 2) % 2;
    c.opt.r = 2 + i % 4;
    c.opt.cache_mode = 1 + (i / 4) % 2;
    c.opt.B = 3;
    c.opt.S = 11;
    c.opt.H = 10;
    c.opt.D = 3;
    c.opt.max_start_pos = 13;
    c.seed = seed++;
    c.name = "random" + std::to_string(i);
    cases.push_back(c);
  }
  // seqused = 0 everywhere: nothing compressed, all gradients zero.
  {
    GradCase c;
    c.opt.B = 2;
    c.opt.S = 6;
    c.opt.H = 8;
    c.opt.D = 2;
    c.opt.coff = 2;
    c.opt.r = 3;
    c.opt.start_pos = {0, 4};
    c.opt.seqused = {0, 0};
    c.name = "no_blocks_seqused0";
    cases.push_back(c);
  }
  // sp + U before the next block boundary in every batch (TH, one empty segment): no blocks.
  {
    GradCase c;
    c.opt.th = true;
    c.opt.B = 3;
    c.opt.H = 8;
    c.opt.D = 2;
    c.opt.coff = 2;
    c.opt.r = 4;
    c.opt.start_pos = {1, 5, 8};
    c.opt.lengths = {2, 0, 3};
    c.opt.seqused = {2, 0, 3};
    c.opt.cache_mode = 2;
    c.name = "no_blocks_short_th";
    cases.push_back(c);
  }
  // start_pos absent and seqused absent.
  {
    GradCase c;
    c.opt.B = 2;
    c.opt.S = 10;
    c.opt.H = 12;
    c.opt.D = 4;
    c.opt.coff = 2;
    c.opt.r = 4;
    c.opt.max_start_pos = -1;
    c.opt.random_seqused = false;
    c.name = "bsh_defaults";
    cases.push_back(c);
  }
  return cases;
}

class GradCheck : public ::testing::TestWithParam<GradCase> {};

TEST_P(GradCheck, BackwardIsDerivativeOfForward) {
  const GradCase& c = GetParam();
  RandomCase<double> rc = make_random_case(c.opt, c.seed);
  check_gradients(rc.problem, rc.in, c.seed * 7 + 1);
}

INSTANTIATE_TEST_SUITE_P(Reference, GradCheck, ::testing::ValuesIn(grad_cases()),
                         [](const ::testing::TestParamInfo<GradCase>& pi) { return pi.param.name; });

// ---------------------------------------------------------------------------
// Spec 2.8: B=1, start_pos=5, seqused=10, r=4, coff=2 (facts derived by hand from the spec).

struct Example {
  Problem p;
  ForwardInputs<double> in;
};

constexpr i64 kExH = 8, kExD = 3;

Example example_2_8(bool th, i64 coff, int cache_mode) {
  RandomOptions o;
  o.th = th;
  o.B = 1;
  o.S = th ? 10 : 12;
  o.H = kExH;
  o.D = kExD;
  o.coff = coff;
  o.r = 4;
  o.start_pos = {5};
  o.seqused = {10};
  if (th) o.lengths = {10};
  o.cache_mode = cache_mode;
  Example ex;
  RandomCase<double> rc = make_random_case(o, 2024 + static_cast<std::uint64_t>(coff));
  ex.p = rc.problem;
  ex.in = rc.in;
  const i64 C = coff * kExD;
  // A hand-made cache instead of the random one, so the expected slots are obvious.
  ref::CacheState<double>& cache = ex.in.cache;
  cache.cache_mode = cache_mode;
  if (cache_mode == 1) {
    // block_size 4, positions 0..19: [0,4)->1, [4,8)->2, [8,12)->0 (skip), [12,16)->3, [16,20)->4.
    cache.block_size = 4;
    cache.table_cols = 5;
    cache.block_table = {1, 2, 0, 3, 4};
    cache.block_num = 5;
  } else {
    // Ring: block_size >= coff*r + S - 1 (= 19 for coff 2, BSH S=12), the batch owns block 1.
    cache.block_size = 19;
    cache.table_cols = 0;
    cache.block_table = {1};
    cache.block_num = 2;
  }
  cache.data.resize(u(cache.block_num * cache.block_size * 2 * C));
  for (std::size_t i = 0; i < cache.data.size(); ++i) cache.data[i] = 100.0 + static_cast<double>(i);
  return ex;
}

// Projection of token row `row` with weight rows [0, C), computed here independently.
std::vector<double> project(const std::vector<double>& x, const std::vector<double>& w, i64 row, i64 C,
                            i64 H) {
  std::vector<double> out(u(C), 0.0);
  for (i64 c = 0; c < C; ++c)
    for (i64 h = 0; h < H; ++h) out[u(c)] += x[u(row * H + h)] * w[u(c * H + h)];
  return out;
}

// Spec 2.2 for one block row j: dZ = S*(dC*K - sum_rows(S*dC*K)).
std::vector<double> block_dz(const ForwardOutputs<double>& f, const std::vector<double>& dC, i64 orow, i64 j,
                             i64 nrow, i64 D) {
  std::vector<double> dz(u(D));
  for (i64 d = 0; d < D; ++d) {
    double sum = 0;
    for (i64 jj = 0; jj < nrow; ++jj) {
      const std::size_t e = u((orow * nrow + jj) * D + d);
      sum += f.softmax_score[e] * dC[u(orow * D + d)] * f.kv[e];
    }
    const std::size_t e = u((orow * nrow + j) * D + d);
    dz[u(d)] = f.softmax_score[e] * (dC[u(orow * D + d)] * f.kv[e] - sum);
  }
  return dz;
}

TEST(Example28, ValidRowsAndShapes) {
  for (bool th : {false, true}) {
    Example ex = example_2_8(th, 2, 1);
    // BSH ceil(12/4) = 3 rows, TH min(10, 10/4 + 1) = 3 rows; blocks [4,8) and [8,12) only.
    EXPECT_EQ(ex.p.out_rows(), 3);
    const ForwardOutputs<double> f = ref::forward(ex.p, ex.in);
    EXPECT_EQ(f.valid, (std::vector<std::uint8_t>{1, 1, 0})) << (th ? "TH" : "BSH");
    EXPECT_EQ(f.cmp_kv.size(), u(3 * kExD));
    EXPECT_EQ(f.softmax_score.size(), u(3 * 8 * kExD));
    for (i64 e = 2 * 8 * kExD; e < 3 * 8 * kExD; ++e) {  // padding row 2 is all zero
      EXPECT_EQ(f.softmax_score[u(e)], 0.0);
      EXPECT_EQ(f.kv[u(e)], 0.0);
    }
    for (i64 d = 0; d < kExD; ++d) EXPECT_EQ(f.cmp_kv[u(2 * kExD + d)], 0.0);
  }
}

// Slot (blk, off) kv / score part, column c of C.
double slot(const ref::CacheState<double>& cache, i64 C, i64 blk, i64 off, int part, i64 c) {
  return cache.data[u((blk * cache.block_size + off) * 2 * C + part * C + c)];
}

TEST(Example28, CacheWritesMode1SkipBlockZero) {
  const i64 C = 2 * kExD;
  Example ex = example_2_8(false, 2, 1);
  const std::vector<double> before = ex.in.cache.data;
  ref::forward(ex.p, ex.in);
  const ref::CacheState<double>& cache = ex.in.cache;
  // Positions 5..14 are written except 8..11, whose table entry is 0.
  std::vector<bool> written(before.size(), false);
  auto expect_written = [&](i64 pos, i64 blk) {
    const i64 s = pos - 5, off = pos % 4;
    const std::vector<double> kv = project(ex.in.x, ex.in.wkv, s, C, kExH);
    const std::vector<double> sc = project(ex.in.x, ex.in.wgate, s, C, kExH);
    for (i64 c = 0; c < C; ++c) {
      EXPECT_NEAR(slot(cache, C, blk, off, 0, c), kv[u(c)], 1e-12) << "pos " << pos;
      EXPECT_NEAR(slot(cache, C, blk, off, 1, c), sc[u(c)] + ex.in.ape[u((pos % 4) * C + c)], 1e-12)
          << "pos " << pos;
      written[u((blk * 4 + off) * 2 * C + c)] = true;
      written[u((blk * 4 + off) * 2 * C + C + c)] = true;
    }
  };
  for (i64 pos : {5, 6, 7}) expect_written(pos, 2);
  for (i64 pos : {12, 13, 14}) expect_written(pos, 3);
  for (std::size_t i = 0; i < before.size(); ++i)
    if (!written[i]) {
      EXPECT_EQ(cache.data[i], before[i]) << "untouched element " << i;
    }
}

TEST(Example28, CacheWritesMode2OnlyFromPosition8) {
  const i64 C = 2 * kExD;
  Example ex = example_2_8(false, 2, 2);
  const std::vector<double> before = ex.in.cache.data;
  ref::forward(ex.p, ex.in);
  const ref::CacheState<double>& cache = ex.in.cache;
  // trunc(15,4) - (2-1)*4 = 8: positions 8..14 land in ring slots 8..14 of block 1; 5,6,7 are not written.
  std::vector<bool> written(before.size(), false);
  for (i64 pos = 8; pos <= 14; ++pos) {
    const i64 s = pos - 5, off = pos % 19;
    const std::vector<double> kv = project(ex.in.x, ex.in.wkv, s, C, kExH);
    const std::vector<double> sc = project(ex.in.x, ex.in.wgate, s, C, kExH);
    for (i64 c = 0; c < C; ++c) {
      EXPECT_NEAR(slot(cache, C, 1, off, 0, c), kv[u(c)], 1e-12) << "pos " << pos;
      EXPECT_NEAR(slot(cache, C, 1, off, 1, c), sc[u(c)] + ex.in.ape[u((pos % 4) * C + c)], 1e-12);
      written[u((19 + off) * 2 * C + c)] = true;
      written[u((19 + off) * 2 * C + C + c)] = true;
    }
  }
  for (std::size_t i = 0; i < before.size(); ++i)
    if (!written[i]) {
      EXPECT_EQ(cache.data[i], before[i]) << "untouched element " << i;
    }
}

TEST(Example28, CacheWritesCoff1Mode2OnlyTail) {
  // coff=1: trunc(15,4) - 0 = 12, so only the tail positions 12..14 are written.
  const i64 C = kExD;
  Example ex = example_2_8(false, 1, 2);
  const std::vector<double> before = ex.in.cache.data;
  ref::forward(ex.p, ex.in);
  for (i64 off = 0; off < ex.in.cache.block_size; ++off) {
    const bool expect_change = off >= 12 && off <= 14;
    for (i64 c = 0; c < 2 * C; ++c) {
      const std::size_t e = u((ex.in.cache.block_size + off) * 2 * C + c);
      if (expect_change) {
        EXPECT_NE(ex.in.cache.data[e], before[e]) << "slot " << off;
      } else {
        EXPECT_EQ(ex.in.cache.data[e], before[e]) << "slot " << off;
      }
    }
  }
}

TEST(Example28, BlockRowsSourcesMode1) {
  const i64 C = 2 * kExD, D = kExD;
  Example ex = example_2_8(false, 2, 1);
  const ref::CacheState<double> cache0 = ex.in.cache;  // reads see the pre-call state of positions < 5
  const ForwardOutputs<double> f = ref::forward(ex.p, ex.in);
  auto K = [&](i64 orow, i64 j, i64 d) { return f.kv[u((orow * 8 + j) * D + d)]; };
  for (i64 d = 0; d < D; ++d) {
    // Block 0: prev rows 0,2,4,6 = positions 0..3 (block 1 offsets 0..3, kv columns [0,D)).
    for (i64 t = 0; t < 4; ++t) EXPECT_EQ(K(0, 2 * t, d), slot(cache0, C, 1, t, 0, d));
    // Block 0 cur t=0 = position 4 (block 2 offset 0, kv columns [D,2D)).
    EXPECT_EQ(K(0, 1, d), slot(cache0, C, 2, 0, 0, D + d));
    // Block 1 prev t=0 = position 4 (block 2 offset 0, columns [0,D)).
    EXPECT_EQ(K(1, 0, d), slot(cache0, C, 2, 0, 0, d));
  }
  // Fresh rows: block 0 cur t=1 is token s=0 (columns [D,2D)); block 1 prev t=1 is s=0 (columns [0,D)).
  const std::vector<double> kv0 = project(ex.in.x, ex.in.wkv, 0, C, kExH);
  for (i64 d = 0; d < D; ++d) {
    EXPECT_NEAR(K(0, 3, d), kv0[u(D + d)], 1e-12);
    EXPECT_NEAR(K(1, 2, d), kv0[u(d)], 1e-12);
  }
}

void check_example_backward(bool th, i64 coff, int mode) {
  const i64 D = kExD, C = coff * D, nrow = coff * 4;
  Example ex = example_2_8(th, coff, mode);
  ForwardInputs<double> in = ex.in;
  const ForwardOutputs<double> f = ref::forward(ex.p, in);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> dist(0.5, 1.5);
  std::vector<double> dC(u(3 * D));
  for (double& v : dC) v = dist(rng);
  BackwardInputs<double> bi{ex.in.x, ex.in.wkv, ex.in.wgate, dC, f.softmax_score, f.kv};
  const BackwardOutputs<double> g = ref::backward(ex.p, bi);

  // d_x: tokens 0..6 are compressed, 7..9 are the tail, BSH 10,11 are beyond seqused.
  const i64 rows = ex.p.rows();
  for (i64 s = 0; s < rows; ++s) {
    double mag = 0;
    for (i64 h = 0; h < kExH; ++h) mag += std::fabs(g.d_x[u(s * kExH + h)]);
    if (s < 7) {
      EXPECT_GT(mag, 0.0) << "token " << s;
    } else {
      EXPECT_EQ(mag, 0.0) << "token " << s;
    }
  }

  auto ape = [&](i64 t, i64 col) { return g.d_ape[u(t * C + col)]; };
  if (coff == 2) {
    const std::vector<double> dz0_3 = block_dz(f, dC, 0, 3, nrow, D), dz1_1 = block_dz(f, dC, 1, 1, nrow, D);
    const std::vector<double> dz1_2 = block_dz(f, dC, 1, 2, nrow, D), dz1_3 = block_dz(f, dC, 1, 3, nrow, D);
    for (i64 d = 0; d < D; ++d) {
      EXPECT_EQ(ape(0, d), 0.0);                                     // prev slot 0 is always a cache row
      EXPECT_NEAR(ape(0, D + d), dz1_1[u(d)], 1e-14);                // block 1 cur t=0 only
      EXPECT_NEAR(ape(1, d), dz1_2[u(d)], 1e-14);                    // block 1 prev t=1 (s=0)
      EXPECT_NEAR(ape(1, D + d), dz0_3[u(d)] + dz1_3[u(d)], 1e-14);  // both blocks' cur t=1
    }
  } else {
    // coff=1: block 0 drops slot 0 (position 4).
    const std::vector<double> dz1_0 = block_dz(f, dC, 1, 0, nrow, D);
    const std::vector<double> dz0_1 = block_dz(f, dC, 0, 1, nrow, D), dz1_1 = block_dz(f, dC, 1, 1, nrow, D);
    for (i64 d = 0; d < D; ++d) {
      EXPECT_NEAR(ape(0, d), dz1_0[u(d)], 1e-14);
      EXPECT_NEAR(ape(1, d), dz0_1[u(d)] + dz1_1[u(d)], 1e-14);
    }
  }
}

TEST(Example28, BackwardZeroRowsAndApeRoutingBshCoff2) { check_example_backward(false, 2, 1); }
TEST(Example28, BackwardZeroRowsAndApeRoutingThCoff2) { check_example_backward(true, 2, 2); }
TEST(Example28, BackwardZeroRowsAndApeRoutingBshCoff1) { check_example_backward(false, 1, 2); }
TEST(Example28, BackwardZeroRowsAndApeRoutingThCoff1) { check_example_backward(true, 1, 1); }

TEST(Example28, Mode1ReadsDoNotSkipBlockZero) {
  // Positions 0..3 map to block id 0: writes there would be skipped, but reads still use it (spec 1.3).
  const i64 C = 2 * kExD, D = kExD;
  Example ex = example_2_8(false, 2, 1);
  ex.in.cache.block_table = {0, 2, 1, 3, 4};  // [8,12) now goes to block 1, so it is written
  const ref::CacheState<double> cache0 = ex.in.cache;
  const ForwardOutputs<double> f = ref::forward(ex.p, ex.in);
  for (i64 t = 0; t < 4; ++t)
    for (i64 d = 0; d < D; ++d) EXPECT_EQ(f.kv[u((2 * t) * D + d)], slot(cache0, C, 0, t, 0, d));
  // Block 0 is unchanged; block 1 now holds positions 8..11.
  for (i64 e = 0; e < 4 * 2 * C; ++e) EXPECT_EQ(ex.in.cache.data[u(e)], cache0.data[u(e)]);
  const std::vector<double> kv3 = project(ex.in.x, ex.in.wkv, 3, C, kExH);  // position 8 = token 3
  for (i64 c = 0; c < C; ++c) EXPECT_NEAR(slot(ex.in.cache, C, 1, 0, 0, c), kv3[u(c)], 1e-12);
}

TEST(Backward, RoundDnewStagesBothProjectionGradientsButNotApe) {
  RandomOptions o;
  o.B = 2;
  o.S = 10;
  o.H = 9;
  o.D = 3;
  o.coff = 2;
  o.r = 3;
  o.start_pos = {4, 0};
  o.seqused = {10, 7};
  RandomCase<double> rc = make_random_case(o, 99);
  const ForwardOutputs<double> f = ref::forward(rc.problem, rc.in);
  std::vector<double> dC(f.cmp_kv.size(), 0.5);
  const BackwardInputs<double> bi{rc.in.x, rc.in.wkv, rc.in.wgate, dC, f.softmax_score, f.kv};
  const BackwardOutputs<double> plain = ref::backward(rc.problem, bi);
  // Doubling is exact, so the products must double exactly and d_ape (taken before staging) must not move.
  const BackwardOutputs<double> doubled =
      ref::backward(rc.problem, bi, std::function<double(double)>([](double v) { return 2 * v; }));
  for (std::size_t i = 0; i < plain.d_x.size(); ++i) EXPECT_EQ(doubled.d_x[i], 2 * plain.d_x[i]);
  for (std::size_t i = 0; i < plain.d_wkv.size(); ++i) EXPECT_EQ(doubled.d_wkv[i], 2 * plain.d_wkv[i]);
  for (std::size_t i = 0; i < plain.d_wgate.size(); ++i) EXPECT_EQ(doubled.d_wgate[i], 2 * plain.d_wgate[i]);
  EXPECT_EQ(doubled.d_ape, plain.d_ape);
  double mag = 0;
  for (double v : plain.d_wgate) mag += std::fabs(v);
  EXPECT_GT(mag, 0.0);
}

// ---------------------------------------------------------------------------
// Forward invariants.

void check_softmax_and_sum(const Problem& p, const ForwardOutputs<double>& f) {
  const i64 D = p.D, nrow = p.block_rows();
  for (i64 row = 0; row < p.out_rows(); ++row) {
    if (!f.valid[u(row)]) continue;
    for (i64 d = 0; d < D; ++d) {
      double sum = 0, cmp = 0;
      for (i64 j = 0; j < nrow; ++j) {
        const std::size_t e = u((row * nrow + j) * D + d);
        EXPECT_GE(f.softmax_score[e], 0.0);
        sum += f.softmax_score[e];
        cmp += f.softmax_score[e] * f.kv[e];
      }
      EXPECT_NEAR(sum, 1.0, 1e-14) << "row " << row << " col " << d;
      EXPECT_NEAR(f.cmp_kv[u(row * D + d)], cmp, 1e-13) << "row " << row << " col " << d;
    }
  }
}

TEST(Forward, SoftmaxColumnsAndPlaceholders) {
  // start_pos 2 < r = 4 with coff 2: block 0's prev half (positions -4..-1) is all placeholders.
  RandomOptions o;
  o.B = 2;
  o.S = 9;
  o.H = 10;
  o.D = 3;
  o.coff = 2;
  o.r = 4;
  o.start_pos = {2, 0};
  o.seqused = {9, 9};
  RandomCase<double> rc = make_random_case(o, 77);
  const ref::CacheState<double> cache0 = rc.in.cache;
  const ForwardOutputs<double> f = ref::forward(rc.problem, rc.in);
  check_softmax_and_sum(rc.problem, f);
  const i64 D = 3, nrow = 8, per_batch = 3, C = 6;
  for (i64 b = 0; b < 2; ++b) {
    const i64 row = b * per_batch;  // first block of each batch
    ASSERT_TRUE(f.valid[u(row)]);
    for (i64 t = 0; t < 4; ++t)
      for (i64 d = 0; d < D; ++d) {
        EXPECT_EQ(f.softmax_score[u((row * nrow + 2 * t) * D + d)], 0.0);
        EXPECT_EQ(f.kv[u((row * nrow + 2 * t) * D + d)], 0.0);
      }
  }
  // Batch 0, block 0 cur half: positions 0,1 come from the cache, 2,3 are tokens 0,1 (+ape);
  // the softmax runs over these four scores only.
  const std::vector<double> sc0 = project(rc.in.x, rc.in.wgate, 0, C, 10);
  const std::vector<double> sc1 = project(rc.in.x, rc.in.wgate, 1, C, 10);
  for (i64 d = 0; d < D; ++d) {
    auto cache_score = [&](i64 pos) {
      const i64 blk = cache0.block_table[u(pos / cache0.block_size)];
      return cache0.data[u((blk * cache0.block_size + pos % cache0.block_size) * 2 * C + C + D + d)];
    };
    const double z[4] = {cache_score(0), cache_score(1), sc0[u(D + d)] + rc.in.ape[u(2 * C + D + d)],
                         sc1[u(D + d)] + rc.in.ape[u(3 * C + D + d)]};
    const double zmax = *std::max_element(z, z + 4);
    double den = 0;
    for (double v : z) den += std::exp(v - zmax);
    for (i64 t = 0; t < 4; ++t)
      EXPECT_NEAR(f.softmax_score[u((2 * t + 1) * D + d)], std::exp(z[t] - zmax) / den, 1e-14);
  }
}

TEST(Forward, SoftmaxInvariantsRandom) {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    RandomOptions o;
    o.th = seed % 2 == 0;
    o.coff = 1 + static_cast<i64>(seed % 3 == 0);
    o.r = 1 + static_cast<i64>(seed % 5);
    o.cache_mode = 1 + static_cast<int>(seed % 2);
    o.B = 3;
    o.S = 12;
    RandomCase<double> rc = make_random_case(o, seed);
    const ForwardOutputs<double> f = ref::forward(rc.problem, rc.in);
    check_softmax_and_sum(rc.problem, f);
    // Padding rows are all zero.
    const i64 nrow = rc.problem.block_rows(), D = rc.problem.D;
    for (i64 row = 0; row < rc.problem.out_rows(); ++row) {
      if (f.valid[u(row)]) continue;
      for (i64 e = 0; e < nrow * D; ++e) {
        EXPECT_EQ(f.softmax_score[u(row * nrow * D + e)], 0.0);
        EXPECT_EQ(f.kv[u(row * nrow * D + e)], 0.0);
      }
      for (i64 d = 0; d < D; ++d) EXPECT_EQ(f.cmp_kv[u(row * D + d)], 0.0);
    }
  }
}

TEST(Forward, EmptyInputLeavesCacheUntouched) {
  RandomOptions o;
  o.B = 2;
  o.S = 0;
  RandomCase<double> rc = make_random_case(o, 3);
  const std::vector<double> before = rc.in.cache.data;
  const ForwardOutputs<double> f = ref::forward(rc.problem, rc.in);
  EXPECT_TRUE(f.cmp_kv.empty());
  EXPECT_EQ(rc.in.cache.data, before);
}

TEST(Forward, FloatInstantiationTracksDouble) {
  RandomOptions o;
  o.th = true;
  o.B = 3;
  o.S = 10;
  o.coff = 2;
  o.r = 3;
  RandomCase<double> rc = make_random_case(o, 11);
  ForwardInputs<float> inf = to_float(rc.in);
  ForwardInputs<double> ind = rc.in;
  const ForwardOutputs<float> ff = ref::forward(rc.problem, inf);
  const ForwardOutputs<double> fd = ref::forward(rc.problem, ind);
  ASSERT_EQ(ff.cmp_kv.size(), fd.cmp_kv.size());
  for (std::size_t i = 0; i < fd.cmp_kv.size(); ++i) EXPECT_NEAR(ff.cmp_kv[i], fd.cmp_kv[i], 1e-5);
  for (std::size_t i = 0; i < fd.kv.size(); ++i) EXPECT_NEAR(ff.softmax_score[i], fd.softmax_score[i], 1e-5);

  std::vector<double> dC(fd.cmp_kv.size(), 0.25);
  const BackwardOutputs<double> gd = ref::backward(
      rc.problem, BackwardInputs<double>{rc.in.x, rc.in.wkv, rc.in.wgate, dC, fd.softmax_score, fd.kv});
  const auto to_bf16 = [](float v) { return bf16_to_float(float_to_bf16(v)); };
  const BackwardOutputs<float> gf = ref::backward(
      rc.problem,
      BackwardInputs<float>{inf.x, inf.wkv, inf.wgate, convert<float>(dC), ff.softmax_score, ff.kv},
      std::function<float(float)>(to_bf16));
  // bf16 staging of d_new_* costs up to 2^-9 relative per term; allow a few of those.
  double scale = 0;
  for (double v : gd.d_x) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0.0);
  for (std::size_t i = 0; i < gd.d_x.size(); ++i) EXPECT_NEAR(gf.d_x[i], gd.d_x[i], 0.01 * scale);
  for (std::size_t i = 0; i < gd.d_ape.size(); ++i) EXPECT_NEAR(gf.d_ape[i], gd.d_ape[i], 1e-5);
}

}  // namespace
}  // namespace kvcomp::test
