// The AVX512-BF16 kernel for bf16 products of 1-8 rows, and of any number of rows on decode panels
// (products/rows.hpp). Compiled with -mavx512f -mavx512bw -mavx512bf16; called only where the CPU has
// AVX512-BF16 and the order was checked against oneDNN.
// GCC 12 reports the undefined pass-through operand inside its AVX-512 unpack intrinsics as maybe
// uninitialized (a false positive of its headers).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/products/rows.hpp"

namespace kvcomp::detail {

namespace {

// The 16 x 16 transpose of 32-bit elements: r[j] = row j in, column j out.
inline void transpose16x16_epi32(__m512i (&r)[16]) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // u[4i + j], each 128-bit lane L: rows 4i .. 4i + 3 of column 4L + j
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i a0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i a1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i b0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i b1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
}

// A's pair (k, k + 1) of one row as vdpbf16ps takes it; `single`: only a[k] (the pair ends its block).
inline std::uint32_t a_pair(const std::uint16_t* row, std::int64_t k, bool single) {
  std::uint32_t pair = row[k];
  if (!single) std::memcpy(&pair, row + k, sizeof pair);
  return pair;
}

// v[p] = the pairs of [k, k + len) (len <= 32) of 16 rows of B (b at B[n0, 0]) as vdpbf16ps takes them:
// lane j the pair of row j, values past len zero.
inline void load_pairs_masked(const std::uint16_t* b, std::int64_t ldb, std::int64_t k, std::int64_t len,
                              __m512i (&v)[16]) {
  const __mmask32 mask = static_cast<__mmask32>((std::uint64_t{1} << len) - 1);
  for (int j = 0; j < 16; ++j) v[j] = _mm512_maskz_loadu_epi16(mask, b + j * ldb + k);
  transpose16x16_epi32(v);
}

// A K block's sums into C's 16 columns at cp: the first block's sum is the value, the later ones are
// added to it in order.
inline void store_block_sum(float* cp, int blk, __m512 acc) {
  _mm512_storeu_ps(cp, blk == 0 ? acc : _mm512_add_ps(_mm512_loadu_ps(cp), acc));
}

// acc[m] += the pairs p < np of A[m, k + 2p .. k + 2p + 1] . B[n0 + lane, same], v[p] holding lane j's pair
// of column j; `odd`: the last pair has one element (the pair's second A value is zero, its B one is).
template <int M>
inline void dot_pairs(const std::uint16_t* a, std::int64_t lda, std::int64_t k, const __m512i (&v)[16],
                      int np, bool odd, __m512 (&acc)[M]) {
#pragma GCC unroll 16
  for (int p = 0; p < np; ++p) {
    const bool single = odd && p + 1 == np;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const std::uint32_t pair = a_pair(a + m * lda, k + 2 * p, single);
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), (__m512bh)v[p]);
    }
  }
}

// acc[m] = the vdpbf16ps chain over the pairs of [k0, k1) (counted from k0) of A[m] . B[n0 + lane], from
// zero; b points at B[n0, 0].
template <int M>
inline void k_block(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t ldb,
                    std::int64_t k0, std::int64_t k1, __m512 (&acc)[M]) {
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  std::int64_t k = k0;
  __m512i v[16];
  for (; k + 32 <= k1; k += 32) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(b + j * ldb + k + 128), _MM_HINT_T0);
      v[j] = _mm512_loadu_si512(b + j * ldb + k);
    }
    transpose16x16_epi32(v);
    dot_pairs<M>(a, lda, k, v, 16, false, acc);
  }
  if (k < k1) {  // the block's last 1-31 values: the rest of each row masked to zero
    const int rest = static_cast<int>(k1 - k);
    load_pairs_masked(b, ldb, k, rest, v);
    dot_pairs<M>(a, lda, k, v, (rest + 1) / 2, rest % 2 != 0, acc);
  }
}

template <int M>
void rows_kernel(std::int64_t n, std::int64_t k, const std::uint16_t* a, std::int64_t lda,
                 const std::uint16_t* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  const Bf16KBlocks blocks = jit_bf16_k_blocks(k);
  for (std::int64_t n0 = 0; n0 < n; n0 += 16)
    for (int blk = 0; blk < blocks.count; ++blk) {
      __m512 acc[M];
      k_block<M>(a, lda, b + n0 * ldb, ldb, blocks.begin(blk), blocks.end(blk), acc);
      for (int m = 0; m < M; ++m) store_block_sum(c + m * ldc + n0, blk, acc[m]);
    }
}

// Panel kernel (products/rows.hpp): acc[g][m] = the chain of group g's pairs [0, np) of one K block (the odd
// last pair with A's second value zero); t points at the block's first pair of group 0, groups `group`
// vectors apart. G groups side by side: the panels stream contiguously, and each chain waits on its
// previous vdpbf16ps, so G x M chains keep the unit busy (two groups at a time ran about twice as fast
// as one). Per element the chain is the rows kernel's, so each row
// gets the same bits whatever the call's row count or tiles.
template <int M, int G>
inline void tile_chain(const std::uint16_t* a, std::int64_t lda, std::int64_t k0, const __m512i* t,
                       std::int64_t group, std::int64_t np, bool odd, __m512 (&acc)[G][M]) {
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < M; ++m) acc[g][m] = _mm512_setzero_ps();
  const std::int64_t full = odd ? np - 1 : np;
  for (std::int64_t p = 0; p < full; ++p) {
    __m512i v[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) v[g] = _mm512_loadu_si512(t + g * group + p);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      int pair;
      std::memcpy(&pair, a + m * lda + k0 + 2 * p, sizeof pair);
      const __m512bh bc = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[g][m] = _mm512_dpbf16_ps(acc[g][m], bc, (__m512bh)v[g]);
    }
  }
  if (odd) {
    const std::int64_t p = np - 1;
    for (int m = 0; m < M; ++m) {
      const __m512bh bc = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[m * lda + k0 + 2 * p]));
      for (int g = 0; g < G; ++g)
        acc[g][m] = _mm512_dpbf16_ps(acc[g][m], bc, (__m512bh)_mm512_loadu_si512(t + g * group + p));
    }
  }
}

template <int M, int G>
void tile_rows(std::int64_t g0, std::int64_t first, std::int64_t k0, std::int64_t len, int blk,
               std::int64_t group, const std::uint16_t* a, std::int64_t lda, const __m512i* panels, float* c,
               std::int64_t ldc) {
  __m512 acc[G][M];
  tile_chain<M, G>(a, lda, k0, panels + g0 * group + first, group, (len + 1) / 2, len % 2 != 0, acc);
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < M; ++m) store_block_sum(c + m * ldc + 16 * (g0 + g), blk, acc[g][m]);
}

template <int G, std::size_t... I>
void tile_rest(std::int64_t m, std::int64_t g0, std::int64_t first, std::int64_t k0, std::int64_t len,
               int blk, std::int64_t group, const std::uint16_t* a, std::int64_t lda, const __m512i* panels,
               float* c, std::int64_t ldc, std::index_sequence<I...>) {
  using Fn = void (*)(std::int64_t, std::int64_t, std::int64_t, std::int64_t, int, std::int64_t,
                      const std::uint16_t*, std::int64_t, const __m512i*, float*, std::int64_t);
  static constexpr Fn kernels[] = {&tile_rows<static_cast<int>(I) + 1, G>...};
  kernels[m - 1](g0, first, k0, len, blk, group, a, lda, panels, c, ldc);
}

// Rows [0, m) against groups [g0, g0 + G), K block by K block, in tiles of MR rows (the rest in one
// smaller tile): each block's slice of the panels is read by every row tile while it is in the caches.
template <int MR, int G>
void panel_groups(std::int64_t m, std::int64_t g0, const Bf16KBlocks& blocks, std::int64_t group,
                  const std::uint16_t* a, std::int64_t lda, const __m512i* panels, float* c,
                  std::int64_t ldc) {
  std::int64_t first = 0;  // the block's first pair within a group
  for (int blk = 0; blk < blocks.count; ++blk) {
    const std::int64_t k0 = blocks.begin(blk), len = blocks.end(blk) - k0;
    std::int64_t r = 0;
    for (; r + MR <= m; r += MR)
      tile_rows<MR, G>(g0, first, k0, len, blk, group, a + r * lda, lda, panels, c + r * ldc, ldc);
    if constexpr (MR > 1)
      if (r < m)
        tile_rest<G>(m - r, g0, first, k0, len, blk, group, a + r * lda, lda, panels, c + r * ldc, ldc,
                     std::make_index_sequence<MR - 1>{});
    first += (len + 1) / 2;
  }
}

// m rows against the panels of n columns: tiles of MR rows x G groups (the groups left over two, then one
// at a time).
template <int MR, int G>
void panel_tiles(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a, std::int64_t lda,
                 const std::uint16_t* panels, float* c, std::int64_t ldc) {
  const Bf16KBlocks blocks = jit_bf16_k_blocks(k);
  const std::int64_t group = bf16_panel_pairs(k), groups = n / 16;
  const auto* t = reinterpret_cast<const __m512i*>(panels);
  std::int64_t g0 = 0;
  for (; g0 + G <= groups; g0 += G) panel_groups<MR, G>(m, g0, blocks, group, a, lda, t, c, ldc);
  if constexpr (G > 2)
    for (; g0 + 2 <= groups; g0 += 2) panel_groups<MR, 2>(m, g0, blocks, group, a, lda, t, c, ldc);
  for (; g0 < groups; ++g0) panel_groups<MR, 1>(m, g0, blocks, group, a, lda, t, c, ldc);
}

// 1-8 rows: one tile of all of them, four groups side by side for one or two rows, two for more. One
// row with eight groups (eight streams of panels 64 x bf16_panel_pairs(k) bytes apart, a power of two
// at the common hidden sizes) ran slower (docs/performance.md).
template <int M>
void panel_rows(std::int64_t n, std::int64_t k, const std::uint16_t* a, std::int64_t lda,
                const std::uint16_t* panels, float* c, std::int64_t ldc) {
  panel_tiles<M, M <= 2 ? 4 : 2>(M, n, k, a, lda, panels, c, ldc);
}

// More rows: tiles of 6 rows x 4 groups (24 accumulators).
void many_rows(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a, std::int64_t lda,
               const std::uint16_t* panels, float* c, std::int64_t ldc) {
  panel_tiles<6, 4>(m, n, k, a, lda, panels, c, ldc);
}

template <std::size_t... I>
void rows_dispatch(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a, std::int64_t lda,
                   const std::uint16_t* b, std::int64_t ldb, float* c, std::int64_t ldc,
                   std::index_sequence<I...>) {
  using Fn = void (*)(std::int64_t, std::int64_t, const std::uint16_t*, std::int64_t, const std::uint16_t*,
                      std::int64_t, float*, std::int64_t);
  static constexpr Fn kernels[] = {&rows_kernel<static_cast<int>(I) + 1>...};
  kernels[std::clamp<std::int64_t>(m, 1, sizeof...(I)) - 1](n, k, a, lda, b, ldb, c, ldc);
}

template <std::size_t... I>
void panel_dispatch(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a, std::int64_t lda,
                    const std::uint16_t* panels, float* c, std::int64_t ldc, std::index_sequence<I...>) {
  using Fn = void (*)(std::int64_t, std::int64_t, const std::uint16_t*, std::int64_t, const std::uint16_t*,
                      float*, std::int64_t);
  static constexpr Fn kernels[] = {&panel_rows<static_cast<int>(I) + 1>...};
  kernels[std::clamp<std::int64_t>(m, 1, sizeof...(I)) - 1](n, k, a, lda, panels, c, ldc);
}

}  // namespace

std::int64_t bf16_panel_pairs(std::int64_t k) {
  const Bf16KBlocks blocks = jit_bf16_k_blocks(k);
  std::int64_t pairs = 0;
  for (int blk = 0; blk < blocks.count; ++blk) pairs += (blocks.end(blk) - blocks.begin(blk) + 1) / 2;
  return pairs;
}

void write_panels_avx512_bf16(const std::uint16_t* w, std::int64_t ldw, std::int64_t n, std::int64_t k,
                              std::uint16_t* out) {
  const Bf16KBlocks blocks = jit_bf16_k_blocks(k);
  auto* t = reinterpret_cast<__m512i*>(out);
  for (std::int64_t n0 = 0; n0 < n; n0 += 16) {
    const std::uint16_t* b = w + n0 * ldw;
    for (int blk = 0; blk < blocks.count; ++blk)
      for (std::int64_t kk = blocks.begin(blk); kk < blocks.end(blk); kk += 32) {
        const std::int64_t len = std::min<std::int64_t>(32, blocks.end(blk) - kk);
        __m512i v[16];
        load_pairs_masked(b, ldw, kk, len, v);
        for (std::int64_t p = 0; p < (len + 1) / 2; ++p) _mm512_storeu_si512(t++, v[p]);
      }
  }
}

void gemm_rows_avx512_bf16_panels(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a,
                                  std::int64_t lda, const std::uint16_t* panels, float* c, std::int64_t ldc) {
  if (m > kRowsKernelMax)
    many_rows(m, n, k, a, lda, panels, c, ldc);
  else
    panel_dispatch(m, n, k, a, lda, panels, c, ldc, std::make_index_sequence<kRowsKernelMax>{});
}

void gemm_rows_avx512_bf16(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint16_t* a,
                           std::int64_t lda, const std::uint16_t* b, std::int64_t ldb, float* c,
                           std::int64_t ldc) {
  rows_dispatch(m, n, k, a, lda, b, ldb, c, ldc, std::make_index_sequence<kRowsKernelMax>{});
}

}  // namespace kvcomp::detail
