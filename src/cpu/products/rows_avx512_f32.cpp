// The AVX-512 kernel for fp32 products of any number of rows on 16-bit decode panels (products/rows.hpp).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c; called only where kvcomp's kernels
// run AVX-512 (detected_isa and KVCOMP_ISA). GCC 12 reports the undefined pass-through operand inside its
// AVX-512 conversion and shuffle intrinsics as (maybe) uninitialized (a false positive of its headers).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "cpu/products/rows.hpp"

namespace kvcomp::detail {

namespace {

// Columns [g0 .. g0 + 16G) of a panel row (16-bit values at `row`, the panel's layout), widened: v[j] is
// 16 columns. fp16 (in order): v[g] = group g. bf16 (each 16 stored 0-3, 8-11, 4-7, 12-15): for G = 2,
// one load of both groups; v[0] = columns 0-7 of group 0 | 0-7 of group 1, v[1] = 8-15 of each (the
// unpacks take the low / high four of each 128-bit lane); for G = 1 the same in 256 bits, v[0] = 0-7 |
// 8-15 after a lane shuffle.
template <int G, bool kFp16>
inline void widen(const std::uint16_t* row, __m512 (&v)[G]) {
  if constexpr (kFp16) {
    for (int g = 0; g < G; ++g)
      v[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * g)));
  } else if constexpr (G == 2) {
    const __m512i y = _mm512_loadu_si512(row), zero = _mm512_setzero_si512();
    v[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, y));
    v[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, y));
  } else {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)),
                  zero = _mm256_setzero_si256();
    const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, y));  // columns 0-7
    const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, y));  // columns 8-15
    v[0] = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
  }
}

// The 16 columns of group g out of the accumulators of one row (widen's arrangement).
template <int G, bool kFp16>
inline __m512 group_of(const __m512 (&acc)[G], int g) {
  if constexpr (kFp16 || G == 1) {
    return acc[g];
  } else {  // acc[0] = 0-7 of both groups, acc[1] = 8-15: 128-bit lanes (0, 1) of group 0, (2, 3) of group 1
    return g == 0 ? _mm512_shuffle_f32x4(acc[0], acc[1], 0x44) : _mm512_shuffle_f32x4(acc[0], acc[1], 0xEE);
  }
}

// M rows x 16G columns of one K block [k0, k1): acc[m] = the fma chain over k of A[m, k] * B[col, k], from
// zero, in k order (the rows kernel's order); then C = the sum (first block) or C + the sum.
template <int M, int G, bool kFp16>
void tile(const float* a, std::int64_t lda, const std::uint16_t* panel, std::int64_t w, std::int64_t k0,
          std::int64_t k1, int blk, float* c, std::int64_t ldc) {
  __m512 acc[M][G];
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
  for (std::int64_t k = k0; k < k1; ++k) {
    __m512 v[G];
    widen<G, kFp16>(panel + k * w, v);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m512 av = _mm512_set1_ps(a[m * lda + k]);
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) acc[m][g] = _mm512_fmadd_ps(av, v[g], acc[m][g]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      float* cp = c + m * ldc + 16 * g;
      const __m512 sum = group_of<G, kFp16>(acc[m], g);
      _mm512_storeu_ps(cp, blk == 0 ? sum : _mm512_add_ps(_mm512_loadu_ps(cp), sum));
    }
}

constexpr int kTileRows = 12;

template <int G, bool kFp16, std::size_t... I>
void tile_rest(std::int64_t m, const float* a, std::int64_t lda, const std::uint16_t* panel, std::int64_t w,
               std::int64_t k0, std::int64_t k1, int blk, float* c, std::int64_t ldc,
               std::index_sequence<I...>) {
  using Fn = void (*)(const float*, std::int64_t, const std::uint16_t*, std::int64_t, std::int64_t,
                      std::int64_t, int, float*, std::int64_t);
  static constexpr Fn kernels[] = {&tile<static_cast<int>(I) + 1, G, kFp16>...};
  kernels[m - 1](a, lda, panel, w, k0, k1, blk, c, ldc);
}

// All m rows against 16G columns of a panel (panel at the group's first column, row stride w): K block
// by K block, each block's slice of the panel read by every row tile while it is in the caches.
template <int G, bool kFp16>
void groups(std::int64_t m, const float* a, std::int64_t lda, const std::uint16_t* panel, std::int64_t w,
            float* c, std::int64_t ldc, const KBlocks& blocks) {
  for (int blk = 0; blk < blocks.count; ++blk) {
    const std::int64_t k0 = blocks.begin(blk), k1 = blocks.end(blk);
    std::int64_t r = 0;
    for (; r + kTileRows <= m; r += kTileRows)
      tile<kTileRows, G, kFp16>(a + r * lda, lda, panel, w, k0, k1, blk, c + r * ldc, ldc);
    if (r < m)
      tile_rest<G, kFp16>(m - r, a + r * lda, lda, panel, w, k0, k1, blk, c + r * ldc, ldc,
                          std::make_index_sequence<kTileRows - 1>{});
  }
}

template <bool kFp16>
void rows_panels(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                 const std::uint16_t* panels, float* c, std::int64_t ldc, SgemmOrder order) {
  const KBlocks blocks = sgemm_k_blocks(k, order);
  for (std::int64_t p0 = 0; p0 < n; p0 += kPanelWidth) {
    const std::int64_t w = std::min(kPanelWidth, n - p0);
    const std::uint16_t* panel = panels + p0 * k;
    std::int64_t g = 0;
    for (; g + 32 <= w; g += 32) groups<2, kFp16>(m, a, lda, panel + g, w, c + p0 + g, ldc, blocks);
    for (; g < w; g += 16) groups<1, kFp16>(m, a, lda, panel + g, w, c + p0 + g, ldc, blocks);
  }
}

}  // namespace

void gemm_rows_avx512_panels(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                             const std::uint16_t* panels, float* c, std::int64_t ldc, bool fp16,
                             SgemmOrder order) {
  if (fp16)
    rows_panels<true>(m, n, k, a, lda, panels, c, ldc, order);
  else
    rows_panels<false>(m, n, k, a, lda, panels, c, ldc, order);
}

}  // namespace kvcomp::detail
