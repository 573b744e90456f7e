// The AVX512-BF16 kernel for bf16 products of 1-8 rows, and of any number on decode panels
// (src/cpu/products/rows.hpp), against oneDNN's jit gemm:
// every row it computes must carry the bits the jit gemm gives the same row inside a long call (a
// 256-row tile of a prefill), for every K, column count and row position, on one thread as gemm_bf16
// calls it. On AMX machines oneDNN is capped at its AVX512-BF16 kernels for the whole process: its jit
// gemm then sums as on a CPU with AVX512-BF16 alone (Intel's without AMX, AMD's), where kvcomp runs the
// kernel. Uncapped, that gemm multiplies on AMX tiles, in another order, and kvcomp never pairs the two
// (ProductConfig::bf16_rows_kernel is false where oneDNN's kernel is AMX's). Without AVX512-BF16, or where
// oneDNN runs another kernel for these shapes, it reports itself skipped.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/isa.hpp"
#include "cpu/products/rows.hpp"
#include "kvcomp/half.hpp"

namespace kvcomp::detail {
namespace {

using i64 = std::int64_t;

// Before oneDNN's first call: its AVX512-BF16 kernels, not AMX's (a no-op on CPUs without AMX).
const bool kCapped = [] { return dnnl_set_max_cpu_isa(dnnl_cpu_isa_avx512_core_bf16) == dnnl_success; }();

std::vector<std::pair<i64, i64>> blocks_of(i64 k) {
  const Bf16KBlocks b = jit_bf16_k_blocks(k);
  std::vector<std::pair<i64, i64>> v;
  for (int i = 0; i < b.count; ++i) v.emplace_back(b.begin(i), b.end(i));
  return v;
}

TEST(GemmRowsBf16, KBlocksOfOneDnnJitGemm) {
  using V = std::vector<std::pair<i64, i64>>;
  EXPECT_EQ(blocks_of(1), (V{{0, 1}}));
  EXPECT_EQ(blocks_of(384), (V{{0, 384}}));
  EXPECT_EQ(blocks_of(385), (V{{0, 193}, {193, 385}}));
  EXPECT_EQ(blocks_of(1003), (V{{0, 502}, {502, 1003}}));
  EXPECT_EQ(blocks_of(1536), (V{{0, 768}, {768, 1536}}));
  EXPECT_EQ(blocks_of(1537), (V{{0, 768}, {768, 1536}, {1536, 1537}}));
  const V k4096 = blocks_of(4096);
  ASSERT_EQ(k4096.size(), 6u);
  EXPECT_EQ(k4096.back(), (std::pair<i64, i64>{3840, 4096}));
}

// C[rows, n] (row stride ldc) = A . B^T by oneDNN's matmul on one thread, B stored [n, k] with ldb: the
// product as gemm_bf16 runs one tile of it. Its implementation's name goes to `impl`, "none" where
// oneDNN makes no bf16 matmul (its ISA capped below AVX-512 by DNNL_MAX_CPU_ISA).
void onednn_rows(i64 rows, i64 n, i64 k, const std::uint16_t* a, i64 lda, const std::uint16_t* b, i64 ldb,
                 float* c, i64 ldc, std::string& impl) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  const dnnl::memory::desc ad({rows, k}, dt::bf16, dims{lda, 1}), bd({k, n}, dt::bf16, dims{1, ldb}),
      cd({rows, n}, dt::f32, dims{ldc, 1});
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(eng, ad, bd, cd);
  } catch (const dnnl::error&) {
    impl = "none";
    return;
  }
  impl = pd.impl_info_str();
  dnnl::stream st(eng);
  dnnl::memory am(ad, eng, const_cast<std::uint16_t*>(a)), bm(bd, eng, const_cast<std::uint16_t*>(b)),
      cm(cd, eng, c);
  dnnl::matmul(pd).execute(st, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  st.wait();
}

// Rows [r0, r0 + m) of a 256-row call against the kernel on the same rows: 1-8 rows on B where it lies,
// and (prepared weights' panels serve calls of any height) 9 to 256 rows on B's panels, whose tiles of
// rows and groups change nothing per element.
TEST(GemmRowsBf16, EveryRowEqualsItsRowInALongCall) {
  if (!cpu_has_avx512_bf16()) GTEST_SKIP() << "the CPU lacks AVX512-BF16";
  ASSERT_TRUE(kCapped) << "oneDNN refused its ISA cap: its jit gemm may run on AMX";
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  constexpr i64 long_rows = 256;
  int tested = 0;
  for (const i64 k :
       {1, 2, 3, 31, 32, 33, 96, 255, 384, 385, 386, 513, 769, 1003, 1536, 1537, 2000, 4096, 4099, 7168}) {
    for (const i64 n : {16, 48, 80, 256}) {                       // 80: four groups and one
      const i64 lda = k + 3, ldb = k + (k % 5), ldc = 2 * n + 8;  // C strided, as the projections'
      std::vector<std::uint16_t> a(long_rows * lda), b(n * ldb);
      // Each row of A its own scale, so that sums cancel at different magnitudes.
      for (i64 i = 0; i < long_rows; ++i)
        for (i64 j = 0; j < k; ++j)
          a[i * lda + j] = float_to_bf16(normal(rng) * static_cast<float>(1 + i % 7));
      for (auto& v : b) v = float_to_bf16(normal(rng));
      std::vector<float> ref(long_rows * ldc), out(kRowsKernelMax * ldc);
      std::string impl;
      onednn_rows(long_rows, n, k, a.data(), lda, b.data(), ldb, ref.data(), ldc, impl);
      if (impl != "gemm:jit") continue;  // another kernel for this shape: not the order the kernel has
      ++tested;
      for (i64 m = 1; m <= kRowsKernelMax; ++m)
        for (const i64 r0 : {i64{0}, i64{5}, i64{100}, long_rows - m}) {
          gemm_rows_avx512_bf16(m, n, k, a.data() + r0 * lda, lda, b.data(), ldb, out.data(), ldc);
          for (i64 i = 0; i < m; ++i)
            ASSERT_EQ(std::memcmp(out.data() + i * ldc, ref.data() + (r0 + i) * ldc, n * sizeof(float)), 0)
                << "K " << k << ", " << n << " columns, rows " << r0 << ".." << r0 + m - 1 << ": row "
                << r0 + i;
        }
      std::vector<std::uint16_t> panels(n / 16 * 32 * bf16_panel_pairs(k));
      write_panels_avx512_bf16(b.data(), ldb, n, k, panels.data());
      std::vector<float> got((long_rows + 1) * ldc);  // a row past the call's
      for (const auto& [r0, m] : {std::pair<i64, i64>{0, 9}, {3, 13}, {0, 64}, {100, 71}, {0, long_rows}}) {
        std::fill(got.begin(), got.end(), -1.0f);
        gemm_rows_avx512_bf16_panels(m, n, k, a.data() + r0 * lda, lda, panels.data(), got.data(), ldc);
        for (i64 i = 0; i < m; ++i)
          ASSERT_EQ(std::memcmp(got.data() + i * ldc, ref.data() + (r0 + i) * ldc, n * sizeof(float)), 0)
              << "panels, K " << k << ", " << n << " columns, rows " << r0 << ".." << r0 + m - 1 << ": row "
              << r0 + i;
        EXPECT_EQ(got[static_cast<std::size_t>(m * ldc)], -1.0f) << "wrote past its rows";
      }
    }
  }
  if (tested == 0) GTEST_SKIP() << "oneDNN does not run its jit gemm for these shapes here";
  RecordProperty("shapes_tested", tested);
}

// The decode panels give the kernel's bits: 1-8 rows, K across the block rules, 16 to 256 columns, a
// column range that starts at a later group (as gemm_bf16_rows_kernel's tiles read them).
TEST(GemmRowsBf16, PanelsGiveTheBitsOfTheRows) {
  if (!cpu_has_avx512_bf16()) GTEST_SKIP() << "the CPU lacks AVX512-BF16";
  std::mt19937 rng(12);
  std::normal_distribution<float> normal;
  // 1, 3, 4, 7 and 16 groups of 16 columns (and one less from the second group on): the kernel's passes of
  // 4, 2 and 1 groups side by side.
  for (const i64 k : {1, 2, 31, 32, 33, 385, 1003, 1537, 4099})
    for (const i64 n : {16, 48, 64, 112, 256}) {
      const i64 lda = k + 1, ldc = n + 8;
      std::vector<std::uint16_t> a(kRowsKernelMax * lda), b(n * k);
      for (auto& v : a) v = float_to_bf16(normal(rng));
      for (auto& v : b) v = float_to_bf16(normal(rng));
      const i64 group = 32 * bf16_panel_pairs(k);  // bf16 values of one 16-column group
      std::vector<std::uint16_t> panels(n / 16 * group);
      write_panels_avx512_bf16(b.data(), k, n, k, panels.data());
      std::vector<float> want(kRowsKernelMax * ldc), got(want.size());
      for (i64 m = 1; m <= kRowsKernelMax; ++m) {
        gemm_rows_avx512_bf16(m, n, k, a.data(), lda, b.data(), k, want.data(), ldc);
        gemm_rows_avx512_bf16_panels(m, n, k, a.data(), lda, panels.data(), got.data(), ldc);
        for (i64 i = 0; i < m; ++i)
          ASSERT_EQ(std::memcmp(got.data() + i * ldc, want.data() + i * ldc, n * sizeof(float)), 0)
              << "K " << k << ", " << n << " columns, " << m << " rows: row " << i;
        if (n > 16) {  // columns [16, n) from the second group on
          gemm_rows_avx512_bf16_panels(m, n - 16, k, a.data(), lda, panels.data() + group, got.data(), ldc);
          for (i64 i = 0; i < m; ++i)
            ASSERT_EQ(std::memcmp(got.data() + i * ldc, want.data() + i * ldc + 16, (n - 16) * sizeof(float)),
                      0)
                << "K " << k << ", columns 16.." << n << ", " << m << " rows: row " << i;
        }
      }
    }
}

// The panels of a matrix hold what the layout says: pair p of group g's block at (g, p).
TEST(GemmRowsBf16, PanelLayout) {
  if (!cpu_has_avx512_bf16()) GTEST_SKIP() << "the CPU lacks AVX512-BF16";
  const i64 n = 32, k = 385;  // two blocks: [0, 193) and [193, 385), 97 + 96 pairs
  std::vector<std::uint16_t> b(n * k);
  for (i64 i = 0; i < n * k; ++i) b[i] = static_cast<std::uint16_t>(i % 65521 + 1);
  ASSERT_EQ(bf16_panel_pairs(k), 97 + 96);
  std::vector<std::uint16_t> panels(n / 16 * 32 * bf16_panel_pairs(k));
  write_panels_avx512_bf16(b.data(), k, n, k, panels.data());
  const auto at = [&](i64 g, i64 pair, i64 lane, i64 half) {
    return panels[(g * bf16_panel_pairs(k) + pair) * 32 + 2 * lane + half];
  };
  EXPECT_EQ(at(0, 0, 0, 0), b[0]);
  EXPECT_EQ(at(0, 0, 0, 1), b[1]);
  EXPECT_EQ(at(1, 3, 5, 1), b[(16 + 5) * k + 7]);
  EXPECT_EQ(at(0, 96, 2, 0), b[2 * k + 192]);  // the first block's last pair: one value
  EXPECT_EQ(at(0, 96, 2, 1), 0);
  EXPECT_EQ(at(1, 97, 4, 0), b[(16 + 4) * k + 193]);  // the second block's pairs start at 193
  EXPECT_EQ(at(1, 97, 4, 1), b[(16 + 4) * k + 194]);
}

// The kernel writes C's n columns of its m rows and nothing else.
TEST(GemmRowsBf16, WritesOnlyItsCells) {
  if (!cpu_has_avx512_bf16()) GTEST_SKIP() << "the CPU lacks AVX512-BF16";
  const i64 m = 3, n = 32, k = 100, ldc = 40;
  std::vector<std::uint16_t> a(m * k, float_to_bf16(1.0f)), b(n * k, float_to_bf16(0.5f));
  std::vector<float> c(m * ldc + 8, -7.0f);
  gemm_rows_avx512_bf16(m, n, k, a.data(), k, b.data(), k, c.data(), ldc);
  for (i64 i = 0; i < static_cast<i64>(c.size()); ++i)
    EXPECT_EQ(c[i], i < m * ldc && i % ldc < n ? 50.0f : -7.0f) << "float " << i;
}

}  // namespace
}  // namespace kvcomp::detail
