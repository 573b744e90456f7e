// The block phases of the two operators, on one chunk of token rows [a, b):
// the operator logic between the GEMMs. They walk the batches and blocks of
// the plan, write the state cache, assemble each block from cache rows and
// fresh projections, and call the per-column kernels of cpu/simd
// (softmax and reduction, slot gradients) on it.
//
// Both block walks run parallel over column slices of D: every column is processed by
// one thread in a fixed (batch, block, slot) order, so results, including the
// d_ape sums, are bitwise independent of the thread count; and for the
// forward, cache reads and writes of one column happen in the spec's batch
// order (writes of a batch before the reads of its blocks). Where a chunk holds
// two blocks per thread and no slot aliases, the forward deals whole blocks
// instead (every element still computed by one thread, alike).
#pragma once

#include <cstdint>

#include "plan/block_plan.hpp"

namespace kvcomp::detail {

struct BackwardBlockInputs {
  const void* d_cmp_kv = nullptr;        // [out_rows, D], d_cmp_dtype
  DType d_cmp_dtype = DType::f32;        // the io dtype, or f32 (the epilogue's backward wrote it)
  const float* softmax_score = nullptr;  // [out_rows, coff*r, D]
  const float* kv = nullptr;             // [out_rows, coff*r, D]
};

// Writes the gradient cells of dnew [b-a, 2C] (columns [0,C) d_new_kv,
// [C,2C) d_new_score) and adds the chunk's dZ rows into dape [r, C]
// (float64); cells without gradient are not touched, so the caller zeroes
// dnew first. npu_parity rounds dK / dZ to the io dtype (spec 6.1 step 7).
// dnew16 instead of dnew (bf16 io on the bf16 units; dnew null): the cells
// as bf16. npu_parity: the bits of the rounded fp32 values. Precise: the high
// bf16 part of each fp32 value, and its low part into dnew16_lo (the same
// layout; the caller zeroes both), the parts split_bf16 would give.
void backward_blocks(const BlockPlan& plan, const BackwardBlockInputs& in, std::int64_t a, std::int64_t b,
                     float* dnew, std::uint16_t* dnew16, std::uint16_t* dnew16_lo, std::int64_t ld_dnew,
                     double* dape, bool npu_parity, int num_threads);

struct ForwardBlockIo {
  // Projections of global rows [proj_first, b): [rows, 2C], kv then score
  // (score already holds + ape for used tokens).
  const float* proj = nullptr;
  std::int64_t proj_first = 0;
  std::int64_t proj_ld = 0;
  // State cache
  CacheGeometry cache;
  // Outputs
  void* cmp_kv = nullptr;          // io dtype [out_rows, D]
  float* softmax_score = nullptr;  // may be null
  float* kv = nullptr;             // may be null
  // Scratch: forward_scratch_bytes() for each of forward_block_threads() threads.
  void* scratch = nullptr;
  // Set where the call has two blocks per thread and no cache slot that it writes is also read or
  // written again by it (cache_slots_alias false): forward_blocks may then deal whole blocks to the
  // threads. Needs scratch for num_threads threads (forward_block_threads gives that for such calls).
  bool blocks_may_split = false;
};

// Per-thread scratch bytes of forward_blocks (a multiple of 64).
std::size_t forward_scratch_bytes(const Dims& d);
// Threads forward_blocks and backward_blocks use: num_threads, at most one per column slice.
int block_phase_threads(const Dims& d, int num_threads);
// Threads forward_blocks may use (the scratch it needs): all num_threads where a call of these dims may
// hold two blocks per thread (at most T / r + B blocks), else block_phase_threads.
int forward_block_threads(const Dims& d, int num_threads);

// Adds ape to the score projections of used tokens of rows [a, b).
void add_ape(const BlockPlan& plan, const float* ape, float* proj, std::int64_t proj_first,
             std::int64_t proj_ld, std::int64_t a, std::int64_t b, int num_threads);

// Cache writes of rows [a, b) and the blocks whose last row lies in [a, b): in column runs per thread, or,
// where the slots are aliasing-free and the chunk holds two blocks per thread, in shares of the rows and
// of the blocks per thread (whole rows: a decode call's cache slots read as whole runs, not one column
// run per thread). Bitwise the same.
void forward_blocks(const BlockPlan& plan, const ForwardBlockIo& io, std::int64_t a, std::int64_t b,
                    int num_threads);

}  // namespace kvcomp::detail
