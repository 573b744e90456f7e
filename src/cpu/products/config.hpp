// Which product kernels this process may run: decided once, from the CPU, oneDNN and the environment
// (common/environment.hpp), into one struct. Nothing else in the CPU backend reads the environment or
// asks the CPU what it has for its products.
//
// Per call, the drivers' plans (cpu/call_plan.hpp) ask this struct and the per-shape probes
// (order_probes.hpp) what each product of the call runs on, and keep the answer; the product
// functions receive that answer as arguments. product_kernels() (and `kvcomp info`) print the
// struct's description.
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

}  // namespace kvcomp::detail
