// The bit-order probes: small products run once (per process, or per shape) to learn in which order
// oneDNN sums, so that kvcomp's own kernels are used only where they give oneDNN's bits, and a shorter
// or differently laid out oneDNN call only where it gives a row the bits of a longer one. oneDNN
// documents none of these orders; each probe compares bits on random operands whose magnitudes make
// any other order show.
//
// A probe that cannot run (no memory) answers "no": the call keeps the path that needs no probe.
// Probes run on one thread with the OpenMP limit 1, as the products run each tile. Their answers are
// kept for the process, per key, in fixed tables (nothing allocated with operator new on the fp32
// path: docs/robustness.md).
#pragma once

#include <cstdint>
#include <optional>

#include "cpu/products/onednn_bf16.hpp"
#include "cpu/products/rows.hpp"

namespace kvcomp::detail {

struct ProductConfig;

// --- oneDNN's sgemm (fp32 products) -------------------------------------------------------------------

// sgemm's order for a tile of nt columns and depth K, A and B (stored [nt, K]) with row strides lda
// and ldb: none unless nt is a multiple of 16 (the rows kernel's groups); the AVX2 sgemm's is the same
// for every shape; the AVX-512 sgemm's is probed once per shape and strides (the strides matter: with
// K 2048 or 4096 and 128 or more columns it sums in another order where they are K than where they are
// K + 16).
std::optional<SgemmOrder> sgemm_order_for(bool sgemm_avx512, std::int64_t nt, std::int64_t K,
                                          std::int64_t lda, std::int64_t ldb);

// Whether kvcomp's AVX2 rows kernel (fp32 and bf16 rows, bf16 panels; with fp16: fp16 rows and panels)
// gives sgemm's bits on one thread: every row count 1-8 against a 24-row call, over K that take each
// branch of sgemm's K blocking. Once per process (ProductConfig).
bool rows_kernel_matches_sgemm(bool sgemm_avx512, bool fp16);

// Whether sgemm gives every row of [M, N] = A . B the same bits with B stored plain ([K, N]) as
// stored transposed ([N, K]): tiles of 16, 208 and 256 rows, the full and the last column tile.
// Probed once per shape and strides.
bool sgemm_b_plain_matches(std::int64_t N, std::int64_t K, std::int64_t lda, std::int64_t ldb_t,
                           std::int64_t ldb_plain);

// --- oneDNN's bf16 matmul -------------------------------------------------------------------------------

// Whether the bf16-C tile of shape s gives each element its fp32 twin's sum rounded to nearest even.
bool bf16_c_tile_probe(const Bf16Kernels& k, const Bf16Shape& s);
// Whether the m-row tile of shape s on a packed B gives the rows at both ends of a 64-row tile their
// bits in it.
bool bf16_short_tile_probe(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t m);
// Whether kvcomp's AVX512-BF16 rows kernel gives oneDNN's jit gemm's bits for depth K.
bool bf16_rows_kernel_probe(const Bf16Kernels& k, std::int64_t K);

}  // namespace kvcomp::detail
