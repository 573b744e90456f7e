// Built with -mamx-tile -mamx-bf16 -mavx512f (src/CMakeLists.txt); run only where amx_tiles_usable().
#include "cpu/products/amx.hpp"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/numerics.hpp"
#include "cpu/isa.hpp"

namespace kvcomp::detail {

namespace {

constexpr std::int64_t kStepK = 32;        // bf16 values of K per tile step (16 pairs)
constexpr std::int64_t kGroupCols = 16;    // columns of one B tile
constexpr std::int64_t kStepBytes = 1024;  // one packed B tile: 16 pair-rows x 16 columns x 4 bytes
// Column groups a row block runs before the next: as many as keep B's panel (every K step of them)
// near 1 MiB, so that it stays in L2 for the next row block, 8 to 32 (K 4096: 8, K 1024: 32).
constexpr std::int64_t kPanelBytes = std::int64_t{1} << 20;
constexpr std::int64_t kMinPanelGroups = 8, kMaxPanelGroups = 32;
constexpr std::int64_t kChunkSteps = 8;  // K steps of A copied at a time (256 K: 16 KiB for 32 rows)

std::int64_t steps_of(std::int64_t K) { return (K + kStepK - 1) / kStepK; }

// The tile configuration (palette 1) as LDTILECFG reads it.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// LDTILECFG of tiles 0-7 with these rows each (64 bytes wide; 0 rows: unused).
void load_tile_rows(const int (&rows)[8]) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<std::uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] > 0 ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// Tiles: 0-3 the C tiles (A0 or A1 times B0 or B1: 0 = A0.B0, 1 = A0.B1, 2 = A1.B0, 3 = A1.B1),
// 4-5 A0 and A1 (r0 and r1 rows of 32 bf16), 6-7 B0 and B1 (16 pair-rows of 16 columns).
void load_config(int r0, int r1) { load_tile_rows({r0, r0, r1, r1, r0, r1, 16, 16}); }

// Steps [k0, k0 + n) of rows [0, rows) of A (row stride lda) copied into `chunk`, step by step, each
// step `step_rows` rows of 32 bf16 (64 bytes), the last step zero-padded past K (reading A past K
// could meet inf or NaN, which times B's zero padding is NaN).
void copy_a_steps(const std::uint16_t* a, std::int64_t lda, std::int64_t rows, std::int64_t K,
                  std::int64_t k0, std::int64_t n, std::int64_t step_rows, std::uint16_t* chunk) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t k = (k0 + i) * kStepK, len = std::min(kStepK, K - k);
    std::uint16_t* dst = chunk + i * step_rows * kStepK;
    const std::uint16_t* src = a + k;
    if (len == kStepK) {  // one 64-byte load and store per row
      for (std::int64_t r = 0; r < rows; ++r)
        _mm512_store_si512(dst + r * kStepK, _mm512_loadu_si512(src + r * lda));
    } else {  // the last step: its first len values, zeros after
      const auto keep = static_cast<__mmask32>((std::uint64_t{1} << len) - 1);
      for (std::int64_t r = 0; r < rows; ++r)
        _mm512_store_si512(dst + r * kStepK, _mm512_maskz_loadu_epi16(keep, src + r * lda));
    }
  }
}

// TILESTORED of C tile t (0-3): the tile number is part of the instruction.
void store_c_tile(int t, void* at, std::int64_t stride) {
  switch (t) {
    case 0:
      _tile_stored(0, at, stride);
      break;
    case 1:
      _tile_stored(1, at, stride);
      break;
    case 2:
      _tile_stored(2, at, stride);
      break;
    default:
      _tile_stored(3, at, stride);
      break;
  }
}

// Where C tile t (rows x cols of the 16 x 16 it holds) goes: `c` points at its first element.
void store_tile(int t, int rows, std::int64_t cols, void* c, std::int64_t ldc, AmxStore store) {
  if (store == AmxStore::set && cols == kGroupCols) {
    store_c_tile(t, c, ldc * static_cast<std::int64_t>(sizeof(float)));
    return;
  }
  alignas(64) float sums[16 * 16];
  store_c_tile(t, sums, 64);
  for (int r = 0; r < rows; ++r) {
    const float* s = sums + r * 16;
    if (store == AmxStore::bf16) {
      std::uint16_t* out = static_cast<std::uint16_t*>(c) + r * ldc;
      for (std::int64_t j = 0; j < cols; ++j) out[j] = f32_to_bf16(s[j]);
    } else {
      float* out = static_cast<float*>(c) + r * ldc;
      if (store == AmxStore::add)
        for (std::int64_t j = 0; j < cols; ++j) out[j] = out[j] + s[j];
      else
        for (std::int64_t j = 0; j < cols; ++j) out[j] = s[j];
    }
  }
}

// One K chunk of a block of up to 32 rows x 32 columns: its C tiles zeroed (the first chunk) or
// reloaded from `partial` (the fp32 sums of the chunks before: four tiles of 16 x 16, 64-byte rows;
// storing and reloading fp32 changes no bit), `n` steps from step k0 on (A from `chunk`, per step
// 32 rows of 32 bf16, A1's rows from the 17th on; B from the packed groups b0 / b1), and the sums
// saved to `partial` unless this is the last chunk (then they stay in the tiles for the store).
template <bool TwoRows, bool TwoCols>
void chunk_steps(const std::uint16_t* chunk, const char* b0, const char* b1, std::int64_t k0, std::int64_t n,
                 float* partial, bool first, bool last) {
  if (first) {
    _tile_zero(0);
    if constexpr (TwoCols) _tile_zero(1);
    if constexpr (TwoRows) _tile_zero(2);
    if constexpr (TwoRows && TwoCols) _tile_zero(3);
  } else {
    _tile_loadd(0, partial, 64);
    if constexpr (TwoCols) _tile_loadd(1, partial + 256, 64);
    if constexpr (TwoRows) _tile_loadd(2, partial + 512, 64);
    if constexpr (TwoRows && TwoCols) _tile_loadd(3, partial + 768, 64);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint16_t* x = chunk + i * 32 * kStepK;
    const std::int64_t at = (k0 + i) * kStepBytes;
    _tile_loadd(4, x, 64);
    _tile_loadd(6, b0 + at, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TwoCols) {
      _tile_loadd(7, b1 + at, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TwoRows) {
      _tile_loadd(5, x + 16 * kStepK, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (TwoCols) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (!last) {
    _tile_stored(0, partial, 64);
    if constexpr (TwoCols) _tile_stored(1, partial + 256, 64);
    if constexpr (TwoRows) _tile_stored(2, partial + 512, 64);
    if constexpr (TwoRows && TwoCols) _tile_stored(3, partial + 768, 64);
  }
}

// Tiles of a block of 33 to 64 rows x one group: 0-3 the C tiles of rows 0-15, 16-31, 32-47 and 48 on
// (r2 and r3 rows), 4 A's rows 0-15 and then 16-31, 5 its rows from 32 on, 7 from 48 on, 6 B.
void load_config_tall(int r2, int r3) { load_tile_rows({16, 16, r2, r3, 16, r2, 16, r3}); }

// chunk_steps for 33 to 64 rows and one group of 16 columns (each step's B tile read once for all
// the rows): A from `chunk` (per step 64 rows of 32 bf16), the sums between chunks in `partial`.
template <bool FourRows>
void chunk_steps_tall(const std::uint16_t* chunk, const char* b, std::int64_t k0, std::int64_t n,
                      float* partial, bool first, bool last) {
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    if constexpr (FourRows) _tile_zero(3);
  } else {
    _tile_loadd(0, partial, 64);
    _tile_loadd(1, partial + 256, 64);
    _tile_loadd(2, partial + 512, 64);
    if constexpr (FourRows) _tile_loadd(3, partial + 768, 64);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint16_t* x = chunk + i * 64 * kStepK;
    _tile_loadd(6, b + (k0 + i) * kStepBytes, 64);
    _tile_loadd(4, x, 64);
    _tile_loadd(5, x + 32 * kStepK, 64);
    if constexpr (FourRows) _tile_loadd(7, x + 48 * kStepK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (FourRows) _tile_dpbf16ps(3, 7, 6);
    _tile_loadd(4, x + 16 * kStepK, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  if (!last) {
    _tile_stored(0, partial, 64);
    _tile_stored(1, partial + 256, 64);
    _tile_stored(2, partial + 512, 64);
    if constexpr (FourRows) _tile_stored(3, partial + 768, 64);
  }
}

// amx_gemm_block for 33 to 64 rows and one A (decode calls of that many sequences): all the rows on
// each B tile, so that B, the bulk of such a call's bytes, is read once (the 32-row blocks read each
// panel of B twice, the second time from L2). Each element's chain of sums is the same.
__attribute__((noinline)) void gemm_block_tall(std::int64_t M, std::int64_t N, std::int64_t K,
                                               const std::uint16_t* a, std::int64_t lda, const char* bp,
                                               void* c, std::int64_t ldc, AmxStore store, std::int64_t g0,
                                               std::int64_t g1) {
  constexpr std::int64_t kPanel = 16;  // groups sharing one copy of A's chunk (their sums: 64 KiB)
  const std::int64_t steps = steps_of(K), chunks = (steps + kChunkSteps - 1) / kChunkSteps;
  const std::int64_t c_size = store == AmxStore::bf16 ? 2 : 4;
  const int r2 = static_cast<int>(std::min<std::int64_t>(16, M - 32));
  const int r3 = static_cast<int>(std::max<std::int64_t>(0, M - 48));
  alignas(64) std::uint16_t chunk[kChunkSteps * 64 * kStepK];
  alignas(64) float partial[kPanel][4 * 256];
  load_config_tall(r2, r3);
  for (std::int64_t p0 = g0; p0 < g1; p0 += kPanel) {
    const std::int64_t p1 = std::min(g1, p0 + kPanel);
    for (std::int64_t c0 = 0; c0 < chunks; ++c0) {
      const std::int64_t k0 = c0 * kChunkSteps, n = std::min(kChunkSteps, steps - k0);
      copy_a_steps(a, lda, M, K, k0, n, 64, chunk);
      const bool first = c0 == 0, last = c0 == chunks - 1;
      for (std::int64_t g = p0; g < p1; ++g) {
        float* part = partial[g - p0];
        const char* b = bp + g * steps * kStepBytes;
        if (r3 > 0)
          chunk_steps_tall<true>(chunk, b, k0, n, part, first, last);
        else
          chunk_steps_tall<false>(chunk, b, k0, n, part, first, last);
        if (!last) continue;
        const std::int64_t n0 = g * kGroupCols, cols = std::min(kGroupCols, N - n0);
        auto* cm = static_cast<unsigned char*>(c) + n0 * c_size;
        store_tile(0, 16, cols, cm, ldc, store);
        store_tile(1, 16, cols, cm + 16 * ldc * c_size, ldc, store);
        store_tile(2, r2, cols, cm + 32 * ldc * c_size, ldc, store);
        if (r3 > 0) store_tile(3, r3, cols, cm + 48 * ldc * c_size, ldc, store);
      }
    }
  }
  _tile_release();
}

}  // namespace

bool amx_tiles_usable() {
  static const bool ok = [] {
    if (!cpu_has_amx_bf16()) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, Linux >= 5.16
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

std::size_t amx_packed_bytes(std::int64_t N, std::int64_t K) {
  return static_cast<std::size_t>(amx_groups(N) * steps_of(K) * kStepBytes);
}

void amx_pack_b(std::int64_t N, std::int64_t K, const std::uint16_t* b, std::int64_t ldb, bool b_transposed,
                void* packed, std::int64_t g0, std::int64_t g1) {
  const std::int64_t steps = steps_of(K), pairs = steps * kStepK / 2;
  auto* out = static_cast<std::uint32_t*>(packed);
  if (!b_transposed) {
    // b[k * ldb + n]: each row's columns contiguous. Step by step (32 rows of K), every group of the
    // slice: the 32 rows are read along their length, 32 runs at a time (a walk down one group's 16
    // columns touched a new page per row: rows 8 KiB apart for H = 4096), and each group's step tile
    // (1 KiB) is written whole. A whole pair-row of a whole group: the two rows' 16 values
    // interleaved by one permute.
    // Word 2j of a pair-row from the first row's j, word 2j + 1 from the second's (index 32 + j).
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (std::int64_t st = 0; st < steps; ++st)
      for (std::int64_t g = g0; g < g1; ++g) {
        std::uint32_t* tile = out + (g * steps + st) * (kStepBytes / 4);  // [16 pairs][16 columns]
        const std::int64_t n0 = g * kGroupCols, cols = std::min(kGroupCols, N - n0);
        for (std::int64_t q = 0; q < kStepK / 2; ++q) {
          const std::int64_t k = st * kStepK + 2 * q;
          const std::uint16_t* r0 = k < K ? b + k * ldb + n0 : nullptr;
          const std::uint16_t* r1 = k + 1 < K ? b + (k + 1) * ldb + n0 : nullptr;
          std::uint32_t* dst = tile + q * kGroupCols;
          if (r1 && cols == kGroupCols) {
            const __m512i lo = _mm512_maskz_loadu_epi16(0xFFFF, r0);
            const __m512i hi = _mm512_maskz_loadu_epi16(0xFFFF, r1);
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(lo, interleave, hi));
          } else {
            for (std::int64_t j = 0; j < kGroupCols; ++j) {
              const std::uint32_t l = r0 && j < cols ? r0[j] : 0u, h = r1 && j < cols ? r1[j] : 0u;
              dst[j] = l | (h << 16);
            }
          }
        }
      }
    return;
  }
  for (std::int64_t g = g0; g < g1; ++g) {
    std::uint32_t* grp = out + g * steps * (kStepBytes / 4);  // [pairs][16] of this group
    const std::int64_t n0 = g * kGroupCols, cols = std::min(kGroupCols, N - n0);
    if (cols == kGroupCols && ldb <= (std::int64_t{1} << 26)) {
      // b[n * ldb + k], a whole group: each pair-row gathers one pair (4 bytes) from each of the 16
      // columns; a last odd k, and the padding, as below.
      const __m512i offsets =
          _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                             _mm512_set1_epi32(static_cast<int>(ldb * 2)));
      const std::uint16_t* base = b + n0 * ldb;
      const std::int64_t whole = K / 2;
      const __m512i zero = _mm512_setzero_si512();
      for (std::int64_t p = 0; p < whole; ++p)
        _mm512_storeu_si512(grp + p * kGroupCols,
                            _mm512_mask_i32gather_epi32(zero, 0xFFFF, offsets, base + 2 * p, 1));
      for (std::int64_t p = whole; p < pairs; ++p)
        for (std::int64_t j = 0; j < kGroupCols; ++j)
          grp[p * kGroupCols + j] = 2 * p < K ? base[j * ldb + 2 * p] : 0u;
    } else {  // b[n * ldb + k]: each column's K contiguous
      for (std::int64_t j = 0; j < kGroupCols; ++j) {
        const std::uint16_t* col = j < cols ? b + (n0 + j) * ldb : nullptr;
        for (std::int64_t p = 0; p < pairs; ++p) {
          const std::int64_t k = 2 * p;
          const std::uint32_t lo = col && k < K ? col[k] : 0u, hi = col && k + 1 < K ? col[k + 1] : 0u;
          grp[p * kGroupCols + j] = lo | (hi << 16);
        }
      }
    }
  }
}

namespace {

// amx_gemm_block in blocks of up to 32 rows x 2 groups (2 x 2 C tiles: one tile load per TDPBF16PS),
// panel by panel: a panel of B read for the first row block is in L2 for the others. Not inlined, nor
// is gemm_block_tall: one stack frame of buffers at a time.
__attribute__((noinline)) void gemm_block_pairs(std::int64_t M, std::int64_t N, std::int64_t K,
                                                const std::uint16_t* a, std::int64_t lda, const void* packed,
                                                void* c, std::int64_t ldc, AmxStore store, std::int64_t g0,
                                                std::int64_t g1, const std::uint16_t* a2) {
  const std::int64_t steps = steps_of(K), chunks = (steps + kChunkSteps - 1) / kChunkSteps;
  const std::int64_t parts = a2 ? 2 : 1;
  const std::int64_t c_size = store == AmxStore::bf16 ? 2 : 4;
  const char* bp = static_cast<const char*>(packed);
  // A K chunk of the row block's rows (copy_a_steps: 16 KiB, it stays in L1 across the panel's column
  // groups, where rows of A 8 KiB apart would all fall into one L1 set), and the fp32 sums of the
  // panel's blocks between chunks.
  alignas(64) std::uint16_t chunk[kChunkSteps * 32 * kStepK];
  alignas(64) float partial[kMaxPanelGroups / 2][4 * 256];
  const std::int64_t panel =
      std::clamp(kPanelBytes / (steps * kStepBytes) / 2 * 2, kMinPanelGroups, kMaxPanelGroups);
  int cfg_r0 = -1, cfg_r1 = -1;
  for (std::int64_t p0 = g0; p0 < g1; p0 += panel) {
    const std::int64_t p1 = std::min(g1, p0 + panel);
    for (std::int64_t m = 0; m < M; m += 32) {
      const int rows = static_cast<int>(std::min<std::int64_t>(32, M - m));
      const int r0 = std::min(rows, 16), r1 = rows - r0;
      if (r0 != cfg_r0 || r1 != cfg_r1) {
        load_config(r0, r1);
        cfg_r0 = r0;
        cfg_r1 = r1;
      }
      // The K chunks of A, then (a2) those of A2 on the same B, one chain of sums.
      for (std::int64_t c0 = 0; c0 < parts * chunks; ++c0) {
        const std::int64_t k0 = c0 % chunks * kChunkSteps;
        const std::uint16_t* a_part = c0 < chunks ? a : a2;
        const std::int64_t n = std::min(kChunkSteps, steps - k0);
        copy_a_steps(a_part + m * lda, lda, rows, K, k0, n, 32, chunk);
        const bool first = c0 == 0, last = c0 == parts * chunks - 1;
        for (std::int64_t g = p0; g < p1; g += 2) {
          const bool two_cols = g + 1 < p1;
          const char* b0 = bp + g * steps * kStepBytes;
          const char* b1 = b0 + steps * kStepBytes;
          float* part = partial[(g - p0) / 2];
          if (r1 > 0 && two_cols)
            chunk_steps<true, true>(chunk, b0, b1, k0, n, part, first, last);
          else if (r1 > 0)
            chunk_steps<true, false>(chunk, b0, b1, k0, n, part, first, last);
          else if (two_cols)
            chunk_steps<false, true>(chunk, b0, b1, k0, n, part, first, last);
          else
            chunk_steps<false, false>(chunk, b0, b1, k0, n, part, first, last);
          if (!last) continue;
          const std::int64_t n0 = g * kGroupCols;
          auto* cm = static_cast<unsigned char*>(c) + (m * ldc + n0) * c_size;
          auto* cm1 = cm + 16 * ldc * c_size;
          const std::int64_t cols0 = std::min(kGroupCols, N - n0);
          const std::int64_t cols1 = std::min(kGroupCols, N - n0 - kGroupCols);
          store_tile(0, r0, cols0, cm, ldc, store);
          if (two_cols) store_tile(1, r0, cols1, cm + 16 * c_size, ldc, store);
          if (r1 > 0) {
            store_tile(2, r1, cols0, cm1, ldc, store);
            if (two_cols) store_tile(3, r1, cols1, cm1 + 16 * c_size, ldc, store);
          }
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

void amx_gemm_block(std::int64_t M, std::int64_t N, std::int64_t K, const std::uint16_t* a, std::int64_t lda,
                    const void* packed, void* c, std::int64_t ldc, AmxStore store, std::int64_t g0,
                    std::int64_t g1, const std::uint16_t* a2) {
  if (M <= 0 || g0 >= g1) return;
  // 33 to 64 rows and one A: a decode call of that many sequences, bound by reading B, which the 32-row
  // blocks read twice (the second time from L2). Not for more rows: blocks of 64 rows load 1.25 tiles
  // per TDPBF16PS instead of one, and the training forward's 256-row products ran slower in them
  // (C4A 0.88-0.90 -> 0.93-0.99x its product alone; docs/performance.md).
  if (!a2 && M > 32 && M <= 64)
    return gemm_block_tall(M, N, K, a, lda, static_cast<const char*>(packed), c, ldc, store, g0, g1);
  gemm_block_pairs(M, N, K, a, lda, packed, c, ldc, store, g0, g1, a2);
}

}  // namespace kvcomp::detail
