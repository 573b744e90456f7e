// Forward and backward against the float64 oracle, over the sweep of issue #2.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "harness.hpp"

namespace kvcomp::test {
namespace {

struct SweepCase {
  std::string name;
  RandomOptions opt;
  DType io = DType::bf16;
};

std::ostream& operator<<(std::ostream& os, const SweepCase& c) { return os << c.name; }

SweepCase make(std::string name, bool th, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D,
               std::int64_t coff, std::int64_t r, int cache_mode, DType io, std::int32_t max_sp) {
  SweepCase c;
  c.name = std::move(name);
  c.opt.th = th;
  c.opt.B = B;
  c.opt.S = S;
  c.opt.H = H;
  c.opt.D = D;
  c.opt.coff = coff;
  c.opt.r = r;
  c.opt.cache_mode = cache_mode;
  c.opt.max_start_pos = max_sp;
  c.opt.block_size = 8;
  c.io = io;
  return c;
}

std::vector<SweepCase> sweep() {
  std::vector<SweepCase> v;
  // The three production profiles (narrow H keeps the oracle fast).
  v.push_back(make("c4a_bsh_bf16", false, 2, 16, 48, 512, 2, 4, 1, DType::bf16, 9));
  v.push_back(make("c4a_th_fp16_ring", true, 3, 14, 40, 512, 2, 4, 2, DType::f16, 11));
  v.push_back(make("c4li_th_bf16", true, 4, 12, 64, 128, 2, 4, 1, DType::bf16, 6));
  v.push_back(make("c4li_bsh_fp16_ring", false, 2, 10, 32, 128, 2, 4, 2, DType::f16, 5));
  v.push_back(make("c128a_bsh_bf16", false, 1, 300, 24, 512, 1, 128, 1, DType::bf16, 200));
  v.push_back(make("c128a_th_fp16", true, 2, 280, 16, 512, 1, 128, 2, DType::f16, 150));
  // Odd and non-power-of-two ratios.
  for (std::int64_t r : {3, 9, 33, 127})
    for (std::int64_t coff : {1, 2}) {
      const std::string n = "r" + std::to_string(r) + "_coff" + std::to_string(coff);
      v.push_back(make(n + "_bsh_bf16", false, 2, 2 * r + 5, 24, 16, coff, r, 1, DType::bf16,
                       static_cast<std::int32_t>(3 * r)));
      v.push_back(make(n + "_th_fp16_ring", true, 3, 2 * r + 3, 20, 24, coff, r, 2, DType::f16,
                       static_cast<std::int32_t>(2 * r + 1)));
    }
  // fp32 io (extension), ratio 1 and 2.
  v.push_back(make("r1_bsh_f32", false, 2, 7, 96, 16, 2, 1, 1, DType::f32, 3));
  v.push_back(make("r2_th_f32", true, 3, 9, 96, 16, 1, 2, 1, DType::f32, 5));
  // start_pos regimes: aligned, unaligned, none.
  {
    auto c = make("startpos_aligned", false, 3, 12, 32, 16, 2, 4, 1, DType::bf16, 0);
    c.opt.start_pos = {0, 8, 16};
    v.push_back(c);
    auto u = make("startpos_unaligned", false, 3, 12, 32, 16, 2, 4, 1, DType::bf16, 0);
    u.opt.start_pos = {1, 5, 7};
    v.push_back(u);
    auto n = make("startpos_absent_seqused_absent", false, 2, 13, 32, 16, 2, 4, 1, DType::f16, -1);
    n.opt.random_seqused = false;
    v.push_back(n);
  }
  // seqused 0 / partial / full.
  {
    auto c = make("seqused_mixed", false, 3, 12, 32, 16, 2, 4, 2, DType::bf16, 0);
    c.opt.start_pos = {3, 4, 6};
    c.opt.seqused = {0, 7, 12};
    v.push_back(c);
  }
  // TH with empty segments, and hundreds of 1-3 token batches.
  {
    auto c = make("th_empty_segments", true, 6, 9, 24, 16, 2, 4, 1, DType::bf16, 10);
    c.opt.lengths = {0, 7, 0, 0, 9, 3};
    v.push_back(c);
    auto t = make("th_tiny_batches", true, 300, 3, 16, 8, 2, 4, 1, DType::bf16, 9);
    v.push_back(t);
  }
  // Longer than one chunk of token rows (kChunkRows = 1024): blocks and their
  // prev halves straddle chunk boundaries.
  {
    auto c = make("chunks_th_c4", true, 3, 1100, 64, 8, 2, 4, 1, DType::bf16, 7);
    c.opt.allow_empty_segments = false;
    c.opt.random_seqused = false;
    v.push_back(c);
    auto d = make("chunks_bsh_r128", false, 1, 2200, 8, 8, 1, 128, 2, DType::f16, 130);
    v.push_back(d);
    auto e = make("chunks_bsh_r5_coff2", false, 2, 1030, 8, 4, 2, 5, 1, DType::bf16, 12);
    v.push_back(e);
    // A block (coff*r = 1200 rows) longer than a chunk: the carried rows of
    // the forward span more than one previous chunk.
    auto f = make("chunks_bsh_r600_coff2", false, 1, 2700, 8, 4, 2, 600, 1, DType::bf16, 650);
    v.push_back(f);
  }
  return v;
}

class Sweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(Sweep, ForwardMatchesOracle) {
  const SweepCase& c = GetParam();
  auto rc = make_random_case(c.opt, 1234);
  round_io_inputs(rc.in, c.io);
  const ref::Problem& p = rc.problem;

  ForwardRun ours(p, rc.in, c.io);
  ASSERT_TRUE(ours.run().ok()) << ours.run().message;

  ref::ForwardInputs<double> hi_in = rc.in;
  auto high = ref::forward<double>(p, hi_in);
  auto lo_in = to_float(rc.in);
  auto same = ref::forward<float>(p, lo_in);

  const std::size_t D = static_cast<std::size_t>(p.D), blk = static_cast<std::size_t>(p.coff * p.r) * D;
  std::vector<double> a_cmp, b_cmp, c_cmp, a_s, b_s, c_s, a_k, b_k, c_k;
  const auto a_cmp_all = ours.cmp_kv.values(), a_s_all = ours.softmax_score.values(),
             a_k_all = ours.kv.values();
  for (std::size_t row = 0; row < high.valid.size(); ++row) {
    if (!high.valid[row]) {  // padding rows: exact zeros
      for (std::size_t i = 0; i < D; ++i) ASSERT_EQ(a_cmp_all[row * D + i], 0.0) << "padding row " << row;
      for (std::size_t i = 0; i < blk; ++i) {
        ASSERT_EQ(a_s_all[row * blk + i], 0.0) << "padding row " << row;
        ASSERT_EQ(a_k_all[row * blk + i], 0.0) << "padding row " << row;
      }
      continue;
    }
    for (std::size_t i = 0; i < D; ++i) {
      a_cmp.push_back(a_cmp_all[row * D + i]);
      b_cmp.push_back(round_to_dtype(same.cmp_kv[row * D + i], c.io));
      c_cmp.push_back(round_to_dtype(high.cmp_kv[row * D + i], c.io));
    }
    for (std::size_t i = 0; i < blk; ++i) {
      a_s.push_back(a_s_all[row * blk + i]);
      b_s.push_back(same.softmax_score[row * blk + i]);
      c_s.push_back(static_cast<float>(high.softmax_score[row * blk + i]));
      a_k.push_back(a_k_all[row * blk + i]);
      b_k.push_back(same.kv[row * blk + i]);
      c_k.push_back(static_cast<float>(high.kv[row * blk + i]));
    }
  }
  EXPECT_TRUE(projection_accuracy(a_cmp, b_cmp, c_cmp, c.io)) << "cmp_kv";
  KVCOMP_EXPECT_THREE_WAY("softmax_score", a_s, b_s, c_s, DType::f32);
  EXPECT_TRUE(projection_accuracy(a_k, b_k, c_k, DType::f32)) << "kv";

  // State cache: slots the oracle wrote match (two-party, io tolerance, as
  // upstream); every other float is bitwise unchanged.
  std::vector<double> a_w, c_w;
  std::size_t untouched_changed = 0;
  for (std::size_t i = 0; i < rc.in.cache.data.size(); ++i) {
    const float before = static_cast<float>(rc.in.cache.data[i]);
    if (hi_in.cache.data[i] != rc.in.cache.data[i]) {
      a_w.push_back(ours.cache.f32[i]);
      c_w.push_back(static_cast<float>(hi_in.cache.data[i]));
    } else if (std::memcmp(&ours.cache.f32[i], &before, sizeof before) != 0) {
      ++untouched_changed;
    }
  }
  EXPECT_EQ(untouched_changed, 0u) << "cache slots the spec does not write were modified";
  const auto tw = two_way_compare(a_w, c_w, c.io);
  EXPECT_TRUE(tw.pass) << "state cache writes: " << tw.summary();
}

TEST_P(Sweep, BackwardThreeWay) {
  const SweepCase& c = GetParam();
  auto rc = make_random_case(c.opt, 99);
  round_io_inputs(rc.in, c.io);
  const ref::Problem& p = rc.problem;
  const BackwardData bd = make_backward_data(p, rc.in, c.io, 7);

  BackwardRun ours(p, rc.in, bd, c.io);
  const Status s = ours.run();
  ASSERT_TRUE(s.ok()) << s.message;
  const BackwardGoldens g = backward_goldens(p, rc.in, bd, c.io);
  KVCOMP_EXPECT_THREE_WAY("d_x", ours.d_x.values(), g.same.d_x, g.high.d_x, c.io);
  KVCOMP_EXPECT_THREE_WAY("d_wkv", ours.d_wkv.values(), g.same.d_wkv, g.high.d_wkv, c.io);
  KVCOMP_EXPECT_THREE_WAY("d_wgate", ours.d_wgate.values(), g.same.d_wgate, g.high.d_wgate, c.io);
  KVCOMP_EXPECT_THREE_WAY("d_ape", ours.d_ape.values(), g.same.d_ape, g.high.d_ape, DType::f32);

  // Rows without gradient (tail, past seqused) are exact zeros, as in the oracle.
  const auto dx = ours.d_x.values();
  for (std::size_t i = 0; i < dx.size(); ++i) {
    if (g.high.d_x[i] == 0.0 && g.same.d_x[i] == 0.0) {
      ASSERT_EQ(dx[i], 0.0) << "d_x element " << i;
    }
  }

  // npu parity: the fp32 computation with io-staged d_new, i.e. the B party.
  BackwardRun parity(p, rc.in, bd, c.io);
  Options o;
  o.precision = Precision::npu_parity;
  ASSERT_TRUE(parity.run(o).ok());
  const auto tw = two_way_compare(parity.d_x.values(), g.same.d_x, c.io);
  EXPECT_TRUE(tw.pass) << "npu parity d_x vs the fp32 golden: " << tw.summary();
  const auto tw2 = two_way_compare(parity.d_wkv.values(), g.same.d_wkv, c.io);
  EXPECT_TRUE(tw2.pass) << "npu parity d_wkv vs the fp32 golden: " << tw2.summary();
}

INSTANTIATE_TEST_SUITE_P(Issue2, Sweep, ::testing::ValuesIn(sweep()),
                         [](const auto& tp) { return tp.param.name; });

}  // namespace
}  // namespace kvcomp::test
