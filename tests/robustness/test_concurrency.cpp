// Thread safety: the library keeps no mutable global state, so independent
// calls from many threads at once must give exactly what the same calls give
// one after another. Run under ThreadSanitizer by scripts/test-sanitizers.sh.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "harness.hpp"

namespace kvcomp::test {
namespace {

constexpr int kThreads = 8;

// Everything one thread works on: its own problem, inputs and outputs.
struct Job {
  RandomCase<double> rc;
  BackwardData bd;
  DType io;
  std::unique_ptr<ForwardRun> fwd;
  std::unique_ptr<BackwardRun> bwd;

  Job(int i) : io(i % 3 == 0 ? DType::f16 : DType::bf16) {
    RandomOptions o;
    o.th = i % 2 == 1;  // both layouts, both cache modes, both coff values
    o.cache_mode = i % 4 < 2 ? 1 : 2;
    o.coff = i % 3 == 2 ? 1 : 2;
    o.B = 2 + i % 3;
    o.S = 24 + 4 * i;
    o.H = 48;
    o.D = 8;
    o.r = 4;
    rc = make_random_case(o, 1000 + static_cast<std::uint64_t>(i));
    round_io_inputs(rc.in, io);
    bd = make_backward_data(rc.problem, rc.in, io, 2000 + static_cast<std::uint64_t>(i));
    reset();
  }
  // Fresh outputs and a fresh state cache (the forward updates it in place).
  void reset() {
    fwd = std::make_unique<ForwardRun>(rc.problem, rc.in, io);
    bwd = std::make_unique<BackwardRun>(rc.problem, rc.in, bd, io);
  }
  void run(Status* fs, Status* bs) {
    *fs = fwd->run();
    *bs = bwd->run();
  }
};

// Bitwise view of every output buffer of a job, forward then backward.
std::vector<std::vector<unsigned char>> snapshot(Job& j) {
  std::vector<std::vector<unsigned char>> out;
  auto add = [&out](Buffer& b) {
    const auto* p = static_cast<const unsigned char*>(b.data());
    const std::size_t n = b.size() * (b.dtype == DType::bf16 || b.dtype == DType::f16 ? 2 : 4);
    out.emplace_back(p, p + n);
  };
  add(j.fwd->cmp_kv);
  add(j.fwd->softmax_score);
  add(j.fwd->kv);
  add(j.fwd->cache);
  add(j.bwd->d_x);
  add(j.bwd->d_wkv);
  add(j.bwd->d_wgate);
  add(j.bwd->d_ape);
  return out;
}

TEST(Concurrency, EightThreadsBothOpsEqualSerialBitwise) {
  std::vector<std::unique_ptr<Job>> jobs;
  for (int i = 0; i < kThreads; ++i) jobs.push_back(std::make_unique<Job>(i));

  // Serial: one call after another on this thread.
  std::vector<std::vector<std::vector<unsigned char>>> serial;
  for (auto& j : jobs) {
    Status fs, bs;
    j->run(&fs, &bs);
    ASSERT_TRUE(fs.ok()) << fs.message;
    ASSERT_TRUE(bs.ok()) << bs.message;
    serial.push_back(snapshot(*j));
    j->reset();
  }

  // Concurrent: all jobs at once, each started on its own thread, several
  // rounds so that the calls overlap in different orders.
  for (int round = 0; round < 3; ++round) {
    std::vector<Status> fs(kThreads), bs(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i)
      threads.emplace_back([&, i] {
        jobs[static_cast<std::size_t>(i)]->run(&fs[static_cast<std::size_t>(i)],
                                               &bs[static_cast<std::size_t>(i)]);
      });
    for (auto& t : threads) t.join();
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      ASSERT_TRUE(fs[i].ok()) << fs[i].message;
      ASSERT_TRUE(bs[i].ok()) << bs[i].message;
      const auto got = snapshot(*jobs[i]);
      ASSERT_EQ(got.size(), serial[i].size());
      for (std::size_t k = 0; k < got.size(); ++k)
        EXPECT_EQ(got[k], serial[i][k]) << "job " << i << " output " << k << " round " << round;
      jobs[i]->reset();
    }
  }
}

// The same plan cannot be shared mid-flight, but many threads may plan and
// execute their own calls over the same read-only inputs at once.
TEST(Concurrency, SharedReadOnlyInputsSeparateOutputs) {
  Job base(1);
  Status fs, bs;
  base.run(&fs, &bs);
  ASSERT_TRUE(bs.ok()) << bs.message;
  std::vector<std::unique_ptr<BackwardRun>> runs;
  for (int i = 0; i < kThreads; ++i)
    runs.push_back(std::make_unique<BackwardRun>(base.rc.problem, base.rc.in, base.bd, base.io));
  // Every thread reads thread 0's inputs and writes its own outputs.
  std::vector<Status> st(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      BackwardArgs a = runs[static_cast<std::size_t>(i)]->args;
      const BackwardArgs& shared = runs[0]->args;
      a.x = shared.x;
      a.wkv = shared.wkv;
      a.wgate = shared.wgate;
      a.d_cmp_kv = shared.d_cmp_kv;
      a.softmax_score = shared.softmax_score;
      a.kv = shared.kv;
      a.cu_seqlens = shared.cu_seqlens;
      a.seqused = shared.seqused;
      a.start_pos = shared.start_pos;
      st[static_cast<std::size_t>(i)] = compressor_backward(a);
    });
  for (auto& t : threads) t.join();
  for (std::size_t i = 0; i < runs.size(); ++i) {
    ASSERT_TRUE(st[i].ok()) << st[i].message;
    EXPECT_EQ(runs[i]->d_x.half, base.bwd->d_x.half) << "thread " << i;
    EXPECT_EQ(runs[i]->d_wkv.half, base.bwd->d_wkv.half) << "thread " << i;
    EXPECT_EQ(runs[i]->d_wgate.half, base.bwd->d_wgate.half) << "thread " << i;
    EXPECT_EQ(runs[i]->d_ape.f32, base.bwd->d_ape.f32) << "thread " << i;
  }
}

}  // namespace
}  // namespace kvcomp::test
