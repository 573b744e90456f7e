// Prepared weights (kvcomp.hpp: prepare_weights): a forward call that names them gives the oracle's
// results over the whole sweep, bitwise those of the same call without them, and a blob that does
// not belong to the call is refused before anything is written.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "sweep.hpp"

namespace kvcomp::test {
namespace {

// Prepares this run's weights into `blob` and names them in its args.
void prepare(ForwardRun& r, std::vector<unsigned char>& blob, const Options& o = {}) {
  std::size_t bytes = 0;
  ASSERT_TRUE(prepared_weights_size(r.args.wkv, r.args.wgate, &bytes).ok());
  ASSERT_GE(bytes, 64u);
  blob.assign(bytes, 0xA5);
  const Status s = prepare_weights(r.args.wkv, r.args.wgate, blob.data(), bytes, o);
  ASSERT_TRUE(s.ok()) << s.message;
  r.args.prepared_weights = blob.data();
  r.args.prepared_weights_bytes = bytes;
}

class PreparedSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(PreparedSweep, ForwardMatchesOracle) {
  check_forward(GetParam(), [](ForwardRun& r, const Options& o) {
    std::vector<unsigned char> blob;
    prepare(r, blob);
    return r.run(o);
  });
}

bool same_bits(const Buffer& a, const Buffer& b) {
  if (a.dtype != b.dtype || a.size() != b.size()) return false;
  const std::size_t n = a.size() * (a.dtype == DType::f32 || a.dtype == DType::i32 ? 4 : 2);
  return std::memcmp(const_cast<Buffer&>(a).data(), const_cast<Buffer&>(b).data(), n) == 0;
}

TEST_P(PreparedSweep, BitwiseTheCallWithout) {
  const SweepCase& c = GetParam();
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun plain(rc.problem, rc.in, c.io), prepared(rc.problem, rc.in, c.io);
  std::vector<unsigned char> blob;
  // Prepared with another thread count than the call: neither may change a bit.
  Options two;
  two.num_threads = 2;
  prepare(prepared, blob, two);
  ASSERT_TRUE(plain.run().ok());
  const Status s = prepared.run();
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_TRUE(same_bits(plain.cmp_kv, prepared.cmp_kv));
  EXPECT_TRUE(same_bits(plain.softmax_score, prepared.softmax_score));
  EXPECT_TRUE(same_bits(plain.kv, prepared.kv));
  EXPECT_TRUE(same_bits(plain.cache, prepared.cache));
}

INSTANTIATE_TEST_SUITE_P(Issue17, PreparedSweep, ::testing::ValuesIn(sweep()),
                         [](const auto& tp) { return tp.param.name; });

// The small rule case, with prepared weights, and the state a refusal must leave.
struct PreparedRules : ::testing::Test {
  RandomCase<double> rc = make_random_case(small_rule_options(false), 17);
  ForwardRun run{rc.problem, rc.in, DType::f16};
  std::vector<unsigned char> blob;
  void SetUp() override { prepare(run, blob); }
  // The call is refused with `code` and `words` in its message, and writes nothing.
  void expect_refused(StatusCode code, const char* words) {
    const auto cache = run.cache.f32;
    const auto out = run.cmp_kv.half;
    const Status s = run.run();
    EXPECT_EQ(s.code, code) << s.message;
    EXPECT_NE(s.message.find(words), std::string::npos) << s.message;
    EXPECT_EQ(run.cache.f32, cache);
    EXPECT_EQ(run.cmp_kv.half, out);
  }
};

TEST_F(PreparedRules, TheBlobOfThisCallIsTaken) {
  const Status s = run.run();
  EXPECT_TRUE(s.ok()) << s.message;
}

TEST_F(PreparedRules, ABlobOfOtherWeightsIsRefused) {
  // Weights with fewer rows: another C.
  Buffer other =
      Buffer::filled(static_cast<std::size_t>((rc.problem.C() - 1) * rc.problem.H), DType::f16, 0.5f);
  const Tensor w = tensor(other, {rc.problem.C() - 1, rc.problem.H});
  std::size_t bytes = 0;
  ASSERT_TRUE(prepared_weights_size(w, w, &bytes).ok());
  std::vector<unsigned char> b2(bytes);
  ASSERT_TRUE(prepare_weights(w, w, b2.data(), bytes).ok());
  run.args.prepared_weights = b2.data();
  run.args.prepared_weights_bytes = bytes;
  expect_refused(StatusCode::invalid_param, "must be prepared from weights like this call's");
}

TEST_F(PreparedRules, ABlobOfAnotherDtypeIsRefused) {
  ForwardRun bf(rc.problem, rc.in, DType::bf16);
  std::vector<unsigned char> b2;
  prepare(bf, b2);
  run.args.prepared_weights = b2.data();
  run.args.prepared_weights_bytes = b2.size();
  expect_refused(StatusCode::invalid_param, "bf16 given");
}

TEST_F(PreparedRules, ACorruptOrShortBlobIsRefused) {
  blob[0] ^= 1;  // the header's magic
  expect_refused(StatusCode::invalid_param, "must come from prepare_weights()");
  blob[0] ^= 1;
  blob[32] ^= 1;  // the header's record of the product kernels: as if made under other ones
  expect_refused(StatusCode::invalid_param, "with these product kernels");
  blob[32] ^= 1;
  run.args.prepared_weights_bytes = 10;
  expect_refused(StatusCode::invalid_param, "too short");
  run.args.prepared_weights_bytes = blob.size() - 1;  // the fp32 copy cut short
  expect_refused(StatusCode::invalid_param, "must hold its");
}

TEST_F(PreparedRules, PlanningRefusesWhatExecuteWould) {
  blob[3] ^= 1;
  ForwardPlan plan;
  const Status s = plan_forward(run.args, Options{}, &plan);
  EXPECT_EQ(s.code, StatusCode::invalid_param) << s.message;
  blob[3] ^= 1;
  ASSERT_TRUE(plan_forward(run.args, Options{}, &plan).ok());
  std::vector<unsigned char> ws(plan.workspace_size());
  blob[3] ^= 1;  // spoiled between the phases: execute checks again
  const Status e = execute(plan, ws.data(), ws.size());
  EXPECT_EQ(e.code, StatusCode::invalid_param) << e.message;
}

TEST_F(PreparedRules, PreparingChecksItsArguments) {
  std::size_t bytes = 0;
  ASSERT_TRUE(prepared_weights_size(run.args.wkv, run.args.wgate, &bytes).ok());
  // fp16 io takes fp32 products: header + [2C, ld >= H] fp32.
  EXPECT_GE(bytes, 64u + 2u * static_cast<std::size_t>(rc.problem.C() * rc.problem.H) * 4u);
  std::vector<unsigned char> b2(bytes);
  EXPECT_EQ(prepare_weights(run.args.wkv, run.args.wgate, b2.data(), bytes - 1).code,
            StatusCode::invalid_param);
  EXPECT_EQ(prepare_weights(run.args.wkv, run.args.wgate, nullptr, bytes).code, StatusCode::null_pointer);
  EXPECT_EQ(prepared_weights_size(run.args.wkv, run.args.wgate, nullptr).code, StatusCode::null_pointer);
  Tensor no_data = run.args.wkv;
  no_data.data = nullptr;
  EXPECT_EQ(prepared_weights_size(no_data, run.args.wgate, &bytes).code, StatusCode::null_pointer);
  Tensor other = run.args.wgate;
  other.shape[0] -= 1;
  EXPECT_EQ(prepared_weights_size(run.args.wkv, other, &bytes).code, StatusCode::shape_error);
  Tensor ints = run.args.wkv;
  ints.dtype = DType::i32;
  EXPECT_EQ(prepared_weights_size(ints, ints, &bytes).code, StatusCode::invalid_param);
  Tensor flat = run.args.wkv;
  flat.rank = 1;
  EXPECT_EQ(prepared_weights_size(flat, flat, &bytes).code, StatusCode::invalid_param);
}

// One-token calls with 16-bit weights (bf16; fp16 on CPUs with F16C) whose C is a multiple of 16 read the
// blob's decode panels where it has them (AVX2 CPUs whose oneDNN runs AVX2 kernels, products/onednn_f32.hpp):
// the oracle's results, bitwise those of the call without the blob; spoiling the panels changes a one-token
// call (so they are what it reads) and leaves a two-token call alone (it reads the fp32 rows).
SweepCase decode_case(std::int64_t B, std::int64_t H, std::int64_t D, std::int64_t coff,
                      std::vector<std::int32_t> start_pos) {
  SweepCase c;
  c.name = "decode";
  c.B = B;
  c.S = 1;
  c.H = H;
  c.D = D;
  c.coff = coff;
  c.r = 4;
  c.start_pos = std::move(start_pos);
  c.random_seqused = false;
  c.forward_seed = 4242 + static_cast<std::uint64_t>(H + D);
  return c;
}

TEST(PreparedDecode, OneTokenCallsReadTheDecodePanels) {
  // H = 1003: four K blocks; C = 32 (one panel of 32 columns per matrix) and C = 80 (64 + 16).
  bool any_panels = false;
  for (const DType io : {DType::bf16, DType::f16})
    for (const auto& [D, coff] : {std::pair<std::int64_t, std::int64_t>{16, 2}, {80, 1}}) {
      SweepCase one = decode_case(1, 1003, D, coff, {3}), two = decode_case(2, 1003, D, coff, {3, 6});
      one.io = two.io = io;
      check_forward(one, [](ForwardRun& r, const Options& o) {
        std::vector<unsigned char> blob;
        prepare(r, blob);
        return r.run(o);
      });
      for (const SweepCase& c : {one, two}) {
        auto rc = make_random_case(c.options(), c.forward_seed);
        round_io_inputs(rc.in, c.io);
        ForwardRun plain(rc.problem, rc.in, c.io), prepared(rc.problem, rc.in, c.io);
        std::vector<unsigned char> blob;
        prepare(prepared, blob);
        const auto C = static_cast<std::size_t>(rc.problem.C()), H = static_cast<std::size_t>(c.H);
        const bool panels = blob.size() >= 64 + 2 * C * H * 4 + 2 * C * H * 2;
        any_panels = any_panels || panels;
        // Spoil the panels (the blob's last 2 * C * H 16-bit values): every weight read from them becomes
        // 0x3F80 (1.0 in bf16, 1.875 in fp16).
        if (panels)
          for (std::size_t i = blob.size() - 2 * C * H * 2; i < blob.size(); i += 2)
            blob[i] = 0x80, blob[i + 1] = 0x3F;
        ASSERT_TRUE(plain.run().ok());
        const Status s = prepared.run();
        ASSERT_TRUE(s.ok()) << s.message;
        // Read where the AVX2 rows kernel runs (not under KVCOMP_ISA=scalar, which ctest also runs), by
        // one-token calls, and by calls of more tokens where kvcomp's kernels run AVX-512; where the
        // kernel's order is probed per shape (oneDNN's AVX-512 sgemm), only if this shape's order is
        // known, so such a call may or may not read them there.
        const std::string kernels = product_kernels();
        const bool read = panels && kernels.find("kvcomp avx2") != std::string::npos &&
                          (c.B == 1 || std::string(kernel_isa()) == "avx512");
        const bool probed = kernels.find("order probed per shape") != std::string::npos;
        const bool same = same_bits(plain.cmp_kv, prepared.cmp_kv);
        const std::string what = std::string(io == DType::f16 ? "fp16" : "bf16") +
                                 ", B = " + std::to_string(c.B) + ", D = " + std::to_string(D);
        if (!read)
          EXPECT_TRUE(same) << what;
        else if (!probed)
          EXPECT_FALSE(same) << what;
        else
          RecordProperty(what + ": panels read", same ? "no" : "yes");
      }
    }
  if (!any_panels)
    GTEST_SKIP() << "this machine's prepared weights hold no decode panels (products/onednn_f32.hpp)";
}

// Decode calls of 1-8 tokens without prepared weights read 16-bit weights where they lie (bf16, and fp16
// on CPUs with F16C, where the AVX2 rows kernel runs: products/onednn_f32.hpp): the oracle's results, bitwise
// those of the same call with prepared weights (fp32 rows or decode panels, converted once by
// prepare_weights).
TEST(PreparedDecode, RawSixteenBitWeightsGiveThePreparedBits) {
  for (const DType io : {DType::bf16, DType::f16})
    for (const std::int64_t B : {1, 3, 8})
      for (const auto& [D, coff] : {std::pair<std::int64_t, std::int64_t>{16, 2}, {80, 1}}) {
        SweepCase c =
            decode_case(B, 1003, D, coff, std::vector<std::int32_t>(static_cast<std::size_t>(B), 3));
        c.io = io;
        check_forward(c, [](ForwardRun& r, const Options& o) { return r.run(o); });
        auto rc = make_random_case(c.options(), c.forward_seed);
        round_io_inputs(rc.in, c.io);
        ForwardRun plain(rc.problem, rc.in, c.io), prepared(rc.problem, rc.in, c.io);
        std::vector<unsigned char> blob;
        prepare(prepared, blob);
        ASSERT_TRUE(plain.run().ok());
        const Status s = prepared.run();
        ASSERT_TRUE(s.ok()) << s.message;
        EXPECT_TRUE(same_bits(plain.cmp_kv, prepared.cmp_kv))
            << (io == DType::f16 ? "fp16" : "bf16") << ", B = " << B << ", D = " << D;
        EXPECT_TRUE(same_bits(plain.cache, prepared.cache));
      }
}

// On more threads than column tiles of 256 (a small layer on a many-core machine), the decode products
// cut the weights into narrower tiles (products/rows.hpp: dealt_tile_cols), down to 64 columns: C = 256
// gives 2 tiles of 256 on one thread and 8 of 64 on twelve. The oracle's results, bitwise those of the
// one-thread call, with and without prepared weights, on the bf16 rows kernel (AVX512-BF16) and the
// AVX2 one on 16-bit weights (fp16 io, or bf16 io without bf16 units).
TEST(PreparedDecode, ManyThreadsCutTheWeightsFinerWithTheSameBits) {
  constexpr int kManyThreads = 12;
  for (const DType io : {DType::bf16, DType::f16})
    for (const std::int64_t B : {1, 8})
      for (const bool with_blob : {false, true}) {
        SweepCase c = decode_case(B, 1003, 128, 2, std::vector<std::int32_t>(static_cast<std::size_t>(B), 3));
        c.io = io;
        const auto run = [with_blob](ForwardRun& r, const Options& o) {
          std::vector<unsigned char> blob;
          if (with_blob) prepare(r, blob);
          return r.run(o);
        };
        check_forward(c, [&](ForwardRun& r, const Options& o) {
          Options many = o;
          many.num_threads = kManyThreads;
          return run(r, many);
        });
        auto rc = make_random_case(c.options(), c.forward_seed);
        round_io_inputs(rc.in, c.io);
        ForwardRun one(rc.problem, rc.in, c.io), many(rc.problem, rc.in, c.io);
        Options o;
        o.num_threads = 1;
        ASSERT_TRUE(run(one, o).ok());
        o.num_threads = kManyThreads;
        const Status s = run(many, o);
        ASSERT_TRUE(s.ok()) << s.message;
        const std::string what = std::string(io == DType::f16 ? "fp16" : "bf16") +
                                 ", B = " + std::to_string(B) + (with_blob ? ", prepared" : "");
        EXPECT_TRUE(same_bits(one.cmp_kv, many.cmp_kv)) << what;
        EXPECT_TRUE(same_bits(one.cache, many.cache)) << what;
      }
}

// A forward that names prepared weights plans no workspace for the form of the weights the blob holds
// (fp32 rows, AMX's packed B or the AVX-512 panels of a long bf16 call; a long fp32-product call of depth
// H >= 1200 may plan room to transpose the fp32 rows, below), runs in exactly the size planned
// with the bits of the call without, and refuses, before writing, a blob swapped after planning for one
// that holds less.
struct PreparedWorkspace : ::testing::Test {
  // One sequence of 1024 tokens: a long call (per-call panels from 128 rows, fp32 rows widened whole).
  static SweepCase long_case(DType io) {
    SweepCase c = decode_case(1, 512, 64, 1, {0});
    c.S = 1024;
    c.io = io;
    return c;
  }
  static std::size_t planned(const ForwardArgs& args) {
    ForwardPlan plan;
    const Status s = plan_forward(args, Options{}, &plan);
    EXPECT_TRUE(s.ok()) << s.message;
    return plan.workspace_size();
  }
};

TEST_F(PreparedWorkspace, NoRoomForWhatTheBlobHolds) {
  for (const DType io : {DType::f16, DType::bf16}) {
    const SweepCase c = long_case(io);
    auto rc = make_random_case(c.options(), c.forward_seed);
    round_io_inputs(rc.in, c.io);
    ForwardRun plain(rc.problem, rc.in, c.io), prepared(rc.problem, rc.in, c.io);
    std::vector<unsigned char> blob;
    prepare(prepared, blob);
    const std::size_t without = planned(plain.args), with = planned(prepared.args);
    const std::string what = io == DType::f16 ? "fp16" : "bf16";
    const auto C = static_cast<std::size_t>(rc.problem.C()), H = static_cast<std::size_t>(c.H);
    if (io == DType::f16)  // fp32 products everywhere: the blob holds the [2C, H] fp32 rows
      EXPECT_GE(without, with + 2 * C * H * sizeof(float)) << what;
    else if (blob.size() > 64)  // packed (AMX), AVX-512 panels or fp32 rows: room the call no longer needs
      EXPECT_LT(with, without) << what;
    else  // bf16 units reading the weights where they lie, no panels: nothing to leave out
      EXPECT_EQ(with, without) << what;

    ForwardPlan plan;
    ASSERT_TRUE(plan_forward(prepared.args, Options{}, &plan).ok());
    std::vector<unsigned char> ws(plan.workspace_size());
    const Status s = execute(plan, ws.data(), ws.size());
    ASSERT_TRUE(s.ok()) << what << ": " << s.message;
    ASSERT_TRUE(plain.run().ok());
    EXPECT_TRUE(same_bits(plain.cmp_kv, prepared.cmp_kv)) << what;
    EXPECT_TRUE(same_bits(plain.softmax_score, prepared.softmax_score)) << what;
    EXPECT_TRUE(same_bits(plain.cache, prepared.cache)) << what;
  }
}

// A long call on fp32 products (fp16 io) whose depth H takes oneDNN's copy-based sgemm (K >= 1200) reads
// the blob's fp32 rows transposed, as [H, 2C], where the products give the same bits from there (forward.cpp,
// gemm_b_plain_same_bits): bitwise the call without the blob, and still the blob's weights, not the
// call's, when they differ (prepare_weights: a stale blob gives the old weights' results). 1100 rows:
// whole row tiles of the products and a part of one, and a chunk and a part of one, whichever the tile.
TEST_F(PreparedWorkspace, ALongFp32CallReadsTheBlobItself) {
  SweepCase c = long_case(DType::f16);
  c.H = 1536;
  c.S = 1100;
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun plain(rc.problem, rc.in, c.io), prepared(rc.problem, rc.in, c.io),
      stale(rc.problem, rc.in, c.io);
  std::vector<unsigned char> blob, stale_blob;
  prepare(prepared, blob);
  prepare(stale, stale_blob);
  // The stale call's own weights change after its blob was made: every value negated.
  for (Buffer* w : {&stale.seq.wkv, &stale.seq.wgate})
    for (std::uint16_t& h : w->half) h ^= 0x8000u;
  ASSERT_TRUE(plain.run().ok());
  for (ForwardRun* r : {&prepared, &stale}) {
    const char* what = r == &prepared ? "prepared" : "stale blob";
    ForwardPlan plan;
    ASSERT_TRUE(plan_forward(r->args, Options{}, &plan).ok()) << what;
    std::vector<unsigned char> ws(plan.workspace_size());
    const Status s = execute(plan, ws.data(), ws.size());
    ASSERT_TRUE(s.ok()) << what << ": " << s.message;
    EXPECT_TRUE(same_bits(plain.cmp_kv, r->cmp_kv)) << what;
    EXPECT_TRUE(same_bits(plain.softmax_score, r->softmax_score)) << what;
    EXPECT_TRUE(same_bits(plain.kv, r->kv)) << what;
    EXPECT_TRUE(same_bits(plain.cache, r->cache)) << what;
  }
}

TEST_F(PreparedWorkspace, ABlobSwappedForOneWithoutPanelsIsRefused) {
  const SweepCase c = long_case(DType::bf16);
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun run(rc.problem, rc.in, c.io);
  std::vector<unsigned char> blob;
  prepare(run, blob);
  std::uint32_t kind = 0;
  std::memcpy(&kind, blob.data() + 8, sizeof kind);  // the header's kind: 0 = in place (prepared.hpp)
  if (kind != 0 || blob.size() == 64)
    GTEST_SKIP() << "this machine's bf16 blob holds no AVX-512 panels (prepared.hpp: in_place kind)";
  ForwardPlan plan;
  ASSERT_TRUE(plan_forward(run.args, Options{}, &plan).ok());
  std::vector<unsigned char> ws(plan.workspace_size());
  // The same header without the panels (data and panel bytes 0), as prepare_weights writes it under
  // KVCOMP_KERNELS=-panels: a valid blob, for which the call writes the panels into its workspace.
  std::vector<unsigned char> bare(blob.begin(), blob.begin() + 64);
  std::memset(bare.data() + 40, 0, 16);
  run.args.prepared_weights = bare.data();
  run.args.prepared_weights_bytes = bare.size();
  EXPECT_GT(planned(run.args), ws.size());
  const auto out = run.cmp_kv.half;
  const auto cache = run.cache.f32;
  // Execute reads the blob the plan's args point at: its header swapped in place (the panels' bytes
  // after it are then unused).
  const std::vector<unsigned char> header(blob.begin(), blob.begin() + 64);
  std::memcpy(blob.data(), bare.data(), bare.size());
  const Status s = execute(plan, ws.data(), ws.size());
  EXPECT_EQ(s.code, StatusCode::invalid_param) << s.message;
  EXPECT_NE(s.message.find("plan the call again"), std::string::npos) << s.message;
  EXPECT_EQ(run.cmp_kv.half, out);
  EXPECT_EQ(run.cache.f32, cache);
  // With the panels back, the same plan runs.
  std::memcpy(blob.data(), header.data(), header.size());
  EXPECT_TRUE(execute(plan, ws.data(), ws.size()).ok());
}

}  // namespace
}  // namespace kvcomp::test
