// The block plan's cache aliasing rule (plan/block_plan.hpp), compiled into
// the test from its source: it decides whether a backend may run the cache
// writes and reads of a forward all at once.
#include <gtest/gtest.h>

#include <vector>

#include "plan/block_plan.hpp"

namespace kvcomp::detail {
namespace {

// BSH, B batches of S tokens, cmp_ratio r, coff, the given start positions.
BlockPlan make_plan(std::int64_t B, std::int64_t S, std::int64_t r, std::int64_t coff,
                    const std::vector<std::int32_t>& start_pos) {
  Dims d;
  d.layout = Layout::bsh;
  d.B = B;
  d.S = S;
  d.T = B * S;
  d.H = 8;
  d.D = 4;
  d.C = coff * d.D;
  d.r = r;
  d.coff = coff;
  BlockPlan p;
  EXPECT_TRUE(BlockPlan::build(d, nullptr, nullptr, start_pos.data(), &p).ok());
  return p;
}

CacheGeometry paged(const std::vector<std::int32_t>& table, std::int64_t cols, std::int64_t bs) {
  return {64, bs, 1, table.data(), cols};
}

TEST(CacheAlias, DistinctBlocksDoNotAlias) {
  // Two batches, positions [8, 16) each, block_size 8: column 0 is read (cache rows of the first
  // block, start_pos 8 with coff 2 reads positions 4..7), column 1 is written.
  const BlockPlan p = make_plan(2, 8, 4, 2, {8, 8});
  const std::vector<std::int32_t> table = {1, 2, 3, 4};
  EXPECT_FALSE(cache_slots_alias(p, paged(table, 2, 8)));
}

TEST(CacheAlias, TwoBatchesWritingOneBlockAlias) {
  const BlockPlan p = make_plan(2, 8, 4, 2, {8, 8});
  const std::vector<std::int32_t> table = {1, 2, 3, 2};
  EXPECT_TRUE(cache_slots_alias(p, paged(table, 2, 8)));
}

TEST(CacheAlias, ABatchReadingWhatAnotherWritesAliases) {
  const BlockPlan p = make_plan(2, 8, 4, 2, {8, 8});
  const std::vector<std::int32_t> table = {1, 2, 2, 4};  // batch 1 reads block 2, batch 0 writes it
  EXPECT_TRUE(cache_slots_alias(p, paged(table, 2, 8)));
}

TEST(CacheAlias, ReadsOfDisjointSlotsOfAWrittenBlockDoNotAlias) {
  // One block of 16 slots per batch: batch 0 reads positions 4..7 and writes 8..15 of block 1.
  const BlockPlan p = make_plan(1, 8, 4, 2, {8});
  const std::vector<std::int32_t> table = {1};
  EXPECT_FALSE(cache_slots_alias(p, paged(table, 1, 16)));
}

TEST(CacheAlias, SkippedWritesToBlockZeroDoNotAlias) {
  // Both batches write through id 0 (mode 1: "do not write") and read distinct blocks.
  const BlockPlan p = make_plan(2, 8, 4, 2, {8, 8});
  const std::vector<std::int32_t> table = {1, 0, 3, 0};
  EXPECT_FALSE(cache_slots_alias(p, paged(table, 2, 8)));
  // Reads of block 0 by one batch and skipped writes to it by another: still no alias.
  const std::vector<std::int32_t> table2 = {0, 0, 3, 0};
  EXPECT_FALSE(cache_slots_alias(p, paged(table2, 2, 8)));
}

TEST(CacheAlias, SharedReadOnlyPrefixDoesNotAlias) {
  const BlockPlan p = make_plan(2, 8, 4, 2, {8, 8});
  const std::vector<std::int32_t> table = {1, 2, 1, 4};  // both read block 1, nobody writes it
  EXPECT_FALSE(cache_slots_alias(p, paged(table, 2, 8)));
}

TEST(CacheAlias, RingBlocksAliasOnlyWhenShared) {
  // Ring: block_size >= coff*r + S - 1 = 15; writes of the tail wrap around the ring.
  const BlockPlan p = make_plan(2, 8, 4, 2, {8, 13});
  const std::vector<std::int32_t> distinct = {0, 1};
  EXPECT_FALSE(cache_slots_alias(p, {4, 15, 2, distinct.data(), 1}));
  const std::vector<std::int32_t> shared = {1, 1};
  EXPECT_TRUE(cache_slots_alias(p, {4, 15, 2, shared.data(), 1}));
}

TEST(CacheAlias, OneBatchMappingTwoColumnsToOneBlockAliases) {
  // Batch 0 writes positions 0..15 through columns 0 and 1, both block 5.
  const BlockPlan p = make_plan(1, 16, 4, 1, {0});
  const std::vector<std::int32_t> table = {5, 5};
  EXPECT_TRUE(cache_slots_alias(p, paged(table, 2, 8)));
}

}  // namespace
}  // namespace kvcomp::detail
