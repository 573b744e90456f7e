// The block plan: which compressed block covers which token rows, and which
// rows of a block come from the state cache (spec sections 1.4, 1.7, 2.1).
//
// Blocks are aligned on the global position p = start_pos + s. Batch b owns
// blocks k = sp/r .. limit/r - 1 with limit = trunc(sp + used, r); the first
// one is partial when sp % r != 0 (its first sp % r cur slots are cache rows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

enum class Layout { bsh, th };

// Everything the shapes say, derived once by validation.
struct Dims {
  Layout layout = Layout::bsh;
  DType io = DType::bf16;
  std::int64_t B = 0, S = 0, T = 0;  // S: BSH padded length; T: token rows of x
  std::int64_t H = 0, D = 0, C = 0;  // C = coff * D
  std::int64_t r = 0, coff = 1;
  bool gate = true;  // false: no wgate (cmp_ratio 1, coff 1): every score 0 (+ ape), no gate product
};

struct BatchSpan {
  std::int64_t base = 0;     // flat row of token s = 0
  std::int64_t len = 0;      // tokens in x for this batch
  std::int64_t sp = 0;       // start position
  std::int64_t used = 0;     // seqused
  std::int64_t limit = 0;    // trunc(sp + used, r): positions >= limit are the uncompressed tail
  std::int64_t k0 = 0;       // first block index (global, = sp / r)
  std::int64_t nblocks = 0;  // compressed blocks of this batch
  std::int64_t out_row = 0;  // flat output row of its first block
};

struct BlockPlan {
  Dims dims;
  std::vector<BatchSpan> batches;
  std::int64_t total_blocks = 0;

  // Reads the sequence description (int32 host data, any may be null = absent)
  // and checks the data rules of spec 4.4: cu_seqlens starts at 0, is
  // non-decreasing and ends at T; 0 <= seqused <= len; start_pos >= 0 and
  // start_pos + len fits in int32. Writes *out only on success.
  static Status build(const Dims& dims, const std::int32_t* cu_seqlens, const std::int32_t* seqused,
                      const std::int32_t* start_pos, BlockPlan* out);
};

// Index of the first batch whose rows reach past `row` (batches are in row
// order); plan.batches.size() if none.
std::size_t first_batch_ending_after(const BlockPlan& plan, std::int64_t row);

// Where the forward reads and writes the state cache: the view both backends take of a call's
// state_cache and state_block_table.
struct CacheGeometry {
  std::int64_t block_num = 0, block_size = 0;
  int cache_mode = 1;                   // 1 paged, 2 ring
  const std::int32_t* table = nullptr;  // the block table's data (host, or device memory on a GPU)
  std::int64_t table_cols = 1;          // cache_mode 1: columns of the table
  float* data = nullptr;                // the cache: [block_num, block_size, slot_width] fp32
  std::int64_t stride0 = 0;             // elements from one block to the next (dim 0 may be strided)
  std::int64_t slot_width = 0;          // floats per slot: 2 C, the kv state then the score state
};

// Whether the forward of this plan writes a cache slot that it also reads or
// writes elsewhere (tables that map two positions, of one batch or of two, to
// the same slot). Without such aliasing the order of the cache writes and
// reads cannot change a result, and a backend may run them all at once;
// with it, the spec's order (batch after batch, a batch's writes before its
// reads) decides. The plan and table must have passed validation.
bool cache_slots_alias(const BlockPlan& plan, const CacheGeometry& cache);
// The geometry of a forward call's cache, its block table read from `table` (args.state_block_table's
// data, or a host copy of device memory).
CacheGeometry cache_geometry(const ForwardArgs& args, const std::int32_t* table);
// The same with the table where the call's tensor holds it.
inline CacheGeometry cache_geometry(const ForwardArgs& args) {
  return cache_geometry(args, static_cast<const std::int32_t*>(args.state_block_table->data));
}

// Row source of slot (half c, slot t) of block k in batch span `bs`:
// position p = k*r + t - (coff-1-c)*r. Fresh when p >= sp.
inline std::int64_t slot_position(const Dims& d, std::int64_t k, std::int64_t c, std::int64_t t) {
  return k * d.r + t - (d.coff - 1 - c) * d.r;
}

}  // namespace kvcomp::detail
