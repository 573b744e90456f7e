#include "cpu/gemm.hpp"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>

namespace kvcomp::detail {

namespace {

// Tile sizes. Fixed constants: changing them changes the rounding of results
// (still deterministic), so they are part of the numerical contract of a
// release.
constexpr std::int64_t kTileM = 256;
constexpr std::int64_t kTileN = 256;

}  // namespace

// Each tile is one dnnl_sgemm call (oneDNN's BLAS-style entry: no primitive,
// no memory objects, nothing allocated with operator new; its packing
// buffers come from oneDNN's own aligned malloc). The calling thread's
// OpenMP limit is set to 1 first, because dnnl_sgemm sizes its internal
// split by omp_get_max_threads() when it is not already inside an active
// parallel region, which is the case with one thread.
bool gemm_f32(std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a, GemmOperand b, float* c,
              std::int64_t ldc, bool accumulate, int num_threads) {
  if (M <= 0 || N <= 0) return true;
  if (K <= 0) {
    if (!accumulate)
      for (std::int64_t i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return true;
  }
  const std::int64_t tiles_m = (M + kTileM - 1) / kTileM;
  const std::int64_t tiles_n = (N + kTileN - 1) / kTileN;
  const std::int64_t tiles = tiles_m * tiles_n;
  const float beta = accumulate ? 1.0f : 0.0f;
  std::atomic<bool> ok{true};
#pragma omp parallel num_threads(static_cast <int>(std::min <std::int64_t>(num_threads, tiles)))
  {
    omp_set_num_threads(1);  // this implicit task's limit only: oneDNN runs the tile on this thread
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t m0 = (tile / tiles_n) * kTileM;
      const std::int64_t n0 = (tile % tiles_n) * kTileN;
      const std::int64_t mt = std::min(kTileM, M - m0);
      const std::int64_t nt = std::min(kTileN, N - n0);
      // Row-major: A[M,K] (or stored [K,M] when transposed), B[K,N] (or [N,K]).
      const float* a_ptr = a.transposed ? a.ptr + m0 : a.ptr + m0 * a.ld;
      const float* b_ptr = b.transposed ? b.ptr + n0 * b.ld : b.ptr + n0;
      if (dnnl_sgemm(a.transposed ? 'T' : 'N', b.transposed ? 'T' : 'N', mt, nt, K, 1.0f, a_ptr, a.ld, b_ptr,
                     b.ld, beta, c + m0 * ldc + n0, ldc) != dnnl_success)
        ok = false;
    }
  }
  return ok;
}

}  // namespace kvcomp::detail
