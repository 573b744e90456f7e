// How the CUDA drivers walk a call (plain C++, no CUDA): the batches as the
// kernels read them, and the chunks of token rows with the blocks each
// visits. Built from the block plan when planning (chunk_plan.cpp); the
// device plan (cuda/common.hpp) adds the device copies.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/block_plan.hpp"

namespace kvcomp::detail::cuda {

// One batch as the kernels read it (BatchSpan plus its first block index).
struct DevBatch {
  long long base, len, sp, used, limit, k0, nblocks, out_row, first_block;
};

// One chunk of token rows [a, b) and the blocks its kernels visit.
struct Chunk {
  std::int64_t a = 0, b = 0;
  std::int64_t g_lo = 0, g_hi = 0;  // global block indices [g_lo, g_hi)
  bool has_grad = false;            // backward: some row of the chunk receives gradient
  bool all_grad = false;            // backward: every row does
};

// Token rows per chunk of each operator. Fixed (never chosen at run time), so
// results depend on the inputs only and the workspace is bounded.
constexpr std::int64_t kForwardChunkRows = 16384;
constexpr std::int64_t kBackwardChunkRows = 4096;

struct ChunkPlan {
  std::vector<DevBatch> batches;
  std::vector<std::int32_t> block_batch;  // [total_blocks]: the batch of each block
  std::int64_t total_blocks = 0;
  std::int64_t chunk_rows = 0;
  std::vector<Chunk> chunks;
  std::int64_t max_chunk_blocks = 0;
  bool serial = false;  // forward: cache slots alias, so writes and reads keep the spec's order
};

// Forward chunks visit the blocks whose last row lies in the chunk, backward
// chunks those with a gradient row in it.
ChunkPlan make_chunk_plan(const BlockPlan& plan, std::int64_t chunk_rows, bool forward);

}  // namespace kvcomp::detail::cuda
