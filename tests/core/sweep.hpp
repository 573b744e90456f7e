// The sweep of operator cases (issue #2) and the checks of one case against
// the float64 oracle, shared by the CPU suite (tests/core/test_ops.cpp) and
// the GPU suite (tests/cuda): each passes a runner that executes the call on
// its backend and leaves the results in the run's host buffers.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "harness.hpp"

namespace kvcomp::test {

using ForwardRunner = std::function<Status(ForwardRun&, const Options&)>;
using BackwardRunner = std::function<Status(BackwardRun&, const Options&)>;

// One case of the sweep, by named fields (designated initialisers); the
// defaults are those of most cases. Prints as one line with every field and
// the seeds, so that a failure can be replayed.
struct SweepCase {
  std::string name;
  bool th = false;  // layout: TH (segments of at most S tokens) or BSH
  std::int64_t B = 2, S = 8, H = 16, D = 16, coff = 2, r = 4;
  int cache_mode = 1;
  DType io = DType::bf16;
  std::int32_t max_start_pos = 0;  // start_pos uniform in [0, max]; negative: absent
  std::int64_t block_size = 8;
  std::vector<std::int32_t> start_pos = {}, seqused = {}, lengths = {};  // fixed values, B entries each
  bool random_seqused = true;                                            // false: seqused absent
  bool allow_empty_segments = true;
  std::uint64_t forward_seed = 1234, backward_seed = 99, backward_data_seed = 7;

  RandomOptions options() const {
    RandomOptions o;
    o.th = th;
    o.B = B;
    o.S = S;
    o.H = H;
    o.D = D;
    o.coff = coff;
    o.r = r;
    o.cache_mode = cache_mode;
    o.max_start_pos = max_start_pos;
    o.block_size = block_size;
    o.start_pos = start_pos;
    o.seqused = seqused;
    o.lengths = lengths;
    o.random_seqused = random_seqused;
    o.allow_empty_segments = allow_empty_segments;
    return o;
  }
};

inline std::string list(const std::vector<std::int32_t>& v) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  os << ']';
  return os.str();
}

inline std::ostream& operator<<(std::ostream& os, const SweepCase& c) {
  return os << c.name << ": layout=" << (c.th ? "TH" : "BSH") << " B=" << c.B << " S=" << c.S << " H=" << c.H
            << " D=" << c.D << " coff=" << c.coff << " r=" << c.r << " cache_mode=" << c.cache_mode
            << " io=" << dtype_name(c.io) << " max_start_pos=" << c.max_start_pos
            << " block_size=" << c.block_size << " start_pos=" << list(c.start_pos)
            << " seqused=" << list(c.seqused) << " lengths=" << list(c.lengths)
            << " random_seqused=" << c.random_seqused << " allow_empty_segments=" << c.allow_empty_segments
            << " forward_seed=" << c.forward_seed << " backward_seed=" << c.backward_seed
            << " backward_data_seed=" << c.backward_data_seed;
}

// gtest prints a failing parameterised case with this.
inline void PrintTo(const SweepCase& c, std::ostream* os) { *os << c; }

inline std::vector<SweepCase> sweep() {
  std::vector<SweepCase> v = {
      // The three production profiles (narrow H keeps the oracle fast).
      {.name = "c4a_bsh_bf16", .B = 2, .S = 16, .H = 48, .D = 512, .max_start_pos = 9},
      {.name = "c4a_th_fp16_ring",
       .th = true,
       .B = 3,
       .S = 14,
       .H = 40,
       .D = 512,
       .cache_mode = 2,
       .io = DType::f16,
       .max_start_pos = 11},
      {.name = "c4li_th_bf16", .th = true, .B = 4, .S = 12, .H = 64, .D = 128, .max_start_pos = 6},
      {.name = "c4li_bsh_fp16_ring",
       .B = 2,
       .S = 10,
       .H = 32,
       .D = 128,
       .cache_mode = 2,
       .io = DType::f16,
       .max_start_pos = 5},
      {.name = "c128a_bsh_bf16",
       .B = 1,
       .S = 300,
       .H = 24,
       .D = 512,
       .coff = 1,
       .r = 128,
       .max_start_pos = 200},
      {.name = "c128a_th_fp16",
       .th = true,
       .B = 2,
       .S = 280,
       .H = 16,
       .D = 512,
       .coff = 1,
       .r = 128,
       .cache_mode = 2,
       .io = DType::f16,
       .max_start_pos = 150},
  };
  // Odd and non-power-of-two ratios.
  for (std::int64_t r : {3, 9, 33, 127})
    for (std::int64_t coff : {1, 2}) {
      const std::string n = "r" + std::to_string(r) + "_coff" + std::to_string(coff);
      v.push_back({.name = n + "_bsh_bf16",
                   .B = 2,
                   .S = 2 * r + 5,
                   .H = 24,
                   .D = 16,
                   .coff = coff,
                   .r = r,
                   .max_start_pos = static_cast<std::int32_t>(3 * r)});
      v.push_back({.name = n + "_th_fp16_ring",
                   .th = true,
                   .B = 3,
                   .S = 2 * r + 3,
                   .H = 20,
                   .D = 24,
                   .coff = coff,
                   .r = r,
                   .cache_mode = 2,
                   .io = DType::f16,
                   .max_start_pos = static_cast<std::int32_t>(2 * r + 1)});
    }
  v.insert(
      v.end(),
      {
          // fp32 io (extension), ratio 1 and 2.
          {.name = "r1_bsh_f32", .B = 2, .S = 7, .H = 96, .r = 1, .io = DType::f32, .max_start_pos = 3},
          {.name = "r2_th_f32",
           .th = true,
           .B = 3,
           .S = 9,
           .H = 96,
           .coff = 1,
           .r = 2,
           .io = DType::f32,
           .max_start_pos = 5},
          // start_pos regimes: aligned, unaligned, none.
          {.name = "startpos_aligned", .B = 3, .S = 12, .H = 32, .start_pos = {0, 8, 16}},
          {.name = "startpos_unaligned", .B = 3, .S = 12, .H = 32, .start_pos = {1, 5, 7}},
          {.name = "startpos_absent_seqused_absent",
           .B = 2,
           .S = 13,
           .H = 32,
           .io = DType::f16,
           .max_start_pos = -1,
           .random_seqused = false},
          // seqused 0 / partial / full.
          {.name = "seqused_mixed",
           .B = 3,
           .S = 12,
           .H = 32,
           .cache_mode = 2,
           .start_pos = {3, 4, 6},
           .seqused = {0, 7, 12}},
          // TH with empty segments, and hundreds of 1-3 token batches.
          {.name = "th_empty_segments",
           .th = true,
           .B = 6,
           .S = 9,
           .H = 24,
           .max_start_pos = 10,
           .lengths = {0, 7, 0, 0, 9, 3}},
          {.name = "th_tiny_batches", .th = true, .B = 300, .S = 3, .D = 8, .max_start_pos = 9},
          // Longer than one chunk of token rows (kChunkRows = 1024): blocks and
          // their prev halves straddle chunk boundaries.
          {.name = "chunks_th_c4",
           .th = true,
           .B = 3,
           .S = 1100,
           .H = 64,
           .D = 8,
           .max_start_pos = 7,
           .random_seqused = false,
           .allow_empty_segments = false},
          {.name = "chunks_bsh_r128",
           .B = 1,
           .S = 2200,
           .H = 8,
           .D = 8,
           .coff = 1,
           .r = 128,
           .cache_mode = 2,
           .io = DType::f16,
           .max_start_pos = 130},
          {.name = "chunks_bsh_r5_coff2", .B = 2, .S = 1030, .H = 8, .D = 4, .r = 5, .max_start_pos = 12},
          // A block (coff*r = 1200 rows) longer than a chunk: the carried rows of
          // the forward span more than one previous chunk.
          {.name = "chunks_bsh_r600_coff2",
           .B = 1,
           .S = 2700,
           .H = 8,
           .D = 4,
           .r = 600,
           .max_start_pos = 650},
      });
  return v;
}

// The forward of case c, run by `run`, against the float64 oracle (spec 7.2):
// cmp_kv and kv to the fp32 projection bound, softmax_score three-way, padding
// rows exact zeros, the state cache written where the oracle writes and
// bitwise unchanged elsewhere.
inline void check_forward(const SweepCase& c, const ForwardRunner& run) {
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  const ref::Problem& p = rc.problem;

  ForwardRun ours(p, rc.in, c.io);
  const Status s = run(ours, Options{});
  ASSERT_TRUE(s.ok()) << s.message;

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

// The backward of case c, run by `run`, three-way against the goldens in the
// precise mode; npu_parity two-way against the fp32 golden (its B party).
inline void check_backward(const SweepCase& c, const BackwardRunner& run) {
  auto rc = make_random_case(c.options(), c.backward_seed);
  round_io_inputs(rc.in, c.io);
  const ref::Problem& p = rc.problem;
  const BackwardData bd = make_backward_data(p, rc.in, c.io, c.backward_data_seed);

  BackwardRun ours(p, rc.in, bd, c.io);
  const Status s = run(ours, Options{});
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
  ASSERT_TRUE(run(parity, o).ok());
  // The NPU's own output is judged by the three-way rule against the same goldens (spec 7.2).
  KVCOMP_EXPECT_THREE_WAY("npu parity d_x", parity.d_x.values(), g.same.d_x, g.high.d_x, c.io);
  KVCOMP_EXPECT_THREE_WAY("npu parity d_wkv", parity.d_wkv.values(), g.same.d_wkv, g.high.d_wkv, c.io);
  KVCOMP_EXPECT_THREE_WAY("npu parity d_wgate", parity.d_wgate.values(), g.same.d_wgate, g.high.d_wgate,
                          c.io);
  const auto tw = two_way_compare(parity.d_x.values(), g.same.d_x, c.io);
  EXPECT_TRUE(tw.pass) << "npu parity d_x vs the fp32 golden: " << tw.summary();
  const auto tw2 = two_way_compare(parity.d_wkv.values(), g.same.d_wkv, c.io);
  EXPECT_TRUE(tw2.pass) << "npu parity d_wkv vs the fp32 golden: " << tw2.summary();
}

}  // namespace kvcomp::test
