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

#include <cstdint>

namespace kvcomp::detail {

struct GemmOperand {
  const float* ptr = nullptr;
  std::int64_t ld = 0;      // leading dimension (elements)
  bool transposed = false;  // A: stored [K,M]; B: stored [N,K]
};

// C[M,N] = A[M,K] * B[K,N] (+ C when accumulate). C is row-major with ldc.
// Returns false if oneDNN failed (out of memory for its packing buffers); C
// is then undefined. Allocates nothing itself.
bool gemm_f32(std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a, GemmOperand b, float* c,
              std::int64_t ldc, bool accumulate, int num_threads);

}  // namespace kvcomp::detail
