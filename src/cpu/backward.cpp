#include <emmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/environment.hpp"
#include "cpu/backend.hpp"
#include "cpu/block_phases.hpp"
#include "cpu/convert.hpp"
#include "cpu/epilogue.hpp"
#include "cpu/phase_clock.hpp"
#include "cpu/products/config.hpp"
#include "cpu/products/onednn_bf16.hpp"
#include "cpu/products/onednn_f32.hpp"

namespace kvcomp::detail {

namespace {

constexpr const char* kNoBf16Products = "[kvcomp] oneDNN could not create the bf16 products of the backward";

struct BackwardBuffers {
  std::int64_t R, ld_h, ld_c2, ld_r;  // chunk rows and padded leading dimensions
  float* wcat = nullptr;              // [2C, ld_h]: wkv rows then wgate rows, fp32 (fp32 products)
  float* dwcat;                       // [2C (bf16: padded to a tile), ld_h]: d_wkv then d_wgate rows, fp32
  float* xf = nullptr;  // [R, ld_h]: the chunk's x rows in fp32, rows without gradient zeroed (fp32 products)
  float* dnew = nullptr;    // [Rp, ld_c2]: d_new_kv | d_new_score (fp32 products only)
  float* dnew_t = nullptr;  // [2C, ld_r]: its transpose (oneDNN's transposed-A path runs at half speed)
  float* dxf;               // [Rp, ld_h]: d_x of the chunk before narrowing
  double* dape;             // [r, C]
  float* dp = nullptr;      // [epilogue rows, D]: the pooled rows' gradient (a call with an epilogue)
  void* epilogue_scratch = nullptr;
  // bf16 products (products/onednn_bf16.hpp), when the io dtype is bf16 and the CPU has bf16 units. d_new in
  // bf16 as a high part and, in precise mode, a low part (d_new - hi, rounded), which the blocks
  // write themselves (no fp32 rows): both as the d_x product's A [Rp, ld_dn] and, transposed, as the
  // weight-gradient product's A [2Cp, ld_t].
  bool bf16 = false;
  bool ok = true;
  std::int64_t ld_dn = 0, ld_t = 0, c2p = 0;  // c2p: 2C padded to a tile
  std::uint16_t* dn[2] = {nullptr, nullptr};
  std::uint16_t* dnt[2] = {nullptr, nullptr};
  std::uint16_t* xb = nullptr;  // [R padded to a tile, H]: the chunk's x rows, rows without gradient zeroed
  std::uint16_t* wcat16 = nullptr;  // [2C, H]: wkv rows then wgate rows, the d_x product's B
  void* packed_w = nullptr;         // wcat16 packed, where the product wants B packed
  void* packed_x = nullptr;         // xb as the weight-gradient product's B, likewise
  std::size_t packed_x_bytes = 0;
  std::size_t size;

  // d_x (+)= dn[part] . [wkv ; wgate]: [n, 2C] . [2C, H], one product over both halves of d_new (two
  // products of K = C, the second accumulating, moved the fp32 d_x rows through memory twice more).
  Bf16Shape dx_shape(const Dims& d) const { return {d.H, 2 * d.C, ld_dn, ld_h, d.H, false}; }
  // The same product written straight into the bf16 d_x rows (npu_parity's one part).
  Bf16Shape dx_io_shape(const Dims& d) const { return {d.H, 2 * d.C, ld_dn, d.H, d.H, false, true}; }
  // [d_wkv ; d_wgate] += dnt . x: [2C, k] . [k, H], k the chunk's rows padded to a tile.
  Bf16Shape dw_shape(const Dims& d, std::int64_t k) const { return {d.H, k, ld_t, ld_h, d.H, false}; }

  BackwardBuffers(const Dims& d, const BackwardDecision& call, void* base) {
    WorkspaceLayout ws(base);
    R = std::min(kChunkRows, std::max<std::int64_t>(d.T, 1));
    // dnew and dxf hold the rows of the d_x product padded for row stability (onednn_f32.hpp,
    // onednn_bf16.hpp).
    const std::int64_t Rp = std::max(gemm_row_capacity(call.tiling, R), bf16_padded_rows(R));
    ld_h = padded_ld(d.H);
    ld_c2 = padded_ld(2 * d.C);
    ld_r = padded_ld(R);
    if (products_16bit(call.path)) {
      ld_dn = padded_ld(2 * d.C);
      ld_t = padded_ld(bf16_padded_rows(R));
      c2p = bf16_padded_rows(2 * d.C);
      const Bf16Plan w = bf16_plan(call.bf16, dx_shape(d)),
                     x = bf16_plan(call.bf16, dw_shape(d, bf16_padded_rows(R)));
      packed_x_bytes = x.packed_bytes;
      bf16 = true;
      ok = w.ok && x.ok;  // oneDNN could not make the products (out of memory)
      wcat16 = ws.take<std::uint16_t>(2 * d.C * d.H);
      if (w.packed_bytes > 0) packed_w = ws.take<unsigned char>(static_cast<std::int64_t>(w.packed_bytes));
      if (packed_x_bytes > 0) packed_x = ws.take<unsigned char>(static_cast<std::int64_t>(packed_x_bytes));
      // The low part only in precise mode (npu_parity's d_new is bf16 already).
      for (int part = 0; part < dnew_parts(call.path); ++part) {
        dn[part] = ws.take<std::uint16_t>(Rp * ld_dn);
        dnt[part] = ws.take<std::uint16_t>(c2p * ld_t);
      }
      xb = ws.take<std::uint16_t>(bf16_padded_rows(R) * d.H);
    }
    if (!bf16) {
      wcat = ws.take<float>(2 * d.C * ld_h);
      xf = ws.take<float>(R * ld_h);
      dnew_t = ws.take<float>(2 * d.C * ld_r);
    }
    dwcat = ws.take<float>((bf16 ? c2p : 2 * d.C) * ld_h);
    if (!bf16) dnew = ws.take<float>(Rp * ld_c2);
    dxf = ws.take<float>(Rp * ld_h);
    dape = ws.take<double>(d.r * d.C);
    if (call.epilogue_rows > 0) {
      dp = ws.take<float>(call.epilogue_rows * d.D);
      epilogue_scratch =
          ws.take<unsigned char>(static_cast<std::int64_t>(epilogue_backward_bytes(call.epilogue_rows, d.D)));
    }
    size = ws.size();
  }
};

// Rows [0, rows) x columns [0, cols) of src (row stride ld_src) transposed into dst (row stride ld_dst):
// dst[c * ld_dst + i] = src[i * ld_src + c]. B x B blocks by `block` (SSE2 shuffles, x86-64's
// baseline), the edges one by one; the threads deal out runs of 64 columns. A pure copy: no rounding,
// so the thread count cannot matter.
template <std::int64_t B, class T, class Block>
void transpose_blocks(const T* src, std::int64_t rows, std::int64_t cols, std::int64_t ld_src, T* dst,
                      std::int64_t ld_dst, int num_threads, Block block) {
  constexpr std::int64_t kCols = 64;
  const std::int64_t r_b = rows / B * B;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t c0 = 0; c0 < cols; c0 += kCols) {
    const std::int64_t c_end = std::min(cols, c0 + kCols), c_b = c0 + (c_end - c0) / B * B;
    for (std::int64_t i = 0; i < r_b; i += B) {
      for (std::int64_t c = c0; c < c_b; c += B)
        block(src + i * ld_src + c, ld_src, dst + c * ld_dst + i, ld_dst);
      for (std::int64_t c = c_b; c < c_end; ++c)
        for (std::int64_t k = i; k < i + B; ++k) dst[c * ld_dst + k] = src[k * ld_src + c];
    }
    for (std::int64_t c = c0; c < c_end; ++c)
      for (std::int64_t k = r_b; k < rows; ++k) dst[c * ld_dst + k] = src[k * ld_src + c];
  }
}

// One 8 x 8 block of 16-bit values: rows of src to rows (columns of src) of dst.
void transpose_8x8_u16(const std::uint16_t* src, std::int64_t ld_src, std::uint16_t* dst,
                       std::int64_t ld_dst) {
  __m128i r[8], t[8], u[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * ld_src));
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm_unpacklo_epi16(r[k], r[k + 1]);      // rows k, k+1 of columns 0-3, interleaved
    t[k + 1] = _mm_unpackhi_epi16(r[k], r[k + 1]);  // of columns 4-7
  }
  for (int h = 0; h < 2; ++h) {                     // h = 0: columns 0-3, 1: columns 4-7
    u[4 * h] = _mm_unpacklo_epi32(t[h], t[h + 2]);  // rows 0-3 of two columns
    u[4 * h + 1] = _mm_unpackhi_epi32(t[h], t[h + 2]);
    u[4 * h + 2] = _mm_unpacklo_epi32(t[h + 4], t[h + 6]);  // rows 4-7 of the same columns
    u[4 * h + 3] = _mm_unpackhi_epi32(t[h + 4], t[h + 6]);
  }
  for (int h = 0; h < 2; ++h)
    for (int q = 0; q < 2; ++q) {
      const std::int64_t col = 4 * h + 2 * q;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + col * ld_dst),
                       _mm_unpacklo_epi64(u[4 * h + q], u[4 * h + 2 + q]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (col + 1) * ld_dst),
                       _mm_unpackhi_epi64(u[4 * h + q], u[4 * h + 2 + q]));
    }
}

// One 4 x 4 block of floats.
void transpose_4x4_f32(const float* src, std::int64_t ld_src, float* dst, std::int64_t ld_dst) {
  const __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + ld_src), r2 = _mm_loadu_ps(src + 2 * ld_src),
               r3 = _mm_loadu_ps(src + 3 * ld_src);
  const __m128 t0 = _mm_unpacklo_ps(r0, r1), t1 = _mm_unpackhi_ps(r0, r1);  // rows 0, 1 interleaved
  const __m128 t2 = _mm_unpacklo_ps(r2, r3), t3 = _mm_unpackhi_ps(r2, r3);  // rows 2, 3
  _mm_storeu_ps(dst, _mm_movelh_ps(t0, t2));
  _mm_storeu_ps(dst + ld_dst, _mm_movehl_ps(t2, t0));
  _mm_storeu_ps(dst + 2 * ld_dst, _mm_movelh_ps(t1, t3));
  _mm_storeu_ps(dst + 3 * ld_dst, _mm_movehl_ps(t3, t1));
}

// The weight-gradient product's A from the bf16 d_new parts the blocks wrote (dn[part], rows [0, rows),
// a multiple of a tile, zero past the chunk's own): each part transposed as 16-bit values to
// [2C, rows] (rows 2C..c2p zero).
void transpose_parts(std::int64_t rows, std::int64_t c2, std::uint16_t* const dn[2], std::int64_t ld_dn,
                     std::uint16_t* const dnt[2], std::int64_t c2p, std::int64_t ld_t, int parts,
                     int num_threads) {
  for (int part = 0; part < parts; ++part) {
    transpose_blocks<8>(dn[part], rows, c2, ld_dn, dnt[part], ld_t, num_threads, transpose_8x8_u16);
    for (std::int64_t c = c2; c < c2p; ++c)
      std::fill(dnt[part] + c * ld_t, dnt[part] + c * ld_t + rows, std::uint16_t{0});
  }
}

// Rows of [a, b) that receive gradient: tokens inside their batch's
// compressed region (s < limit - sp). Everything else gets an exact zero row.
void mark_gradient_rows(const BlockPlan& plan, std::int64_t a, std::int64_t b, std::vector<char>& mark) {
  std::fill(mark.begin(), mark.end(), 0);
  for (std::size_t bi = first_batch_ending_after(plan, a);
       bi < plan.batches.size() && plan.batches[bi].base < b; ++bi) {
    const BatchSpan& s = plan.batches[bi];
    const std::int64_t lo = std::max(a, s.base),
                       hi = std::min({b, s.base + s.len, s.base + (s.limit - s.sp)});
    for (std::int64_t row = lo; row < hi; ++row) mark[static_cast<std::size_t>(row - a)] = 1;
  }
}

// Whether every row of the chunk that gets no gradient holds finite bf16 values only (exponent bits
// not all ones). Then the weight-gradient product may read x where it lies: such a row meets a zero
// d_new row, and 0 * finite adds a zero to sums that start at +0, which changes no bit (a sum that
// starts at +0 is never -0: +0 + -0 = +0 and x - x = +0). Only 0 * inf or 0 * NaN would
// (test_row_stability.py::test_rows_without_gradient_reach_no_gradient checks both on the machine's
// own kernels).
bool rows_without_gradient_finite(const std::uint16_t* x, std::int64_t H, const std::vector<char>& mark,
                                  std::int64_t n, int num_threads) {
  if (std::all_of(mark.begin(), mark.begin() + n, [](char m) { return m != 0; })) return true;
  bool bad = false;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(|| : bad)
  for (std::int64_t i = 0; i < n; ++i) {
    if (mark[static_cast<std::size_t>(i)]) continue;
    const std::uint16_t* row = x + i * H;
    unsigned all_ones = 0;
    for (std::int64_t h = 0; h < H; ++h) all_ones |= (row[h] & 0x7f80u) == 0x7f80u ? 1u : 0u;
    bad = bad || all_ones != 0;
  }
  return !bad;
}

void zero_bytes(void* p, std::int64_t elements, std::size_t elem_size) {
  std::memset(p, 0, static_cast<std::size_t>(elements) * elem_size);
}

}  // namespace

namespace {

// The verbose report of a planned call (KVCOMP_VERBOSE=1): its path, its products' kernel, and why the
// others were not taken.
void report_backward(const Dims& d, const BackwardDecision& call, int num_threads) {
  const ProductConfig& config = product_config();
  std::string s = plan_report_head("backward", d, num_threads, call.tiling.row_stable) +
                  "\n[kvcomp]   path: " + backward_path_name(call.path) + "; products: ";
  if (products_16bit(call.path)) {
    s += std::string("bf16 (") + (config.bf16_kernels.amx ? "kvcomp amx_bf16" : config.bf16_kernel.c_str()) +
         ")";
  } else {
    s += "fp32 (dnnl_sgemm tiles); bf16 units not taken: ";
    s += d.io != DType::bf16 ? "the io is not bf16"
         : !config.bf16()    ? config.bf16_off.c_str()
         : !config.bf16_backward
             ? "slower than the fp32 FMAs on this CPU (AVX512-BF16 without AMX on Intel)"
             : "precise needs two bf16 products, slower than fp32 here (KVCOMP_PRODUCTS=bf16 asks for them)";
  }
  std::fprintf(stderr, "%s\n", s.c_str());
}

}  // namespace

BackwardDecision decide_backward(const Dims& d, const Options& options) {
  const ProductConfig& config = product_config();
  BackwardDecision call;
  call.tiling = config.tiling(options.row_stable);
  call.bf16 = config.bf16_kernels;
  const bool parity = options.precision == Precision::npu_parity;
  // 16-bit products where the io is bf16 and the bf16 units outrun fp32 for this mode: npu_parity's one
  // product where they outrun the fp32 FMAs (bf16_backward), precise's two where even two do
  // (bf16_split).
  // (A call without a gate: fp32 products, as its forward's.)
  if (d.io == DType::bf16 && config.bf16() && config.bf16_backward && (parity || config.bf16_split) && d.gate)
    call.path = parity ? BackwardPath::parity16 : BackwardPath::precise16;
  else
    call.path = parity ? BackwardPath::f32_rounded : BackwardPath::f32;
  return call;
}

Status backward_workspace_size(const Dims& d, const BackwardDecision& call, int num_threads,
                               std::size_t* size) {
  const BackwardBuffers buf(d, call, nullptr);
  if (!buf.ok) return {StatusCode::runtime_error, kNoBf16Products};
  if (verbose()) report_backward(d, call, num_threads);
  *size = buf.size;
  return Status::success();
}

namespace {

// [wkv ; wgate] as the d_x product's B: one bf16 matrix (packed where the kernel wants), or fp32 rows.
// Phase bwd_weights.
Status stage_weights(const BackwardArgs& args, const Dims& d, const BackwardDecision& call,
                     BackwardBuffers& buf, int num_threads) {
  const std::int64_t H = d.H, C = d.C;
  if (buf.bf16) {
    // The threads copy runs of rows (2 C H values, 16 MiB for C4A).
    const auto* wkv = static_cast<const std::uint16_t*>(args.wkv.data);
    const auto* wgate = static_cast<const std::uint16_t*>(args.wgate.data);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (std::int64_t row = 0; row < 2 * C; ++row)
      std::memcpy(buf.wcat16 + row * H, row < C ? wkv + row * H : wgate + (row - C) * H,
                  static_cast<std::size_t>(H) * sizeof(std::uint16_t));
    const Bf16PackJob job{buf.wcat16, buf.packed_w};
    if (!bf16_pack_b(call.bf16, buf.dx_shape(d), &job, 1, num_threads))
      return {StatusCode::runtime_error, "[kvcomp] oneDNN reorder of the bf16 weights failed"};
  } else {
    rows_to_f32(args.wkv.data, d.io, C, H, buf.wcat, buf.ld_h, num_threads);
    if (d.gate) rows_to_f32(args.wgate.data, d.io, C, H, buf.wcat + C * buf.ld_h, buf.ld_h, num_threads);
  }
  std::fill(buf.dape, buf.dape + d.r * C, 0.0);
  return Status::success();
}

// d_new of the chunk's rows [a, b) and its share of d_ape, from the blocks (the softmax backward), into
// d_new's rows zeroed up to n_pad (the d_x product's padded rows stay zero). Phase bwd_blocks.
void chunk_blocks(const BlockPlan& plan, const BackwardBlockInputs& in, const BackwardDecision& call,
                  BackwardBuffers& buf, std::int64_t a, std::int64_t b, std::int64_t n_pad, int num_threads) {
  const std::int64_t C = plan.dims.C;
  // Zeroed by the threads (8 MiB per chunk for C4A in fp32).
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t i = 0; i < n_pad; ++i) {
    if (buf.bf16)
      for (std::uint16_t* part : buf.dn)
        if (part) std::fill(part + i * buf.ld_dn, part + i * buf.ld_dn + 2 * C, std::uint16_t{0});
    if (buf.dnew) std::fill(buf.dnew + i * buf.ld_c2, buf.dnew + i * buf.ld_c2 + 2 * C, 0.0f);
  }
  backward_blocks(plan, in, a, b, buf.dnew, buf.dn[0], buf.dn[1], buf.bf16 ? buf.ld_dn : buf.ld_c2, buf.dape,
                  rounds_dnew(call.path), num_threads);
}

// One chunk's products on the bf16 units: x as the weight-gradient product's B (bwd_x), d_new's parts
// transposed (bwd_split), d_x rows (bwd_dx), [d_wkv ; d_wgate] (bwd_dw). *io_rows: the chunk's first rows
// whose d_x the product wrote as io values itself (npu_parity), which the caller leaves alone;
// *dx_to_io: whether it may, for the rest of the call.
Status chunk_products_bf16(const Dims& d, const BackwardDecision& call, BackwardBuffers& buf,
                           const std::uint16_t* xs, unsigned char* dx_rows, const std::vector<char>& mark,
                           std::int64_t n, std::int64_t n_pad, bool dw_written, bool* dx_to_io,
                           std::int64_t* io_rows, int num_threads, PhaseLaps& laps) {
  const std::int64_t H = d.H, C = d.C;
  // x as the weight-gradient product's B: where the chunk is whole tiles (training) and its rows without
  // gradient are finite (rows_without_gradient_finite), x itself; else a copy with those rows zeroed
  // (0 . inf would be NaN).
  const std::uint16_t* xb = xs;
  if (n != n_pad || !rows_without_gradient_finite(xs, H, mark, n, num_threads)) {
    xb = buf.xb;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (std::int64_t i = 0; i < n_pad; ++i) {
      std::uint16_t* dst = buf.xb + i * H;
      if (i < n && mark[static_cast<std::size_t>(i)])
        std::memcpy(dst, xs + i * H, static_cast<std::size_t>(H) * sizeof(std::uint16_t));
      else
        std::fill(dst, dst + H, std::uint16_t{0});
    }
  }
  const Bf16Shape dw = buf.dw_shape(d, n_pad);
  const Bf16Plan dw_plan = bf16_plan(call.bf16, dw);
  if (!dw_plan.ok || dw_plan.packed_bytes > buf.packed_x_bytes)
    return {StatusCode::runtime_error, "[kvcomp] oneDNN could not make the bf16 product of a short chunk"};
  const Bf16PackJob job{xb, buf.packed_x};
  if (!bf16_pack_b(call.bf16, dw, &job, 1, num_threads))
    return {StatusCode::runtime_error, "[kvcomp] oneDNN reorder of x failed"};
  laps.lap(Phase::bwd_x);
  // hi (and lo in precise mode) of d_new, transposed.
  const int parts = dnew_parts(call.path);
  transpose_parts(n_pad, 2 * C, buf.dn, buf.ld_dn, buf.dnt, buf.c2p, buf.ld_t, parts, num_threads);
  laps.lap(Phase::bwd_split);
  // d_x rows = sum over parts of [dn_kv | dn_score] . [wkv ; wgate], hi then lo.
  const Bf16Shape dx = buf.dx_shape(d);
  const void* b_w = buf.packed_w ? buf.packed_w : buf.wcat16;
  // npu_parity: the product writes the bf16 d_x rows of the chunk's whole tiles itself, oneDNN rounding
  // each fp32 sum as it stores the tile: the bits of the narrowing in write_dx_rows, without the fp32
  // rows' trip through memory (rows without gradient are zeroed there, as their d_new rows are 0 but a
  // weight may be inf). The partial last tile: the fp32 rows. Where oneDNN cannot (no such product, or
  // only its reference kernel): all fp32, for the rest of the call.
  *io_rows = 0;
  const std::int64_t whole_tiles = n / kBf16TileRows * kBf16TileRows;
  if (*dx_to_io && whole_tiles > 0) {
    *dx_to_io = gemm_bf16(call.bf16, buf.dx_io_shape(d), whole_tiles, buf.dn[0], {{{b_w, dx_rows}}}, false,
                          num_threads);
    *io_rows = *dx_to_io ? whole_tiles : 0;
  }
  // Precise: hi and lo as one product of twice the K where the AMX kernel runs (gemm_bf16_two_parts).
  const Bf16Target dx_target{b_w, buf.dxf + *io_rows * buf.ld_h};
  const std::int64_t dx_rows_left = n_pad - *io_rows;
  const std::uint16_t* dx_hi = buf.dn[0] + *io_rows * buf.ld_dn;
  const bool dx_ok =
      *io_rows >= n_pad ||
      (parts == 2 ? gemm_bf16_two_parts(call.bf16, dx, dx_rows_left, dx_hi, buf.dn[1] + *io_rows * buf.ld_dn,
                                        {&dx_target, 1}, false, num_threads)
                  : gemm_bf16(call.bf16, dx, dx_rows_left, dx_hi, {&dx_target, 1}, false, num_threads));
  if (!dx_ok) return {StatusCode::runtime_error, "[kvcomp] oneDNN bf16 matmul for d_x failed"};
  laps.lap(Phase::bwd_dx);
  // [d_wkv ; d_wgate] += dnt . x, hi and lo likewise.
  const Bf16Target dw_target{buf.packed_x ? buf.packed_x : xb, buf.dwcat};
  const bool dw_ok =
      parts == 2 ? gemm_bf16_two_parts(call.bf16, dw, buf.c2p, buf.dnt[0], buf.dnt[1], {&dw_target, 1},
                                       dw_written, num_threads)
                 : gemm_bf16(call.bf16, dw, buf.c2p, buf.dnt[0], {&dw_target, 1}, dw_written, num_threads);
  if (!dw_ok) return {StatusCode::runtime_error, "[kvcomp] oneDNN bf16 matmul for d_wkv/d_wgate failed"};
  laps.lap(Phase::bwd_dw);
  return Status::success();
}

// The same on fp32 products: x rows in fp32, rows without gradient zeroed (bwd_x), d_x rows (bwd_dx),
// d_new transposed (bwd_split), [d_wkv ; d_wgate] (bwd_dw).
Status chunk_products_f32(const Dims& d, const BackwardDecision& call, BackwardBuffers& buf,
                          const unsigned char* x_rows, const std::vector<char>& mark, std::int64_t n,
                          std::int64_t n_pad, bool dw_written, int num_threads, PhaseLaps& laps) {
  const std::int64_t H = d.H;
  // Without a gate the products read d_new's kv half only (its score half is 0 at ratio 1).
  const std::int64_t P = projection_columns(d);
  const std::size_t io_size = dtype_size(d.io);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    float* dst = buf.xf + i * buf.ld_h;
    if (mark[static_cast<std::size_t>(i)])
      to_f32(x_rows + static_cast<std::size_t>(i * H) * io_size, d.io, dst, H);
    else
      std::fill(dst, dst + H, 0.0f);
  }
  laps.lap(Phase::bwd_x);
  // d_x rows = [d_new_kv | d_new_score] . [wkv ; wgate]
  if (!gemm_f32(call.tiling, n_pad, H, P, {buf.dnew, buf.ld_c2, false}, {buf.wcat, buf.ld_h, false}, buf.dxf,
                buf.ld_h, false, num_threads))
    return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for d_x failed"};
  laps.lap(Phase::bwd_dx);
  // [d_wkv ; d_wgate] += [d_new_kv | d_new_score]^T . x (oneDNN's transposed-A path runs at half speed)
  transpose_blocks<4>(buf.dnew, n, P, buf.ld_c2, buf.dnew_t, buf.ld_r, num_threads, transpose_4x4_f32);
  laps.lap(Phase::bwd_split);
  if (!gemm_f32(call.tiling, P, H, n, {buf.dnew_t, buf.ld_r, false}, {buf.xf, buf.ld_h, false}, buf.dwcat,
                buf.ld_h, dw_written, num_threads))
    return {StatusCode::runtime_error, "[kvcomp] oneDNN matmul for d_wkv/d_wgate failed"};
  laps.lap(Phase::bwd_dw);
  return Status::success();
}

// The chunk's d_x rows: narrowed from the fp32 rows where the product did not write them (rows from
// io_rows on), zero where a row gets no gradient. Phase bwd_outputs.
void write_dx_rows(const Dims& d, const BackwardBuffers& buf, const std::vector<char>& mark, std::int64_t n,
                   std::int64_t io_rows, unsigned char* dx_rows, int num_threads) {
  const std::size_t io_size = dtype_size(d.io);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    unsigned char* dst = dx_rows + static_cast<std::size_t>(i * d.H) * io_size;
    if (!mark[static_cast<std::size_t>(i)])
      zero_bytes(dst, d.H, io_size);
    else if (i >= io_rows)
      from_f32(buf.dxf + i * buf.ld_h, dst, d.io, d.H);
  }
}

// d_wkv, d_wgate (io dtype, or fp32) from their fp32 sums, and d_ape from its float64 sums (fp32, or hi
// and lo parts). Phase bwd_outputs.
void write_weight_grads(const BackwardArgs& args, const Dims& d, const BackwardBuffers& buf,
                        int num_threads) {
  const std::int64_t H = d.H, C = d.C;
  auto* dwkv = static_cast<unsigned char*>(args.d_wkv.data);
  auto* dwgate = static_cast<unsigned char*>(args.d_wgate.data);
  const DType w_dt = args.d_wkv.dtype;  // the io dtype, or fp32 (validated: the same for d_wgate)
  const std::size_t w_size = dtype_size(w_dt);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (std::int64_t c = 0; c < C; ++c) {
    from_f32(buf.dwcat + c * buf.ld_h, dwkv + static_cast<std::size_t>(c * H) * w_size, w_dt, H);
    if (dwgate)  // else a call without wgate
      from_f32(buf.dwcat + (C + c) * buf.ld_h, dwgate + static_cast<std::size_t>(c * H) * w_size, w_dt, H);
  }
  auto* dape = static_cast<float*>(args.d_ape.data);
  if (!dape) return;                        // a call without APE
  const bool parts = args.d_ape.rank == 3;  // [2, r, C]: hi, then lo = the rest of the float64 sum
  for (std::int64_t i = 0; i < d.r * C; ++i) {
    dape[i] = static_cast<float>(buf.dape[i]);
    if (parts) dape[d.r * C + i] = static_cast<float>(buf.dape[i] - static_cast<double>(dape[i]));
  }
}

}  // namespace

Status run_backward(const BackwardArgs& args, const BlockPlan& plan, const BackwardDecision& call,
                    int num_threads, void* workspace, std::size_t workspace_size) {
  const Dims& d = plan.dims;
  const std::size_t io_size = dtype_size(d.io);
  PhaseLaps laps(1);

  if (plan.total_blocks == 0) {  // no block at all: four all-zero outputs, whatever the memory held
    zero_bytes(args.d_x.data, args.d_x.numel(), io_size);
    zero_bytes(args.d_wkv.data, args.d_wkv.numel(), dtype_size(args.d_wkv.dtype));
    if (args.d_wgate.data)
      zero_bytes(args.d_wgate.data, args.d_wgate.numel(), dtype_size(args.d_wgate.dtype));
    if (args.d_ape.data) zero_bytes(args.d_ape.data, args.d_ape.numel(), sizeof(float));
    if (args.epilogue.norm_weight)
      zero_bytes(args.d_norm_weight.data, args.d_norm_weight.numel(), dtype_size(args.d_norm_weight.dtype));
    laps.lap(Phase::bwd_outputs);
    return Status::success();
  }

  BackwardBuffers buf(d, call, WorkspaceLayout::align(workspace));
  if (!buf.ok || buf.size > workspace_size) return {StatusCode::runtime_error, kNoBf16Products};
  if (Status s = stage_weights(args, d, call, buf, num_threads); !s.ok()) return s;
  laps.lap(Phase::bwd_weights);

  BackwardBlockInputs in{args.d_cmp_kv.data, d.io, static_cast<const float*>(args.softmax_score.data),
                         static_cast<const float*>(args.kv.data)};
  // The epilogue's backward first: the pooled rows' gradient, in fp32, is what the blocks read.
  if (const EpilogueView ep = epilogue_view(args.epilogue); ep.any()) {
    epilogue_backward(plan, ep, call.epilogue_rows, args.pooled.data, args.d_cmp_kv.data, buf.dp,
                      args.d_norm_weight.data, buf.epilogue_scratch, num_threads);
    in.d_cmp_kv = buf.dp;
    in.d_cmp_dtype = DType::f32;
    laps.lap(Phase::bwd_blocks);
  }
  // npu_parity's d_x product on the bf16 units may write the io rows itself (chunk_products_bf16).
  bool dx_to_io =
      call.path == BackwardPath::parity16 && bf16_c_rounds_like_f32(call.bf16, buf.dx_io_shape(d));
  std::vector<char> mark(static_cast<std::size_t>(buf.R));
  // The first chunk with gradient writes the weight-gradient accumulators, later ones add to them
  // (chunks without gradient rows are skipped).
  bool dw_written = false;
  for (std::int64_t a = 0; a < d.T; a += kChunkRows) {
    const std::int64_t b = std::min(d.T, a + kChunkRows), n = b - a;
    mark_gradient_rows(plan, a, b, mark);
    auto* dx_rows = static_cast<unsigned char*>(args.d_x.data) + static_cast<std::size_t>(a * d.H) * io_size;
    if (std::none_of(mark.begin(), mark.begin() + n, [](char m) { return m != 0; })) {
      zero_bytes(dx_rows, n * d.H, io_size);
      laps.lap(Phase::bwd_outputs);
      continue;
    }
    const std::int64_t n_pad = buf.bf16 ? bf16_padded_rows(n) : gemm_padded_rows(call.tiling, n, false);
    chunk_blocks(plan, in, call, buf, a, b, n_pad, num_threads);
    laps.lap(Phase::bwd_blocks);
    // x rows without gradient are zeroed so that 0 * Inf/NaN in them cannot leak into d_wkv / d_wgate
    // (the NPU kernel does the same).
    const auto* x_rows =
        static_cast<const unsigned char*>(args.x.data) + static_cast<std::size_t>(a * d.H) * io_size;
    std::int64_t io_rows = 0;  // rows [0, io_rows): d_x written by its product (bf16 npu_parity)
    const Status s =
        buf.bf16 ? chunk_products_bf16(
                       d, call, buf, static_cast<const std::uint16_t*>(static_cast<const void*>(x_rows)),
                       dx_rows, mark, n, n_pad, dw_written, &dx_to_io, &io_rows, num_threads, laps)
                 : chunk_products_f32(d, call, buf, x_rows, mark, n, n_pad, dw_written, num_threads, laps);
    if (!s.ok()) return s;
    dw_written = true;
    write_dx_rows(d, buf, mark, n, io_rows, dx_rows, num_threads);
    laps.lap(Phase::bwd_outputs);
  }
  write_weight_grads(args, d, buf, num_threads);
  laps.lap(Phase::bwd_outputs);
  return Status::success();
}

}  // namespace kvcomp::detail
