#include "cpu/block_phases.hpp"

#include <emmintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "cpu/simd/kernels.hpp"
#include "cpu/stream_store.hpp"

namespace kvcomp::detail {

namespace {

std::int64_t slices(const Dims& d) { return (d.D + kSlice - 1) / kSlice; }

// The columns [lo, hi) of D this thread of an OpenMP team owns: a contiguous run of whole slices (empty
// for a thread beyond the slice count).
struct ColumnRun {
  std::int64_t lo, hi;
};
ColumnRun thread_columns(const Dims& d) {
  const std::int64_t ns = slices(d), nt = omp_get_num_threads(), tid = omp_get_thread_num();
  return {std::min(d.D, ns * tid / nt * kSlice), std::min(d.D, ns * (tid + 1) / nt * kSlice)};
}

// Token range [lo, hi) of batch `s` (local indices) inside rows [a, b).
struct LocalRange {
  std::int64_t lo, hi;
};
LocalRange local_range(const BatchSpan& s, std::int64_t a, std::int64_t b) {
  return {std::max(a, s.base) - s.base, std::min(b, s.base + s.len) - s.base};
}

float* cache_slot(const ForwardBlockIo& io, std::int64_t batch, std::int64_t pos, bool for_write) {
  const CacheGeometry& c = io.cache;
  std::int64_t id;
  if (c.cache_mode == 1) {
    id = c.table[batch * c.table_cols + pos / c.block_size];
    if (for_write && id == 0) return nullptr;  // block id 0: "do not write"
  } else {
    id = c.table[batch];
  }
  return c.data + id * c.stride0 + (pos % c.block_size) * c.slot_width;
}

}  // namespace

void backward_blocks(const BlockPlan& plan, const BackwardBlockInputs& in, std::int64_t a, std::int64_t b,
                     float* dnew, std::uint16_t* dnew16, std::uint16_t* dnew16_lo, std::int64_t ld_dnew,
                     double* dape, bool npu_parity, int num_threads) {
  const Dims& dm = plan.dims;
  const std::int64_t D = dm.D, C = dm.C, r = dm.r, coff = dm.coff, cr = coff * r;
  const std::size_t first = first_batch_ending_after(plan, a);
  const SimdKernels& kern = simd_kernels();
  const DType parity = npu_parity ? dm.io : DType::f32;
  const auto* dcmp = static_cast<const unsigned char*>(in.d_cmp_kv);
  const std::size_t io_size = dtype_size(in.d_cmp_dtype);
  // As in forward_blocks: each thread owns a contiguous run of column slices and does all of them for
  // one block before the next, so the block's saved rows are read once per thread. A column's dape sums
  // keep their order (blocks in order), and no two threads share a column.
#pragma omp parallel num_threads(block_phase_threads(dm, num_threads))
  {
    const auto [col_lo, col_hi] = thread_columns(dm);
    float dc[kSlice];
    double wsum[kSlice];
    for (std::size_t bi = first; col_lo < col_hi && bi < plan.batches.size() && plan.batches[bi].base < b;
         ++bi) {
      const BatchSpan& s = plan.batches[bi];
      if (s.nblocks == 0) continue;
      LocalRange lr = local_range(s, a, b);
      lr.hi = std::min(lr.hi, s.limit - s.sp);  // tokens past the compressed region get no gradient
      if (lr.lo >= lr.hi) continue;
      const std::int64_t k_first = std::max(s.k0, (lr.lo + s.sp) / r);
      const std::int64_t k_last = std::min(s.k0 + s.nblocks - 1, (lr.hi - 1 + s.sp) / r + (coff - 1));
      for (std::int64_t k = k_first; k <= k_last; ++k) {
        const std::int64_t orow = s.out_row + (k - s.k0);
        for (std::int64_t d0 = col_lo; d0 < col_hi; d0 += kSlice) {
          const std::int64_t w = std::min(D, d0 + kSlice) - d0;
          const float* S = in.softmax_score + orow * cr * D + d0;
          const float* K = in.kv + orow * cr * D + d0;
          kern.to_f32(dcmp + static_cast<std::size_t>(orow * D + d0) * io_size, in.d_cmp_dtype, dc, w);
          // w = sum_j S_j K_j over every row of the block (cache rows included):
          // products of two floats are exact in float64 and the sum of at most
          // 2048 of them loses ~11 bits of 53, far below fp32 resolution.
          kern.block_dot(S, K, cr, D, w, wsum);
          for (std::int64_t t = 0; t < r; ++t) {
            for (std::int64_t c = 0; c < coff; ++c) {
              const std::int64_t pos = slot_position(dm, k, c, t);
              if (pos < s.sp) continue;  // cache or placeholder row: no gradient (spec 2.3)
              const std::int64_t tok = pos - s.sp;
              if (tok < lr.lo || tok >= lr.hi) continue;
              const std::int64_t j = t * coff + c;
              const std::int64_t at = (s.base + tok - a) * ld_dnew + c * D + d0;
              if (dnew16)
                kern.slot_grad_bf16(S + j * D, K + j * D, dc, wsum, w, dnew16 + at, dnew16 + at + C,
                                    dnew16_lo ? dnew16_lo + at : nullptr,
                                    dnew16_lo ? dnew16_lo + at + C : nullptr, dape + t * C + c * D + d0);
              else
                kern.slot_grad(S + j * D, K + j * D, dc, wsum, w, parity, dnew + at, dnew + at + C,
                               dape + t * C + c * D + d0);
            }
          }
        }
      }
    }
  }
}

void add_ape(const BlockPlan& plan, const float* ape, float* proj, std::int64_t proj_first,
             std::int64_t proj_ld, std::int64_t a, std::int64_t b, int num_threads) {
  const Dims& dm = plan.dims;
  const std::int64_t C = dm.C;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t row = a; row < b; ++row) {
    const std::size_t bi = first_batch_ending_after(plan, row);
    if (bi >= plan.batches.size()) continue;
    const BatchSpan& s = plan.batches[bi];
    const std::int64_t tok = row - s.base;
    if (tok < 0 || tok >= s.used) continue;  // tokens past seqused are never used
    const float* bias = ape + ((s.sp + tok) % dm.r) * C;
    float* score = proj + (row - proj_first) * proj_ld + C;
    for (std::int64_t i = 0; i < C; ++i) score[i] += bias[i];
  }
}

namespace {

// The blocks of batch s whose last cur row lies in rows [a, b): k in [first, last] (none: last < first).
struct BlockRange {
  std::int64_t first, last;
};
BlockRange chunk_blocks(const Dims& dm, const BatchSpan& s, std::int64_t a, std::int64_t b) {
  if (s.nblocks == 0) return {0, -1};
  const LocalRange lr = local_range(s, a, b);
  return {std::max(s.k0, (lr.lo + s.sp) / dm.r), std::min(s.k0 + s.nblocks - 1, (lr.hi + s.sp) / dm.r - 1)};
}

// Cache writes (spec 1.3) of batch s's tokens in rows [a, b): columns [lo, hi) of each of the coff kv and
// score column groups of each slot.
void write_slots(const ForwardBlockIo& io, const Dims& dm, const BatchSpan& s, std::int64_t batch,
                 std::int64_t a, std::int64_t b, std::int64_t lo, std::int64_t hi) {
  const LocalRange lr = local_range(s, a, b);
  const std::int64_t write_from =
      io.cache.cache_mode == 1 ? s.sp : std::max(s.sp, s.limit - (dm.coff - 1) * dm.r);
  for (std::int64_t tok = lr.lo; tok < std::min(lr.hi, s.used); ++tok) {
    const std::int64_t pos = s.sp + tok;
    if (pos < write_from) continue;
    float* slot = cache_slot(io, batch, pos, true);
    if (!slot) continue;
    const float* src = io.proj + (s.base + tok - io.proj_first) * io.proj_ld;
    for (std::int64_t c = 0; c < dm.coff; ++c) {
      stream_floats(slot + c * dm.D + lo, src + c * dm.D + lo, hi - lo);
      stream_floats(slot + dm.C + c * dm.D + lo, src + dm.C + c * dm.D + lo, hi - lo);
    }
  }
}

// One thread's softmax scratch, carved from the workspace (no allocation in a parallel region: an
// exception cannot leave it).
struct SoftmaxScratch {
  double* e;
  const float** src_kv;
  const float** src_sc;
  const float** row_kv;  // the block's rows at the first column
  const float** row_sc;
};
SoftmaxScratch thread_scratch(const ForwardBlockIo& io, const Dims& dm) {
  const std::int64_t cr = dm.coff * dm.r;
  auto* bytes = static_cast<unsigned char*>(io.scratch) +
                static_cast<std::size_t>(omp_get_thread_num()) * forward_scratch_bytes(dm);
  double* e = reinterpret_cast<double*>(bytes);
  const float** src_kv = reinterpret_cast<const float**>(e + (cr + 1) * kSoftmaxPitch);
  return {e, src_kv, src_kv + cr, src_kv + 2 * cr, src_kv + 3 * cr};
}

// Block k of batch s over columns [col_lo, col_hi): its rows from the cache or the projections, then the
// softmax (and pooling) in runs of kSoftmaxChunk columns.
void forward_block(const ForwardBlockIo& io, const Dims& dm, const BatchSpan& s, std::int64_t batch,
                   std::int64_t k, std::int64_t col_lo, std::int64_t col_hi, const SoftmaxScratch& sp,
                   const SimdKernels& kern) {
  const std::int64_t D = dm.D, C = dm.C, cr = dm.coff * dm.r;
  const std::int64_t orow = s.out_row + (k - s.k0);
  for (std::int64_t t = 0; t < dm.r; ++t)
    for (std::int64_t c = 0; c < dm.coff; ++c) {
      const std::int64_t j = t * dm.coff + c;
      const std::int64_t pos = slot_position(dm, k, c, t);
      if (pos < 0) {  // no history: a placeholder with softmax weight exactly 0
        sp.row_kv[j] = sp.row_sc[j] = nullptr;
      } else if (pos < s.sp) {
        const float* slot = cache_slot(io, batch, pos, false);
        sp.row_kv[j] = slot + c * D + col_lo;
        sp.row_sc[j] = slot + C + c * D + col_lo;
      } else {
        const float* row = io.proj + (s.base + pos - s.sp - io.proj_first) * io.proj_ld;
        sp.row_kv[j] = row + c * D + col_lo;
        sp.row_sc[j] = row + C + c * D + col_lo;
      }
    }
  for (std::int64_t d0 = col_lo; d0 < col_hi; d0 += kSoftmaxChunk) {
    const std::int64_t w = std::min(col_hi, d0 + kSoftmaxChunk) - d0;
    for (std::int64_t j = 0; j < cr; ++j) {
      sp.src_kv[j] = sp.row_kv[j] ? sp.row_kv[j] + (d0 - col_lo) : nullptr;
      sp.src_sc[j] = sp.row_sc[j] ? sp.row_sc[j] + (d0 - col_lo) : nullptr;
    }
    // Softmax over the rows of the block, per column, in float64.
    float* s_out = io.softmax_score ? io.softmax_score + orow * cr * D + d0 : nullptr;
    float* k_out = io.kv ? io.kv + orow * cr * D + d0 : nullptr;
    kern.block_softmax(
        sp.src_sc, sp.src_kv, cr, w, sp.e, s_out, k_out, D,
        static_cast<unsigned char*>(io.cmp_kv) + static_cast<std::size_t>(orow * D + d0) * dtype_size(dm.io),
        dm.io);
  }
}

}  // namespace

void forward_blocks(const BlockPlan& plan, const ForwardBlockIo& io, std::int64_t a, std::int64_t b,
                    int num_threads) {
  const Dims& dm = plan.dims;
  const std::size_t first = first_batch_ending_after(plan, a), nb = plan.batches.size();
  const SimdKernels& kern = simd_kernels();
  // Dealing whole blocks needs a chunk of at least two per thread, and no cache slot that the call both
  // writes and reads (io.blocks_may_split): then no block reads what another thread writes, and every
  // output element is computed as in the column walk below, by one thread, so the bits do not change.
  std::int64_t blocks = 0;
  if (io.blocks_may_split)
    for (std::size_t bi = first; bi < nb && plan.batches[bi].base < b; ++bi) {
      const BlockRange kr = chunk_blocks(dm, plan.batches[bi], a, b);
      blocks += std::max<std::int64_t>(0, kr.last - kr.first + 1);
    }
  if (blocks >= 2 * num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
      const SoftmaxScratch sp = thread_scratch(io, dm);
      const std::int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
      // 1. This thread's share of the chunk's rows: their cache slots, every column.
      const std::int64_t r_lo = a + (b - a) * tid / nt, r_hi = a + (b - a) * (tid + 1) / nt;
      for (std::size_t bi = first_batch_ending_after(plan, r_lo); bi < nb && plan.batches[bi].base < r_hi;
           ++bi)
        write_slots(io, dm, plan.batches[bi], static_cast<std::int64_t>(bi), r_lo, r_hi, 0, dm.D);
      // 2. This thread's share of the chunk's blocks, in batch order, every column.
      const std::int64_t k_lo = blocks * tid / nt, k_hi = blocks * (tid + 1) / nt;
      std::int64_t at = 0;
      for (std::size_t bi = first; at < k_hi && bi < nb && plan.batches[bi].base < b; ++bi) {
        const BatchSpan& s = plan.batches[bi];
        const BlockRange kr = chunk_blocks(dm, s, a, b);
        for (std::int64_t k = kr.first; k <= kr.last; ++k, ++at)
          if (at >= k_lo && at < k_hi)
            forward_block(io, dm, s, static_cast<std::int64_t>(bi), k, 0, dm.D, sp, kern);
      }
      _mm_sfence();  // the streamed cache writes ordered before the region ends
    }
    return;
  }
#pragma omp parallel num_threads(block_phase_threads(dm, num_threads))
  {
    const SoftmaxScratch sp = thread_scratch(io, dm);
    // Each thread owns a contiguous run of column slices and walks the batches and their blocks once,
    // doing all of its slices of a block before the next block. A column's operations keep their
    // order (batches in order, a batch's cache writes before its blocks read), and no two threads
    // share a column, so the outputs are bitwise those of any thread count.
    const auto [col_lo, col_hi] = thread_columns(dm);
    for (std::size_t bi = first; col_lo < col_hi && bi < nb && plan.batches[bi].base < b; ++bi) {
      const BatchSpan& s = plan.batches[bi];
      const auto batch = static_cast<std::int64_t>(bi);
      // 1. Cache writes of this batch's tokens in the chunk.
      write_slots(io, dm, s, batch, a, b, col_lo, col_hi);
      // 2. Blocks whose last cur row lies in the chunk.
      const BlockRange kr = chunk_blocks(dm, s, a, b);
      for (std::int64_t k = kr.first; k <= kr.last; ++k)
        forward_block(io, dm, s, batch, k, col_lo, col_hi, sp, kern);
    }
    // The streamed cache writes ordered before the region ends, for the other threads and later calls.
    // (A block of this call that reads a slot written in it, through aliased block ids, runs on this
    // thread, and a thread's loads see its own streamed stores.)
    _mm_sfence();
  }
}

int forward_block_threads(const Dims& d, int num_threads) {
  return d.T / d.r + d.B >= 2 * static_cast<std::int64_t>(num_threads) ? num_threads
                                                                       : block_phase_threads(d, num_threads);
}

int block_phase_threads(const Dims& d, int num_threads) {
  return static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(num_threads, slices(d))));
}

std::size_t forward_scratch_bytes(const Dims& d) {
  const std::int64_t cr = d.coff * d.r;
  const std::size_t bytes = static_cast<std::size_t>((cr + 1) * kSoftmaxPitch) * sizeof(double) +
                            4 * static_cast<std::size_t>(cr) * sizeof(const float*);
  return (bytes + 63) / 64 * 64;
}

}  // namespace kvcomp::detail
