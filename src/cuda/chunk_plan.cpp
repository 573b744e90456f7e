#include "cuda/chunk_plan.hpp"

#include <algorithm>

namespace kvcomp::detail::cuda {

ChunkPlan make_chunk_plan(const BlockPlan& plan, std::int64_t chunk_rows, bool forward) {
  const Dims& d = plan.dims;
  ChunkPlan cp;
  ChunkPlan* out = &cp;
  out->chunk_rows = chunk_rows;
  out->total_blocks = plan.total_blocks;
  // Per block: its batch, its last row and its first gradient row (both
  // non-decreasing in the block index: batches and blocks are in row order).
  std::vector<std::int32_t>& block_batch = out->block_batch;
  std::vector<std::int64_t> last_row, first_row;
  block_batch.reserve(static_cast<std::size_t>(plan.total_blocks));
  long long first_block = 0;
  for (std::size_t bi = 0; bi < plan.batches.size(); ++bi) {
    const BatchSpan& s = plan.batches[bi];
    out->batches.push_back({s.base, s.len, s.sp, s.used, s.limit, s.k0, s.nblocks, s.out_row, first_block});
    for (std::int64_t i = 0; i < s.nblocks; ++i) {
      const std::int64_t k = s.k0 + i;
      block_batch.push_back(static_cast<std::int32_t>(bi));
      last_row.push_back(s.base + (k * d.r + d.r - 1 - s.sp));
      first_row.push_back(s.base + std::max(k * d.r - (d.coff - 1) * d.r, s.sp) - s.sp);
    }
    first_block += s.nblocks;
  }
  // Chunks: the blocks each visits, and (backward) whether its rows get gradient.
  std::size_t g_lo = 0, g_hi = 0, bi = 0;
  for (std::int64_t a = 0; a < d.T; a += chunk_rows) {
    Chunk c;
    c.a = a;
    c.b = std::min(d.T, a + chunk_rows);
    while (g_lo < last_row.size() && last_row[g_lo] < a) ++g_lo;
    if (forward) {
      g_hi = g_lo;
      while (g_hi < last_row.size() && last_row[g_hi] < c.b) ++g_hi;
    } else {
      g_hi = std::max(g_hi, g_lo);
      while (g_hi < first_row.size() && first_row[g_hi] < c.b) ++g_hi;
      while (bi < plan.batches.size() && plan.batches[bi].base + plan.batches[bi].len <= a) ++bi;
      std::int64_t grad_rows = 0;
      for (std::size_t j = bi; j < plan.batches.size() && plan.batches[j].base < c.b; ++j) {
        const BatchSpan& s = plan.batches[j];
        const std::int64_t hi = s.base + std::min(s.len, std::max<std::int64_t>(0, s.limit - s.sp));
        grad_rows += std::max<std::int64_t>(0, std::min(hi, c.b) - std::max(s.base, a));
      }
      c.has_grad = grad_rows > 0;
      c.all_grad = grad_rows == c.b - a;
    }
    c.g_lo = static_cast<std::int64_t>(g_lo);
    c.g_hi = static_cast<std::int64_t>(std::max(g_hi, g_lo));
    out->max_chunk_blocks = std::max(out->max_chunk_blocks, c.g_hi - c.g_lo);
    out->chunks.push_back(c);
  }
  return cp;
}

}  // namespace kvcomp::detail::cuda
