// The AVX2 kernel for products of 1-8 rows (src/cpu/products/rows.hpp) against oneDNN's sgemm: every row
// it computes must carry the bits sgemm gives the same row inside a long call (a 192-row tile, the
// rows of a prefill), for every K, column count and row position, in the K blocks of the sgemm that
// runs (AVX2 or AVX-512). ctest runs this twice on one thread (as gemm_f32 calls sgemm):
// KVCOMP_TEST_SGEMM=avx2 with oneDNN capped at AVX2 (so AVX-512 machines test that order too), and
// KVCOMP_TEST_SGEMM=avx512 uncapped, which reports itself skipped where oneDNN has no AVX-512 kernels;
// without AVX2 both are skipped.
#include <gtest/gtest.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
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

// KVCOMP_TEST_SGEMM=avx2 caps oneDNN at its AVX2 kernels, before its first call; sgemm runs on one
// thread, as gemm_f32 calls it.
const bool kSetUp = [] {
  const char* want = std::getenv("KVCOMP_TEST_SGEMM");
  if (want != nullptr && std::string(want) == "avx2") dnnl_set_max_cpu_isa(dnnl_cpu_isa_avx2);
  omp_set_num_threads(1);
  return true;
}();

// The orders (products/rows.hpp) the sgemm oneDNN runs here may take: the AVX2 one on its AVX2 kernels,
// the two AVX-512 ones on its AVX-512 kernels (which one a shape takes is not known in advance: the
// library probes it, as the tests below do), none on neither.
std::vector<SgemmOrder> candidate_orders() {
  const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const unsigned avx2 = static_cast<unsigned>(dnnl_cpu_isa_avx2);
  const unsigned avx512 = static_cast<unsigned>(dnnl_cpu_isa_avx512_core);
  if ((isa & avx512) == avx512) return {kSgemmAvx512Halves, kSgemmAvx512Fixed};
  if ((isa & avx2) == avx2) return {kSgemmAvx2};
  return {};
}

// Skips without AVX2 + FMA, or where oneDNN does not run the sgemm this run asks for (KVCOMP_TEST_SGEMM:
// avx2 or avx512; unset: either).
std::string sgemm_missing() {
  if (detected_isa() < Isa::avx2) return "the CPU lacks AVX2 + FMA";
  const char* want = std::getenv("KVCOMP_TEST_SGEMM");
  const std::vector<SgemmOrder> orders = candidate_orders();
  if (orders.empty()) return "oneDNN runs neither its AVX2 nor its AVX-512 sgemm";
  if (want != nullptr && std::string(want) == "avx2" && orders.size() != 1)
    return "oneDNN is not on its AVX2 kernels";
  if (want != nullptr && std::string(want) == "avx512" && orders.size() != 2)
    return "oneDNN has no AVX-512 kernels on this CPU";
  return "";
}
#define SKIP_WITHOUT_SGEMM()                                                        \
  do {                                                                              \
    if (const std::string why = sgemm_missing(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// The first candidate order for which `same(order)` holds (the kernel then gives sgemm's bits on one
// probe), or nothing. The callers then assert every row of the shape in that order. Shapes with no
// order are counted: on AVX-512 the library keeps sgemm's padding for them, so they are no error, but a
// run in which no shape has an order fails.
template <class F>
std::optional<SgemmOrder> order_of(F&& same) {
  for (const SgemmOrder order : candidate_orders())
    if (same(order)) return order;
  return std::nullopt;
}

// Shapes with and without an order, per test: on AVX2 every shape must have the one order.
struct OrderCount {
  int matched = 0, unmatched = 0;
  // The shape's order: the first candidate under which run(order) writes the long call's first row
  // (`ref`, n values) into `out`; counted.
  template <class Run>
  std::optional<SgemmOrder> find(Run&& run, const float* out, const float* ref, i64 n) {
    const std::optional<SgemmOrder> order = order_of([&](SgemmOrder o) {
      run(o);
      return std::memcmp(out, ref, n * sizeof(float)) == 0;
    });
    ++(order ? matched : unmatched);
    return order;
  }
  void check() const {
    EXPECT_GT(matched, 0) << "no shape has a known order";
    if (candidate_orders().size() == 1) {
      EXPECT_EQ(unmatched, 0) << "shapes without the AVX2 order";
    }
    ::testing::Test::RecordProperty("shapes_without_order", unmatched);
  }
};

std::vector<std::pair<i64, i64>> blocks_of(i64 k, SgemmOrder order = kSgemmAvx2) {
  const KBlocks b = sgemm_k_blocks(k, order);
  std::vector<std::pair<i64, i64>> v;
  for (int i = 0; i < b.count; ++i) v.emplace_back(b.begin(i), b.end(i));
  return v;
}

TEST(GemmRows, KBlocksOfOneDnnAvx2Sgemm) {
  using V = std::vector<std::pair<i64, i64>>;
  EXPECT_EQ(blocks_of(1), (V{{0, 1}}));
  EXPECT_EQ(blocks_of(256), (V{{0, 256}}));
  EXPECT_EQ(blocks_of(257), (V{{0, 129}, {129, 257}}));
  EXPECT_EQ(blocks_of(511), (V{{0, 256}, {256, 511}}));
  EXPECT_EQ(blocks_of(512), (V{{0, 256}, {256, 512}}));
  EXPECT_EQ(blocks_of(513), (V{{0, 256}, {256, 385}, {385, 513}}));
  EXPECT_EQ(blocks_of(1000), (V{{0, 256}, {256, 512}, {512, 756}, {756, 1000}}));
  const V k4096 = blocks_of(4096);
  ASSERT_EQ(k4096.size(), 16u);
  for (i64 i = 0; i < 16; ++i)
    EXPECT_EQ(k4096[static_cast<std::size_t>(i)], (std::pair<i64, i64>{256 * i, 256 * i + 256}));
}

TEST(GemmRows, KBlocksOfOneDnnAvx512Sgemm) {
  using V = std::vector<std::pair<i64, i64>>;
  const auto blocks = [](i64 k) { return blocks_of(k, kSgemmAvx512Halves); };
  EXPECT_EQ(blocks(384), (V{{0, 384}}));
  EXPECT_EQ(blocks(385), (V{{0, 193}, {193, 385}}));
  EXPECT_EQ(blocks(768), (V{{0, 384}, {384, 768}}));
  EXPECT_EQ(blocks(769), (V{{0, 384}, {384, 577}, {577, 769}}));
  EXPECT_EQ(blocks(1000), (V{{0, 384}, {384, 692}, {692, 1000}}));
  const V k4096 = blocks(4096);  // 9 x 384 = 3456, then 640 in two halves
  ASSERT_EQ(k4096.size(), 11u);
  EXPECT_EQ(k4096[8], (std::pair<i64, i64>{3072, 3456}));
  EXPECT_EQ(k4096[9], (std::pair<i64, i64>{3456, 3776}));
  EXPECT_EQ(k4096[10], (std::pair<i64, i64>{3776, 4096}));
  const auto fixed = [](i64 k) { return blocks_of(k, kSgemmAvx512Fixed); };
  EXPECT_EQ(fixed(384), (V{{0, 384}}));
  EXPECT_EQ(fixed(769), (V{{0, 384}, {384, 768}, {768, 769}}));
  const V f4096 = fixed(4096);
  ASSERT_EQ(f4096.size(), 11u);
  EXPECT_EQ(f4096[10], (std::pair<i64, i64>{3840, 4096}));
}

// Rows [r0, r0 + m) of a 192-row sgemm call against the kernel on the same rows.
TEST(GemmRows, EveryRowEqualsItsRowInALongSgemmCall) {
  SKIP_WITHOUT_SGEMM();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  constexpr i64 long_rows = 192;
  OrderCount count;
  for (const i64 k :
       {1,   2,   3,   4,   7,   16,   17,   96,   255,  256,  257,  300,  384,  385,  511,  512,
        513, 600, 768, 769, 777, 1000, 1003, 1024, 1025, 1152, 1153, 1536, 2000, 4096, 4099, 7168}) {
    for (const i64 n : {16, 48, 256}) {
      const i64 lda = k + 3, ldb = k + 16 + (k % 5), ldc = n + 8;
      std::vector<float> a(long_rows * lda), b(n * ldb), ref(long_rows * ldc), out(kRowsKernelMax * ldc);
      // Each row its own scale, so that sums cancel at different magnitudes.
      for (i64 i = 0; i < long_rows; ++i)
        for (i64 j = 0; j < k; ++j) a[i * lda + j] = normal(rng) * static_cast<float>(1 + i % 7);
      for (float& v : b) v = normal(rng);
      ASSERT_EQ(
          dnnl_sgemm('N', 'T', long_rows, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, ref.data(), ldc),
          dnnl_success);
      const std::optional<SgemmOrder> order = count.find(
          [&](SgemmOrder o) { gemm_rows_avx2(1, n, k, a.data(), lda, b.data(), ldb, out.data(), ldc, o); },
          out.data(), ref.data(), n);
      if (!order) continue;
      for (i64 m = 1; m <= kRowsKernelMax; ++m)
        for (const i64 r0 : {i64{0}, i64{5}, i64{100}, long_rows - m}) {
          gemm_rows_avx2(m, n, k, a.data() + r0 * lda, lda, b.data(), ldb, out.data(), ldc, *order);
          for (i64 i = 0; i < m; ++i)
            ASSERT_EQ(std::memcmp(out.data() + i * ldc, ref.data() + (r0 + i) * ldc, n * sizeof(float)), 0)
                << "K " << k << ", " << n << " columns, rows " << r0 << ".." << r0 + m - 1 << ": row "
                << r0 + i;
        }
    }
  }
  count.check();
}

// Random operands of the 16-bit tests: the rows of A (k values each, row stride lda) normal, row i scaled
// by 1 + i % scales, so that sums cancel at different magnitudes; B normal, rounded to bf16 (or to fp16,
// every 7th value scaled by 2^-18 so that fp16's subnormals occur) into b16 and widened back (b).
void fill_operands(std::mt19937& rng, i64 k, i64 lda, int scales, std::vector<float>& a,
                   std::vector<std::uint16_t>& b16, std::vector<float>& b, bool fp16 = false) {
  std::normal_distribution<float> normal;
  for (std::size_t i = 0; i < a.size() / static_cast<std::size_t>(lda); ++i)
    for (i64 j = 0; j < k; ++j) a[i * lda + j] = normal(rng) * static_cast<float>(1 + i % scales);
  for (std::size_t i = 0; i < b16.size(); ++i) {
    if (fp16) {
      b16[i] = float_to_fp16(normal(rng) * (i % 7 == 0 ? 0x1p-18f : 1.0f));
      b[i] = fp16_to_float(b16[i]);
    } else {
      b16[i] = float_to_bf16(normal(rng));
      b[i] = bf16_to_float(b16[i]);
    }
  }
}

// A 16-bit variant (weights read where they lie, widened as read): against the same long sgemm call on
// the widened weights, including rows of exactly K values (a caller's tensor).
void check_16bit_weights(bool fp16) {
  std::mt19937 rng(fp16 ? 10 : 9);
  constexpr i64 long_rows = 192;
  OrderCount count;
  const auto kernel = fp16 ? gemm_rows_avx2_f16 : gemm_rows_avx2_bf16;
  for (const i64 k : {1, 5, 8, 9, 255, 257, 300, 385, 513, 769, 1003, 4096, 4103}) {
    for (const i64 n : {16, 48, 256}) {
      for (const i64 ldb : {k, k + 13}) {
        const i64 lda = k + 3, ldc = n + 8;
        std::vector<float> a(long_rows * lda), b(n * ldb), ref(long_rows * ldc), out(kRowsKernelMax * ldc);
        std::vector<std::uint16_t> b16(n * ldb);
        fill_operands(rng, k, lda, 5, a, b16, b, fp16);
        ASSERT_EQ(
            dnnl_sgemm('N', 'T', long_rows, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, ref.data(), ldc),
            dnnl_success);
        const std::optional<SgemmOrder> order = count.find(
            [&](SgemmOrder o) { kernel(1, n, k, a.data(), lda, b16.data(), ldb, out.data(), ldc, o); },
            out.data(), ref.data(), n);
        if (!order) continue;
        for (i64 m = 1; m <= kRowsKernelMax; ++m)
          for (const i64 r0 : {i64{0}, i64{7}, long_rows - m}) {
            kernel(m, n, k, a.data() + r0 * lda, lda, b16.data(), ldb, out.data(), ldc, *order);
            for (i64 i = 0; i < m; ++i)
              ASSERT_EQ(std::memcmp(out.data() + i * ldc, ref.data() + (r0 + i) * ldc, n * sizeof(float)), 0)
                  << "K " << k << ", " << n << " columns, ldb " << ldb << ", rows " << r0 << ".."
                  << r0 + m - 1 << ": row " << r0 + i;
          }
      }
    }
  }
  count.check();
}

TEST(GemmRows, Bf16WeightsGiveTheBitsOfTheWidenedOnes) {
  SKIP_WITHOUT_SGEMM();
  check_16bit_weights(false);
}

TEST(GemmRows, Fp16WeightsGiveTheBitsOfTheWidenedOnes) {
  SKIP_WITHOUT_SGEMM();
  if (!cpu_has_f16c()) GTEST_SKIP() << "the CPU lacks F16C";
  check_16bit_weights(true);
}

// Decode panels, laid out here from their description in products/rows.hpp (not by the library's writer):
// panels of 64 columns (the last one narrower), K-major, each 16 columns in the order 0-3, 8-11, 4-7,
// 12-15. One row against the same long sgemm call on the widened weights, at three row positions, for
// every panel width (16, 48, 64, 64 + 16, 3 x 64 + 16, 4 x 64) and K of each sgemm_k_blocks branch;
// the columns past n keep their bytes.
std::vector<std::uint16_t> panels_of(const std::vector<std::uint16_t>& b16, i64 n, i64 k, i64 ldb,
                                     bool fp16 = false) {
  static constexpr int kPos[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  std::vector<std::uint16_t> out(static_cast<std::size_t>(n * k));
  for (i64 p0 = 0; p0 < n; p0 += 64) {
    const i64 w = std::min<i64>(64, n - p0);
    for (i64 kk = 0; kk < k; ++kk)
      for (i64 j = 0; j < w; ++j)
        out[p0 * k + kk * w + j / 16 * 16 + (fp16 ? j % 16 : kPos[j % 16])] = b16[(p0 + j) * ldb + kk];
  }
  return out;
}

// fp16 panels: the same panels, each 16 columns in order.
void check_panels(bool fp16) {
  std::mt19937 rng(fp16 ? 14 : 13);
  constexpr i64 long_rows = 192;
  OrderCount count;
  for (const i64 k : {1, 4, 255, 256, 257, 385, 511, 513, 769, 1003, 4096, 4103}) {
    for (const i64 n : {16, 48, 64, 80, 208, 256}) {
      const i64 lda = k + 3, ldb = k + 5, ldc = n + 8;
      std::vector<float> a(long_rows * lda), b(n * ldb), ref(long_rows * ldc), out(ldc, -7.0f);
      std::vector<std::uint16_t> b16(n * ldb);
      fill_operands(rng, k, lda, 3, a, b16, b, fp16);
      const std::vector<std::uint16_t> panels = panels_of(b16, n, k, ldb, fp16);
      ASSERT_EQ(
          dnnl_sgemm('N', 'T', long_rows, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, ref.data(), ldc),
          dnnl_success);
      // The shape's order from the rows kernel on the widened weights; the panels must then agree.
      std::vector<float> row(ldc);
      const std::optional<SgemmOrder> order = count.find(
          [&](SgemmOrder o) { gemm_rows_avx2(1, n, k, a.data(), lda, b.data(), ldb, row.data(), ldc, o); },
          row.data(), ref.data(), n);
      if (!order) continue;
      for (const i64 r0 : {i64{0}, i64{37}, long_rows - 1}) {
        gemm_row_avx2_panels(n, k, a.data() + r0 * lda, panels.data(), out.data(), fp16, *order);
        ASSERT_EQ(std::memcmp(out.data(), ref.data() + r0 * ldc, n * sizeof(float)), 0)
            << "K " << k << ", " << n << " columns, row " << r0;
        for (i64 j = n; j < ldc; ++j) ASSERT_EQ(out[j], -7.0f) << "column " << j << " written";
      }
      // The library's description of the layout agrees with this one.
      for (i64 col = 0; col < n; col += 7)
        for (i64 kk = 0; kk < k; kk += 97)
          EXPECT_EQ(panels[panel_offset(col, kk, n, k, fp16)], b16[col * ldb + kk]);
    }
  }
  count.check();
}

TEST(GemmRows, DecodePanelsGiveTheBitsOfTheWidenedRows) {
  SKIP_WITHOUT_SGEMM();
  check_panels(false);
}

TEST(GemmRows, Fp16DecodePanelsGiveTheBitsOfTheWidenedRows) {
  SKIP_WITHOUT_SGEMM();
  if (!cpu_has_f16c()) GTEST_SKIP() << "the CPU lacks F16C";
  check_panels(true);
}

// The AVX-512 kernel on the same panels, any number of rows, gives each row the bits of the AVX2 rows
// kernel on the widened weights (checked against sgemm above), in each order it may be given: panel
// widths of one to four groups (one or two at a time, bf16's lane shuffles), K across the blocks of both
// orders, rows in tiles of 12 and their rest.
void check_avx512_panels(bool fp16) {
  std::mt19937 rng(fp16 ? 16 : 15);
  for (const i64 k : {1, 7, 385, 769, 1003, 4096})
    for (const i64 n : {16, 48, 80, 256}) {
      const i64 m_max = 64, lda = k + 3, ldc = n + 8;
      std::vector<float> a(m_max * lda), b(n * k);
      std::vector<std::uint16_t> b16(n * k);
      fill_operands(rng, k, lda, 3, a, b16, b, fp16);
      const std::vector<std::uint16_t> panels = panels_of(b16, n, k, k, fp16);
      for (const SgemmOrder order : {kSgemmAvx2, kSgemmAvx512Halves, kSgemmAvx512Fixed}) {
        std::vector<float> want(m_max * ldc, -7.0f);
        for (i64 r = 0; r < m_max; r += kRowsKernelMax)
          gemm_rows_avx2(kRowsKernelMax, n, k, a.data() + r * lda, lda, b.data(), k, want.data() + r * ldc,
                         ldc, order);
        for (const i64 m : {2, 9, 12, 13, 64}) {
          std::vector<float> got((m + 1) * ldc, -7.0f);
          gemm_rows_avx512_panels(m, n, k, a.data(), lda, panels.data(), got.data(), ldc, fp16, order);
          for (i64 i = 0; i < m; ++i)
            ASSERT_EQ(std::memcmp(got.data() + i * ldc, want.data() + i * ldc, n * sizeof(float)), 0)
                << "K " << k << ", " << n << " columns, " << m << " rows: row " << i << ", unit "
                << order.unit << (order.halves ? " halves" : " fixed");
          for (i64 j = 0; j < static_cast<i64>(got.size()); ++j) {
            if (j % ldc >= n || j >= m * ldc) {
              ASSERT_EQ(got[j], -7.0f) << "float " << j << " written";
            }
          }
        }
      }
    }
}

TEST(GemmRows, Avx512PanelsOfManyRowsGiveTheRowsKernelBits) {
  if (detected_isa() < Isa::avx512) GTEST_SKIP() << "the CPU lacks AVX-512";
  check_avx512_panels(false);
}

TEST(GemmRows, Avx512Fp16PanelsOfManyRowsGiveTheRowsKernelBits) {
  if (detected_isa() < Isa::avx512) GTEST_SKIP() << "the CPU lacks AVX-512";
  check_avx512_panels(true);
}

// The library's panel writer lays the weights out as described (the layout of panels_of, bf16 and fp16),
// for every panel width and K with and without a tail of fewer than 8.
TEST(GemmRows, WritePanelsLaysOutTheDescribedPanels) {
  if (detected_isa() < Isa::avx2) GTEST_SKIP() << "the CPU lacks AVX2 + FMA";
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> bits(0, 0xFFFF);
  for (const bool fp16 : {false, true})
    for (const i64 k : {1, 7, 8, 9, 300, 1003}) {
      for (const i64 n : {16, 48, 64, 80, 208}) {
        const i64 ldb = k + 3;
        std::vector<std::uint16_t> b16(n * ldb), out(n * k, 0xAAAA);
        for (auto& v : b16) v = static_cast<std::uint16_t>(bits(rng));
        write_panels_avx2(b16.data(), ldb, n, k, out.data(), fp16);
        EXPECT_EQ(out, panels_of(b16, n, k, ldb, fp16))
            << "K " << k << ", " << n << " columns, fp16 " << fp16;
      }
    }
}

// The kernel writes exactly its m x n cells: the columns past n and the rows past m keep their bytes.
TEST(GemmRows, WritesOnlyItsCells) {
  SKIP_WITHOUT_SGEMM();
  const i64 k = 300, n = 32, ldc = 40;
  std::vector<float> a(kRowsKernelMax * k, 0.5f), b(n * k, 0.25f);
  std::vector<float> c((kRowsKernelMax + 1) * ldc, -7.0f);
  gemm_rows_avx2(3, n, k, a.data(), k, b.data(), k, c.data(), ldc, kSgemmAvx2);
  for (i64 i = 0; i <= kRowsKernelMax; ++i)
    for (i64 j = 0; j < ldc; ++j)
      EXPECT_EQ(c[i * ldc + j], i < 3 && j < n ? 37.5f : -7.0f) << "row " << i << " column " << j;
}

}  // namespace
}  // namespace kvcomp::detail
