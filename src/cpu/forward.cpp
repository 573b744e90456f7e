// The CPU forward, phase by phase (the phases phase_clock.hpp times): the weights as the products read
// them, then per chunk of token rows the projections, + ape, and the blocks (cache writes, softmax,
// pooling); last the output rows that hold no block. What each chunk's projection product runs on is
// decided by choose_projection, the same function the plan's verbose report asks.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "common/environment.hpp"
#include "cpu/backend.hpp"
#include "cpu/block_phases.hpp"
#include "cpu/convert.hpp"
#include "cpu/epilogue.hpp"
#include "cpu/phase_clock.hpp"
#include "cpu/prepared.hpp"
#include "cpu/products/config.hpp"
#include "cpu/products/onednn_bf16.hpp"
#include "cpu/products/onednn_f32.hpp"

namespace kvcomp::detail {

namespace {

// Rows from which a bf16 call on AVX512-BF16 writes the weights' panels itself when the call names none
// (prepare_weights): from there on writing them (2 C H values, once per call) costs less than oneDNN's
// jit gemm packing the weights for every tile of rows (docs/performance.md). Both give every row the
// same bits.
constexpr std::int64_t kPanelCallRows = 128;

// Token rows per chunk. On the bf16 units 128 per thread, from 256 to kChunkRows: the chunk's x rows
// (read by every column tile of both products) and its projections (read back by the block phase) then
// stay nearer the cores than in chunks of kChunkRows; not fewer per thread, since a packed B (AMX) runs a
// chunk as 64-row tiles per product, and 2 x chunk / 64 tiles must keep every thread busy. The fp32
// products take four of their row tiles (gemm_tile_rows: 1024 rows where the tile is 256, 768 on AVX2,
// where 1024 rows would pad to 1056 and run as five 192-row tiles and a 96-row one). The products give a
// row the same bits whatever the chunk (row-stable), and a block's softmax does not depend on it, so
// neither do the outputs.
std::int64_t forward_chunk_rows(const Dims& d, const ForwardDecision& call, int num_threads) {
  if (!call.bf16_products) return 4 * gemm_tile_rows(call.tiling, d.H, true);
  return std::clamp<std::int64_t>(128 * std::int64_t{std::max(num_threads, 1)}, 256, kChunkRows);
}

struct ForwardBuffers {
  std::int64_t ld_h, ld_c2;  // padded leading dimensions
  // fp32 products of a longer call: wkv rows then wgate rows in fp32, [2C, ld_h], or transposed, [H, ld_c2]
  float* wcat = nullptr;
  // The longer call's weights read as the plain B [H, ld_c2] (gemm_b_plain_same_bits): widened so from
  // the 16-bit weights, or the blob's fp32 rows transposed.
  bool w_plain = false;
  float* widen = nullptr;  // fp32 products of one row tile: each thread's column tile of the fp32 weights
  float* xf = nullptr;     // [Rp, ld_h]: the chunk's x rows in fp32, zero rows up to the GEMM's padded M
  float* proj;    // [coff*r + Rp, ld_c2]: projections (kv | score+ape) of the chunk and the rows before it
  void* scratch;  // forward_scratch_bytes() for each thread of forward_blocks
  // bf16 products (products/onednn_bf16.hpp), when x is bf16 and the CPU has bf16 units:
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
  ForwardBuffers(const Dims& d, const ForwardDecision& call, const PreparedView& prepared, int num_threads,
                 void* base) {
    WorkspaceLayout ws(base);
    bf16 = call.bf16_products;
    chunk = forward_chunk_rows(d, call, num_threads);
    // Rp: the chunk's rows padded for a row-stable product (products/onednn_f32.hpp,
    // products/onednn_bf16.hpp).
    const std::int64_t R = std::min(chunk, std::max<std::int64_t>(d.T, 1));
    const std::int64_t Rp = std::max(gemm_row_capacity(call.tiling, R), bf16_padded_rows(R));
    ld_h = padded_ld(d.H);
    ld_c2 = padded_ld(2 * d.C);
    const Bf16Plan p = bf16 ? bf16_plan(call.bf16, bf16_shape(d)) : Bf16Plan{};
    const std::size_t packed = p.packed_bytes;
    ok = !bf16 || p.ok;                  // oneDNN could not make the product (out of memory): the call fails
    if (bf16) {                          // the bf16 products read x and the (packed) weights: no fp32 copies
      if (packed > 0 && !prepared.kv) {  // the blob holds them packed otherwise
        packed_kv = ws.take<unsigned char>(static_cast<std::int64_t>(packed));
        packed_gate = ws.take<unsigned char>(static_cast<std::int64_t>(packed));
      }
      xb = ws.take<std::uint16_t>(Rp * d.H);
      if (packed == 0 && !prepared.kv_panels && d.T >= kPanelCallRows && call.bf16_decode_panels &&
          d.C % 16 == 0)
        panels = ws.take<std::uint16_t>(2 * static_cast<std::int64_t>(bf16_panel_elements(d.C, d.H)));
    } else {
      // A call of one row tile (decode) widens the weights tile by tile, in the caches; a longer one
      // reads each column tile once per row tile, so it widens them once, whole, as [H, 2C] where the
      // probe holds (a blob's fp32 rows transposed so too), else as [2C, H]; a blob holds the latter.
      const bool one_pass = gemm_one_column_pass(call.tiling, gemm_padded_rows(call.tiling, R, true), d.H);
      w_plain = d.gate && !one_pass && gemm_b_plain_same_bits(call.tiling, 2 * d.C, d.H, ld_h, ld_h, ld_c2);
      if (w_plain)
        wcat = ws.take<float>(d.H * ld_c2);
      else if (!d.gate)  // no gate: wkv alone, widened whole (a call without wgate takes no blob)
        wcat = ws.take<float>(d.C * ld_h);
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

// What the call's projection products may read, decided from its shape, its plan, its prepared weights
// and its buffers (before any data is read): the same at planning (the verbose report) and in the run.
struct ProjectionInputs {
  // bf16 products: the weights' AVX-512 panels for kvcomp's AVX512-BF16 kernel, from the blob or written
  // by this call (a long call without them, where the kernel serves its chunks).
  bool bf16_panels = false;
  bool bf16_panels_written = false;
  // fp32 products: the blob's 16-bit decode panels; the 16-bit weights read in place by kvcomp's AVX2
  // rows kernel (a decode call without a blob: sgemm's order for it); gemm_f32's tiles of few live rows
  // on that kernel (their orders).
  bool f32_panels = false;
  std::optional<SgemmOrder> in_place_order;
  std::optional<RowsKernelOrders> rows_orders;
};

ProjectionInputs projection_inputs(const Dims& d, const ForwardDecision& call, const PreparedView& prepared,
                                   const ForwardBuffers& buf) {
  ProjectionInputs in;
  const bool row_stable = call.tiling.row_stable;
  if (buf.bf16) {
    in.bf16_panels = prepared.kv_panels != nullptr;
    if (!in.bf16_panels && buf.panels && row_stable &&
        bf16_rows_kernel_applicable(call.bf16, call.bf16_rows_kernel, ForwardBuffers::bf16_shape(d),
                                    std::min(d.T, buf.chunk), true))
      in.bf16_panels = in.bf16_panels_written = true;
    return in;
  }
  const ProductConfig& config = product_config();
  const bool fp16 = d.io == DType::f16;
  in.f32_panels = prepared.kv_panels != nullptr;
  // A decode call of at most 8 rows without prepared weights, on AVX2: its fp32 products read the 16-bit
  // weights where they lie, with the bits of the converted copy, and skip converting them.
  if (!prepared.kv && d.gate && (d.io == DType::bf16 || fp16))
    in.in_place_order = rows_16bit_order(config, row_stable, d.T, d.C, d.H, buf.ld_h, fp16);
  // gemm_f32 reads B stored [2C, H] with row stride ld_h (the fp32 copy, or the widened tiles).
  // Asked only where a chunk has so few rows (the first, or the last).
  const std::int64_t last = d.T % buf.chunk;
  if (d.T <= kRowsKernelMax || (last > 0 && last <= kRowsKernelMax))
    in.rows_orders = rows_kernel_orders(config, row_stable, projection_columns(d), d.H, buf.ld_h, buf.ld_h);
  return in;
}

// What a chunk's projection product runs on, in order of preference.
enum class Projection {
  bf16_rows_kernel,   // kvcomp's AVX512-BF16 kernel, x where it lies, on the weights or their panels
  bf16_short_rows,    // oneDNN's jit gemm, the rows padded to 2, in column tiles
  bf16_tiles,         // whole tiles (64 rows, or 16 on a packed B where that keeps the bits)
  bf16_rows,          // no row stability: the rows as they are, in column tiles
  f32_panels,         // kvcomp's rows kernel on the blob's 16-bit decode panels
  f32_16bit_weights,  // kvcomp's AVX2 rows kernel on the 16-bit weights where they lie
  f32_tiles,          // oneDNN's sgemm in fixed tiles (few live rows on kvcomp's AVX2 rows kernel)
};

struct ProjectionChoice {
  Projection kind = Projection::f32_tiles;
  std::int64_t rows = 0;            // rows the product runs (the chunk's, padded for row stability)
  std::optional<SgemmOrder> order;  // f32_panels, f32_16bit_weights
  bool live_rows_kernel = false;    // f32_tiles: the live rows on kvcomp's AVX2 rows kernel (whole groups)
};

// Allocates nothing (a run asks it per chunk, after its first writes).
ProjectionChoice choose_projection(const Dims& d, const ForwardDecision& call, const ProjectionInputs& in,
                                   std::int64_t ld_h, std::int64_t n, int num_threads) {
  ProjectionChoice c;
  const bool row_stable = call.tiling.row_stable;
  if (call.bf16_products) {
    const Bf16Shape shape = ForwardBuffers::bf16_shape(d);
    if (row_stable &&
        bf16_rows_kernel_applicable(call.bf16, call.bf16_rows_kernel, shape, n, in.bf16_panels)) {
      c.kind = Projection::bf16_rows_kernel;
      c.rows = n;
    } else if (!row_stable) {
      c.kind = Projection::bf16_rows;
      c.rows = n;
    } else {
      // Few rows (decode): padded to 2 in column tiles where the kernel's rows allow it
      // (bf16_short_rows_stable), on a packed B (AMX) under 64 rows to a multiple of 16 where that
      // tile's rows keep their bits (bf16_packed_short_rows), else to whole 64-row tiles; each gives a
      // row the same bits.
      const std::int64_t n_short = std::max<std::int64_t>(n, 2);
      const bool short_rows = n_short < kBf16TileRows * std::max(num_threads, 1) &&
                              bf16_short_rows_stable(call.bf16, shape, n_short);
      const std::int64_t n_packed = short_rows ? 0 : bf16_packed_short_rows(call.bf16, shape, n);
      c.kind = short_rows ? Projection::bf16_short_rows : Projection::bf16_tiles;
      c.rows = short_rows ? n_short : n_packed > 0 ? n_packed : bf16_padded_rows(n);
    }
    return c;
  }
  const ProductConfig& config = product_config();
  const bool fp16 = d.io == DType::f16;
  c.order = in.f32_panels ? row_panels_order(config, row_stable, n, d.C, d.H, ld_h, fp16) : std::nullopt;
  if (c.order) {
    c.kind = Projection::f32_panels;
    c.rows = n;
  } else if (in.in_place_order) {
    c.kind = Projection::f32_16bit_weights;
    c.rows = n;
    c.order = in.in_place_order;
  } else {
    c.kind = Projection::f32_tiles;
    c.rows = gemm_padded_rows(call.tiling, n, true);
    c.live_rows_kernel = in.rows_orders && n <= kRowsKernelMax;
  }
  return c;
}

// Why the kernels preferred to `c` were not taken (the verbose report).
std::string projection_not_taken(const Dims& d, const ForwardDecision& call, const ProjectionInputs& in,
                                 const ProjectionChoice& c, std::int64_t n) {
  const bool row_stable = call.tiling.row_stable;
  std::string s;
  const auto add = [&s](const std::string& why) { s += (s.empty() ? "" : "; ") + why; };
  if (call.bf16_products) {
    if (c.kind == Projection::bf16_rows_kernel) return s;
    add(!call.bf16_rows_kernel ? "kvcomp avx512_bf16: not on this CPU or switched off"
        : !row_stable          ? "kvcomp avx512_bf16: the call is not row-stable"
        : n > kRowsKernelMax && !in.bf16_panels
            ? "kvcomp avx512_bf16: more than 8 rows and no panels"
            : "kvcomp avx512_bf16: oneDNN's order for this shape is not the kernel's");
    if (c.kind == Projection::bf16_tiles)
      add("2-row column tiles: oneDNN's kernel does not keep a row's bits in them");
    return s;
  }
  if (c.kind == Projection::f32_panels) return s;
  add(in.f32_panels ? "decode panels: not for this row count, call or order"
                    : "decode panels: none prepared");
  if (c.kind == Projection::f32_16bit_weights) return s;
  add(d.io == DType::f32     ? "16-bit weights in place: fp32 io"
      : d.T > kRowsKernelMax ? "16-bit weights in place: more than 8 rows"
                             : "16-bit weights in place: prepared weights, or the kernel does not run");
  if (!c.live_rows_kernel)
    add(!product_config().f32_rows_kernel ? "kvcomp avx2 rows in the tiles: the kernel does not run here"
        : !row_stable                     ? "kvcomp avx2 rows in the tiles: the call is not row-stable"
                                          : "kvcomp avx2 rows in the tiles: more than 8 rows");
  return s;
}

const char* projection_name(Projection p, const ProductConfig& config) {
  switch (p) {
    case Projection::bf16_rows_kernel:
      return "kvcomp avx512_bf16 rows kernel";
    case Projection::bf16_short_rows:
      return "oneDNN jit gemm, rows padded to 2";
    case Projection::bf16_tiles:
      return config.bf16_kernels.amx ? "kvcomp amx_bf16" : "oneDNN bf16 tiles";
    case Projection::bf16_rows:
      return "oneDNN bf16, the rows as they are";
    case Projection::f32_panels:
      return "kvcomp rows kernel on decode panels";
    case Projection::f32_16bit_weights:
      return "kvcomp avx2 rows kernel on the 16-bit weights";
    case Projection::f32_tiles:
      return "dnnl_sgemm tiles";
  }
  return "unknown";
}

// The call's weights as its products read them: the blob's, else packed, converted or widened here (or
// left where they lie). Phase fwd_weights.
struct ProjectionWeights {
  const void* b_kv = nullptr;  // bf16 products: wkv, or its packed copy
  const void* b_gate = nullptr;
  const float* wcat =
      nullptr;  // fp32 products: [2C, ld_h] rows, or [H, ld_c2] (w_plain); null: widened per tile
  const std::uint16_t* panels[2] = {nullptr, nullptr};  // the decode panels (bf16: AVX-512; fp32: the blob's)
};

Status stage_weights(const ForwardArgs& args, const Dims& d, const ForwardDecision& call,
                     const PreparedView& prepared, const ProjectionInputs& in, ForwardBuffers& buf,
                     int num_threads, ProjectionWeights* w) {
  const std::int64_t H = d.H, C = d.C;
  w->b_kv = args.wkv.data;
  w->b_gate = args.wgate.data;
  w->wcat = buf.wcat;
  if (buf.bf16) {
    w->panels[0] = prepared.kv_panels;
    w->panels[1] = prepared.gate_panels;
    if (in.bf16_panels_written) {
      write_bf16_panels(static_cast<const std::uint16_t*>(args.wkv.data),
                        static_cast<const std::uint16_t*>(args.wgate.data), C, H, buf.panels, num_threads);
      w->panels[0] = buf.panels;
      w->panels[1] = buf.panels + bf16_panel_elements(C, H);
    }
    if (prepared.kv) {  // packed
      w->b_kv = prepared.kv;
      w->b_gate = prepared.gate;
    } else if (buf.packed_kv) {
      const Bf16PackJob jobs[] = {{static_cast<const std::uint16_t*>(args.wkv.data), buf.packed_kv},
                                  {static_cast<const std::uint16_t*>(args.wgate.data), buf.packed_gate}};
      if (!bf16_pack_b(call.bf16, ForwardBuffers::bf16_shape(d), jobs, 2, num_threads))
        return {StatusCode::runtime_error, "[kvcomp] oneDNN reorder of the bf16 weights failed"};
      w->b_kv = buf.packed_kv;
      w->b_gate = buf.packed_gate;
    }
    return Status::success();
  }
  w->panels[0] = prepared.kv_panels;
  w->panels[1] = prepared.gate_panels;
  if (!d.gate) {  // wkv alone: [C, ld_h]
    rows_to_f32(args.wkv.data, d.io, C, H, buf.wcat, buf.ld_h, num_threads);
    return Status::success();
  }
  // The long fp32-product call's weights widened as [H, 2C] where oneDNN's sgemm gives the same bits
  // from there as from [2C, H] and runs faster (AVX-512, docs/performance.md); a prepared blob's [2C, H]
  // is transposed too.
  if (buf.w_plain && prepared.kv) {  // the blob's fp32 rows transposed (even where wkv, wgate differ)
    rows_to_f32_transposed(prepared.kv, DType::f32, 2 * C, H, buf.ld_h, buf.wcat, buf.ld_c2, num_threads);
  } else if (prepared.kv) {  // wkv rows then wgate rows: one fp32 matrix, [2C, ld_h]
    w->wcat = static_cast<const float*>(prepared.kv);
  } else if (buf.w_plain) {  // [wkv ; wgate]^T: [H, 2C]
    rows_to_f32_transposed(args.wkv.data, d.io, C, H, H, buf.wcat, buf.ld_c2, num_threads);
    rows_to_f32_transposed(args.wgate.data, d.io, C, H, H, buf.wcat + C, buf.ld_c2, num_threads);
  } else if (!in.in_place_order && buf.wcat) {
    rows_to_f32(args.wkv.data, d.io, C, H, buf.wcat, buf.ld_h, num_threads);
    rows_to_f32(args.wgate.data, d.io, C, H, buf.wcat + C * buf.ld_h, buf.ld_h, num_threads);
  }
  return Status::success();
}

// [new_kv | new_score] = x . [wkv ; wgate]^T for the chunk's rows x_rows (n of them) into `rows` (row
// stride ld_c2), as `choice` says. Phases fwd_x and fwd_products (this one lapped by the caller).
Status project_chunk(const ForwardArgs& args, const Dims& d, const ForwardDecision& call,
                     const ProjectionChoice& choice, const ProjectionInputs& in, const ProjectionWeights& w,
                     ForwardBuffers& buf, const unsigned char* x_rows, std::int64_t n, float* rows,
                     int num_threads, PhaseLaps& laps) {
  const std::int64_t H = d.H, C = d.C;
  if (buf.bf16) {
    // The two products into the two column halves, in one team.
    const Bf16Shape shape = ForwardBuffers::bf16_shape(d);
    const Bf16Target both[] = {{w.b_kv, rows}, {w.b_gate, rows + C}};
    const auto* xs = static_cast<const std::uint16_t*>(static_cast<const void*>(x_rows));
    bool ok = true;
    switch (choice.kind) {
      case Projection::bf16_rows_kernel:  // 1-8 rows on the weights where they lie, any number on panels
        gemm_bf16_rows_kernel(shape, n, xs, both, num_threads, w.panels[0] ? w.panels : nullptr);
        break;
      case Projection::bf16_rows:
        ok = gemm_bf16_rows(call.bf16, shape, n, xs, both, false, num_threads);
        break;
      default: {
        // x where it lies when the chunk is whole tiles (a training call's chunks), else copied with zero
        // rows after it: the same rows through the same tiles either way.
        const std::int64_t n_pad = choice.rows;
        const std::uint16_t* xa = xs;
        if (n_pad != n) {
          std::memcpy(buf.xb, x_rows, static_cast<std::size_t>(n * H) * sizeof(std::uint16_t));
          std::memset(buf.xb + n * H, 0, static_cast<std::size_t>((n_pad - n) * H) * sizeof(std::uint16_t));
          xa = buf.xb;
        }
        laps.lap(Phase::fwd_x);
        ok = choice.kind == Projection::bf16_short_rows
                 ? gemm_bf16_rows(call.bf16, shape, n_pad, xa, both, false, num_threads)
                 : gemm_bf16(call.bf16, shape, n_pad, xa, both, false, num_threads);
      }
    }
    if (!ok) return {StatusCode::runtime_error, "[kvcomp] oneDNN bf16 matmul for the projections failed"};
    return Status::success();
  }
  const bool fp16 = d.io == DType::f16;
  rows_to_f32(x_rows, d.io, n, H, buf.xf, buf.ld_h, num_threads);
  laps.lap(Phase::fwd_x);
  switch (choice.kind) {
    case Projection::f32_panels:
      gemm_row_panels(n, C, H, buf.xf, buf.ld_h, w.panels[0], w.panels[1], fp16, rows, buf.ld_c2,
                      *choice.order, num_threads);
      return Status::success();
    case Projection::f32_16bit_weights:
      gemm_rows_16bit_weights(n, C, H, buf.xf, buf.ld_h, static_cast<const std::uint16_t*>(args.wkv.data),
                              static_cast<const std::uint16_t*>(args.wgate.data), fp16, rows, buf.ld_c2,
                              *choice.order, num_threads);
      return Status::success();
    default:
      break;
  }
  // Zero rows up to the padded M, so each token's projection is computed alike whatever the chunk's row
  // count (onednn_f32.hpp, row stability); the weights widened now, tile by tile, unless prepared or
  // widened whole.
  const std::int64_t n_pad = choice.rows;
  for (std::int64_t i = n; i < n_pad; ++i) std::fill(buf.xf + i * buf.ld_h, buf.xf + i * buf.ld_h + H, 0.0f);
  const RowsKernelOrders* orders = in.rows_orders ? &*in.rows_orders : nullptr;
  const bool ok = w.wcat ? gemm_f32(call.tiling, n_pad, projection_columns(d), H, {buf.xf, buf.ld_h, false},
                                    buf.w_plain ? GemmOperand{w.wcat, buf.ld_c2, false}
                                                : GemmOperand{w.wcat, buf.ld_h, true},
                                    rows, buf.ld_c2, false, num_threads, n, orders)
                         : gemm_f32_widening(call.tiling, n_pad, C, H, {buf.xf, buf.ld_h, false},
                                             args.wkv.data, args.wgate.data, d.io, rows, buf.ld_c2, buf.widen,
                                             buf.ld_h, num_threads, n, orders);
  if (!ok) return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for the projections failed"};
  if (!d.gate)  // no gate product: the scores are 0 (+ ape, added next)
    for (std::int64_t i = 0; i < n; ++i)
      std::fill(rows + i * buf.ld_c2 + C, rows + i * buf.ld_c2 + 2 * C, 0.0f);
  return Status::success();
}

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
  if (s.base + s.len <= a) return a;             // the batch of row a - 1 ends there
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

// The block phases' view of the call (its cache, outputs and scratch).
ForwardBlockIo block_io(const ForwardArgs& args, const BlockPlan& plan, const ForwardBuffers& buf,
                        int num_threads) {
  ForwardBlockIo io;
  io.cache = cache_geometry(args);
  io.cmp_kv = args.cmp_kv.data;
  io.softmax_score = args.grad_enabled ? static_cast<float*>(args.softmax_score.data) : nullptr;
  io.kv = args.grad_enabled ? static_cast<float*>(args.kv.data) : nullptr;
  io.scratch = buf.scratch;
  // Whole blocks may be dealt to the threads (forward_blocks) where no slot the call writes is also
  // read or written again by it; the check reads the block table once (allocates: before any write).
  if (plan.total_blocks >= 2 * num_threads) io.blocks_may_split = !cache_slots_alias(plan, io.cache);
  io.proj_ld = buf.ld_c2;
  return io;
}

// The verbose report of a planned call (KVCOMP_VERBOSE=1): the products of its chunks and why the
// kernels preferred to them were not taken.
void report_forward(const Dims& d, const ForwardDecision& call, const ProjectionInputs& in,
                    const ForwardBuffers& buf, int num_threads) {
  const ProductConfig& config = product_config();
  std::string s =
      plan_report_head("forward", d, num_threads, call.tiling.row_stable) + "\n[kvcomp]   products: ";
  if (call.bf16_products)
    s += "bf16 (" + (config.bf16_kernels.amx ? std::string("kvcomp amx_bf16") : config.bf16_kernel) + ")";
  else
    s += "fp32 (dnnl_sgemm); bf16 units not taken: " +
         (d.io != DType::bf16 ? std::string("the io is not bf16") : config.bf16_off);
  if (in.bf16_panels_written) s += "; the weights' AVX-512 panels written by this call";
  // The chunks' row counts: every chunk but the last has `full` rows.
  const std::int64_t full = std::min(d.T, buf.chunk), last = d.T - (d.T - 1) / buf.chunk * buf.chunk;
  for (int i = 0; i < (last == full ? 1 : 2); ++i) {
    const std::int64_t n = i == 0 ? full : last;
    const ProjectionChoice c = choose_projection(d, call, in, buf.ld_h, n, num_threads);
    s += "\n[kvcomp]   " + std::string(i == 0 ? "chunks" : "last chunk") + " of " + std::to_string(n) +
         " rows: " + projection_name(c.kind, config) + " (" + std::to_string(c.rows) + " rows" +
         (c.live_rows_kernel ? ", the live ones on kvcomp's avx2 rows kernel" : "") + ")";
    const std::string not_taken = projection_not_taken(d, call, in, c, n);
    if (!not_taken.empty()) s += "; not taken: " + not_taken;
  }
  std::fprintf(stderr, "%s\n", s.c_str());
}

}  // namespace

std::string plan_report_head(const char* op, const Dims& d, int num_threads, bool row_stable) {
  return std::string("[kvcomp] ") + op + " plan: " + std::to_string(d.T) + " rows, H " + std::to_string(d.H) +
         (d.gate ? ", 2 x " : ", 1 x (no gate) ") + std::to_string(d.C) + " projection columns, " +
         dtype_name(d.io) + " io, " + std::to_string(num_threads) + " threads" +
         (row_stable ? "" : ", not row-stable");
}

ForwardDecision decide_forward(const Dims& d, const Options& options) {
  const ProductConfig& config = product_config();
  ForwardDecision call;
  call.tiling = config.tiling(options.row_stable);
  call.bf16 = config.bf16_kernels;
  // A call without a gate runs fp32 products on every CPU: its product is wkv's alone, which the bf16
  // tiles and kernels (made for the two halves) do not run.
  call.bf16_products = d.io == DType::bf16 && config.bf16() && d.gate;
  call.bf16_rows_kernel = config.bf16_rows_kernel;
  call.bf16_decode_panels = config.bf16_decode_panels;
  return call;
}

Status forward_workspace_size(const Dims& d, const ForwardDecision& call, const void* prepared_weights,
                              int num_threads, std::size_t* size) {
  const PreparedView prepared = prepared_weights ? prepared_view(prepared_weights) : PreparedView{};
  const ForwardBuffers buf(d, call, prepared, num_threads, nullptr);
  if (!buf.ok) return {StatusCode::runtime_error, kNoBf16Product};
  if (verbose() && d.T > 0)
    report_forward(d, call, projection_inputs(d, call, prepared, buf), buf, num_threads);
  *size = buf.size;
  return Status::success();
}

Status run_forward(const ForwardArgs& args, const BlockPlan& plan, const ForwardDecision& call,
                   int num_threads, void* workspace, std::size_t workspace_size) {
  const Dims& d = plan.dims;
  if (d.T == 0) return Status::success();  // empty input: nothing computed, cache untouched
  PhaseLaps laps(0);
  // The weights as the products read them: from prepare_weights() when the call names its result
  // (checked by execute's validation just before; the same bytes as stage_weights makes, made once for
  // many calls).
  const PreparedView prepared = args.prepared_weights ? prepared_view(args.prepared_weights) : PreparedView{};
  ForwardBuffers buf(d, call, prepared, num_threads, WorkspaceLayout::align(workspace));
  if (!buf.ok) return {StatusCode::runtime_error, kNoBf16Product};
  if (buf.size > workspace_size)  // planned for a blob that held more than the one named now
    return {StatusCode::invalid_param, "[kvcomp] workspace_size (= " + std::to_string(workspace_size) +
                                           ") must be >= " + std::to_string(buf.size) +
                                           " bytes for the prepared_weights named now: plan the call again"};
  const ProjectionInputs in = projection_inputs(d, call, prepared, buf);
  ProjectionWeights w;
  if (Status s = stage_weights(args, d, call, prepared, in, buf, num_threads, &w); !s.ok()) return s;
  laps.lap(Phase::fwd_weights);

  ForwardBlockIo io = block_io(args, plan, buf, num_threads);
  const std::size_t io_size = dtype_size(d.io);
  std::int64_t prev_first = 0;
  for (std::int64_t a = 0; a < d.T; a += buf.chunk) {
    const std::int64_t b = std::min(d.T, a + buf.chunk), n = b - a;
    // The projection rows the chunk's blocks read from before it, moved to the front.
    const std::int64_t first = first_carried_row(plan, a);
    if (a > 0)
      std::memmove(buf.proj, buf.proj + (first - prev_first) * buf.ld_c2,
                   static_cast<std::size_t>((a - first) * buf.ld_c2) * sizeof(float));
    prev_first = first;
    laps.lap(Phase::fwd_rows);
    const auto* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(a * d.H) * io_size;
    const ProjectionChoice choice = choose_projection(d, call, in, buf.ld_h, n, num_threads);
    if (Status s = project_chunk(args, d, call, choice, in, w, buf, x_rows, n,
                                 buf.proj + (a - first) * buf.ld_c2, num_threads, laps);
        !s.ok())
      return s;
    laps.lap(Phase::fwd_products);
    if (args.ape.data)  // else a call without APE
      add_ape(plan, static_cast<const float*>(args.ape.data), buf.proj, first, buf.ld_c2, a, b, num_threads);
    laps.lap(Phase::fwd_ape);
    io.proj = buf.proj;
    io.proj_first = first;
    forward_blocks(plan, io, a, b, num_threads);
    laps.lap(Phase::fwd_blocks);
  }
  zero_padding_rows(args, plan);  // last: rows disjoint from the blocks' rows
  laps.lap(Phase::fwd_rows);
  // The epilogue on the pooled rows, which a call that records the gradient keeps in `pooled` first.
  if (const EpilogueView ep = epilogue_view(args.epilogue); ep.any()) {
    epilogue_forward(plan, ep, args.cmp_kv.numel() / d.D, args.cmp_kv.data,
                     args.grad_enabled ? args.pooled.data : nullptr, num_threads);
    laps.lap(Phase::fwd_blocks);
  }
  return Status::success();
}

}  // namespace kvcomp::detail
