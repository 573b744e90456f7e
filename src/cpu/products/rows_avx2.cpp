// The AVX2 kernels for products of 1-8 rows (products/rows.hpp), B in fp32, bf16 or fp16. Compiled with
// -mavx2 -mfma -mf16c; called only after the CPU was found to have AVX2 and FMA (and F16C for fp16 B).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cpu/products/rows.hpp"
#include "kvcomp/half.hpp"

namespace kvcomp::detail {

namespace {

// The in-lane 4x4 transpose of four registers [B[r, k..k+3] | B[r+4, k..k+3]], r = 0..3: v[j] =
// B[0..7, k + j], the 8 rows in order.
inline void transpose_halves(const __m256 (&y)[4], __m256* v) {
  const __m256 t0 = _mm256_unpacklo_ps(y[0], y[1]), t1 = _mm256_unpackhi_ps(y[0], y[1]);
  const __m256 t2 = _mm256_unpacklo_ps(y[2], y[3]), t3 = _mm256_unpackhi_ps(y[2], y[3]);
  v[0] = _mm256_shuffle_ps(t0, t2, 0x44);
  v[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
  v[2] = _mm256_shuffle_ps(t1, t3, 0x44);
  v[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}

// Columns [0, 8) of B^T at k .. k+3: b points at B[n0, k] (B stored [N, K], row stride ldb); two
// 128-bit loads per register, then transpose_halves.
inline void load_columns4(const float* b, std::int64_t ldb, __m256 v[4]) {
  const __m256 y[4] = {_mm256_loadu2_m128(b + 4 * ldb, b), _mm256_loadu2_m128(b + 5 * ldb, b + ldb),
                       _mm256_loadu2_m128(b + 6 * ldb, b + 2 * ldb),
                       _mm256_loadu2_m128(b + 7 * ldb, b + 3 * ldb)};
  transpose_halves(y, v);
}

// Columns [0, 8) of B^T at k .. k+7 from bf16 rows (widened exactly: a bf16 is the high half of its
// float): one 128-bit load per row, rows r and r + 4 in one register, interleaved with zeros into
// [B[r, k..k+3] | B[r+4, k..k+3]] and [B[r, k+4..k+7] | B[r+4, k+4..k+7]] as floats, then the
// transpose of load_columns4 on each half.
inline void load_columns8_bf16(const std::uint16_t* b, std::int64_t ldb, __m256 v[8]) {
  const __m256i zero = _mm256_setzero_si256();
  __m256 lo[4], hi[4];
  for (int r = 0; r < 4; ++r) {
    const __m256i y = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + (r + 4) * ldb),
                                          reinterpret_cast<const __m128i*>(b + r * ldb));
    lo[r] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, y));
    hi[r] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, y));
  }
  transpose_halves(lo, v);
  transpose_halves(hi, v + 4);
}

// The same from fp16 rows (F16C's widening is exact): the low and the high 64 bits of rows r and r + 4
// side by side, then widened, give the same two registers per r.
inline void load_columns8_f16(const std::uint16_t* b, std::int64_t ldb, __m256 v[8]) {
  __m256 lo[4], hi[4];
  for (int r = 0; r < 4; ++r) {
    const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + r * ldb));
    const __m128i x4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (r + 4) * ldb));
    lo[r] = _mm256_cvtph_ps(_mm_unpacklo_epi64(x0, x4));
    hi[r] = _mm256_cvtph_ps(_mm_unpackhi_epi64(x0, x4));
  }
  transpose_halves(lo, v);
  transpose_halves(hi, v + 4);
}

// The 16-bit formats of B besides fp32.
enum class Half { bf16, f16 };

template <Half kHalf>
inline float half_to_float(std::uint16_t h) {
  return kHalf == Half::bf16 ? bf16_to_float(h) : fp16_to_float(h);
}

// As k_block below, from 16-bit rows: one 8-column group (G = 1), 8 k per step (8 rows streaming: with
// rows 2^n bytes apart, 16 would alias in one L1 set).
template <int M, int G, Half kHalf>
inline void k_block(const float* a, std::int64_t lda, const std::uint16_t* b, std::int64_t ldb,
                    std::int64_t k0, std::int64_t k1, __m256 (&acc_g)[G][M]) {
  static_assert(G == 1);
  __m256(&acc)[M] = acc_g[0];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  std::int64_t k = k0;
  for (; k + 8 <= k1; k += 8) {
    if (((k - k0) & 31) == 0)  // one cache line of each of the 8 rows, 4 lines ahead
      for (int r = 0; r < 8; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(b + r * ldb + k + 128), _MM_HINT_T0);
    __m256 v[8];
    if constexpr (kHalf == Half::bf16)
      load_columns8_bf16(b + k, ldb, v);
    else
      load_columns8_f16(b + k, ldb, v);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + m * lda + k + j), v[j], acc[m]);
  }
  for (; k < k1; ++k) {
    const std::uint16_t* p = b + k;
    const __m256 v = _mm256_setr_ps(half_to_float<kHalf>(p[0]), half_to_float<kHalf>(p[ldb]),
                                    half_to_float<kHalf>(p[2 * ldb]), half_to_float<kHalf>(p[3 * ldb]),
                                    half_to_float<kHalf>(p[4 * ldb]), half_to_float<kHalf>(p[5 * ldb]),
                                    half_to_float<kHalf>(p[6 * ldb]), half_to_float<kHalf>(p[7 * ldb]));
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + m * lda + k), v, acc[m]);
  }
}

// acc[g][m] = the fma chain over k in [k0, k1) of A[m, k] * B[n0 + 8g + lane, k], from zero. One
// chain per output element, in k order: the order sgemm's kernels sum a K block in.
template <int M, int G, Half>
inline void k_block(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, std::int64_t k0,
                    std::int64_t k1, __m256 (&acc)[G][M]) {
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < M; ++m) acc[g][m] = _mm256_setzero_ps();
  std::int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    if (((k - k0) & 15) == 0)  // one cache line of each of the 8G rows, 4 lines ahead
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

// M rows, 8G columns at a time (fp32 B: two 8-column groups, 16 rows of B streaming, measured fastest up
// to 4 rows; one group beyond, for the registers; 16-bit B: one group). kHalf: the format of a 16-bit B.
template <int M, class T, Half kHalf>
void rows_kernel(std::int64_t n, std::int64_t k, const float* a, std::int64_t lda, const T* b,
                 std::int64_t ldb, float* c, std::int64_t ldc, SgemmOrder order) {
  constexpr int G = std::is_same_v<T, float> && M <= 4 ? 2 : 1;
  const KBlocks blocks = sgemm_k_blocks(k, order);
  for (std::int64_t n0 = 0; n0 < n; n0 += 8 * G) {
    for (int blk = 0; blk < blocks.count; ++blk) {
      __m256 acc[G][M];
      k_block<M, G, kHalf>(a, lda, b + n0 * ldb, ldb, blocks.begin(blk), blocks.end(blk), acc);
      for (int g = 0; g < G; ++g)
        for (int m = 0; m < M; ++m) {
          float* cp = c + m * ldc + n0 + 8 * g;
          // The first block's sum is the value, the later ones are added to it in order.
          _mm256_storeu_ps(cp, blk == 0 ? acc[g][m] : _mm256_add_ps(_mm256_loadu_ps(cp), acc[g][m]));
        }
    }
  }
}

// rows_kernel<m, T, kHalf> for a run-time m in [1, kRowsKernelMax].
template <class T, Half kHalf, std::size_t... I>
void rows_dispatch(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                   const T* b, std::int64_t ldb, float* c, std::int64_t ldc, SgemmOrder order,
                   std::index_sequence<I...>) {
  using Fn = void (*)(std::int64_t, std::int64_t, const float*, std::int64_t, const T*, std::int64_t, float*,
                      std::int64_t, SgemmOrder);
  static constexpr Fn kernels[] = {&rows_kernel<static_cast<int>(I) + 1, T, kHalf>...};
  kernels[std::clamp<std::int64_t>(m, 1, sizeof...(I)) - 1](n, k, a, lda, b, ldb, c, ldc, order);
}

// One row against one panel of G 16-column groups (products/rows.hpp): acc[g] = the fma chain over k in
// [k0, k1) of a[k] * B[8g + lane, k], from zero, in k order (k_block's order, without transposes).
template <int G, Half kHalf>
inline void panel_k_block(const float* a, const std::uint16_t* panel, std::int64_t k0, std::int64_t k1,
                          __m256 (&acc)[2 * G]) {
  constexpr std::int64_t w = 16 * G;
  for (int g = 0; g < 2 * G; ++g) acc[g] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (std::int64_t k = k0; k < k1; ++k) {
    const std::uint16_t* row = panel + k * w;
    if ((k & 1) == 0) {  // the panel streams: two rows (at most two cache lines) per pass, 8 rows ahead
      _mm_prefetch(reinterpret_cast<const char*>(row + 8 * w), _MM_HINT_T0);
      if (G > 2) _mm_prefetch(reinterpret_cast<const char*>(row + 8 * w + 32), _MM_HINT_T0);
    }
    const __m256 av = _mm256_broadcast_ss(a + k);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      __m256 lo, hi;  // columns 0-7 and 8-15 of the group
      if constexpr (kHalf == Half::bf16) {
        const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * g));
        lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, y));
        hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, y));
      } else {
        lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));
        hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g + 8)));
      }
      acc[2 * g] = _mm256_fmadd_ps(av, lo, acc[2 * g]);
      acc[2 * g + 1] = _mm256_fmadd_ps(av, hi, acc[2 * g + 1]);
    }
  }
}

template <int G, Half kHalf>
void panel_row(std::int64_t k, const float* a, const std::uint16_t* panel, float* c, SgemmOrder order) {
  const KBlocks blocks = sgemm_k_blocks(k, order);
  for (int blk = 0; blk < blocks.count; ++blk) {
    __m256 acc[2 * G];
    panel_k_block<G, kHalf>(a, panel, blocks.begin(blk), blocks.end(blk), acc);
    for (int g = 0; g < 2 * G; ++g)  // as rows_kernel: the first block's sum, the later ones added in order
      _mm256_storeu_ps(c + 8 * g, blk == 0 ? acc[g] : _mm256_add_ps(_mm256_loadu_ps(c + 8 * g), acc[g]));
  }
}

// The 8 x 8 transpose of 16-bit elements: r[j] = row j in, column j out.
inline void transpose8x8_epi16(__m128i (&r)[8]) {
  __m128i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)  // rows 0-3 (h = 0) and 4-7
    for (int i = 0; i < 2; ++i) {
      u[4 * h + 2 * i] = _mm_unpacklo_epi32(t[4 * h + i], t[4 * h + i + 2]);
      u[4 * h + 2 * i + 1] = _mm_unpackhi_epi32(t[4 * h + i], t[4 * h + i + 2]);
    }
  for (int j = 0; j < 4; ++j) {
    r[2 * j] = _mm_unpacklo_epi64(u[j], u[j + 4]);
    r[2 * j + 1] = _mm_unpackhi_epi64(u[j], u[j + 4]);
  }
}

// One row against panels of n columns, panel after panel.
template <Half kHalf>
void row_panels(std::int64_t n, std::int64_t k, const float* a, const std::uint16_t* panels, float* c,
                SgemmOrder order) {
  for (std::int64_t p0 = 0; p0 < n; p0 += kPanelWidth) {
    const std::uint16_t* panel = panels + p0 * k;
    switch (std::min(kPanelWidth, n - p0) / 16) {
      case 4:
        panel_row<4, kHalf>(k, a, panel, c + p0, order);
        break;
      case 3:
        panel_row<3, kHalf>(k, a, panel, c + p0, order);
        break;
      case 2:
        panel_row<2, kHalf>(k, a, panel, c + p0, order);
        break;
      default:
        panel_row<1, kHalf>(k, a, panel, c + p0, order);
        break;
    }
  }
}

}  // namespace

void write_panels_avx2(const std::uint16_t* w, std::int64_t ldw, std::int64_t n, std::int64_t k,
                       std::uint16_t* out, bool fp16) {
  for (std::int64_t p0 = 0; p0 < n; p0 += kPanelWidth) {
    const std::int64_t wd = std::min(kPanelWidth, n - p0);
    std::uint16_t* panel = out + p0 * k;
    for (std::int64_t g = 0; g < wd; g += 16) {
      const std::uint16_t* cols = w + (p0 + g) * ldw;
      std::int64_t kk = 0;
      for (; kk + 8 <= k; kk += 8) {
        __m128i lo[8], hi[8];  // columns 0-7 and 8-15 of the group, k .. k + 7 each
        for (int i = 0; i < 8; ++i) {
          lo[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cols + i * ldw + kk));
          hi[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cols + (i + 8) * ldw + kk));
        }
        transpose8x8_epi16(lo);
        transpose8x8_epi16(hi);
        for (int j = 0; j < 8;
             ++j)  // bf16: columns 0-3, 8-11 | 4-7, 12-15; fp16: in order (products/rows.hpp)
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(panel + (kk + j) * wd + g),
              fp16 ? _mm256_set_m128i(hi[j], lo[j])
                   : _mm256_set_m128i(_mm_unpackhi_epi64(lo[j], hi[j]), _mm_unpacklo_epi64(lo[j], hi[j])));
      }
      for (; kk < k; ++kk)
        for (std::int64_t j = 0; j < 16; ++j)
          panel[panel_offset(g + j, kk, wd, k, fp16)] = cols[j * ldw + kk];
    }
  }
}

void gemm_row_avx2_panels(std::int64_t n, std::int64_t k, const float* a, const std::uint16_t* panels,
                          float* c, bool fp16, SgemmOrder order) {
  if (fp16)
    row_panels<Half::f16>(n, k, a, panels, c, order);
  else
    row_panels<Half::bf16>(n, k, a, panels, c, order);
}

void gemm_rows_avx2(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                    const float* b, std::int64_t ldb, float* c, std::int64_t ldc, SgemmOrder order) {
  rows_dispatch<float, Half::bf16>(m, n, k, a, lda, b, ldb, c, ldc, order,
                                   std::make_index_sequence<kRowsKernelMax>{});
}

void gemm_rows_avx2_bf16(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                         const std::uint16_t* b, std::int64_t ldb, float* c, std::int64_t ldc,
                         SgemmOrder order) {
  rows_dispatch<std::uint16_t, Half::bf16>(m, n, k, a, lda, b, ldb, c, ldc, order,
                                           std::make_index_sequence<kRowsKernelMax>{});
}

void gemm_rows_avx2_f16(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                        const std::uint16_t* b, std::int64_t ldb, float* c, std::int64_t ldc,
                        SgemmOrder order) {
  rows_dispatch<std::uint16_t, Half::f16>(m, n, k, a, lda, b, ldb, c, ldc, order,
                                          std::make_index_sequence<kRowsKernelMax>{});
}

}  // namespace kvcomp::detail
