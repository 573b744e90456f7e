// fp32 matrix products through oneDNN, tiled by us so results never depend on
// the thread count.
//
// oneDNN, left to itself, may split the reduction dimension across threads
// when the output is small, and the split depends on how many threads there
// are: the sums then change with the thread count. Here the output is cut into
// fixed tiles (sizes independent of the threads), each tile is one
// single-threaded oneDNN sgemm over the whole K, and OpenMP spreads the
// tiles over the threads. Every output element is therefore summed in the
// same order whatever the thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "cpu/products/rows.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

struct GemmOperand {
  const float* ptr = nullptr;
  std::int64_t ld = 0;      // leading dimension (elements)
  bool transposed = false;  // A: stored [K,M]; B: stored [N,K]
};

// How a call's products are cut: whether the call is row-stable (Options::row_stable) and whether oneDNN
// runs its AVX-512 sgemm (ProductConfig::sgemm_avx512). Decided per call in its plan.
struct F32Tiling {
  bool row_stable = true;
  bool sgemm_avx512 = false;
};

// Row stability. oneDNN's sgemm does not compute a row of C the same way in
// every call: on AVX-512 a call with fewer than 16 rows takes another path,
// and on AVX2 rows in a tail of 1-3 rows of its 6-row kernel are summed in
// another order than full groups (measured with Debian's oneDNN 2.6.3). So
// a token's projection would depend on how many rows its call had, and a
// sequence split over two calls (chunked prefill, context parallelism)
// would not reproduce the one-call result bit for bit. Callers whose rows
// are tokens therefore pass M padded to gemm_row_quantum(b.transposed) (the
// padding rows of A zero, C with room for them); gemm_f32 cuts M into tiles
// that are multiples of the quantum (a padded count of at most one quantum
// is one tile), so every row is computed by the same kernel path: a row's
// result depends on that row of A and on B only.
// A call without row stability (Options::row_stable false, for decode-bound serving) has quantum 1 and
// the tiles of 256 rows.
std::int64_t gemm_row_quantum(const F32Tiling& t, bool b_transposed);
// The largest value gemm_row_quantum returns (workspace sizing).
constexpr std::int64_t kMaxRowQuantum = 96;
// round_up(rows, gemm_row_quantum(b_transposed)); on AVX2 a call of at most
// one quantum pads only to the next row count of 0, 4 or 5 modulo 6 (1 -> 4
// rows, not 96: products/onednn_f32.cpp says why that computes each row alike).
std::int64_t gemm_padded_rows(const F32Tiling& t, std::int64_t rows, bool b_transposed);
// Rows per tile of gemm_f32's products of depth K: 192 where oneDNN runs its AVX2 sgemm (and on AVX-512
// with B transposed and K < 1200), else 256 (products/onednn_f32.cpp says why).
std::int64_t gemm_tile_rows(const F32Tiling& t, std::int64_t K, bool b_transposed);
// Rows a buffer of `rows` token rows needs so that either padding fits.
inline std::int64_t gemm_row_capacity(const F32Tiling& t, std::int64_t rows) {
  const std::int64_t a = gemm_padded_rows(t, rows, true), b = gemm_padded_rows(t, rows, false);
  return a > b ? a : b;
}

// kvcomp's AVX2 rows kernel in a call's products (rows.hpp): sgemm's order for the whole column tiles
// and for the last one (none: that tile keeps sgemm), decided in the call's plan
// (gemm_rows_kernel_orders). Null: sgemm everywhere.
struct RowsKernelOrders {
  std::optional<SgemmOrder> full, last;
};

// Columns of one tile of gemm_f32's products.
constexpr std::int64_t kF32TileCols = 256;

// C[M,N] = A[M,K] * B[K,N] (+ C when accumulate). C is row-major with ldc.
// live_rows (when given): rows of A from live_rows on are zero padding (row stability) whose rows of
// C the caller does not read; with `rows` (1 <= live_rows <= kRowsKernelMax, B transposed, no
// accumulate) the column tiles with an order run only the live rows on kvcomp's AVX2 rows kernel
// (products/rows.hpp), with sgemm's bits.
// Returns false if oneDNN failed (out of memory for its packing buffers); C is then undefined.
// Allocates nothing itself.
bool gemm_f32(const F32Tiling& t, std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a,
              GemmOperand b, float* c, std::int64_t ldc, bool accumulate, int num_threads,
              std::int64_t live_rows = -1, const RowsKernelOrders* rows = nullptr);
// A product of the forward whose B is its two 16-bit (or fp32) weight matrices [wkv ; wgate] ([half, K]
// each, row stride K, dtype dt; B stored [N, K] with N = 2 * half): gemm_f32's tiles, each column tile of B
// widened to fp32 in this thread's part of `scratch` (ld_scratch floats a row) just before its product,
// instead of the whole of B before the call. A decode-sized call of 9 or more rows without prepared
// weights then keeps its fp32 copy of the weights in the caches (a whole copy is 2 x 4 x half x K bytes,
// 32 MiB at C4A's H = 4096: written to memory and read back). Only for calls of one row tile, where each
// column tile is read once (gemm_one_column_pass(M, K); false otherwise, nothing done). Same tiles, kernels
// and fp32 values as gemm_f32 on the widened B, so the same bits. scratch: gemm_widen_scratch_floats.
bool gemm_one_column_pass(const F32Tiling& t, std::int64_t M, std::int64_t K);
std::size_t gemm_widen_scratch_floats(std::int64_t N, std::int64_t ld, int num_threads);
bool gemm_f32_widening(const F32Tiling& t, std::int64_t M, std::int64_t half, std::int64_t K, GemmOperand a,
                       const void* wkv, const void* wgate, DType dt, float* c, std::int64_t ldc,
                       float* scratch, std::int64_t ld_scratch, int num_threads, std::int64_t live_rows = -1,
                       const RowsKernelOrders* rows = nullptr);

// The forward projection of a decode-sized call with its 16-bit weights (bf16, or fp16 when `fp16`) read
// where they lie, not converted to fp32 first: C[n, 2 * half] = A[n, K] . [wkv ; wgate]^T, wkv and wgate
// [half, K] with row stride K, on kvcomp's AVX2 rows kernel in sgemm's order `order`. Each cell gets the
// bits gemm_f32 gives it from the weights widened to fp32 (the same kernel order; widening is exact).
// The call's plan decides it (rows_16bit_order, config.hpp): 1 <= n <= 8, half a multiple of 16.
void gemm_rows_16bit_weights(std::int64_t n, std::int64_t half, std::int64_t K, const float* a,
                             std::int64_t lda, const std::uint16_t* wkv, const std::uint16_t* wgate,
                             bool fp16, float* c, std::int64_t ldc, SgemmOrder order, int num_threads);

// Decode panels (products/rows.hpp): 16-bit weights stored a second time, for decode-sized forward calls,
// which then read half the bytes of the fp32 copy, with the same bits.
// - write_panels: the panels of w [n, k] (bf16, or fp16 when `fp16`; row stride ldw, n a multiple of 16)
//   into out (n * k elements); AVX2.
// - gemm_row_panels: the forward projection of an n-row call from them, C[n, 2 * half] = A .
//   [wkv ; wgate]^T (A row stride lda, C ldc), in sgemm's order `order`; n == 1 on AVX2, up to
//   kPanelRowsMax on AVX-512 (gemm_rows_avx512_panels). The call's plan decides it (row_panels_order,
//   config.hpp); each cell gets the bits gemm_f32 gives it.
void write_panels(const std::uint16_t* w, std::int64_t ldw, std::int64_t n, std::int64_t k,
                  std::uint16_t* out, int num_threads = 1, bool fp16 = false);
// The most rows gemm_row_panels takes on AVX-512 (longer calls keep sgemm on the fp32 rows).
constexpr std::int64_t kPanelRowsMax = 256;
void gemm_row_panels(std::int64_t n, std::int64_t half, std::int64_t K, const float* a, std::int64_t lda,
                     const std::uint16_t* kv_panels, const std::uint16_t* gate_panels, bool fp16, float* c,
                     std::int64_t ldc, SgemmOrder order, int num_threads);

}  // namespace kvcomp::detail
