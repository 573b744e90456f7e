// The sweep of the CUDA backend's tests: the CPU suite's cases
// (tests/core/sweep.hpp) plus cases longer than the GPU's chunks.
#pragma once

#include <functional>
#include <vector>

#include "sweep.hpp"

namespace kvcomp::test {

// The CPU sweep, plus cases longer than the GPU's chunks (16384 rows forward,
// 4096 backward) so that blocks and their prev halves straddle them.
inline std::vector<SweepCase> cuda_sweep() {
  std::vector<SweepCase> v = sweep();
  v.push_back({.name = "gpu_chunks_th_r5_coff2",
               .th = true,
               .B = 3,
               .S = 9000,
               .H = 16,
               .D = 8,
               .r = 5,
               .max_start_pos = 12,
               .allow_empty_segments = false});
  v.push_back({.name = "gpu_chunks_bsh_r600_coff2",
               .B = 1,
               .S = 17500,
               .H = 8,
               .D = 4,
               .r = 600,
               .max_start_pos = 650});
  v.push_back(
      {.name = "gpu_chunks_tiny_th", .th = true, .B = 3000, .S = 12, .H = 8, .D = 8, .max_start_pos = 9});
  return v;
}

// Tables whose batches share cache blocks (every batch's row is batch 0's, so
// batch 1 reads slots batch 0 writes): the forward run by `run` must give the
// CPU backend's result, which follows the spec's order. `inspect` sees the
// run's arguments before it runs.
inline void check_shared_cache_blocks(const ForwardRunner& run,
                                      const std::function<void(const ForwardRun&)>& inspect = {}) {
  for (int mode : {1, 2}) {
    SweepCase c{.name = "alias",
                .B = 3,
                .S = 12,
                .H = 16,
                .D = 8,
                .cache_mode = mode,
                .block_size = 32,
                .start_pos = {5, 9, 14},
                .random_seqused = false};
    auto rc = make_random_case(c.options(), c.forward_seed);
    round_io_inputs(rc.in, c.io);
    ForwardRun cpu(rc.problem, rc.in, c.io), ours(rc.problem, rc.in, c.io);
    for (ForwardRun* r : {&cpu, &ours}) {
      const std::size_t cols = mode == 1 ? static_cast<std::size_t>(r->args.state_block_table->dim(1)) : 1;
      for (std::size_t i = 0; i < cols; ++i)
        if (r->table.i32[i] == 0) r->table.i32[i] = 1;
      for (std::size_t b = 1; b < 3; ++b)
        for (std::size_t i = 0; i < cols; ++i) r->table.i32[b * cols + i] = r->table.i32[i];
    }
    if (inspect) inspect(ours);
    ASSERT_TRUE(cpu.run().ok());
    const Status s = run(ours, {});
    ASSERT_TRUE(s.ok()) << s.message;
    const auto tw = two_way_compare(ours.cmp_kv.values(), cpu.cmp_kv.values(), c.io);
    EXPECT_TRUE(tw.pass) << "mode " << mode << " cmp_kv: " << tw.summary();
    const auto tc = two_way_compare(ours.cache.values(), cpu.cache.values(), c.io);
    EXPECT_TRUE(tc.pass) << "mode " << mode << " cache: " << tc.summary();
  }
}

// Paged tables whose rows repeat one block id (every column of a batch's row
// the same block), so that positions block_size apart in one batch share a
// cache slot and one launch of cache writes meets a slot twice: the result
// must be the CPU's, where the batch's last position wins.
inline void check_repeated_block_ids(const ForwardRunner& run,
                                     const std::function<void(const ForwardRun&)>& inspect = {}) {
  SweepCase c{.name = "repeat",
              .B = 2,
              .S = 12,
              .H = 16,
              .D = 8,
              .cache_mode = 1,
              .block_size = 4,
              .start_pos = {1, 6},
              .random_seqused = false};
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun cpu(rc.problem, rc.in, c.io), ours(rc.problem, rc.in, c.io);
  for (ForwardRun* r : {&cpu, &ours}) {
    const auto cols = static_cast<std::size_t>(r->args.state_block_table->dim(1));
    for (std::size_t b = 0; b < 2; ++b)
      for (std::size_t i = 0; i < cols; ++i) r->table.i32[b * cols + i] = static_cast<std::int32_t>(b + 1);
  }
  if (inspect) inspect(ours);
  ASSERT_TRUE(cpu.run().ok());
  const Status s = run(ours, {});
  ASSERT_TRUE(s.ok()) << s.message;
  const auto tw = two_way_compare(ours.cmp_kv.values(), cpu.cmp_kv.values(), c.io);
  EXPECT_TRUE(tw.pass) << "cmp_kv: " << tw.summary();
  const auto tc = two_way_compare(ours.cache.values(), cpu.cache.values(), c.io);
  EXPECT_TRUE(tc.pass) << "cache: " << tc.summary();
}

}  // namespace kvcomp::test
