// The CUDA backend's element-wise kernels: the operator logic between the
// matrix products, the same formulas in the same order per element as the
// CPU backend (cpu/block_phases.cpp with cpu/simd/body.inl; both round
// through common/numerics.hpp), so a block's softmax, pooling and gradients
// give the CPU's bits for the same projections.
//
// One thread per column of a block (or of a row): every output element is
// written by exactly one thread, and every sum runs in a fixed order inside
// one thread, so there is no atomic anywhere.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/backward_path.hpp"
#include "common/epilogue_view.hpp"
#include "cuda/chunk_plan.hpp"
#include "cuda/gemm.hpp"

namespace kvcomp::detail::cuda {

struct Geometry {
  const DevBatch* batches = nullptr;
  const std::int32_t* block_batch = nullptr;
  std::int64_t B = 0, D = 0, C = 0, r = 0, coff = 1;
  DType io = DType::bf16;
};

struct ForwardKernelArgs {
  Geometry g;
  // Projections of rows [panel_first, ...): [rows, 2C] fp32, kv then score (without ape).
  const float* panel = nullptr;
  std::int64_t panel_first = 0, panel_ld = 0;
  const float* ape = nullptr;  // [r, C]; null: a call without APE
  // State cache
  float* cache = nullptr;
  std::int64_t cache_stride0 = 0, block_size = 0, block_num = 0;
  const std::int32_t* table = nullptr;
  std::int64_t table_cols = 1;
  int cache_mode = 1;
  // Outputs
  void* cmp_kv = nullptr;          // io dtype [out_rows, D]
  float* softmax_score = nullptr;  // [out_rows, coff*r, D] or null
  float* kv = nullptr;             // same, or null
  std::int64_t out_rows = 0;       // rows of cmp_kv
  std::int64_t bsh_rows = 0;       // BSH: output rows per batch; 0 for TH
  std::int64_t total_blocks = 0;
  // The call's cache slots alias (the serial path): a batch's positions may
  // share a slot (a paged table row repeating a block id), and only the
  // batch's last such position writes it, as on the CPU. Off otherwise (no
  // slot is written twice: nothing to look for).
  bool last_writer_only = false;
};

// Blocks [g_lo, g_hi) (their rows in the panel): softmax over the rows of
// each block per column in float64, cmp_kv, and the saved S / K.
Status launch_forward_blocks(const ForwardKernelArgs& p, std::int64_t g_lo, std::int64_t g_hi,
                             cudaStream_t s);
// Cache writes of token rows [row_lo, row_hi) (projections in the panel).
Status launch_cache_writes(const ForwardKernelArgs& p, std::int64_t row_lo, std::int64_t row_hi,
                           cudaStream_t s);
// Output rows that hold no block: zeros (cmp_kv, and S / K when given).
Status launch_zero_padding(const ForwardKernelArgs& p, cudaStream_t s);

struct BackwardKernelArgs {
  Geometry g;
  const void* d_cmp_kv = nullptr;        // [out_rows, D], d_cmp_dtype
  DType d_cmp_dtype = DType::bf16;       // the io dtype; f32 after the epilogue's backward (its dp)
  const float* softmax_score = nullptr;  // [out_rows, coff*r, D]
  const float* kv = nullptr;
  BackwardPath mode = BackwardPath::f32;
  // d_new of the chunk rows [a, b): [b-a, ld] in fp32 (mode f32) or the io
  // dtype (hi; lo = (value - hi) * lo_scale for precise16).
  void* dnew_hi = nullptr;
  void* dnew_lo = nullptr;
  std::int64_t dnew_ld = 0;
  float lo_scale = 1.0f;
  // dZ of each (block, slot, column) of the chunk, [blocks, r, C] float64: the
  // slots of the chunk hold dZ, the others 0.
  double* partials = nullptr;
};

// Slot gradients of blocks [g_lo, g_hi) for the tokens in rows [a, b).
Status launch_backward_blocks(const BackwardKernelArgs& p, std::int64_t g_lo, std::int64_t g_hi,
                              std::int64_t a, std::int64_t b, cudaStream_t s);
// dape[i] += partials[blk][i] for blk = 0 .. blocks-1 in order, i < r*C.
Status launch_dape_accumulate(const double* partials, std::int64_t blocks, std::int64_t n, double* dape,
                              cudaStream_t s);

// Rows [a, b) of an io matrix [*, H]: dst row = src row where the row gets
// gradient (inside its batch's compressed region), else zeros. src fp32 when
// src_f32 (narrowed to io), else io.
Status launch_gradient_rows(const Geometry& g, const void* src, bool src_f32, void* dst, std::int64_t a,
                            std::int64_t b, std::int64_t H, cudaStream_t s);
// dst[i] = io(src[i]) for n fp32 values.
Status launch_narrow(const float* src, void* dst, DType io, std::int64_t n, cudaStream_t s);
// The product of c (cuda/gemm.hpp) without cuBLASLt, for shapes it has no
// algorithm for: one thread per element of D, an fp32 sum over K in order
// (16-bit products are exact in fp32), then alpha and beta as cuBLASLt's
// epilogue applies them. Slow, always available, deterministic.
Status launch_plain_gemm(const LtCall& c, cudaStream_t s);
// dst[i] = float(src[i]) for n float64 values.
Status launch_f64_to_f32(const double* src, float* dst, std::int64_t n, cudaStream_t s);

// The model-level epilogue (kvcomp.hpp's Epilogue) over the output rows: per row, one thread for the
// row's statistics (a sum over D in column order), then one thread per column (or per rotated pair).
struct EpilogueKernelArgs {
  Geometry g;             // the batches (out_row, nblocks, k0), D, r, io
  std::int64_t rows = 0;  // output rows
  EpilogueView ep;        // norm weight, eps, rope tables (shared with the CPU backend)
  // Forward: cmp_kv's rows in place; pooled (when not null) gets them first; rstd [rows] scratch.
  void* cmp_kv = nullptr;
  void* pooled = nullptr;
  float* rstd = nullptr;
  // Backward: from d_cmp_kv (io) and the forward's pooled rows (io) to dp [rows, D] fp32;
  // stats [rows, 2] float64 scratch (rstd, mean(w dy x_hat)); wpart [chunk rows, D] float64: the
  // rows' terms of d_norm_weight, summed in row order by launch_dape_accumulate.
  const void* d_cmp_kv = nullptr;
  const void* pooled_in = nullptr;
  float* dp = nullptr;
  double* stats = nullptr;
  double* wpart = nullptr;
};

// The epilogue's forward on every row of cmp_kv (pooled written first when given).
Status launch_epilogue_forward(const EpilogueKernelArgs& e, cudaStream_t s);
// The pooled rows' gradient dp (zero in rows without a block) and, with the RMSNorm, the rows' stats.
Status launch_epilogue_backward(const EpilogueKernelArgs& e, cudaStream_t s);
// wpart[row - row_lo][i] = the term of row `row` in d_norm_weight[i] (0 in rows without a block), for
// rows [row_lo, row_hi); needs launch_epilogue_backward's stats.
Status launch_epilogue_weight_terms(const EpilogueKernelArgs& e, std::int64_t row_lo, std::int64_t row_hi,
                                    cudaStream_t s);
// dst[i] = dt(float(src[i])) for n float64 values (dt: f32, bf16 or f16).
Status launch_f64_narrow(const double* src, void* dst, DType dt, std::int64_t n, cudaStream_t s);

}  // namespace kvcomp::detail::cuda
