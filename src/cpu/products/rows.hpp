// Products of 1-8 rows that give each row the bits oneDNN's sgemm gives it in a long call.
//
// Row stability (products/onednn_f32.hpp) pads a decode-sized fp32 product to 4 or more rows on AVX2, to 16
// on AVX-512, and sgemm's few-row path with B transposed then runs at about half the rate of its one-row path
// on AVX2, at a sixteenth of it on AVX-512 (docs/performance.md). This kernel computes C[m, n] = A[m, K] .
// B[n, K]^T for m <= 8 in the order oneDNN's sgemm sums an element of a whole 16-column group: one fma
// chain per element and K block, from zero, the blocks added in order (sgemm_k_blocks). So a token's row is
// bitwise the row the same token gets from a long tile, without the padding rows. The order was measured, not
// documented: products/onednn_f32.cpp checks it against sgemm once per process before the first use and keeps
// the padding when it differs. The kernel itself is AVX2 + FMA code (the order, not the vector width, fixes
// the bits), for either sgemm.
#pragma once

#include <cstdint>

namespace kvcomp::detail {

// The K blocks of oneDNN's sgemm (measured on 2.6.3; 3.2's sums the same, the bits tests' hashes
// unchanged) for one of its calls, as blocks of `unit`:
// - halves: one block up to `unit`; beyond, blocks of `unit` while more than 2 `unit` remain, then the
//   rest in two halves (the first rounded up). The AVX2 sgemm, unit 256, always (measured for K
//   1-18432); the AVX-512 one, unit 384, for most shapes.
// - not halves: blocks of `unit`, the last one the rest. The AVX-512 sgemm for some K, tile widths and
//   row strides (measured on AMD Zen 5 with 256 columns and stride K: K 769-1185 and 4096, not 4071 or
//   4103; K 2048 and 4096 take the other rule with stride K + 16 than with stride K).
// Which rule a shape takes on AVX-512 is not documented and was not worked out: products/onednn_f32.cpp
// probes sgemm once per shape and pair of row strides (sgemm_order_for).
struct SgemmOrder {
  std::int64_t unit = 256;
  bool halves = true;
  bool operator==(const SgemmOrder&) const = default;
};
struct KBlocks {
  int count = 0;
  std::int64_t full = 0;  // leading blocks of `unit`
  std::int64_t k = 0;
  std::int64_t half = 0;  // the first of the two last blocks (halves), or `unit`
  std::int64_t unit = 256;

  std::int64_t begin(int i) const { return i <= full ? unit * i : unit * full + half; }
  std::int64_t end(int i) const { return i + 1 < count ? begin(i + 1) : k; }
};
inline KBlocks sgemm_k_blocks(std::int64_t k, SgemmOrder order) {
  KBlocks b;
  b.k = k;
  b.unit = order.unit;
  if (k <= order.unit) {
    b.count = 1;
    b.half = k;
    return b;
  }
  if (!order.halves) {
    b.count = static_cast<int>((k + order.unit - 1) / order.unit);
    b.full = b.count - 1;
    b.half = order.unit;
    return b;
  }
  while (k - order.unit * b.full > 2 * order.unit) ++b.full;
  b.half = (k - order.unit * b.full + 1) / 2;
  b.count = static_cast<int>(b.full) + 2;
  return b;
}
// The order of oneDNN's AVX2 sgemm, and the two of its AVX-512 one.
inline constexpr SgemmOrder kSgemmAvx2{256, true}, kSgemmAvx512Halves{384, true},
    kSgemmAvx512Fixed{384, false};

// The rows a call of the kernel may have.
inline constexpr std::int64_t kRowsKernelMax = 8;

// The width of the column tiles that the row kernels' callers deal to the threads, for `matrices`
// matrices of `cols` columns each (cols a multiple of 16): `width`, halved down to no less than
// kMinDealtCols while the tiles would be fewer than the threads, so that a decode call of a small
// layer keeps a many-core machine's threads reading its weights (C4Li's two matrices of 256 columns:
// 2 tiles of 256 on 2 threads, 8 tiles of 64 on 16). Any cut into whole 16-column groups gives the
// same bits: an element's order does not depend on its tile.
inline constexpr std::int64_t kMinDealtCols = 64;
inline std::int64_t dealt_tile_cols(std::int64_t cols, std::int64_t matrices, std::int64_t width,
                                    int num_threads) {
  while (width / 2 >= kMinDealtCols && matrices * ((cols + width - 1) / width) < num_threads) width /= 2;
  return width;
}

// C[m, n] = A[m, k] . B[n, k]^T (A row-major with lda, B stored [n, k] with ldb, C row-major with ldc),
// 1 <= m <= kRowsKernelMax, n a multiple of 16, k >= 1, K blocks sgemm_k_blocks(k, order). AVX2 + FMA
// only (products/rows_avx2.cpp).
void gemm_rows_avx2(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                    const float* b, std::int64_t ldb, float* c, std::int64_t ldc, SgemmOrder order);
// The same with B in bf16, widened as it is read (exactly: the bits equal those of gemm_rows_avx2 on the
// widened B), so a decode call need not convert its bf16 weights to fp32 first. n a multiple of 8.
void gemm_rows_avx2_bf16(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                         const std::uint16_t* b, std::int64_t ldb, float* c, std::int64_t ldc,
                         SgemmOrder order);
// The same with B in fp16, widened as it is read by F16C (exact). AVX2 + FMA + F16C.
void gemm_rows_avx2_f16(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                        const std::uint16_t* b, std::int64_t ldb, float* c, std::int64_t ldc,
                        SgemmOrder order);

// Decode panels: a 16-bit matrix B [n, k] (n a multiple of 16) stored for one-row products, so that a
// token's projection reads the weights once, in order, at half the bytes of the fp32 copy (a one-row
// product is bound by reading its weights). Panel p holds columns [64p, 64p + w), w = min(64, n - 64p),
// K-major: its k-th row is the w values B[64p .. 64p + w, k]. bf16: each 16 of them stored in the order
// 0-3, 8-11, 4-7, 12-15, so that widening the low and the high halves of each 128-bit lane gives columns
// 0-7 and 8-15 in order; fp16: in order (F16C widens 8 consecutive values). Panel p starts at element
// 64p * k.
inline constexpr std::int64_t kPanelWidth = 64;
// Where B[col, kk] lies in the panels of a matrix of n columns.
inline std::int64_t panel_offset(std::int64_t col, std::int64_t kk, std::int64_t n, std::int64_t k,
                                 bool fp16 = false) {
  const std::int64_t p0 = col / kPanelWidth * kPanelWidth, w = n - p0 < kPanelWidth ? n - p0 : kPanelWidth;
  const std::int64_t j = col - p0, q = j % 16;
  const std::int64_t in16 = fp16 ? q : q < 4 ? q : q < 8 ? q + 4 : q < 12 ? q - 4 : q;
  return p0 * k + kk * w + j / 16 * 16 + in16;
}
// Writes the panels of w [n, k] (bf16, or fp16 when `fp16`; row stride ldw, n a multiple of 16) into out
// (n * k elements): 16 columns x 8 k at a time through two 8 x 8 transposes in registers. AVX2.
void write_panels_avx2(const std::uint16_t* w, std::int64_t ldw, std::int64_t n, std::int64_t k,
                       std::uint16_t* out, bool fp16 = false);
// c[0, n) = a[0, k) . B^T for one row, B in panels (bf16, or fp16 when `fp16`; n a multiple of 16, panels
// starting at column 0 of B, c and a unaligned): each element the bits gemm_rows_avx2 gives it from B
// widened to fp32. AVX2 + FMA (+ F16C for fp16).
void gemm_row_avx2_panels(std::int64_t n, std::int64_t k, const float* a, const std::uint16_t* panels,
                          float* c, bool fp16, SgemmOrder order);
// C[m, n] = A[m, k] . B^T for any m >= 1, B in the same panels: each element the bits gemm_rows_avx2 gives
// it from B widened to fp32 (the same chain per element; tiles of 12 rows x 32 columns of 16-lane
// vectors). AVX-512 F/BW/VL (products/rows_avx512_f32.cpp).
void gemm_rows_avx512_panels(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                             const std::uint16_t* panels, float* c, std::int64_t ldc, bool fp16,
                             SgemmOrder order);

// The K blocks of oneDNN 2.6's jit gemm for bf16 operands on AVX512-BF16 (Debian 2.6.3, measured on AMD
// Zen 5 for K 1-7168, any M and N): one block up to 384; up to 1536 two, the first ceil(K / 2); beyond,
// blocks of 768 and the rest. Each block's sum starts from zero, its pairs (k, k + 1) counted from the
// block's start, and the blocks are added to C in order.
struct Bf16KBlocks {
  int count = 0;
  std::int64_t size = 0, k = 0;
  std::int64_t begin(int i) const { return size * i; }
  std::int64_t end(int i) const { return i + 1 < count ? size * (i + 1) : k; }
};
inline Bf16KBlocks jit_bf16_k_blocks(std::int64_t k) {
  Bf16KBlocks b;
  b.k = k;
  b.size = k <= 384 ? k : k <= 1536 ? (k + 1) / 2 : 768;
  b.count = static_cast<int>((k + b.size - 1) / b.size);
  return b;
}

// C[m, n] = A[m, k] . B[n, k]^T on bf16 A and B with fp32 accumulation, 1 <= m <= kRowsKernelMax, n a
// multiple of 16, k >= 1 (A row-major with lda, B stored [n, k] with ldb, C row-major with ldc): one
// vdpbf16ps chain per element and K block of jit_bf16_k_blocks, so each row gets the bits oneDNN's jit
// gemm gives it in a call of any height, without padding rows or packing B. AVX512-BF16 only
// (products/rows_avx512.cpp); products/onednn_bf16.cpp checks the order against oneDNN once per K before
// using it. AVX-512 decode panels: a bf16 matrix B [n, k] (n a multiple of 16) stored pre-transposed for
// gemm_rows_avx512_bf16_panels, so that a row's product loads each pair of 16 columns as one vector:
// per 16-column group (group g at element 32 g bf16_panel_pairs(k)), per K block of jit_bf16_k_blocks,
// per pair (k0 + 2p, k0 + 2p + 1) of the block, the 16 columns' two values side by side (the second
// zero past the block's end): 64 bytes per pair.
std::int64_t bf16_panel_pairs(std::int64_t k);
// Writes the panels of w [n, k] (row stride ldw) into out (32 n / 16 bf16_panel_pairs(k) elements).
void write_panels_avx512_bf16(const std::uint16_t* w, std::int64_t ldw, std::int64_t n, std::int64_t k,
                              std::uint16_t* out);
// gemm_rows_avx512_bf16 on B's panels (those of its columns [0, n), from group 0): the same bits, and
// for any m >= 1 (more than 8 rows in tiles of 6 rows x 4 groups, each A pair broadcast; the chain per
// element is the same).
void gemm_rows_avx512_bf16_panels(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a,
                                  std::int64_t lda, const std::uint16_t* panels, float* c, std::int64_t ldc);

void gemm_rows_avx512_bf16(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a,
                           std::int64_t lda, const std::uint16_t* b, std::int64_t ldb, float* c,
                           std::int64_t ldc);

}  // namespace kvcomp::detail
