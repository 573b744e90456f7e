#include <algorithm>
#include <cstring>
#include <optional>
#include <string>

#include "cpu/backend.hpp"
#include "cpu/block_phases.hpp"
#include "cpu/convert.hpp"
#include "cpu/gemm.hpp"
#include "cpu/gemm_bf16.hpp"
#include "cpu/phase_clock.hpp"
#include "cpu/prepared.hpp"

namespace kvcomp::detail {

namespace {

// Rows from which a bf16 call on AVX512-BF16 writes the weights' panels itself when the call names none
// (prepare_weights): from there on writing them (2 C H values, once per call) costs less than oneDNN's
// jit gemm packing the weights for every tile of rows. Zen 5, 2 threads, H = 4096, C4A / C4Li / C128A:
// 64 rows 1.16 / 0.82 / 1.20x the call on the weights in place, 128 rows 0.97 / 0.76 / 0.94x, 4096 rows
// 0.96 / 0.86 / 0.91x (docs/performance.md). Both give every row the same bits.
constexpr std::int64_t kPanelCallRows = 128;

// Token rows per chunk of a call on the bf16 units: 128 per thread, from 256 to kChunkRows. The chunk's x
// rows (read by every column tile of both products) and its projections (read back by the block phase)
// then stay nearer the cores than in chunks of kChunkRows: AMD Zen 4, 2 threads, H = 4096, C4A BSH
// T = 4096, the forward / its bf16 products alone went from 1.061-1.097 to 1.018-1.082 (5 rounds,
// docs/performance.md). Not fewer per thread: a packed B (AMX) runs a chunk as 64-row tiles per
// product, and 2 x chunk / 64 tiles must keep every thread busy. The products give a row the same bits
// whatever the chunk (row-stable), and a block's softmax does not depend on it, so neither do the
// outputs. The fp32 products take four of their row tiles (gemm_tile_rows: 256 rows, or 192 on AVX2):
// 1024 rows as before where the tile is 256, 768 on AVX2, where a 1024-row chunk was padded to 1056
// rows (the 96-row quantum) and run as five 192-row tiles and a 96-row one. AMD Zen 4 capped at AVX2
// (DNNL_MAX_CPU_ISA=AVX2 KVCOMP_ISA=avx2), 2 threads, H = 4096, bf16 io, T = 4096, five alternating
// rounds, forward / its fp32 products alone: C4A BSH 1.097-1.146 -> 1.092-1.110 (357.6-375.0 ->
// 348.1-360.3 ms), C4A TH 1.111-1.151 -> 1.093-1.117, C128A BSH 1.123-1.184 -> 1.077-1.131, C128A TH
// 1.122-1.156 -> 1.070-1.124 (C4Li within its noise); 960 rows measured as 1024, 576 as 768. On
// AVX-512 a 768-row chunk where the tile is 192 (K < 1200) measured as 1024 (fp16 io, H = 1024). Same
// bits: a row's products do not depend on its chunk.
std::int64_t forward_chunk_rows(const Dims& d, bool bf16, int num_threads) {
  if (!bf16) return 4 * gemm_tile_rows(d.H, true);
  return std::clamp<std::int64_t>(128 * std::int64_t{std::max(num_threads, 1)}, 256, kChunkRows);
}

struct ForwardBuffers {
  std::int64_t ld_h, ld_c2;  // padded leading dimensions
  // fp32 products of a longer call: wkv rows then wgate rows in fp32, [2C, ld_h], or transposed, [H, ld_c2]
  float* wcat = nullptr;
  // The longer call's weights read as the plain B [H, ld_c2] (gemm_b_plain_same_bits): widened so from
  // the 16-bit weights, or the blob's fp32 rows transposed.
  bool w_plain = false;
  float* widen = nullptr;    // fp32 products of one row tile: each thread's column tile of the fp32 weights
  float* xf = nullptr;       // [Rp, ld_h]: the chunk's x rows in fp32, zero rows up to the GEMM's padded M
  float* proj;    // [coff*r + Rp, ld_c2]: projections (kv | score+ape) of the chunk and the rows before it
  void* scratch;  // forward_scratch_bytes() for each thread of forward_blocks
  // bf16 products (gemm_bf16.hpp), when x is bf16 and the CPU has bf16 units:
  bool bf16 = false;
  bool ok = true;
  void* packed_kv = nullptr;  // wkv and wgate packed for the primitive (where it wants them packed)
  void* packed_gate = nullptr;
  std::uint16_t* xb = nullptr;  // [Rp, H] the chunk's x rows, zero rows up to a whole tile
  // A call of kPanelCallRows or more on AVX512-BF16 without prepared panels: wkv's and wgate's
  // panels, written per call (write_bf16_panels), for kvcomp's kernel.
  std::uint16_t* panels = nullptr;
  std::int64_t chunk;  // token rows per chunk (forward_chunk_rows)
  std::size_t size;

  // The two projection products on the bf16 units: [n, H] . [H, C] into a column half of proj.
  static Bf16Shape bf16_shape(const Dims& d) { return projection_shape(d.C, d.H); }

  // `prepared`: the call's prepared_weights (prepared_view; all null without): no room for what it holds.
  ForwardBuffers(const Dims& d, const PreparedView& prepared, int num_threads, void* base) {
    WorkspaceLayout ws(base);
    bf16 = d.io == DType::bf16 && bf16_product_kernel();
    chunk = forward_chunk_rows(d, bf16, num_threads);
    // Rp: the chunk's rows padded for a row-stable product (gemm.hpp, gemm_bf16.hpp).
    const std::int64_t R = std::min(chunk, std::max<std::int64_t>(d.T, 1));
    const std::int64_t Rp = std::max(gemm_row_capacity(R), bf16_padded_rows(R));
    ld_h = padded_ld(d.H);
    ld_c2 = padded_ld(2 * d.C);
    const Bf16Plan p = bf16 ? bf16_plan(bf16_shape(d)) : Bf16Plan{};
    const std::size_t packed = p.packed_bytes;
    ok = !bf16 || p.ok;  // oneDNN could not make the product (out of memory): the call fails
    if (bf16) {          // the bf16 products read x and the (packed) weights: no fp32 copies
      if (packed > 0 && !prepared.kv) {  // the blob holds them packed otherwise
        packed_kv = ws.take<unsigned char>(static_cast<std::int64_t>(packed));
        packed_gate = ws.take<unsigned char>(static_cast<std::int64_t>(packed));
      }
      xb = ws.take<std::uint16_t>(Rp * d.H);
      if (packed == 0 && !prepared.kv_panels && d.T >= kPanelCallRows && bf16_decode_panels_wanted() &&
          d.C % 16 == 0)
        panels = ws.take<std::uint16_t>(2 * static_cast<std::int64_t>(bf16_panel_elements(d.C, d.H)));
    } else {
      // A call of one row tile (decode) widens the weights tile by tile, in the caches; a longer one
      // reads each column tile once per row tile, so it widens them once, whole, as [H, 2C] where the
      // probe holds (a blob's fp32 rows transposed so too), else as [2C, H]; a blob holds the latter.
      const bool one_pass = gemm_one_column_pass(gemm_padded_rows(R, true), d.H);
      w_plain = !one_pass && gemm_b_plain_same_bits(2 * d.C, d.H, ld_h, ld_h, ld_c2);
      if (w_plain)
        wcat = ws.take<float>(d.H * ld_c2);
      else if (!prepared.kv && one_pass)
        widen =
            ws.take<float>(static_cast<std::int64_t>(gemm_widen_scratch_floats(2 * d.C, ld_h, num_threads)));
      else if (!prepared.kv)
        wcat = ws.take<float>(2 * d.C * ld_h);
      xf = ws.take<float>(Rp * ld_h);
    }
    proj = ws.take<float>((d.coff * d.r + Rp) * ld_c2);
    scratch = ws.take<unsigned char>(static_cast<std::int64_t>(forward_scratch_bytes(d)) *
                                     forward_block_threads(d, num_threads));
    size = ws.size();
  }
};

constexpr const char* kNoBf16Product = "[kvcomp] oneDNN could not create the bf16 projection product";

// The first projection row that the blocks of a chunk starting at row a read from the chunks before it
// (a: none): the first row of the block holding row a, its previous half included (coff = 2), in the
// batch holding rows a - 1 and a, if that batch has a block left. At most coff * r - 1 rows before a
// (the room ForwardBuffers keeps), and never before the previous chunk's own first row, so the rows
// are still there to move. C128A (r = 128): 0 to 127 rows to move instead of 128 per chunk.
std::int64_t first_carried_row(const BlockPlan& plan, std::int64_t a) {
  if (a == 0) return 0;
  const Dims& d = plan.dims;
  const std::size_t bi = first_batch_ending_after(plan, a - 1);
  if (bi == plan.batches.size()) return a;
  const BatchSpan& s = plan.batches[bi];
  if (s.base + s.len <= a) return a;  // the batch of row a - 1 ends there
  const std::int64_t pos = s.sp + (a - s.base);  // row a's position
  if (pos >= s.limit) return a;                  // the batch has no block left
  return std::max(s.base, s.base + slot_position(d, pos / d.r, 0, 0) - s.sp);
}

// Zeroes output rows that hold no block (the NPU leaves them unwritten).
void zero_padding_rows(const ForwardArgs& args, const BlockPlan& plan) {
  const Dims& d = plan.dims;
  const std::int64_t cr = d.coff * d.r;
  auto zero_rows = [&](std::int64_t first, std::int64_t count) {
    if (count <= 0) return;
    std::memset(static_cast<unsigned char*>(args.cmp_kv.data) +
                    static_cast<std::size_t>(first * d.D) * dtype_size(d.io),
                0, static_cast<std::size_t>(count * d.D) * dtype_size(d.io));
    for (const Tensor* t : {&args.softmax_score, &args.kv})
      if (args.grad_enabled && t->data)
        std::memset(static_cast<float*>(t->data) + first * cr * d.D, 0,
                    static_cast<std::size_t>(count * cr * d.D) * sizeof(float));
  };
  if (d.layout == Layout::th) {
    zero_rows(plan.total_blocks, args.cmp_kv.dim(0) - plan.total_blocks);
  } else {
    const std::int64_t per = compressed_rows_bsh(d.S, d.r);
    for (const auto& s : plan.batches) zero_rows(s.out_row + s.nblocks, per - s.nblocks);
  }
}

}  // namespace

Status forward_workspace_size(const Dims& d, const void* prepared_weights, int num_threads,
                              std::size_t* size) {
  const PreparedView prepared = prepared_weights ? prepared_view(prepared_weights) : PreparedView{};
  const ForwardBuffers buf(d, prepared, num_threads, nullptr);
  if (!buf.ok) return {StatusCode::runtime_error, kNoBf16Product};
  *size = buf.size;
  return Status::success();
}

Status run_forward(const ForwardArgs& args, const BlockPlan& plan, int num_threads, void* workspace,
                   std::size_t workspace_size) {
  const Dims& d = plan.dims;
  if (d.T == 0) return Status::success();  // empty input: nothing computed, cache untouched
  PhaseLaps laps(0);
  const std::int64_t H = d.H, C = d.C;
  // The weights as the products read them: from prepare_weights() when the call names its result
  // (checked by execute's validation just before; the same bytes as below, made once for many
  // calls), else packed or converted now.
  const PreparedView prepared = args.prepared_weights ? prepared_view(args.prepared_weights) : PreparedView{};
  ForwardBuffers buf(d, prepared, num_threads, WorkspaceLayout::align(workspace));
  if (!buf.ok) return {StatusCode::runtime_error, kNoBf16Product};
  if (buf.size > workspace_size)  // planned for a blob that held more than the one named now
    return {StatusCode::invalid_param, "[kvcomp] workspace_size (= " + std::to_string(workspace_size) +
                                           ") must be >= " + std::to_string(buf.size) +
                                           " bytes for the prepared_weights named now: plan the call again"};
  const std::size_t io_size = dtype_size(d.io);
  const void* b_kv = args.wkv.data;
  const void* b_gate = args.wgate.data;
  const float* wcat = buf.wcat;
  // A decode call of at most 8 rows without prepared weights, on AVX2: its fp32 products read the 16-bit
  // weights where they lie (gemm.hpp), with the bits of the converted copy, and skip converting them.
  const bool fp16 = d.io == DType::f16;
  const std::optional<SgemmOrder> in_place_order = !buf.bf16 && !prepared.kv && (d.io == DType::bf16 || fp16)
                                                       ? gemm_rows_16bit_order(d.T, C, H, buf.ld_h, fp16)
                                                       : std::nullopt;
  const bool half_in_place = in_place_order.has_value();
  // The long fp32-product call's weights widened as [H, 2C] where oneDNN's sgemm gives the same bits from
  // there as from [2C, H], and runs faster (AVX-512: 189 -> 221 GFLOP/s per 256 x 256 tile at K = 4096 on
  // AMD Zen 4, docs/performance.md). A prepared blob's [2C, H] is transposed too: fp16 io, C4A, H = 4096
  // on AMD Zen 4 (2 threads), T = 4096: 380-395 ms with the blob as it is, 326-348 ms transposed (as
  // without a blob); T = 768: 71.2-77.7 -> 64.6-75.4 ms; T = 300 (two row tiles): the same.
  const bool w_plain = buf.w_plain;
  // The AVX-512 panels kvcomp's bf16 kernel reads: the prepared ones, else written now for a long call.
  const std::uint16_t* panels[] = {prepared.kv_panels, prepared.gate_panels};
  if (buf.bf16) {
    const Bf16Shape shape = buf.bf16_shape(d);
    if (!panels[0] && buf.panels && gemm_row_stable() &&
        bf16_rows_kernel_applicable(shape, std::min(d.T, buf.chunk), true)) {
      write_bf16_panels(static_cast<const std::uint16_t*>(args.wkv.data),
                        static_cast<const std::uint16_t*>(args.wgate.data), C, H, buf.panels, num_threads);
      panels[0] = buf.panels;
      panels[1] = buf.panels + bf16_panel_elements(C, H);
    }
    if (prepared.kv) {  // packed
      b_kv = prepared.kv;
      b_gate = prepared.gate;
    } else if (buf.packed_kv) {
      const Bf16PackJob jobs[] = {{static_cast<const std::uint16_t*>(args.wkv.data), buf.packed_kv},
                                  {static_cast<const std::uint16_t*>(args.wgate.data), buf.packed_gate}};
      if (!bf16_pack_b(shape, jobs, 2, num_threads))
        return {StatusCode::runtime_error, "[kvcomp] oneDNN reorder of the bf16 weights failed"};
      b_kv = buf.packed_kv;
      b_gate = buf.packed_gate;
    }
  } else if (w_plain && prepared.kv) {  // the blob's fp32 rows transposed (even where wkv, wgate differ)
    rows_to_f32_transposed(prepared.kv, DType::f32, 2 * C, H, buf.ld_h, buf.wcat, buf.ld_c2, num_threads);
  } else if (prepared.kv) {  // wkv rows then wgate rows: one fp32 matrix, [2C, ld_h]
    wcat = static_cast<const float*>(prepared.kv);
  } else if (w_plain) {  // [wkv ; wgate]^T: [H, 2C]
    rows_to_f32_transposed(args.wkv.data, d.io, C, H, H, buf.wcat, buf.ld_c2, num_threads);
    rows_to_f32_transposed(args.wgate.data, d.io, C, H, H, buf.wcat + C, buf.ld_c2, num_threads);
  } else if (!half_in_place && buf.wcat) {
    rows_to_f32(args.wkv.data, d.io, C, H, buf.wcat, buf.ld_h, num_threads);
    rows_to_f32(args.wgate.data, d.io, C, H, buf.wcat + C * buf.ld_h, buf.ld_h, num_threads);
  }
  laps.lap(Phase::fwd_weights);

  ForwardBlockIo io;
  io.cache = static_cast<float*>(args.state_cache.data);
  io.block_size = args.state_cache.dim(1);
  io.slot_width = 2 * C;
  io.cache_stride0 = args.state_cache_stride0 ? args.state_cache_stride0 : io.block_size * 2 * C;
  io.block_table = static_cast<const std::int32_t*>(args.state_block_table->data);
  io.table_cols = args.cache_mode == 1 ? args.state_block_table->dim(1) : 1;
  io.cache_mode = static_cast<int>(args.cache_mode);
  io.cmp_kv = args.cmp_kv.data;
  io.softmax_score = args.grad_enabled ? static_cast<float*>(args.softmax_score.data) : nullptr;
  io.kv = args.grad_enabled ? static_cast<float*>(args.kv.data) : nullptr;
  io.scratch = buf.scratch;
  // Whole blocks may be dealt to the threads (forward_blocks) where no slot the call writes is also
  // read or written again by it; the check reads the block table once (allocates: before any write).
  if (plan.total_blocks >= 2 * num_threads)
    io.blocks_may_split = !cache_slots_alias(plan, cache_geometry(args, io.block_table));

  io.proj_ld = buf.ld_c2;
  std::int64_t prev_first = 0;
  for (std::int64_t a = 0; a < d.T; a += buf.chunk) {
    const std::int64_t b = std::min(d.T, a + buf.chunk), n = b - a;
    const std::int64_t first = first_carried_row(plan, a);
    if (a > 0)
      std::memmove(buf.proj, buf.proj + (first - prev_first) * buf.ld_c2,
                   static_cast<std::size_t>((a - first) * buf.ld_c2) * sizeof(float));
    prev_first = first;
    laps.lap(Phase::fwd_rows);
    float* rows = buf.proj + (a - first) * buf.ld_c2;
    const auto* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(a * H) * io_size;
    if (buf.bf16) {
      // [new_kv | new_score] = x . [wkv ; wgate]^T on the bf16 units: the chunk's rows in whole
      // tiles (zero rows after them), two products into the two column halves, in one team.
      const Bf16Shape shape = buf.bf16_shape(d);
      const Bf16Target both[] = {{b_kv, rows}, {b_gate, rows + C}};
      bool ok = true;
      if (gemm_row_stable() && bf16_rows_kernel_applicable(shape, n, panels[0] != nullptr)) {
        // kvcomp's AVX512-BF16 kernel, x where it lies: 1-8 rows on the weights where they lie, any
        // number on the weights' panels.
        gemm_bf16_rows_kernel(shape, n, static_cast<const std::uint16_t*>(static_cast<const void*>(x_rows)),
                              both, num_threads, panels[0] ? panels : nullptr);
      } else if (gemm_row_stable()) {
        // Few rows (decode): padded to 2 in column tiles where the kernel's rows allow it
        // (bf16_short_rows_stable), on a packed B (AMX) under 64 rows to a multiple of 16 where that
        // tile's rows keep their bits (bf16_packed_short_rows), else to whole 64-row tiles; each
        // gives a row the same bits.
        const std::int64_t n_short = std::max<std::int64_t>(n, 2);
        const bool short_rows =
            n_short < kBf16TileRows * std::max(num_threads, 1) && bf16_short_rows_stable(shape, n_short);
        const std::int64_t n_packed = short_rows ? 0 : bf16_packed_short_rows(shape, n);
        const std::int64_t n_pad = short_rows ? n_short : n_packed > 0 ? n_packed : bf16_padded_rows(n);
        // x where it lies when the chunk is whole tiles (a training call's chunks), else copied with zero
        // rows after it: the same rows through the same tiles either way.
        const auto* xa = static_cast<const std::uint16_t*>(static_cast<const void*>(x_rows));
        if (n_pad != n) {
          std::memcpy(buf.xb, x_rows, static_cast<std::size_t>(n * H) * sizeof(std::uint16_t));
          std::memset(buf.xb + n * H, 0, static_cast<std::size_t>((n_pad - n) * H) * sizeof(std::uint16_t));
          xa = buf.xb;
        }
        laps.lap(Phase::fwd_x);
        ok = short_rows ? gemm_bf16_rows(shape, n_pad, xa, both, false, num_threads)
                        : gemm_bf16(shape, n_pad, xa, both, false, num_threads);
      } else {  // KVCOMP_ROW_STABLE=0: the chunk's rows as they are, column tiles (decode-bound serving)
        const auto* xs = static_cast<const std::uint16_t*>(static_cast<const void*>(x_rows));
        ok = gemm_bf16_rows(shape, n, xs, both, false, num_threads);
      }
      if (!ok) return {StatusCode::runtime_error, "[kvcomp] oneDNN bf16 matmul for the projections failed"};
    } else {
      rows_to_f32(x_rows, d.io, n, H, buf.xf, buf.ld_h, num_threads);
      laps.lap(Phase::fwd_x);
      const std::optional<SgemmOrder> panel_order =
          prepared.kv_panels ? gemm_row_panels_order(n, C, H, buf.ld_h, fp16) : std::nullopt;
      if (panel_order) {  // decode panels
        gemm_row_panels(n, C, H, buf.xf, buf.ld_h, prepared.kv_panels, prepared.gate_panels, fp16, rows,
                        buf.ld_c2, *panel_order, num_threads);
      } else if (half_in_place) {  // [new_kv | new_score] = x . [wkv ; wgate]^T, the weights as they lie
        gemm_rows_16bit_weights(n, C, H, buf.xf, buf.ld_h, static_cast<const std::uint16_t*>(args.wkv.data),
                                static_cast<const std::uint16_t*>(args.wgate.data), fp16, rows, buf.ld_c2,
                                *in_place_order, num_threads);
      } else {
        // Zero rows up to the padded M, so each token's projection is computed
        // alike whatever the chunk's row count (gemm.hpp, row stability).
        const std::int64_t n_pad = gemm_padded_rows(n, true);
        for (std::int64_t i = n; i < n_pad; ++i)
          std::fill(buf.xf + i * buf.ld_h, buf.xf + i * buf.ld_h + H, 0.0f);
        // [new_kv | new_score] = x . [wkv ; wgate]^T (the weights widened now, tile by tile, unless
        // prepared or widened whole above)
        const bool ok =
            wcat ? gemm_f32(n_pad, 2 * C, H, {buf.xf, buf.ld_h, false},
                            w_plain ? GemmOperand{wcat, buf.ld_c2, false} : GemmOperand{wcat, buf.ld_h, true},
                            rows, buf.ld_c2, false, num_threads, n)
                 : gemm_f32_widening(n_pad, C, H, {buf.xf, buf.ld_h, false}, args.wkv.data, args.wgate.data,
                                     d.io, rows, buf.ld_c2, buf.widen, buf.ld_h, num_threads, n);
        if (!ok) return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for the projections failed"};
      }
    }
    laps.lap(Phase::fwd_products);
    add_ape(plan, static_cast<const float*>(args.ape.data), buf.proj, first, buf.ld_c2, a, b, num_threads);
    laps.lap(Phase::fwd_ape);
    io.proj = buf.proj;
    io.proj_first = first;
    forward_blocks(plan, io, a, b, num_threads);
    laps.lap(Phase::fwd_blocks);
  }
  zero_padding_rows(args, plan);  // last: rows disjoint from the blocks' rows
  laps.lap(Phase::fwd_rows);
  return Status::success();
}

}  // namespace kvcomp::detail
