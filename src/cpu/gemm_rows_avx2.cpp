// The AVX2 kernel for products of 1-8 rows (gemm_rows.hpp). Compiled with -mavx2 -mfma; called only
// after the CPU was found to have both.
#include <immintrin.h>

#include <algorithm>

#include "cpu/gemm_rows.hpp"

namespace kvcomp::detail {

namespace {

// Columns [0, 8) of B^T at k .. k+3: b points at B[n0, k] (B stored [N, K], row stride ldb). Two
// 128-bit loads per register pair rows r and r + 4; an in-lane 4x4 transpose then leaves v[j] =
// B[n0 .. n0+7, k + j] in column order.
inline void load_columns4(const float* b, std::int64_t ldb, __m256 v[4]) {
  const __m256 y0 = _mm256_loadu2_m128(b + 4 * ldb, b);
  const __m256 y1 = _mm256_loadu2_m128(b + 5 * ldb, b + ldb);
  const __m256 y2 = _mm256_loadu2_m128(b + 6 * ldb, b + 2 * ldb);
  const __m256 y3 = _mm256_loadu2_m128(b + 7 * ldb, b + 3 * ldb);
  const __m256 t0 = _mm256_unpacklo_ps(y0, y1), t1 = _mm256_unpackhi_ps(y0, y1);
  const __m256 t2 = _mm256_unpacklo_ps(y2, y3), t3 = _mm256_unpackhi_ps(y2, y3);
  v[0] = _mm256_shuffle_ps(t0, t2, 0x44);
  v[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
  v[2] = _mm256_shuffle_ps(t1, t3, 0x44);
  v[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}

// acc[g][m] = the fma chain over k in [k0, k1) of A[m, k] * B[n0 + 8g + lane, k], from zero. One
// chain per output element, in k order: the order sgemm's kernels sum a K block in.
template <int M, int G>
inline void k_block(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, std::int64_t k0,
                    std::int64_t k1, __m256 (&acc)[G][M]) {
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < M; ++m) acc[g][m] = _mm256_setzero_ps();
  std::int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    if ((k & 15) == 0)  // one cache line of each of the 8G rows, 4 lines ahead
      for (int r = 0; r < 8 * G; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(b + r * ldb + k + 64), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      __m256 v[4];
      load_columns4(b + 8 * g * ldb + k, ldb, v);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          acc[g][m] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + m * lda + k + j), v[j], acc[g][m]);
    }
  }
  for (; k < k1; ++k)
    for (int g = 0; g < G; ++g) {
      const float* p = b + 8 * g * ldb + k;
      const __m256 v = _mm256_setr_ps(p[0], p[ldb], p[2 * ldb], p[3 * ldb], p[4 * ldb], p[5 * ldb],
                                      p[6 * ldb], p[7 * ldb]);
      for (int m = 0; m < M; ++m)
        acc[g][m] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + m * lda + k), v, acc[g][m]);
    }
}

// M rows, 8G columns at a time (two 8-column groups, 16 rows of B streaming, measured fastest up to 4
// rows; one group beyond, for the registers).
template <int M>
void rows_kernel(std::int64_t n, std::int64_t k, const float* a, std::int64_t lda, const float* b,
                 std::int64_t ldb, float* c, std::int64_t ldc) {
  constexpr int G = M <= 4 ? 2 : 1;
  const KBlocks blocks = sgemm_k_blocks(k);
  for (std::int64_t n0 = 0; n0 < n; n0 += 8 * G) {
    for (int blk = 0; blk < blocks.count; ++blk) {
      __m256 acc[G][M];
      k_block<M, G>(a, lda, b + n0 * ldb, ldb, blocks.begin(blk), blocks.end(blk), acc);
      for (int g = 0; g < G; ++g)
        for (int m = 0; m < M; ++m) {
          float* cp = c + m * ldc + n0 + 8 * g;
          // The first block's sum is the value, the later ones are added to it in order.
          _mm256_storeu_ps(cp, blk == 0 ? acc[g][m] : _mm256_add_ps(_mm256_loadu_ps(cp), acc[g][m]));
        }
    }
  }
}

}  // namespace

void gemm_rows_avx2(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                    const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  switch (m) {
    case 1:
      return rows_kernel<1>(n, k, a, lda, b, ldb, c, ldc);
    case 2:
      return rows_kernel<2>(n, k, a, lda, b, ldb, c, ldc);
    case 3:
      return rows_kernel<3>(n, k, a, lda, b, ldb, c, ldc);
    case 4:
      return rows_kernel<4>(n, k, a, lda, b, ldb, c, ldc);
    case 5:
      return rows_kernel<5>(n, k, a, lda, b, ldb, c, ldc);
    case 6:
      return rows_kernel<6>(n, k, a, lda, b, ldb, c, ldc);
    case 7:
      return rows_kernel<7>(n, k, a, lda, b, ldb, c, ldc);
    default:
      return rows_kernel<8>(n, k, a, lda, b, ldb, c, ldc);
  }
}

}  // namespace kvcomp::detail
