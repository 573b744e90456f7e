#include "cpu/products/onednn_f32.hpp"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>

#include "cpu/convert.hpp"
#include "cpu/products/rows.hpp"

namespace kvcomp::detail {

namespace {

// oneDNN 2.6's sgemm kernels (row-major A[M,K] becomes the n dimension of its
// column-major call). AVX-512 (avx512_core and up), one thread, tiles of at
// most 256 columns, leading dimensions never a multiple of 256 (padded_ld):
// every call of 16 to 199 rows computes each row alike. From 200 rows on,
// where B is transposed (the forward's projections), the tile is wider than
// 100 columns and K < 1200, sgemm leaves its copy-based kernel for its no-copy
// one (nocopy_checker_avx512), whose K blocks differ for K 769-1199: so tiles
// of 192 rows there, 256 elsewhere (tile_m; measured on AMD Zen 5: N 16-256,
// K 16-8200, calls of 16-256 rows (a sample) against 192- and 256-row calls,
// B transposed or not). AVX2: the no-copy driver cuts n into blocks
// of 64 (96 when our B is transposed) and a block into groups of 6 rows;
// rows in a final group of 1-3 rows are summed in another order, those in a
// final group of 4 or 5 rows as in a whole group. So a call of one block
// whose row count is 0, 4 or 5 modulo 6 computes every row as a whole block
// does, and with tiles of 192 rows every block of a longer call is whole.
// (Measured with Debian's oneDNN 2.6.3 on an AVX2-only AMD EPYC: every M <= 96
// (B transposed) or <= 64 (B plain) against 192-row calls, K from 1 to 10240,
// N from 1 to 256, rows at offsets 0-96, padded leading dimensions.)
//
// Without row stability (a call's Options::row_stable false) the padding is off: calls of fewer than
// 16 rows (decode) then take oneDNN's short-call path, about twice as fast at one row, and their rows
// no longer match the same tokens in a longer call.

// Rows per tile of a product of depth K: 192 where sgemm keeps every row's order only below 200 rows (AVX2;
// AVX-512 with B transposed and K < 1200, above), 256 elsewhere (fewer passes over B) and without row
// stability.
std::int64_t tile_m(const F32Tiling& t, std::int64_t K, bool b_transposed) {
  if (!t.row_stable) return 256;
  if (!t.sgemm_avx512) return 192;
  return b_transposed && K < 1200 ? 192 : 256;
}

// Deals the column tiles of both weight matrices ([half, K] each; tiles of `width` columns, the last
// one narrower) to an OpenMP team: f(gate, n0, nt) for the tile [n0, n0 + nt) of wkv (gate false) or
// wgate. Any cut into whole 16-column groups gives the same bits: an element's order does not depend
// on its tile.
template <typename F>
void deal_weight_tiles(std::int64_t half, std::int64_t width, int num_threads, F&& f) {
  const std::int64_t per = (half + width - 1) / width, tiles = 2 * per;
#pragma omp parallel for num_threads(static_cast <int>(std::min <std::int64_t>(num_threads, tiles))) \
    schedule(dynamic, 1)
  for (std::int64_t tile = 0; tile < tiles; ++tile) {
    const bool gate = tile >= per;
    const std::int64_t n0 = (tile - (gate ? per : 0)) * width;
    f(gate, n0, std::min(width, half - n0));
  }
}

}  // namespace

void gemm_rows_16bit_weights(std::int64_t n, std::int64_t half, std::int64_t K, const float* a,
                             std::int64_t lda, const std::uint16_t* wkv, const std::uint16_t* wgate,
                             bool fp16, float* c, std::int64_t ldc, SgemmOrder order, int num_threads) {
  const auto kernel = fp16 ? &gemm_rows_avx2_f16 : &gemm_rows_avx2_bf16;
  // The column tiles of gemm_f32, narrower where the threads outnumber them.
  const std::int64_t width = dealt_tile_cols(half, 2, kF32TileCols, num_threads);
  deal_weight_tiles(half, width, num_threads, [&](bool gate, std::int64_t n0, std::int64_t nt) {
    kernel(n, nt, K, a, lda, (gate ? wgate : wkv) + n0 * K, K, c + (gate ? half : 0) + n0, ldc, order);
  });
}

void write_panels(const std::uint16_t* w, std::int64_t ldw, std::int64_t n, std::int64_t k,
                  std::uint16_t* out, int num_threads, bool fp16) {
  const std::int64_t panels = (n + kPanelWidth - 1) / kPanelWidth;
  const int threads = static_cast<int>(std::clamp<std::int64_t>(panels, 1, std::max(num_threads, 1)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t p = 0; p < panels; ++p) {
    const std::int64_t c0 = p * kPanelWidth;
    write_panels_avx2(w + c0 * ldw, ldw, std::min(kPanelWidth, n - c0), k, out + c0 * k, fp16);
  }
}

void gemm_row_panels(std::int64_t n, std::int64_t half, std::int64_t K, const float* a, std::int64_t lda,
                     const std::uint16_t* kv_panels, const std::uint16_t* gate_panels, bool fp16, float* c,
                     std::int64_t ldc, SgemmOrder order, int num_threads) {
  // One panel per tile.
  deal_weight_tiles(half, kPanelWidth, num_threads, [&](bool gate, std::int64_t n0, std::int64_t nt) {
    const std::uint16_t* panel = (gate ? gate_panels : kv_panels) + n0 * K;
    float* out = c + (gate ? half : 0) + n0;
    if (n == 1)
      gemm_row_avx2_panels(nt, K, a, panel, out, fp16, order);
    else
      gemm_rows_avx512_panels(n, nt, K, a, lda, panel, out, ldc, fp16, order);
  });
}

std::int64_t gemm_row_quantum(const F32Tiling& t, bool b_transposed) {
  if (!t.row_stable) return 1;
  if (t.sgemm_avx512) return 16;
  return b_transposed ? 96 : 64;
}

std::int64_t gemm_tile_rows(const F32Tiling& t, std::int64_t K, bool b_transposed) {
  return tile_m(t, K, b_transposed);
}

std::int64_t gemm_padded_rows(const F32Tiling& t, std::int64_t rows, bool b_transposed) {
  const std::int64_t q = gemm_row_quantum(t, b_transposed);
  if (t.row_stable && !t.sgemm_avx512 && rows > 0 && rows <= q) {
    // AVX2, one driver block (decode-sized calls): the fewest rows >= `rows`
    // that are 0, 4 or 5 modulo 6 (q itself is: 64 and 96 are), not q.
    std::int64_t m = std::max<std::int64_t>(rows, 4);
    while (m % 6 != 0 && m % 6 < 4) ++m;
    return m;
  }
  return (rows + q - 1) / q * q;
}

namespace {

// The tiles of gemm_f32: B's tile [n0, n0 + nt) comes from b_tile(n0, nt), which returns it as an operand
// (B itself offset to the tile, or a copy of the tile the provider made on the calling thread).
//
// Each tile is one dnnl_sgemm call (oneDNN's BLAS-style entry: no primitive,
// no memory objects, nothing allocated with operator new; its packing
// buffers come from oneDNN's own aligned malloc). The calling thread's
// OpenMP limit is set to 1 first, because dnnl_sgemm sizes its internal
// split by omp_get_max_threads() when it is not already inside an active
// parallel region, which is the case with one thread.
template <typename BTile>
bool gemm_f32_tiles(const F32Tiling& t, std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a,
                    bool b_transposed, BTile&& b_tile, float* c, std::int64_t ldc, bool accumulate,
                    int num_threads, std::int64_t live_rows, const RowsKernelOrders* orders) {
  if (M <= 0 || N <= 0) return true;
  if (K <= 0) {
    if (!accumulate)
      for (std::int64_t i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return true;
  }
  const std::int64_t rows_per_tile = tile_m(t, K, b_transposed);
  const std::int64_t tiles_m = (M + rows_per_tile - 1) / rows_per_tile;
  const std::int64_t tiles_n = (N + kF32TileCols - 1) / kF32TileCols;
  const std::int64_t tiles = tiles_m * tiles_n;
  const float beta = accumulate ? 1.0f : 0.0f;
  // Few live rows (decode): tiles of whole 16-column groups skip the padding rows
  // (products/rows.hpp); a tile with a partial group, whose last columns sgemm sums in another order,
  // stays with sgemm on all M rows.
  const bool rows_kernel = live_rows > 0 && live_rows <= kRowsKernelMax && live_rows <= M && !accumulate &&
                           !a.transposed && b_transposed && orders != nullptr;
  std::atomic<bool> ok{true};
#pragma omp parallel num_threads(static_cast <int>(std::min <std::int64_t>(num_threads, tiles)))
  {
    omp_set_num_threads(1);  // this implicit task's limit only: oneDNN runs the tile on this thread
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t m0 = (tile / tiles_n) * rows_per_tile;
      const std::int64_t n0 = (tile % tiles_n) * kF32TileCols;
      const std::int64_t mt = std::min(rows_per_tile, M - m0);
      const std::int64_t nt = std::min(kF32TileCols, N - n0);
      // Row-major: A[M,K] (or stored [K,M] when transposed), B[K,N] (or [N,K]).
      const float* a_ptr = a.transposed ? a.ptr + m0 : a.ptr + m0 * a.ld;
      const GemmOperand b = b_tile(n0, nt);
      const std::optional<SgemmOrder>* order =
          rows_kernel ? nt == kF32TileCols ? &orders->full : &orders->last : nullptr;
      if (order && nt % 16 == 0 && *order) {
        gemm_rows_avx2(live_rows, nt, K, a_ptr, a.ld, b.ptr, b.ld, c + n0, ldc, **order);
        continue;
      }
      if (dnnl_sgemm(a.transposed ? 'T' : 'N', b_transposed ? 'T' : 'N', mt, nt, K, 1.0f, a_ptr, a.ld, b.ptr,
                     b.ld, beta, c + m0 * ldc + n0, ldc) != dnnl_success)
        ok = false;
    }
  }
  return ok;
}

}  // namespace

bool gemm_f32(const F32Tiling& t, std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a,
              GemmOperand b, float* c, std::int64_t ldc, bool accumulate, int num_threads,
              std::int64_t live_rows, const RowsKernelOrders* rows) {
  const auto b_tile = [&b](std::int64_t n0, std::int64_t) {
    return GemmOperand{b.transposed ? b.ptr + n0 * b.ld : b.ptr + n0, b.ld, b.transposed};
  };
  return gemm_f32_tiles(t, M, N, K, a, b.transposed, b_tile, c, ldc, accumulate, num_threads, live_rows,
                        rows);
}

bool gemm_one_column_pass(const F32Tiling& t, std::int64_t M, std::int64_t K) {
  return M <= tile_m(t, K, true);
}

std::size_t gemm_widen_scratch_floats(std::int64_t N, std::int64_t ld, int num_threads) {
  const std::int64_t team =
      std::clamp<std::int64_t>((N + kF32TileCols - 1) / kF32TileCols, 1, std::max(num_threads, 1));
  return static_cast<std::size_t>(team * kF32TileCols * ld);
}

bool gemm_f32_widening(const F32Tiling& t, std::int64_t M, std::int64_t half, std::int64_t K, GemmOperand a,
                       const void* wkv, const void* wgate, DType dt, float* c, std::int64_t ldc,
                       float* scratch, std::int64_t ld_scratch, int num_threads, std::int64_t live_rows,
                       const RowsKernelOrders* rows) {
  if (!gemm_one_column_pass(t, M, K)) return false;
  const std::size_t row_bytes = static_cast<std::size_t>(K) * dtype_size(dt);
  const auto b_tile = [&](std::int64_t n0, std::int64_t nt) {
    // This thread's tile of [wkv ; wgate] in fp32 (rows n0 .. n0 + nt of B, either matrix's rows).
    float* tile = scratch + static_cast<std::int64_t>(omp_get_thread_num()) * kF32TileCols * ld_scratch;
    for (std::int64_t n = n0; n < n0 + nt; ++n) {
      const void* src = n < half ? wkv : wgate;
      const std::int64_t row = n < half ? n : n - half;
      to_f32(static_cast<const unsigned char*>(src) + static_cast<std::size_t>(row) * row_bytes, dt,
             tile + (n - n0) * ld_scratch, K);
    }
    return GemmOperand{tile, ld_scratch, true};
  };
  return gemm_f32_tiles(t, M, 2 * half, K, a, true, b_tile, c, ldc, false, num_threads, live_rows, rows);
}

}  // namespace kvcomp::detail
