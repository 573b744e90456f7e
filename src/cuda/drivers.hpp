// The CUDA backend's two drivers, written once over an executor: the chunk
// loops, the workspace layout and every product and phase they issue. The
// backend runs them with CudaExec (cuda/forward.cu, cuda/backward.cu: kernels
// and cuBLASLt on a stream); tests/cuda/test_cuda_logic.cpp runs them with a
// host executor (the thread bodies of cuda/kernel_bodies.hpp in loops, plain
// products), so the whole walk is checked against the oracle on any machine.
//
// An executor provides:
//   Status gemm(const GemmCall&)            D = alpha op(A) op(B) + beta D (cuda/gemm.hpp)
//   Status zero(void*, std::size_t bytes)
//   Status copy(void* dst, const void* src, std::size_t bytes)   (device to device)
//   Status forward_blocks(const ForwardKernelArgs&, g_lo, g_hi)
//   Status cache_writes(const ForwardKernelArgs&, row_lo, row_hi)
//   Status zero_padding(const ForwardKernelArgs&)
//   Status backward_blocks(const BackwardKernelArgs&, g_lo, g_hi, a, b)
//   Status dape_accumulate(const double* partials, blocks, n, double* dape)
//   Status gradient_rows(const Geometry&, const void* src, bool src_f32, void* dst, a, b, H)
//   Status narrow(const float*, void*, DType, n)
//   Status f64_to_f32(const double*, float*, n)
//   Status epilogue_forward(const EpilogueKernelArgs&)
//   Status epilogue_backward(const EpilogueKernelArgs&)
//   Status epilogue_weight_terms(const EpilogueKernelArgs&, row_lo, row_hi)
//   Status f64_narrow(const double*, void*, DType, n)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/workspace.hpp"
#include "cuda/chunk_plan.hpp"
#include "cuda/gemm.hpp"
#include "cuda/kernels.hpp"

namespace kvcomp::detail::cuda {

// [wkv ; wgate] as one [2C, H] io matrix in the workspace, so that each
// product of the operator is one GEMM (the two weights are separate tensors).
// A call without wgate (cmp_ratio 1, coff 1) gets zero gate rows: every score
// is then 0 (+ ape), which is what the call means; the gate half of the
// products is computed on those zeros (the CPU backend skips it).
template <typename Layout>
void* take_wcat(Layout& ws, const Dims& d) {
  return ws.template take<unsigned char>(
      static_cast<std::int64_t>(static_cast<std::size_t>(2 * d.C * d.H) * dtype_size(d.io)));
}

template <typename Exec, typename Args>
Status fill_wcat(Exec& ex, const Args& args, const Dims& d, void* wcat) {
  const std::size_t half = static_cast<std::size_t>(d.C * d.H) * dtype_size(d.io);
  if (auto s = ex.copy(wcat, args.wkv.data, half); !s.ok()) return s;
  if (!d.gate) return ex.zero(static_cast<unsigned char*>(wcat) + half, half);
  return ex.copy(static_cast<unsigned char*>(wcat) + half, args.wgate.data, half);
}

// Output rows per launch of the d_norm_weight terms (the epilogue's backward): their float64 terms
// [rows, D] are the scratch, summed into the total in row order after each launch.
constexpr std::int64_t kEpilogueChunkRows = 1024;

// The output rows the epilogue runs over (those of `out`, cmp_kv or d_cmp_kv), 0 without one: what
// the buffers below size their epilogue scratch by.
inline std::int64_t epilogue_rows(const SequenceArgs& a, const Tensor& out, const Dims& d) {
  return a.epilogue.any() && d.D > 0 ? out.numel() / d.D : 0;
}

// The epilogue's inputs as the kernels read them (no buffers yet).
inline EpilogueKernelArgs epilogue_args(const Epilogue& e, const Geometry& g, std::int64_t rows) {
  EpilogueKernelArgs k;
  k.g = g;
  k.rows = rows;
  k.ep = epilogue_view(e);
  return k;
}

struct ForwardBuffers {
  std::int64_t panel_ld = 0;
  void* wcat = nullptr;  // [2C, H] io: wkv rows then wgate rows
  // [chunk + coff*r, panel_ld]: kv | score projections of a chunk and the rows before it
  float* panel = nullptr;
  float* rstd = nullptr;  // [epilogue rows]: the RMSNorm's fp32 rstd of each output row
  void* gemm_ws = nullptr;
  std::size_t size = 0;

  // epilogue_rows: epilogue_rows(args, cmp_kv, d).
  ForwardBuffers(const Dims& d, std::int64_t epilogue_rows, void* base) {
    AlignedLayout<256> ws(base);
    wcat = take_wcat(ws, d);
    const std::int64_t rows = std::min(kForwardChunkRows, std::max<std::int64_t>(d.T, 1)) + d.coff * d.r;
    panel_ld = (2 * d.C + 3) / 4 * 4;  // 16-byte rows
    panel = ws.take<float>(rows * panel_ld);
    if (epilogue_rows > 0) rstd = ws.take<float>(epilogue_rows);
    gemm_ws = ws.take<unsigned char>(static_cast<std::int64_t>(kGemmWorkspace));
    size = ws.size();
  }
};

// The backward's path on the GPU: fp32 io stages d_new in fp32 (rounding it to fp32 changes nothing);
// 16-bit io stages it in the io dtype, one part (npu_parity) or two (precise).
inline BackwardPath backward_path(const Dims& d, Precision p) {
  if (d.io == DType::f32) return BackwardPath::f32;
  return p == Precision::npu_parity ? BackwardPath::parity16 : BackwardPath::precise16;
}

// precise16 keeps d_new as hi + lo / scale, both in the io dtype: scale is
// 2^(mantissa bits + 1) of the io dtype, so lo spans the bits below hi's.
inline float lo_scale(DType io) { return io == DType::f16 ? 2048.0f : 256.0f; }

struct BackwardBuffers {
  std::int64_t R = 0, dnew_ld = 0;
  std::size_t dnew_elem = 0;
  void* wcat = nullptr;        // [2C, H] io: wkv rows then wgate rows
  void* dnew_hi = nullptr;     // [R, dnew_ld]: d_new_kv | d_new_score (fp32, or io)
  void* dnew_lo = nullptr;     // precise16: the low parts
  void* xm = nullptr;          // [R, H] io: x rows, zero where a row gets no gradient
  float* dxf = nullptr;        // [R, H]: d_x of the chunk in fp32
  float* dwf = nullptr;        // [2C, H]: d_wkv rows then d_wgate rows, fp32 accumulators
  double* dape = nullptr;      // [r, C] float64 accumulator
  double* partials = nullptr;  // [max chunk blocks, r, C]
  // The epilogue's backward (epilogue rows > 0): the pooled rows' gradient, the rows' RMSNorm stats,
  // the d_norm_weight terms of kEpilogueChunkRows rows and their sum.
  float* dp = nullptr;      // [epilogue rows, D]
  double* stats = nullptr;  // [epilogue rows, 2]
  double* wpart = nullptr;  // [min(epilogue rows, kEpilogueChunkRows), D]
  double* wsum = nullptr;   // [D]
  void* gemm_ws = nullptr;
  std::size_t size = 0;

  // epilogue_rows: epilogue_rows(args, d_cmp_kv, d).
  BackwardBuffers(const Dims& d, BackwardPath mode, std::int64_t max_chunk_blocks, std::int64_t epilogue_rows,
                  void* base) {
    AlignedLayout<256> ws(base);
    wcat = take_wcat(ws, d);
    R = std::min(kBackwardChunkRows, std::max<std::int64_t>(d.T, 1));
    dnew_ld = (2 * d.C + 7) / 8 * 8;  // 16-byte rows in any dtype
    dnew_elem = products_16bit(mode) ? dtype_size(d.io) : sizeof(float);
    const auto dnew_bytes = static_cast<std::int64_t>(static_cast<std::size_t>(R * dnew_ld) * dnew_elem);
    dnew_hi = ws.take<unsigned char>(dnew_bytes);
    dnew_lo = mode == BackwardPath::precise16 ? ws.take<unsigned char>(dnew_bytes) : nullptr;
    xm = ws.take<unsigned char>(
        static_cast<std::int64_t>(static_cast<std::size_t>(R * d.H) * dtype_size(d.io)));
    dxf = ws.take<float>(R * d.H);
    dwf = ws.take<float>(2 * d.C * d.H);
    dape = ws.take<double>(d.r * d.C);
    partials = ws.take<double>(std::max<std::int64_t>(1, max_chunk_blocks) * d.r * d.C);
    if (epilogue_rows > 0) {
      dp = ws.take<float>(epilogue_rows * d.D);
      stats = ws.take<double>(2 * epilogue_rows);
      wpart = ws.take<double>(std::min(epilogue_rows, kEpilogueChunkRows) * d.D);
      wsum = ws.take<double>(d.D);
    }
    gemm_ws = ws.take<unsigned char>(static_cast<std::int64_t>(kGemmWorkspace));
    size = ws.size();
  }
};

// The forward of a validated call. batches / block_batch: the chunk plan's
// arrays where the executor's phases read them.
template <typename Exec>
Status run_forward_chunks(Exec& ex, const ForwardArgs& args, const BlockPlan& plan, const ChunkPlan& cp,
                          const DevBatch* batches, const std::int32_t* block_batch, void* workspace) {
  const Dims& d = plan.dims;
  if (d.T == 0) return Status::success();  // empty input: nothing computed, cache untouched
  const std::int64_t ep_rows = epilogue_rows(args, args.cmp_kv, d);
  ForwardBuffers buf(d, ep_rows, AlignedLayout<256>::align(workspace));
  ForwardKernelArgs p;
  p.g = {batches, block_batch, d.B, d.D, d.C, d.r, d.coff, d.io};
  p.panel = buf.panel;
  p.panel_ld = buf.panel_ld;
  p.ape = static_cast<const float*>(args.ape.data);
  const CacheGeometry cache = cache_geometry(args);  // the table: device memory, read by the kernels
  p.cache = cache.data;
  p.block_size = cache.block_size;
  p.block_num = cache.block_num;
  p.cache_stride0 = cache.stride0;
  p.table = cache.table;
  p.table_cols = cache.table_cols;
  p.cache_mode = cache.cache_mode;
  p.cmp_kv = args.cmp_kv.data;
  p.softmax_score = args.grad_enabled ? static_cast<float*>(args.softmax_score.data) : nullptr;
  p.kv = args.grad_enabled ? static_cast<float*>(args.kv.data) : nullptr;
  p.out_rows = args.cmp_kv.dim(0) * (d.layout == Layout::bsh ? args.cmp_kv.dim(1) : 1);
  p.bsh_rows = d.layout == Layout::bsh ? compressed_rows_bsh(d.S, d.r) : 0;
  p.total_blocks = plan.total_blocks;
  p.last_writer_only = cp.serial;

  if (auto s = fill_wcat(ex, args, d, buf.wcat); !s.ok()) return s;
  const std::size_t io_size = dtype_size(d.io);
  const std::int64_t carry = d.coff * d.r;  // rows before a chunk its blocks may read
  for (const Chunk& c : cp.chunks) {
    // [new_kv | new_score] = x . [wkv ; wgate]^T for rows [first, b): the
    // chunk and the carried rows before it (recomputed, not kept).
    const std::int64_t first = std::max<std::int64_t>(0, c.a - carry), n = c.b - first;
    const void* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(first * d.H) * io_size;
    GemmCall g{n, 2 * d.C, d.H, d.io, {x_rows, d.H, false}, {buf.wcat, d.H, true}, buf.panel, buf.panel_ld};
    if (auto s = ex.gemm(g); !s.ok()) return s;
    p.panel_first = first;
    if (!cp.serial) {
      // No cache slot is both written and read (or written twice): any order gives the spec's result.
      if (auto s = ex.cache_writes(p, c.a, c.b); !s.ok()) return s;
      if (auto s = ex.forward_blocks(p, c.g_lo, c.g_hi); !s.ok()) return s;
      continue;
    }
    // Aliasing slots: the spec's order, batch after batch, a batch's writes before its reads.
    for (const DevBatch& s : cp.batches) {
      if (s.base + s.len <= c.a) continue;
      if (s.base >= c.b) break;
      if (auto st = ex.cache_writes(p, std::max<std::int64_t>(c.a, s.base),
                                    std::min<std::int64_t>(c.b, s.base + s.len));
          !st.ok())
        return st;
      const std::int64_t lo = std::max<std::int64_t>(c.g_lo, s.first_block);
      const std::int64_t hi = std::min<std::int64_t>(c.g_hi, s.first_block + s.nblocks);
      if (auto st = ex.forward_blocks(p, lo, hi); !st.ok()) return st;
    }
  }
  if (auto s = ex.zero_padding(p); !s.ok()) return s;
  if (ep_rows == 0) return Status::success();
  // The epilogue on the pooled rows, which a call that records the gradient keeps in `pooled` first.
  EpilogueKernelArgs e = epilogue_args(args.epilogue, p.g, ep_rows);
  e.cmp_kv = args.cmp_kv.data;
  e.pooled = args.grad_enabled ? args.pooled.data : nullptr;
  e.rstd = buf.rstd;
  return ex.epilogue_forward(e);
}

// The backward of a validated call.
template <typename Exec>
Status run_backward_chunks(Exec& ex, const BackwardArgs& args, const BlockPlan& plan, BackwardPath mode,
                           const ChunkPlan& cp, const DevBatch* batches, const std::int32_t* block_batch,
                           void* workspace) {
  const Dims& d = plan.dims;
  const bool norm = args.epilogue.norm_weight.has_value();
  if (plan.total_blocks == 0) {  // spec 2.7: all-zero outputs, whatever the memory held
    for (const Tensor* t : {&args.d_x, &args.d_wkv, &args.d_wgate, &args.d_ape, &args.d_norm_weight}) {
      if (!t->data || (t == &args.d_norm_weight && !norm)) continue;  // no d_ape (no APE), no norm
      if (auto s = ex.zero(t->data, static_cast<std::size_t>(t->numel()) * dtype_size(t->dtype)); !s.ok())
        return s;
    }
    return Status::success();
  }
  const std::int64_t H = d.H, C = d.C;
  const std::size_t io_size = dtype_size(d.io);
  const std::int64_t ep_rows = epilogue_rows(args, args.d_cmp_kv, d);
  BackwardBuffers buf(d, mode, cp.max_chunk_blocks, ep_rows, AlignedLayout<256>::align(workspace));
  if (auto s = fill_wcat(ex, args, d, buf.wcat); !s.ok()) return s;
  if (auto s = ex.zero(buf.dwf, static_cast<std::size_t>(2 * C * H) * sizeof(float)); !s.ok()) return s;
  if (auto s = ex.zero(buf.dape, static_cast<std::size_t>(d.r * C) * sizeof(double)); !s.ok()) return s;

  BackwardKernelArgs p;
  p.g = {batches, block_batch, d.B, d.D, C, d.r, d.coff, d.io};
  p.d_cmp_kv = args.d_cmp_kv.data;
  p.d_cmp_dtype = d.io;
  p.softmax_score = static_cast<const float*>(args.softmax_score.data);
  p.kv = static_cast<const float*>(args.kv.data);
  p.mode = mode;
  p.dnew_hi = buf.dnew_hi;
  p.dnew_lo = buf.dnew_lo;
  p.dnew_ld = buf.dnew_ld;
  p.lo_scale = lo_scale(d.io);
  p.partials = buf.partials;

  if (ep_rows > 0) {
    // The epilogue's backward first: the pooled rows' gradient, in fp32, is what the blocks read.
    EpilogueKernelArgs e = epilogue_args(args.epilogue, p.g, ep_rows);
    e.d_cmp_kv = args.d_cmp_kv.data;
    e.pooled_in = args.pooled.data;
    e.dp = buf.dp;
    e.stats = buf.stats;
    e.wpart = buf.wpart;
    if (auto s = ex.epilogue_backward(e); !s.ok()) return s;
    if (norm) {
      // d_norm_weight[i] = the rows' terms summed in row order, kEpilogueChunkRows rows per launch.
      if (auto s = ex.zero(buf.wsum, static_cast<std::size_t>(d.D) * sizeof(double)); !s.ok()) return s;
      for (std::int64_t lo = 0; lo < ep_rows; lo += kEpilogueChunkRows) {
        const std::int64_t hi = std::min(ep_rows, lo + kEpilogueChunkRows);
        if (auto s = ex.epilogue_weight_terms(e, lo, hi); !s.ok()) return s;
        if (auto s = ex.dape_accumulate(buf.wpart, hi - lo, d.D, buf.wsum); !s.ok()) return s;
      }
      if (auto s = ex.f64_narrow(buf.wsum, args.d_norm_weight.data, args.d_norm_weight.dtype, d.D); !s.ok())
        return s;
    }
    p.d_cmp_kv = buf.dp;
    p.d_cmp_dtype = DType::f32;
  }

  void* parts[2] = {buf.dnew_hi, buf.dnew_lo};
  const float alphas[2] = {1.0f, 1.0f / p.lo_scale};
  const int nparts = mode == BackwardPath::precise16 ? 2 : 1;

  for (const Chunk& c : cp.chunks) {
    const std::int64_t n = c.b - c.a;
    auto* dx_rows = static_cast<unsigned char*>(args.d_x.data) + static_cast<std::size_t>(c.a * H) * io_size;
    if (!c.has_grad) {
      if (auto s = ex.zero(dx_rows, static_cast<std::size_t>(n * H) * io_size); !s.ok()) return s;
      continue;
    }
    const std::size_t dnew_bytes = static_cast<std::size_t>(n * buf.dnew_ld) * buf.dnew_elem;
    for (int i = 0; i < nparts; ++i)
      if (auto s = ex.zero(parts[i], dnew_bytes); !s.ok()) return s;
    if (auto s = ex.backward_blocks(p, c.g_lo, c.g_hi, c.a, c.b); !s.ok()) return s;
    if (args.d_ape.data)  // else a call without APE
      if (auto s = ex.dape_accumulate(buf.partials, c.g_hi - c.g_lo, d.r * C, buf.dape); !s.ok()) return s;

    // x rows without gradient are zeroed so that 0 * Inf/NaN in them cannot
    // leak into d_wkv / d_wgate (the NPU kernel does the same).
    const void* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(c.a * H) * io_size;
    if (!c.all_grad) {
      if (auto s = ex.gradient_rows(p.g, x_rows, false, buf.xm, c.a, c.b, H); !s.ok()) return s;
      x_rows = buf.xm;
    }
    // d_x rows = d_new . [wkv ; wgate] (K = 2C), one product per part of d_new
    for (int i = 0; i < nparts; ++i) {
      GemmCall g{n,
                 H,
                 2 * C,
                 d.io,
                 {parts[i], buf.dnew_ld, false},
                 {buf.wcat, H, false},
                 buf.dxf,
                 H,
                 alphas[i],
                 i == 0 ? 0.0f : 1.0f};
      if (auto s = ex.gemm(g); !s.ok()) return s;
    }
    if (auto s = ex.gradient_rows(p.g, buf.dxf, true, dx_rows, c.a, c.b, H); !s.ok()) return s;
    // [d_wkv ; d_wgate] += d_new^T . x rows (K = the chunk's rows), one product per part
    for (int i = 0; i < nparts; ++i) {
      GemmCall g{2 * C,   H, n,         d.io, {parts[i], buf.dnew_ld, true}, {x_rows, H, false},
                 buf.dwf, H, alphas[i], 1.0f};
      if (auto s = ex.gemm(g); !s.ok()) return s;
    }
  }
  if (auto s = ex.narrow(buf.dwf, args.d_wkv.data, d.io, C * H); !s.ok()) return s;
  if (args.d_wgate.data)  // else a call without wgate
    if (auto s = ex.narrow(buf.dwf + C * H, args.d_wgate.data, d.io, C * H); !s.ok()) return s;
  if (!args.d_ape.data) return Status::success();
  return ex.f64_to_f32(buf.dape, static_cast<float*>(args.d_ape.data), d.r * C);
}

}  // namespace kvcomp::detail::cuda
