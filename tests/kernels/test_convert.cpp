// rows_to_f32_transposed (cpu/convert.hpp), which widens the forward's weights as [H, 2C] for the plain-B
// products: every value lands in its transposed place with the bits of kvcomp/half.hpp's conversion, for
// each io dtype, whole and ragged tiles (16 rows x 64 columns), a source row stride wider than its
// values, and any thread count; what lies past the rows in each destination row is left alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/convert.hpp"
#include "kvcomp/half.hpp"

namespace kvcomp {
// The one function of the library's API that convert.cpp uses (this test links no library).
std::size_t dtype_size(DType dt) { return dt == DType::f32 ? 4 : 2; }
}  // namespace kvcomp

namespace kvcomp::detail {
namespace {

using i64 = std::int64_t;

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

struct Shape {
  i64 rows, cols;
};

TEST(RowsToF32Transposed, EveryValueInItsTransposedPlace) {
  const Shape shapes[] = {{1, 1}, {3, 5}, {15, 63}, {16, 64}, {17, 65}, {32, 128}, {37, 200}, {128, 1536}};
  std::mt19937 rng(17);
  for (const DType dt : {DType::bf16, DType::f16, DType::f32})
    for (const Shape s : shapes)
      for (const i64 extra : {i64{0}, i64{3}})
        for (const int threads : {1, 2, 3}) {
          const i64 src_ld = s.cols + extra, ld = s.rows + 5;
          std::vector<std::uint16_t> h(static_cast<std::size_t>(s.rows * src_ld));
          std::vector<float> f(h.size());
          for (auto& v : h) v = static_cast<std::uint16_t>(rng());
          for (auto& v : f) {
            const auto u = static_cast<std::uint32_t>(rng());
            std::memcpy(&v, &u, sizeof v);
          }
          const void* src = dt == DType::f32 ? static_cast<const void*>(f.data()) : h.data();
          const float sentinel = -12345.0f;
          std::vector<float> dst(static_cast<std::size_t>(s.cols * ld), sentinel);
          rows_to_f32_transposed(src, dt, s.rows, s.cols, src_ld, dst.data(), ld, threads);
          i64 wrong = 0, touched = 0;
          for (i64 j = 0; j < s.cols; ++j) {
            for (i64 i = 0; i < s.rows; ++i) {
              const std::size_t at = static_cast<std::size_t>(i * src_ld + j);
              const float want = dt == DType::f32  ? f[at]
                                 : dt == DType::bf16 ? bf16_to_float(h[at])
                                                     : fp16_to_float(h[at]);
              wrong += bits(dst[static_cast<std::size_t>(j * ld + i)]) != bits(want);
            }
            for (i64 i = s.rows; i < ld; ++i)
              touched += bits(dst[static_cast<std::size_t>(j * ld + i)]) != bits(sentinel);
          }
          EXPECT_EQ(wrong, 0) << "dtype " << static_cast<int>(dt) << ", " << s.rows << " x " << s.cols
                              << ", source stride " << src_ld << ", " << threads << " threads";
          EXPECT_EQ(touched, 0) << s.rows << " x " << s.cols << ": values written past the rows";
        }
}

}  // namespace
}  // namespace kvcomp::detail
