// Products on bf16 operands with fp32 accumulation, on the CPU's bf16 units
// (AMX-BF16, AVX512-BF16) through oneDNN's matmul primitive, or, on AMX, on
// kvcomp's own AMX kernel (products/amx.hpp; KVCOMP_KERNELS=-amx keeps oneDNN's):
// then B is packed once per call in that kernel's layout, A and C are read
// and written where they lie, any M runs as it is (no padding rows needed,
// though callers may still pad), and the tiling below does not apply.
//
// Where they run (bf16 io only; fp16 and fp32 calls keep fp32 products):
// - forward projections, both precision modes: x, wkv and wgate are bf16,
//   the product of two bf16 numbers is exact in fp32, so only the order of
//   the fp32 additions differs from the fp32 path;
// - backward, npu_parity: d_new is already rounded to bf16 (spec 6.1), so
//   d_x and the weight gradients are one bf16 product each, the NPU's own
//   arithmetic;
// - backward, precise: d_new is split into a high and a low bf16 part
//   (d_new = hi + lo to about 2^-17 relative), two products accumulated in
//   fp32 (on kvcomp's AMX kernel one product of twice the K:
//   gemm_bf16_two_parts).
//
// Determinism and row stability as products/onednn_f32.hpp: the caller pads M to a multiple
// of kBf16TileRows with zero rows; the output is cut into tiles of
// kBf16TileRows rows where B is packed, and where it is read in place (the
// kernel packs B on every execution, so taller tiles pack it less often)
// into about one tile per thread of 64 to kBf16InPlaceTileRows rows, the
// last tile the rest; N whole. Each tile is one single-threaded primitive
// execution over the whole K, OpenMP dealing the tiles. oneDNN's kernels sum
// a row of C in the same order whatever the tile's height (a multiple of
// kBf16TileRows), so a row's result depends neither on the thread count nor
// on the other rows of the call (tests/python/test_products.py and
// test_row_stability.py check both on the machine they run on). Decode-sized
// forward calls pad to 2 rows instead, in column tiles, where the kernel
// allows it (bf16_short_rows_stable), and on a packed B to a multiple of 16
// where a probe shows that the shorter tile keeps the rows' bits
// (bf16_packed_short_rows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvcomp::detail {

// Rows of one tile (a multiple of AMX's 16 and of 32): padding a call to a
// multiple of it keeps every primitive at one of a few shapes.
constexpr std::int64_t kBf16TileRows = 64;

// Rows of one tile where B is read in place (a multiple of kBf16TileRows).
constexpr std::int64_t kBf16InPlaceTileRows = 1024;

inline std::int64_t bf16_padded_rows(std::int64_t rows) {
  return (rows + kBf16TileRows - 1) / kBf16TileRows * kBf16TileRows;
}

// Which bf16 kernels a product runs on, from the process's ProductConfig (config.hpp): kvcomp's AMX
// kernel (products/amx.hpp) instead of oneDNN's, and B packed into oneDNN's blocked layout also where
// its kernel would read it in place (KVCOMP_KERNELS=+packed: tests the packed code on AVX512-BF16;
// results stay row-stable and deterministic, but decode calls pad to 64 rows, and oneDNN 2.6's
// brg:avx512_core_bf16 refuses row-strided tiles of a packed B, so most tiles run on its reference
// kernel there, seconds per call). Outside that mode a tile oneDNN would give only its reference
// kernel is refused (an error, never a 1000x slower product), and a shape whose accumulating tiles
// would need it reads B in place instead of packed.
struct Bf16Kernels {
  bool amx = false;
  bool packed = false;
};

// One product shape: C[M, N] (+)= A[M, K] . B[K, N], A bf16 row-major with
// row stride lda, C fp32 row-major with row stride ldc, B bf16 as the caller
// holds it: b[k * ldb + n], or, when b_transposed, stored [N, K]:
// b[n * ldb + k] (a weight matrix as the operators take it).
// c_bf16: C is bf16 instead, each element its fp32 sum rounded to nearest
// even by oneDNN as it stores the tile (gemm_bf16 without accumulate only,
// where bf16_c_rounds_like_f32). B is laid out as for the fp32 shape (its
// twin, c_bf16 false): bf16_plan and bf16_pack_b give the twin's.
struct Bf16Shape {
  std::int64_t N = 0, K = 0, lda = 0, ldc = 0, ldb = 0;
  bool b_transposed = false;
  bool c_bf16 = false;
};

// Whether oneDNN makes this product on the bf16 units (false: not available,
// or it failed, e.g. out of memory), and the bytes of the packed copy of B
// its kernel wants: 0 when it reads B where it lies (AVX512-BF16's gemm packs
// B itself), else the size of the blocked layout (AMX) that bf16_pack_b
// writes.
struct Bf16Plan {
  bool ok = false;
  std::size_t packed_bytes = 0;
};
Bf16Plan bf16_plan(const Bf16Kernels& k, const Bf16Shape& s);

// One matrix B of a shape, and where its packed copy goes (packed_bytes of
// bf16_plan; unused when that is 0).
struct Bf16PackJob {
  const std::uint16_t* b = nullptr;
  void* packed = nullptr;
};

// Packs `count` matrices of one shape (nothing to do when packed_bytes is 0)
// by oneDNN reorders (copies: the result does not depend on the threads),
// each run single-threaded on one of up to num_threads threads: an
// allocation that fails inside oneDNN then throws on our thread, where it is
// caught, instead of inside an OpenMP region of oneDNN's (terminate). With
// fewer matrices than threads, each is packed as column slices (whole blocks
// of the packed layout), one reorder per slice, so that every thread copies a
// share (the backward's weights and x chunks: one matrix each). False if
// oneDNN failed.
bool bf16_pack_b(const Bf16Kernels& k, const Bf16Shape& s, const Bf16PackJob* jobs, int count,
                 int num_threads);

// One product of a call on a shared A: its B (the packed copy, or B itself when packed_bytes is 0)
// and its C (float, or std::uint16_t where the shape's c_bf16).
struct Bf16Target {
  const void* b = nullptr;
  void* c = nullptr;
};

// C[M, N] = A . B, or C += A . B when accumulate, for each target (products of one shape on the same
// A, e.g. the two projections; their tiles are dealt to the threads together, so that a decode call
// whose products are one tile each still uses two threads). M must be a multiple of kBf16TileRows
// (the caller pads A with zero rows and gives C room for them), or, without accumulate, a height that
// bf16_packed_short_rows (config.hpp) returned for this shape. With c_bf16 (only where
// bf16_c_rounds_like_f32, config.hpp), never accumulate (false). False if
// oneDNN failed.
bool gemm_bf16(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
               std::span<const Bf16Target> targets, bool accumulate, int num_threads);

// C (+)= A . B + A2 . B (fp32 C; A2 of A's shape and stride): the precise backward's hi and lo parts of
// d_new on the same B. On kvcomp's AMX kernel one product of twice the K (A's steps, then A2's, in one
// chain of fp32 sums: one pass over C); elsewhere gemm_bf16 on A, then accumulating A2's product (M
// as gemm_bf16 takes it). False if oneDNN failed.
bool gemm_bf16_two_parts(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                         const std::uint16_t* a2, std::span<const Bf16Target> targets, bool accumulate,
                         int num_threads);

// Rows of a short tile on a packed B: AMX's tile height.
constexpr std::int64_t kBf16ShortTileRows = 16;

// Columns of one tile of gemm_bf16_rows.
constexpr std::int64_t kBf16TileCols = 256;

// The same product without row stability, for calls with Options::row_stable false (decode-
// bound serving, products/onednn_f32.hpp): A is M rows as they are (no padding), and where
// B is read in place its columns are cut into tiles of kBf16TileCols, each one
// single-threaded primitive execution over the whole K (one tile over all
// columns where B is packed). Deterministic across thread counts; a row's
// result may depend on M. C fp32 only (c_bf16: false).
bool gemm_bf16_rows(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                    std::span<const Bf16Target> targets, bool accumulate, int num_threads);

// Whether a row-stable call of M rows (M >= 2, no padding to a whole tile) may run as
// gemm_bf16_rows: where B is read in place and oneDNN's kernel for these shapes is its jit gemm
// (AVX512-BF16 without AMX, e.g. Zen 4), a row's sums depend neither on M (from 2 rows: a one-row
// call takes a gemv path that sums differently) nor on the column tile, so M rows give the bits
// that any taller call gives them (measured with oneDNN 2.6.3 on Zen 4, K 96 to 7168; checked on
// each machine by tests/python/test_row_stability.py and test_products.py). Decode-sized calls
// then pad to 2 rows instead of 64. False elsewhere (AMX: packed B, 64-row tiles).
bool bf16_short_rows_stable(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M);

// The M-row product on that kernel, B's columns cut into tiles of kBf16TileCols, or narrower where the
// threads outnumber them (dealt_tile_cols, products/rows.hpp), and more than 8 rows into tiles of at least
// 64 where the column tiles are still too few for the threads, dealt to the threads
// (an element's order does not depend on its tile): the bits gemm_bf16 gives these rows.
// `panels` (optional): the AVX-512 decode panels of each target's B (write_panels_avx512_bf16, from
// column 0), read instead of B: the same bits without the kernel's register transposes.
void gemm_bf16_rows_kernel(const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                           std::span<const Bf16Target> targets, int num_threads,
                           const std::uint16_t* const* panels = nullptr);

}  // namespace kvcomp::detail
