// The CUDA forward: per chunk of token rows, the projections by cuBLASLt
// into an fp32 panel, then the cache writes and the block softmax / pooling
// kernels; the padding rows last. Everything queued on the caller's stream.
#include <algorithm>

#include "core/workspace.hpp"
#include "cuda/common.hpp"
#include "cuda/gemm.hpp"
#include "cuda/kernels.hpp"

namespace kvcomp::detail::cuda {

namespace {

struct ForwardBuffers {
  std::int64_t panel_ld = 0;
  float* panel =
      nullptr;  // [chunk + coff*r, panel_ld]: kv | score projections of a chunk and the rows before it
  void* gemm_ws = nullptr;
  std::size_t size = 0;

  ForwardBuffers(const Dims& d, void* base) {
    AlignedLayout<256> ws(base);
    const std::int64_t rows = std::min(kForwardChunkRows, std::max<std::int64_t>(d.T, 1)) + d.coff * d.r;
    panel_ld = (2 * d.C + 3) / 4 * 4;  // 16-byte rows
    panel = ws.take<float>(rows * panel_ld);
    gemm_ws = ws.take<unsigned char>(static_cast<std::int64_t>(kGemmWorkspace));
    size = ws.size();
  }
};

}  // namespace

Status prepare_forward(const ForwardArgs& args, const Options& options, const BlockPlan& plan,
                       const std::vector<std::int32_t>& block_table, std::shared_ptr<const DevicePlan>* out,
                       std::size_t* workspace) {
  auto dp = std::make_shared<DevicePlan>();
  if (auto s = build_device_plan(plan, args.x.device, options.stream, kForwardChunkRows, true, dp.get());
      !s.ok())
    return s;
  CacheGeometry cache;
  cache.block_num = args.state_cache.dim(0);
  cache.block_size = args.state_cache.dim(1);
  cache.cache_mode = static_cast<int>(args.cache_mode);
  cache.table = block_table.data();
  cache.table_cols = args.cache_mode == 1 ? args.state_block_table->dim(1) : 1;
  dp->serial = cache_slots_alias(plan, cache);
  *workspace = ForwardBuffers(plan.dims, nullptr).size;
  *out = std::move(dp);
  return Status::success();
}

Status run_forward(const ForwardArgs& args, const Options& options, const BlockPlan& plan,
                   const DevicePlan& dev, void* workspace) {
  const Dims& d = plan.dims;
  if (d.T == 0) return Status::success();  // empty input: nothing computed, cache untouched
  DeviceGuard guard(dev.device);
  if (!guard.status().ok()) return guard.status();
  const auto stream = static_cast<cudaStream_t>(options.stream);
  ForwardBuffers buf(d, AlignedLayout<256>::align(workspace));

  ForwardKernelArgs p;
  p.g = {dev.batches, dev.block_batch, d.B, d.D, d.C, d.r, d.coff, d.io};
  p.panel = buf.panel;
  p.panel_ld = buf.panel_ld;
  p.ape = static_cast<const float*>(args.ape.data);
  p.cache = static_cast<float*>(args.state_cache.data);
  p.block_size = args.state_cache.dim(1);
  p.block_num = args.state_cache.dim(0);
  p.cache_stride0 = args.state_cache_stride0 ? args.state_cache_stride0 : p.block_size * 2 * d.C;
  p.table = static_cast<const std::int32_t*>(args.state_block_table->data);
  p.table_cols = args.cache_mode == 1 ? args.state_block_table->dim(1) : 1;
  p.cache_mode = static_cast<int>(args.cache_mode);
  p.cmp_kv = args.cmp_kv.data;
  p.softmax_score = args.grad_enabled ? static_cast<float*>(args.softmax_score.data) : nullptr;
  p.kv = args.grad_enabled ? static_cast<float*>(args.kv.data) : nullptr;
  p.out_rows = args.cmp_kv.dim(0) * (d.layout == Layout::bsh ? args.cmp_kv.dim(1) : 1);
  p.bsh_rows = d.layout == Layout::bsh ? compressed_rows_bsh(d.S, d.r) : 0;
  p.total_blocks = plan.total_blocks;

  const std::size_t io_size = dtype_size(d.io);
  const std::int64_t carry = d.coff * d.r;  // rows before a chunk its blocks may read
  for (const Chunk& c : dev.chunks) {
    // [new_kv | new_score] = x . [wkv ; wgate]^T for rows [first, b): the
    // chunk and the carried rows before it (recomputed, not kept).
    const std::int64_t first = std::max<std::int64_t>(0, c.a - carry), n = c.b - first;
    const void* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(first * d.H) * io_size;
    for (int half = 0; half < 2; ++half) {
      GemmCall g{n,
                 d.C,
                 d.H,
                 d.io,
                 {x_rows, d.H, false},
                 {half ? args.wgate.data : args.wkv.data, d.H, true},
                 buf.panel + half * d.C,
                 buf.panel_ld};
      if (auto s = gemm(g, buf.gemm_ws, kGemmWorkspace, stream); !s.ok()) return s;
    }
    p.panel_first = first;
    if (!dev.serial) {
      // No cache slot is both written and read (or written twice): any order gives the spec's result.
      if (auto s = launch_cache_writes(p, c.a, c.b, stream); !s.ok()) return s;
      if (auto s = launch_forward_blocks(p, c.g_lo, c.g_hi, stream); !s.ok()) return s;
      continue;
    }
    // Aliasing slots: the spec's order, batch after batch, a batch's writes before its reads.
    for (const DevBatch& s : dev.host_batches) {
      if (s.base + s.len <= c.a) continue;
      if (s.base >= c.b) break;
      if (auto st = launch_cache_writes(p, std::max<std::int64_t>(c.a, s.base),
                                        std::min<std::int64_t>(c.b, s.base + s.len), stream);
          !st.ok())
        return st;
      const std::int64_t lo = std::max<std::int64_t>(c.g_lo, s.first_block);
      const std::int64_t hi = std::min<std::int64_t>(c.g_hi, s.first_block + s.nblocks);
      if (auto st = launch_forward_blocks(p, lo, hi, stream); !st.ok()) return st;
    }
  }
  return launch_zero_padding(p, stream);
}

}  // namespace kvcomp::detail::cuda
