// kvcomp's AMX product kernel (src/cpu/products/amx.hpp), single-threaded as gemm_bf16 runs each block:
// against the float64 sums, row and column stability (an element's bits do not depend on the rows or
// column groups of its call), the three ways of storing C, a second A on the same B, the packing of B
// in slices, strides and the tails of M, N and K. Where the CPU or the OS gives no AMX tiles it
// reports itself skipped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.hpp"
#include "cpu/products/amx.hpp"

namespace kvcomp::detail {
namespace {

using i64 = std::int64_t;
using u16 = std::uint16_t;

struct Shape {
  i64 M, N, K;
  bool b_transposed;
};

// bf16 values of random sign with exponents 2^-8 .. 2^8: no product or sum is subnormal.
u16 random_bf16(std::mt19937& rng) {
  const auto r = static_cast<std::uint32_t>(rng());
  return static_cast<u16>((r & 0x8000u) | ((127u - 8u + (r >> 7) % 17u) << 7) | (r & 0x7Fu));
}

struct Operands {
  Shape s;
  i64 lda, ldb, ldc;
  std::vector<u16> a, b;
  std::vector<unsigned char> packed;

  Operands(Shape shape, std::uint32_t seed) : s(shape) {
    lda = s.K + 5;  // rows farther apart than K, the gaps NaN: a product must never read them
    ldb = (s.b_transposed ? s.K : s.N) + 3;
    ldc = s.N + 7;
    std::mt19937 rng(seed);
    a.assign(static_cast<std::size_t>(s.M * lda), 0x7FC0);  // NaN
    for (i64 m = 0; m < s.M; ++m)
      for (i64 k = 0; k < s.K; ++k) a[static_cast<std::size_t>(m * lda + k)] = random_bf16(rng);
    b.assign(static_cast<std::size_t>((s.b_transposed ? s.N : s.K) * ldb), 0x7FC0);
    for (i64 k = 0; k < s.K; ++k)
      for (i64 n = 0; n < s.N; ++n) b[static_cast<std::size_t>(b_index(k, n))] = random_bf16(rng);
    packed.assign(amx_packed_bytes(s.N, s.K), 0xAB);
    amx_pack_b(s.N, s.K, b.data(), ldb, s.b_transposed, packed.data(), 0, groups());
  }
  i64 groups() const { return (s.N + 15) / 16; }
  i64 b_index(i64 k, i64 n) const { return s.b_transposed ? n * ldb + k : k * ldb + n; }
  double product(i64 m, i64 n, double* magnitude) const {
    double sum = 0, mag = 0;
    for (i64 k = 0; k < s.K; ++k) {
      const double p = static_cast<double>(bf16_to_f32(a[static_cast<std::size_t>(m * lda + k)])) *
                       bf16_to_f32(b[static_cast<std::size_t>(b_index(k, n))]);
      sum += p;
      mag += std::fabs(p);
    }
    *magnitude = mag;
    return sum;
  }
  // C over rows [r0, r0 + rows) and groups [g0, g1), into c (row stride ldc, row 0 = r0).
  void run(i64 r0, i64 rows, i64 g0, i64 g1, void* c, AmxStore store) const {
    amx_gemm_block(rows, s.N, s.K, a.data() + r0 * lda, lda, packed.data(), c, ldc, store, g0, g1);
  }
};

class GemmAmx : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (!amx_tiles_usable()) GTEST_SKIP() << "no AMX tiles on this CPU or OS";
  }
};

TEST_P(GemmAmx, MeetsTheFloat64Sums) {
  const Operands o(GetParam(), 1);
  std::vector<float> c(static_cast<std::size_t>(o.s.M * o.ldc), -7.0f);
  o.run(0, o.s.M, 0, o.groups(), c.data(), AmxStore::set);
  for (i64 m = 0; m < o.s.M; ++m)
    for (i64 n = 0; n < o.s.N; ++n) {
      double mag = 0;
      const double want = o.product(m, n, &mag);
      // fp32 accumulation: at most about K roundings of 2^-24 of the running magnitude.
      EXPECT_LE(std::fabs(c[static_cast<std::size_t>(m * o.ldc + n)] - want),
                static_cast<double>(o.s.K + 1) * 0x1p-24 * mag)
          << "m " << m << " n " << n;
    }
  // Columns past N in C's rows are not written.
  for (i64 m = 0; m < o.s.M; ++m)
    for (i64 n = o.s.N; n < o.ldc; ++n) ASSERT_EQ(c[static_cast<std::size_t>(m * o.ldc + n)], -7.0f);
}

TEST_P(GemmAmx, EveryRowAndColumnGroupHasTheBitsOfTheWholeCall) {
  const Operands o(GetParam(), 2);
  const std::size_t size = static_cast<std::size_t>(o.s.M * o.ldc);
  std::vector<float> whole(size, 0.0f), part(size, 0.0f);
  o.run(0, o.s.M, 0, o.groups(), whole.data(), AmxStore::set);
  for (i64 m = 0; m < o.s.M; ++m)  // each row alone
    o.run(m, 1, 0, o.groups(), part.data() + m * o.ldc, AmxStore::set);
  EXPECT_EQ(std::memcmp(whole.data(), part.data(), size * sizeof(float)), 0);
  std::fill(part.begin(), part.end(), 0.0f);
  for (i64 m = 0; m < o.s.M; m += 3)  // blocks of 3 rows, one column group at a time
    for (i64 g = 0; g < o.groups(); ++g)
      o.run(m, std::min<i64>(3, o.s.M - m), g, g + 1, part.data() + m * o.ldc, AmxStore::set);
  EXPECT_EQ(std::memcmp(whole.data(), part.data(), size * sizeof(float)), 0);
}

TEST_P(GemmAmx, AddsTheWholeProductOnceAndRoundsBf16AsF32ToBf16) {
  const Operands o(GetParam(), 3);
  const std::size_t size = static_cast<std::size_t>(o.s.M * o.ldc);
  std::vector<float> product(size, 0.0f), sum(size);
  o.run(0, o.s.M, 0, o.groups(), product.data(), AmxStore::set);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  for (auto& v : sum) v = nd(rng);
  const std::vector<float> before = sum;
  o.run(0, o.s.M, 0, o.groups(), sum.data(), AmxStore::add);
  std::vector<u16> narrow(size, 0x1234);
  o.run(0, o.s.M, 0, o.groups(), narrow.data(), AmxStore::bf16);
  for (i64 m = 0; m < o.s.M; ++m)
    for (i64 n = 0; n < o.ldc; ++n) {
      const auto i = static_cast<std::size_t>(m * o.ldc + n);
      if (n < o.s.N) {
        ASSERT_EQ(f2u(sum[i]), f2u(before[i] + product[i])) << "m " << m << " n " << n;
        ASSERT_EQ(narrow[i], f32_to_bf16(product[i])) << "m " << m << " n " << n;
      } else {
        ASSERT_EQ(f2u(sum[i]), f2u(before[i]));
        ASSERT_EQ(narrow[i], 0x1234);
      }
    }
}

TEST_P(GemmAmx, PackingInSlicesIsThePackingWhole) {
  const Operands o(GetParam(), 5);
  std::vector<unsigned char> sliced(o.packed.size(), 0xCD);
  for (i64 g = 0; g < o.groups(); g += 2)
    amx_pack_b(o.s.N, o.s.K, o.b.data(), o.ldb, o.s.b_transposed, sliced.data(), g,
               std::min(o.groups(), g + 2));
  EXPECT_EQ(sliced, o.packed);
}

// A second A on the same B (the precise backward's hi and lo parts): the bits of one product of A and
// A2 side by side, each zero-padded to whole steps of 32, against B stacked twice likewise; setting C
// and adding to it.
TEST_P(GemmAmx, SecondAIsTheProductOfBothSideBySide) {
  const Operands o(GetParam(), 6), o2(GetParam(), 7);  // o2's A is A2 (same shape and stride)
  const i64 M = o.s.M, N = o.s.N, K = o.s.K, kp = (K + 31) / 32 * 32, k2 = 2 * kp;
  std::vector<u16> acat(static_cast<std::size_t>(M * k2), 0), bcat(static_cast<std::size_t>(k2 * N), 0);
  for (i64 m = 0; m < M; ++m)
    for (i64 k = 0; k < K; ++k) {
      acat[static_cast<std::size_t>(m * k2 + k)] = o.a[static_cast<std::size_t>(m * o.lda + k)];
      acat[static_cast<std::size_t>(m * k2 + kp + k)] = o2.a[static_cast<std::size_t>(m * o.lda + k)];
    }
  for (i64 k = 0; k < K; ++k)
    for (i64 n = 0; n < N; ++n) {
      const u16 v = o.b[static_cast<std::size_t>(o.b_index(k, n))];
      bcat[static_cast<std::size_t>(k * N + n)] = bcat[static_cast<std::size_t>((kp + k) * N + n)] = v;
    }
  std::vector<unsigned char> pcat(amx_packed_bytes(N, k2));
  amx_pack_b(N, k2, bcat.data(), N, false, pcat.data(), 0, o.groups());
  for (const AmxStore store : {AmxStore::set, AmxStore::add}) {
    std::vector<float> start(static_cast<std::size_t>(M * o.ldc));
    std::mt19937 rng(8);
    for (float& v : start) v = bf16_to_f32(random_bf16(rng));
    std::vector<float> two = start, cat = start;
    amx_gemm_block(M, N, K, o.a.data(), o.lda, o.packed.data(), two.data(), o.ldc, store, 0, o.groups(),
                   o2.a.data());
    amx_gemm_block(M, N, k2, acat.data(), k2, pcat.data(), cat.data(), o.ldc, store, 0, o.groups());
    EXPECT_EQ(0, std::memcmp(two.data(), cat.data(), two.size() * sizeof(float)))
        << (store == AmxStore::set ? "set" : "add");
    // And not A's product alone: A2 counts.
    std::vector<float> one = start;
    o.run(0, M, 0, o.groups(), one.data(), store);
    EXPECT_NE(0, std::memcmp(two.data(), one.data(), two.size() * sizeof(float)));
  }
}

// Tails of every kind: M not a multiple of 16 or 32, N of 16, K of 32 or odd; a call of one row and
// one column; a K shorter than one step; both layouts of B. Calls of 33 to 64 rows run all their rows
// on each B tile (M = 33, 48, 57, 64: three or four row tiles, the last partial or whole; N = 300: more
// groups than share one copy of A), the others blocks of 32 rows (M = 65 and more: 70, 130, 256, 257):
// the test of rows alone compares the two.
std::string shape_name(const ::testing::TestParamInfo<Shape>& p) {
  std::string name = "m";
  name.append(std::to_string(p.param.M)).append("_n").append(std::to_string(p.param.N));
  name.append("_k").append(std::to_string(p.param.K));
  return name.append(p.param.b_transposed ? "_bt" : "_b");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmAmx,
    ::testing::Values(Shape{1, 1, 1, true}, Shape{1, 16, 32, true}, Shape{3, 17, 33, false},
                      Shape{16, 32, 64, true}, Shape{17, 48, 31, true}, Shape{31, 40, 95, false},
                      Shape{33, 64, 1, true}, Shape{70, 50, 257, false}, Shape{64, 160, 1003, true},
                      Shape{5, 272, 4096, true}, Shape{48, 33, 100, false}, Shape{57, 300, 2050, true},
                      Shape{130, 40, 300, true}, Shape{256, 20, 64, false}, Shape{257, 17, 40, true}),
    shape_name);

}  // namespace
}  // namespace kvcomp::detail
