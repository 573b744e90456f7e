// Products on bf16 operands with fp32 accumulation, on the CPU's bf16 units
// (AMX-BF16, AVX512-BF16) through oneDNN's matmul primitive.
//
// Used for the forward projections when x and the weights are bf16: the
// products of two bf16 numbers are exact in fp32, so only the order of the
// fp32 additions differs from the fp32 path, and both precision modes take it.
//
// Determinism and row stability as gemm.hpp: the output is cut into tiles of
// fixed shape (every M tile has kBf16TileRows rows, the last one padded with
// zero rows by the caller, N is whole), each tile one single-threaded
// primitive execution over the whole K, OpenMP spreading the tiles; so an
// element's sum order depends on nothing but K and the tile shape.
#pragma once

#include <cstdint>

namespace kvcomp::detail {

// Rows of one tile (a multiple of AMX's 16 and of 32): padding a call to a
// multiple of it keeps every primitive at one of a few shapes.
constexpr std::int64_t kBf16TileRows = 64;

// Which kernel oneDNN runs for bf16 matmuls on this machine, chosen once per
// process: its implementation name when that is a bf16 matrix-unit kernel
// (brg:avx512_core_amx_bf16, brg:avx512_core_bf16 ...), else nullptr (fp32
// products everywhere). Opt-in for now: KVCOMP_PRODUCTS=bf16 asks for them
// (unset or f32: fp32); KVCOMP_ISA below avx512 keeps fp32.
const char* bf16_product_kernel();

// "bf16 (<oneDNN implementation>) + f32 (dnnl_sgemm)" or "f32 (dnnl_sgemm)".
const char* product_kernels();

// Bytes of the packed form of an [N, K] bf16 weight matrix for
// gemm_bf16_nt with these lda / ldc (0 when bf16 products are not available).
std::size_t bf16_packed_weight_bytes(std::int64_t N, std::int64_t K, std::int64_t lda, std::int64_t ldc);

// Packs the bf16 matrix B [N, K] (row stride ldb elements) for products
// C = A . B^T with these lda / ldc, into `packed` (bf16_packed_weight_bytes
// bytes). False if oneDNN failed.
bool bf16_pack_weights(std::int64_t N, std::int64_t K, std::int64_t lda, std::int64_t ldc, const std::uint16_t* b,
                       std::int64_t ldb, void* packed);

// C[M, N] = A[M, K] . B^T with A bf16 (row stride lda), B packed by
// bf16_pack_weights for the same lda / ldc, C fp32 (row stride ldc). M must be a multiple of
// kBf16TileRows (the caller pads A with zero rows). False if oneDNN failed.
bool gemm_bf16_nt(std::int64_t M, std::int64_t N, std::int64_t K, const std::uint16_t* a, std::int64_t lda,
                  const void* packed_b, float* c, std::int64_t ldc, int num_threads);

}  // namespace kvcomp::detail
