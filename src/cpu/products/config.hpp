// Which product kernels this process may run: decided once, from the CPU, oneDNN and the environment
// (common/environment.hpp), into one struct. Nothing else reads the environment or asks the CPU for the
// products' sake.
//
// Per call, plan_forward / plan_backward (decide_forward, decide_backward: cpu/backend.hpp) ask this
// struct, and the questions below ask the per-shape probes (order_probes.hpp), what each product of the
// call runs on; the plan keeps the answer and the product functions receive it as arguments.
// product_kernels() (and `kvcomp info`) print the struct's description.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/environment.hpp"
#include "cpu/isa.hpp"
#include "cpu/products/onednn_bf16.hpp"
#include "cpu/products/onednn_f32.hpp"

namespace kvcomp::detail {

// KVCOMP_PRODUCTS: auto (unset, empty), bf16 (every product of a bf16 call on the bf16 units, the
// precise backward as hi + lo parts) or f32 (every product fp32).
enum class ProductChoice { automatic, bf16, f32 };

struct ProductConfig {
  // What the CPU has, and what the environment asks.
  Isa isa = Isa::scalar;  // kvcomp's own kernels (KVCOMP_ISA caps it)
  bool f16c = false;
  bool amd = false;
  ProductChoice choice = ProductChoice::automatic;
  KernelSwitches switches;

  // fp32 products: oneDNN's sgemm, in tiles of fixed sizes (onednn_f32.hpp).
  bool sgemm_avx512 = false;  // oneDNN runs its AVX-512 sgemm (else its AVX2 one, or older)
  bool sgemm_known = false;   // an sgemm whose order kvcomp's rows kernels reproduce (AVX2 or AVX-512)
  // Forward projections of 1-8 token rows on kvcomp's AVX2 rows kernel (rows.hpp), in row-stable calls:
  // the CPU has AVX2 and FMA, KVCOMP_ISA allows it, -rows does not forbid it, and the kernel matched
  // sgemm bit for bit (checked here, once); f16_rows_kernel: fp16 weights read by it too (F16C).
  bool f32_rows_kernel = false;
  bool f16_rows_kernel = false;
  // Prepared weights of bf16 / fp16 io with fp32 products hold 16-bit decode panels (for fp16: F16C).
  bool decode_panels = false;

  // bf16 products (onednn_bf16.hpp), for bf16 io where the CPU has bf16 units.
  std::string bf16_kernel;        // oneDNN's implementation name; empty: every product fp32
  std::string bf16_off;           // why it is empty (the verbose report)
  Bf16Kernels bf16_kernels;       // kvcomp's AMX kernel instead of oneDNN's; B packed where oneDNN would not
  std::string strided_kernel;     // oneDNN's kernel for row-strided tiles where it differs (AMX)
  bool bf16_backward = false;     // the npu_parity backward's products on the bf16 units
  bool bf16_split = false;        // the precise backward's as hi + lo parts on them
  bool bf16_rows_kernel = false;  // kvcomp's AVX512-BF16 rows kernel may run (shapes probed per call)
  bool bf16_decode_panels = false;  // prepared bf16 weights hold its AVX-512 panels

  std::string description;  // product_kernels()

  bool bf16() const { return !bf16_kernel.empty(); }
  bool rows_kernel_for(bool fp16) const { return fp16 ? f16_rows_kernel : f32_rows_kernel; }
  bool decode_panels_for(bool fp16) const { return decode_panels && (!fp16 || f16c); }
  // How gemm_f32 cuts a call with this row stability.
  F32Tiling tiling(bool row_stable) const { return {row_stable, sgemm_avx512}; }
};

// The process's configuration, made at the first call (it runs a few small products to check kvcomp's
// kernels against oneDNN's), then fixed.
const ProductConfig& product_config();
// product_config().description.
const char* product_kernels();

// The questions a call's plan asks about its fp32 products (the answers are kept in the plan and passed
// to the products).
// - projection_order: sgemm's one order for every column tile of the forward projection [n, 2 half]
//   (depth K, fp32 operands of row stride ld), or none where the tiles differ.
// - rows_kernel_orders: gemm_f32's orders for kvcomp's AVX2 rows kernel on a product [M, N] of depth K
//   (A and B stored [N, K] with row strides lda, ldb), or none where the kernel does not run (a call
//   without row stability, a CPU or oneDNN it does not serve, -rows).
// - rows_16bit_order: the order for a decode call of n rows (1-8) reading its 16-bit weights in place
//   (gemm_rows_16bit_weights), or none.
// - row_panels_order: the order for a call of n rows reading prepared decode panels (gemm_row_panels:
//   1 row on AVX2, up to kPanelRowsMax on AVX-512), or none.
std::optional<SgemmOrder> projection_order(const ProductConfig& c, std::int64_t half, std::int64_t K,
                                           std::int64_t ld);
std::optional<RowsKernelOrders> rows_kernel_orders(const ProductConfig& c, bool row_stable, std::int64_t N,
                                                   std::int64_t K, std::int64_t lda, std::int64_t ldb);
std::optional<SgemmOrder> rows_16bit_order(const ProductConfig& c, bool row_stable, std::int64_t n,
                                           std::int64_t half, std::int64_t K, std::int64_t ld, bool fp16);
std::optional<SgemmOrder> row_panels_order(const ProductConfig& c, bool row_stable, std::int64_t n,
                                           std::int64_t half, std::int64_t K, std::int64_t ld, bool fp16);

// Whether gemm_f32's product [M, N] = A [M, K] . B gives every row the bits with B stored plain ([K, N],
// row stride ldb_plain) that it has with B stored transposed ([N, K], row stride ldb_t), A of row stride
// lda. oneDNN's AVX-512 sgemm runs a tile about 15 % faster from a plain B (the forward projections'
// weights, docs/performance.md) and, in its copy-based kernel (K >= 1200), sums alike. Probed once per
// shape and strides (tiles of 16, 208 and 256 rows; the full and the last column tile); false without
// the probe: oneDNN on AVX2, K < 1200, a call without row stability, or no memory for the probe.
bool gemm_b_plain_same_bits(const F32Tiling& t, std::int64_t N, std::int64_t K, std::int64_t lda,
                            std::int64_t ldb_t, std::int64_t ldb_plain);

// The questions about the bf16 products that need a probe (order_probes.hpp): the products never ask
// them themselves; a call's plan does and passes what it may run.
// Whether gemm_bf16 may run this c_bf16 shape: where oneDNN's bf16-C tile gives each element the bits
// of its fp32 twin's sum narrowed to bf16 (nearest even), so that a row's bits do not depend on which
// of the two wrote it. oneDNN does not promise this (its blocking may depend on C's type): probed once
// per shape and process on random operands, as bf16_packed_short_rows (tests/python/
// test_row_stability.py checks the rows of whole calls). False for an fp32 C.
bool bf16_c_rounds_like_f32(const Bf16Kernels& k, const Bf16Shape& s);

// A row-stable call of n rows (1 <= n < kBf16TileRows) on a packed B (AMX): the height, n rounded up
// to kBf16ShortTileRows, that gemm_bf16 may run it at instead of a whole 64-row tile, or 0. A decode
// call of 1 token then multiplies 16 rows on the tiles instead of 64: AMX works on every row of a
// tile, so the padding rows cost as much as the token's (without this, B = 1 cost its 64-row product).
// Only where oneDNN's primitive of that height gives every row the bits the 64-row tile gives it,
// which its blocking does not promise: probed once per shape and height and process, on random
// rows, at both ends of a 64-row tile (its K blocking may depend on M, and then the sums would
// differ). 0 where B is read in place (bf16_short_rows_stable serves those) or the probe fails.
std::int64_t bf16_packed_short_rows(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t n);

// Whether a row-stable call of M rows (1 to 8, or any with panels) runs on kvcomp's own AVX512-BF16 kernel
// (gemm_rows_avx512_bf16): B stored [N, K] and read in place by oneDNN's jit gemm
// (bf16_short_rows_stable), N a multiple of 16, the CPU with AVX512-BF16, and the kernel's order
// matching the jit gemm's for this K (checked once per K and process). Then a decode call's rows need
// no padding row and its B no packing: the jit gemm packs all of B on each execution, about 3x the
// time of reading it (docs/performance.md). KVCOMP_KERNELS=-rows keeps oneDNN for them.
// With `panels` (the call has the AVX-512 decode panels of its weights), any M: the kernel's order is
// the same for every row count, and on panels it runs at oneDNN's packed brgemm rate (docs/performance.md).
// `available`: ProductConfig::bf16_rows_kernel (the process may use it at all: not where oneDNN packs B,
// as on AMX, since the kernel has the bits of the in-place jit gemm only).
bool bf16_rows_kernel_applicable(const Bf16Kernels& k, bool available, const Bf16Shape& s, std::int64_t M,
                                 bool panels = false);

}  // namespace kvcomp::detail
