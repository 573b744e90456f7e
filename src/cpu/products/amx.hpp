// kvcomp's own bf16 product kernel on Intel's AMX tiles (AMX-BF16), for
// every bf16 product of a CPU with them (products/onednn_bf16.hpp decides; oneDNN's
// kernels where KVCOMP_KERNELS=-amx).
//
// Why not oneDNN's: version 2.6's AMX brgemm takes only dense A and C, and
// kvcomp's tiles write the two projections side by side (C's rows 2N apart),
// so on AMX they ran its jit gemm, which packs B again on every execution
// (the forward 1.15-1.28x its product alone, a decode call 1.5-1.7x:
// docs/performance.md). The tile instructions themselves take any row
// stride, so this kernel writes C where it lies, reads A where it lies (256
// of K at a time copied into an L1 buffer, 16 KiB for 32 rows, 32 KiB for
// 64) and reads B from a copy packed once per call (or once for good:
// prepared weights).
//
// The sums. C[m, n] = sum over k of A[m, k] * B[k, n] runs, for every
// element, over K in steps of 32 (16 pairs; the last step zero-padded) in
// increasing order (with a second A, its steps after A's), one TDPBF16PS
// per step accumulating in an fp32 tile (stored and reloaded as fp32
// between K chunks: no bit changes). A tile's rows never mix, and which
// tile or thread holds an element changes nothing of its sum: so a row's
// bits depend neither on the call's row count (row stability, products/onednn_f32.hpp)
// nor on the thread count, nor on how the caller cuts rows and columns.
// The hardware flushes denormal inputs and results to zero, as oneDNN's
// AMX kernels do.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcomp::detail {

// Whether this process may run the kernel: the CPU has AMX-TILE and AMX-BF16, the OS saves the tile
// state (XCR0), and Linux gave this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked
// once here).
bool amx_tiles_usable();

// Column groups of B as the kernel packs and runs them: 16 columns each, the last zero-padded.
inline std::int64_t amx_groups(std::int64_t N) { return (N + 15) / 16; }

// Bytes of B packed for the kernel: its columns in groups of 16 (the last zero-padded), each group's
// K in steps of 32 (zero-padded), a step 16 pair-rows x 16 columns of two bf16: 1 KiB.
std::size_t amx_packed_bytes(std::int64_t N, std::int64_t K);

// Packs column groups [g0, g1) of B (b[k * ldb + n], or b[n * ldb + k] when b_transposed) into
// `packed` (the whole matrix's layout, amx_packed_bytes(N, K)). A copy: the result does not depend on
// how the groups are dealt.
void amx_pack_b(std::int64_t N, std::int64_t K, const std::uint16_t* b, std::int64_t ldb, bool b_transposed,
                void* packed, std::int64_t g0, std::int64_t g1);

// How C takes a product: set (fp32), add (fp32, C = C + the product, the product summed first as a
// whole) or bf16 (each fp32 sum rounded to nearest even, f32_to_bf16).
enum class AmxStore { set, add, bf16 };

// C[m, n] for rows [0, M) and the columns of groups [g0, g1): A bf16 row-major (row stride lda), B
// packed by amx_pack_b, C row-major (row stride ldc; float, or std::uint16_t for AmxStore::bf16).
// `a2` (optional, same shape and stride): C = A . B + A2 . B as one product of twice the K, A's steps
// and then A2's on the same packed B in one chain of fp32 sums (the precise backward's hi and lo parts:
// one pass over C instead of two). Calls of 33 to 64 rows and one A (decode-sized) run all their rows
// on each B tile (B read once), the others blocks of 32 rows; the sums are the same. Single-threaded,
// on the calling thread (up to about 100 KiB of its stack: A's chunk, the sums between chunks, one
// tile for the stores); needs amx_tiles_usable().
void amx_gemm_block(std::int64_t M, std::int64_t N, std::int64_t K, const std::uint16_t* a, std::int64_t lda,
                    const void* packed, void* c, std::int64_t ldc, AmxStore store, std::int64_t g0,
                    std::int64_t g1, const std::uint16_t* a2 = nullptr);

}  // namespace kvcomp::detail
