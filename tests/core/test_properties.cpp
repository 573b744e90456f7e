// Properties that hold for every input: determinism across thread counts, the
// no-block case, the forward-to-backward chain, the two-phase contract.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "harness.hpp"

namespace kvcomp::test {
namespace {

// A run made by `make` (a unique_ptr to a ForwardRun or BackwardRun) on one thread, then one on each
// of `counts` threads, each held against the first by `same(first, again, threads)`. Returns the first.
template <typename Make, typename Same>
auto bits_across_threads(std::initializer_list<int> counts, Make make, Same same) {
  auto base = make();
  Options o;
  o.num_threads = 1;
  EXPECT_TRUE(base->run(o).ok());
  for (int threads : counts) {
    auto again = make();
    o.num_threads = threads;
    EXPECT_TRUE(again->run(o).ok());
    same(*base, *again, threads);
  }
  return base;
}

// Backward runs of the case on 2, 3, 4 and 7 threads give the bits of the run on one thread, whose d_x
// goes to `d_x`.
void expect_backward_bits_across_threads(const RandomCase<double>& rc, const BackwardData& bd,
                                         std::vector<std::uint16_t>& d_x) {
  const auto base = bits_across_threads(
      {2, 3, 4, 7}, [&] { return std::make_unique<BackwardRun>(rc.problem, rc.in, bd, DType::bf16); },
      [](const BackwardRun& a, const BackwardRun& b, int threads) {
        EXPECT_TRUE(bitwise_equal(a.d_x.half, b.d_x.half)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(a.d_wkv.half, b.d_wkv.half)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(a.d_wgate.half, b.d_wgate.half)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(a.d_ape.f32, b.d_ape.f32)) << threads << " threads";
      });
  d_x = base->d_x.half;
}

// Forward runs of the case on 2, 3 and 5 threads give the bits of the run on one thread.
void expect_forward_bits_across_threads(const RandomCase<double>& rc, DType io) {
  bits_across_threads(
      {2, 3, 5}, [&] { return std::make_unique<ForwardRun>(rc.problem, rc.in, io); },
      [](const ForwardRun& a, const ForwardRun& b, int threads) {
        EXPECT_TRUE(bitwise_equal(a.cmp_kv.half, b.cmp_kv.half)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(a.softmax_score.f32, b.softmax_score.f32)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(a.kv.f32, b.kv.f32)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(a.cache.f32, b.cache.f32)) << threads << " threads";
      });
}

TEST(Determinism, BackwardBitwiseAcrossThreadCounts) {
  auto rc = make_random_case(chunked_case(), 5);
  round_io_inputs(rc.in, DType::bf16);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 11);
  std::vector<std::uint16_t> d_x;
  expect_backward_bits_across_threads(rc, bd, d_x);
  // And run to run with the default thread count.
  BackwardRun r1(rc.problem, rc.in, bd, DType::bf16), r2(rc.problem, rc.in, bd, DType::bf16);
  ASSERT_TRUE(r1.run().ok());
  ASSERT_TRUE(r2.run().ok());
  EXPECT_TRUE(bitwise_equal(r1.d_wkv.half, r2.d_wkv.half));
  EXPECT_TRUE(bitwise_equal(r1.d_x.half, d_x));
}

// The products set the OpenMP limit of their worker tasks to 1 (so oneDNN
// runs each tile on its own thread); the caller's limit must not change.
TEST(Determinism, CallerOpenMpLimitIsUnchanged) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(3);
  auto rc = make_random_case(chunked_case(), 14);
  round_io_inputs(rc.in, DType::bf16);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 15);
  for (int threads : {0, 1, 2}) {
    Options o;
    o.num_threads = threads;
    ForwardRun f(rc.problem, rc.in, DType::bf16);
    ASSERT_TRUE(f.run(o).ok());
    EXPECT_EQ(omp_get_max_threads(), 3) << "after a forward with num_threads " << threads;
    BackwardRun b(rc.problem, rc.in, bd, DType::bf16);
    ASSERT_TRUE(b.run(o).ok());
    EXPECT_EQ(omp_get_max_threads(), 3) << "after a backward with num_threads " << threads;
  }
  omp_set_num_threads(saved);
}

TEST(Determinism, ForwardBitwiseAcrossThreadCounts) {
  auto rc = make_random_case(chunked_case(), 6);
  round_io_inputs(rc.in, DType::f16);
  expect_forward_bits_across_threads(rc, DType::f16);
}

// Narrow column runs (D of one to three 16-column slices: under two per thread): the forward deals whole
// blocks to the threads where no cache slot aliases, and keeps its column walk where slots do (batch 1
// given batch 0's cache blocks). Either way the bits of the column walk on one thread.
TEST(Determinism, NarrowColumnsBitwiseAcrossThreadCounts) {
  std::uint64_t seed = 40;
  for (const std::int64_t D : {16, 40})
    for (const int mode : {1, 2})
      for (const bool th : {false, true})
        for (const bool alias : {false, true}) {
          RandomOptions o;
          o.th = th;
          o.B = 4;
          o.S = 300;
          o.H = 24;
          o.D = D;
          o.cache_mode = mode;
          o.block_size = 16;
          o.max_start_pos = 9;
          auto rc = make_random_case(o, ++seed);
          if (alias) {  // batch 1 reads and writes the cache blocks of batch 0
            auto& table = rc.in.cache.block_table;
            const auto cols = static_cast<std::ptrdiff_t>(rc.in.cache.table_cols);
            std::copy(table.begin(), table.begin() + cols, table.begin() + cols);
          }
          round_io_inputs(rc.in, DType::bf16);
          SCOPED_TRACE("D " + std::to_string(D) + ", cache mode " + std::to_string(mode) +
                       (th ? ", TH" : ", BSH") + (alias ? ", aliased slots" : ""));
          expect_forward_bits_across_threads(rc, DType::bf16);
        }
}

// A decode call of four sequences of one token, each closing a block whose other rows are cache rows:
// on 1 and 2 threads the forward deals the four blocks to the threads (whole rows), on 3 and 5 (under two
// blocks per thread) each thread walks its run of columns. D = 160 is ten slices, so the column runs
// are wide. Both walks must give the same bits, the cache writes included.
TEST(Determinism, DecodeBlocksDealtOrWalkedBitwiseEqual) {
  std::uint64_t seed = 60;
  for (const std::int64_t coff : {1, 2})
    for (const int mode : {1, 2})
      for (const bool th : {false, true}) {
        RandomOptions o;
        o.th = th;
        o.B = 4;
        o.S = 1;
        o.H = 24;
        o.D = 160;
        o.coff = coff;
        o.r = 4;
        o.cache_mode = mode;
        o.block_size = 16;
        o.start_pos = {7, 11, 3, 15};  // (start_pos + 1) % r == 0: every sequence closes a block
        o.seqused = {1, 1, 1, 1};
        o.lengths = {1, 1, 1, 1};
        auto rc = make_random_case(o, ++seed);
        round_io_inputs(rc.in, DType::bf16);
        SCOPED_TRACE("coff " + std::to_string(coff) + ", cache mode " + std::to_string(mode) +
                     (th ? ", TH" : ", BSH"));
        expect_forward_bits_across_threads(rc, DType::bf16);
      }
}

// Rows of H = 200 and C = 80 span more than one 64-column block of oneDNN's packed layout, so where B is
// packed (AMX, KVCOMP_KERNELS=+packed) a call with more threads than matrices packs them in column slices
// (bf16_pack_b), and every slice must land where one whole reorder puts it.
TEST(Determinism, WideBf16CallsBitwiseAcrossThreadCounts) {
  RandomOptions opts;
  opts.B = 2;
  opts.S = 200;
  opts.H = 200;
  opts.D = 40;
  opts.coff = 2;
  opts.r = 4;
  opts.max_start_pos = 9;
  auto rc = make_random_case(opts, 12);
  round_io_inputs(rc.in, DType::bf16);
  expect_forward_bits_across_threads(rc, DType::bf16);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 13);
  std::vector<std::uint16_t> d_x;
  expect_backward_bits_across_threads(rc, bd, d_x);
}

// Spec 2.7: no compressed block at all => four all-zero outputs, even though
// the output memory held other values before the call.
TEST(NoBlocks, BackwardWritesZeros) {
  RandomOptions o;
  o.B = 2;
  o.S = 6;
  o.r = 4;
  o.start_pos = {1, 2};
  o.seqused = {2, 1};  // sp + used = 3: below the first block boundary (4)
  auto rc = make_random_case(o, 3);
  round_io_inputs(rc.in, DType::bf16);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 4);
  BackwardRun run(rc.problem, rc.in, bd, DType::bf16);
  ASSERT_TRUE(run.run().ok());
  for (const Buffer* b : {&run.d_x, &run.d_wkv, &run.d_wgate, &run.d_ape}) {
    const auto v = b->values();
    for (double e : v) ASSERT_EQ(e, 0.0);
  }
  // The oracle agrees.
  const auto g = backward_goldens(rc.problem, rc.in, bd, DType::bf16);
  for (double e : g.high.d_wkv) ASSERT_EQ(e, 0.0);
}

// The library's own forward intermediates fed into its backward equal the
// oracle chain (forward then backward, both float64).
TEST(Chain, ForwardIntermediatesIntoBackward) {
  for (int coff : {1, 2}) {
    RandomOptions o;
    o.th = coff == 2;
    o.B = 3;
    o.S = 23;
    o.H = 32;
    o.D = 24;
    o.coff = coff;
    o.r = 5;
    o.max_start_pos = 12;
    auto rc = make_random_case(o, 17 + static_cast<std::uint64_t>(coff));
    const DType io = DType::bf16;
    round_io_inputs(rc.in, io);
    const ref::Problem& p = rc.problem;
    ForwardRun fwd(p, rc.in, io);
    ASSERT_TRUE(fwd.run().ok());
    // Upstream gradient and the intermediates our forward exported.
    BackwardData bd = make_backward_data(p, rc.in, io, 23);
    bd.softmax_score = fwd.softmax_score.values();
    bd.kv = fwd.kv.values();
    BackwardRun bwd(p, rc.in, bd, io);
    ASSERT_TRUE(bwd.run().ok());
    // Oracle chain: float64 forward intermediates into the float64 backward.
    const BackwardData oracle = make_backward_data(p, rc.in, io, 23);
    const auto g = backward_goldens(p, rc.in, oracle, io);
    KVCOMP_EXPECT_THREE_WAY("chain d_x", bwd.d_x.values(), g.same.d_x, g.high.d_x, io);
    KVCOMP_EXPECT_THREE_WAY("chain d_wkv", bwd.d_wkv.values(), g.same.d_wkv, g.high.d_wkv, io);
    KVCOMP_EXPECT_THREE_WAY("chain d_wgate", bwd.d_wgate.values(), g.same.d_wgate, g.high.d_wgate, io);
    KVCOMP_EXPECT_THREE_WAY("chain d_ape", bwd.d_ape.values(), g.same.d_ape, g.high.d_ape, DType::f32);
  }
}

TEST(TwoPhase, WorkspaceTooSmallIsRejectedAndWritesNothing) {
  RandomOptions o;
  auto rc = make_random_case(o, 8);
  round_io_inputs(rc.in, DType::bf16);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 9);
  BackwardRun run(rc.problem, rc.in, bd, DType::bf16);
  BackwardPlan plan;
  ASSERT_TRUE(plan_backward(run.args, {}, &plan).ok());
  ASSERT_GT(plan.workspace_size(), 0u);
  std::vector<unsigned char> ws(plan.workspace_size());
  const auto before = run.d_x.half;
  const Status s = execute(plan, ws.data(), plan.workspace_size() - 1);
  EXPECT_EQ(s.code, StatusCode::invalid_param);
  EXPECT_NE(s.message.find("workspace_size"), std::string::npos) << s.message;
  EXPECT_EQ(run.d_x.half, before);
  // The right size works, and twice in a row gives the same bits.
  ASSERT_TRUE(execute(plan, ws.data(), ws.size()).ok());
  const auto first = run.d_x.half;
  ASSERT_TRUE(execute(plan, ws.data(), ws.size()).ok());
  EXPECT_EQ(run.d_x.half, first);
}

// The workspace is scratch: execute must not read anything it did not write
// there first. One-call runs (the workspace is kept from the previous call on
// this thread) and two-phase runs on workspaces filled with NaN patterns,
// zeros and 0x5A bytes, at an odd address, all give the same bits.
TEST(TwoPhase, WorkspaceContentsAndAlignmentDoNotMatter) {
  auto rc = make_random_case(chunked_case(), 12);
  round_io_inputs(rc.in, DType::bf16);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 13);
  BackwardRun base(rc.problem, rc.in, bd, DType::bf16);
  ForwardRun fbase(rc.problem, rc.in, DType::bf16);
  release_cached_workspace();
  ASSERT_TRUE(base.run().ok());
  ASSERT_TRUE(fbase.run().ok());
  for (int fill_byte : {0x00, 0xff, 0x5a, 0x7f}) {
    const auto fill = static_cast<unsigned char>(fill_byte);
    BackwardRun b(rc.problem, rc.in, bd, DType::bf16);
    BackwardPlan bp;
    ASSERT_TRUE(plan_backward(b.args, {}, &bp).ok());
    std::vector<unsigned char> ws(bp.workspace_size() + 1, fill);
    ASSERT_TRUE(execute(bp, ws.data() + 1, bp.workspace_size()).ok());
    EXPECT_TRUE(bitwise_equal(base.d_x.half, b.d_x.half)) << int{fill};
    EXPECT_TRUE(bitwise_equal(base.d_wkv.half, b.d_wkv.half)) << int{fill};
    EXPECT_TRUE(bitwise_equal(base.d_wgate.half, b.d_wgate.half)) << int{fill};
    EXPECT_TRUE(bitwise_equal(base.d_ape.f32, b.d_ape.f32)) << int{fill};

    ForwardRun f(rc.problem, rc.in, DType::bf16);
    ForwardPlan fp;
    ASSERT_TRUE(plan_forward(f.args, {}, &fp).ok());
    std::vector<unsigned char> fws(fp.workspace_size() + 1, fill);
    ASSERT_TRUE(execute(fp, fws.data() + 1, fp.workspace_size()).ok());
    EXPECT_TRUE(bitwise_equal(fbase.cmp_kv.half, f.cmp_kv.half)) << int{fill};
    EXPECT_TRUE(bitwise_equal(fbase.softmax_score.f32, f.softmax_score.f32)) << int{fill};
    EXPECT_TRUE(bitwise_equal(fbase.kv.f32, f.kv.f32)) << int{fill};
    EXPECT_TRUE(bitwise_equal(fbase.cache.f32, f.cache.f32)) << int{fill};
  }
  // The kept one-call workspace now holds the last run's data.
  BackwardRun again(rc.problem, rc.in, bd, DType::bf16);
  ASSERT_TRUE(again.run().ok());
  EXPECT_TRUE(bitwise_equal(base.d_x.half, again.d_x.half));
  EXPECT_TRUE(bitwise_equal(base.d_wkv.half, again.d_wkv.half));
}

TEST(TwoPhase, WorkspaceDoesNotGrowWithTokens) {
  RandomOptions o;
  o.th = true;
  o.B = 1;
  o.allow_empty_segments = false;
  std::size_t sizes[2];
  int i = 0;
  for (std::int32_t len : {3000, 30000}) {
    o.lengths = {len};
    o.S = len;
    auto rc = make_random_case(o, 1);
    const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 2);
    BackwardRun run(rc.problem, rc.in, bd, DType::bf16);
    BackwardPlan plan;
    ASSERT_TRUE(plan_backward(run.args, {}, &plan).ok());
    sizes[i++] = plan.workspace_size();
  }
  EXPECT_EQ(sizes[0], sizes[1]);
}

}  // namespace
}  // namespace kvcomp::test
