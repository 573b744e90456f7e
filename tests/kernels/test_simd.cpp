// The run-time dispatched element-wise kernels (src/cpu/simd): every
// variant this CPU can run is checked against plain references (kvcomp/half.hpp
// for the conversions, std::exp softmax in float64) and against the scalar
// variant bitwise. The operator-level suites also run once per ISA cap
// (ctest tests core.isa_* / robustness.isa_*, KVCOMP_ISA).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/numerics.hpp"
#include "cpu/isa.hpp"
#include "cpu/simd/kernels.hpp"
#include "kvcomp/half.hpp"

namespace kvcomp::detail {
namespace {

using i64 = std::int64_t;

std::vector<Isa> runnable() {
  std::vector<Isa> v{Isa::scalar};
  if (detected_isa() >= Isa::avx2) v.push_back(Isa::avx2);
  if (detected_isa() >= Isa::avx512) v.push_back(Isa::avx512);
  return v;
}

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Floats that stress the narrowing conversions: signed zeros, the
// subnormal / normal / overflow boundaries of fp16 and bf16 and their
// neighbours, ties at every rounding position, NaN payloads, plus random
// bit patterns.
std::vector<float> edge_floats() {
  std::vector<std::uint32_t> seeds{
      0x00000000u, 0x00000001u, 0x007fffffu, 0x00800000u, 0x33000000u, 0x33000001u, 0x337fffffu, 0x33800000u,
      0x387fc000u, 0x387fe000u, 0x387fffffu, 0x38800000u, 0x38801000u, 0x38802000u, 0x3f800000u, 0x3f808000u,
      0x3f818000u, 0x3f801000u, 0x3f803000u, 0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, 0x47800000u,
      0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu, 0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0x7f810000u};
  std::vector<float> v;
  for (std::uint32_t s : seeds)
    for (std::uint32_t sign : {0u, 0x80000000u})
      for (int d = -2; d <= 2; ++d) v.push_back(from_bits((s + static_cast<std::uint32_t>(d)) | sign));
  std::mt19937 rng(11);
  for (int i = 0; i < 200000; ++i) v.push_back(from_bits(static_cast<std::uint32_t>(rng())));
  // Every fp16 / bf16 value and the midpoints next to it.
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    v.push_back(fp16_to_float(static_cast<std::uint16_t>(h)));
    v.push_back(from_bits((h << 16) | 0x8000u));  // bf16 tie
    v.push_back(from_bits((h << 16) | 0x8001u));
    v.push_back(from_bits((h << 16) | 0x7fffu));
  }
  return v;
}

class Simd : public ::testing::TestWithParam<Isa> {
 protected:
  const SimdKernels& k() const { return simd_kernels(GetParam()); }
};

TEST_P(Simd, TableIsTheRequestedVariant) { EXPECT_EQ(k().isa, GetParam()); }

TEST_P(Simd, WideningMatchesHalfHppOnEvery16BitPattern) {
  std::vector<std::uint16_t> h(0x10000);
  for (std::uint32_t i = 0; i < 0x10000u; ++i) h[i] = static_cast<std::uint16_t>(i);
  std::vector<float> out(h.size());
  k().to_f32(h.data(), DType::bf16, out.data(), static_cast<i64>(h.size()));
  for (std::uint32_t i = 0; i < 0x10000u; ++i)
    ASSERT_EQ(bits(out[i]), bits(bf16_to_float(h[i]))) << "bf16 0x" << std::hex << i;
  k().to_f32(h.data(), DType::f16, out.data(), static_cast<i64>(h.size()));
  for (std::uint32_t i = 0; i < 0x10000u; ++i)
    ASSERT_EQ(bits(out[i]), bits(fp16_to_float(h[i]))) << "fp16 0x" << std::hex << i;
}

TEST_P(Simd, NarrowingMatchesHalfHpp) {
  const std::vector<float> v = edge_floats();
  std::vector<std::uint16_t> out(v.size());
  k().from_f32(v.data(), out.data(), DType::bf16, static_cast<i64>(v.size()));
  for (std::size_t i = 0; i < v.size(); ++i)
    ASSERT_EQ(out[i], float_to_bf16(v[i])) << "bf16 of 0x" << std::hex << bits(v[i]);
  k().from_f32(v.data(), out.data(), DType::f16, static_cast<i64>(v.size()));
  for (std::size_t i = 0; i < v.size(); ++i)
    ASSERT_EQ(out[i], float_to_fp16(v[i])) << "fp16 of 0x" << std::hex << bits(v[i]);
  std::vector<float> same(v.size());
  k().from_f32(v.data(), same.data(), DType::f32, static_cast<i64>(v.size()));
  EXPECT_EQ(std::memcmp(same.data(), v.data(), v.size() * sizeof(float)), 0);
}

// The precise backward's hi and lo parts: hi the bf16 of v, lo the bf16 of what hi leaves (v - hi, exact
// in fp32), zero where hi is inf or NaN; half.hpp's branchy conversions are the reference.
TEST_P(Simd, SplitMatchesHalfHpp) {
  const std::vector<float> v = edge_floats();
  std::vector<std::uint16_t> hi(v.size()), lo(v.size());
  k().split_bf16(v.data(), hi.data(), lo.data(), static_cast<i64>(v.size()));
  for (std::size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(hi[i], float_to_bf16(v[i])) << "hi of 0x" << std::hex << bits(v[i]);
    const float h = bf16_to_float(hi[i]);
    ASSERT_EQ(lo[i], std::isfinite(h) ? float_to_bf16(v[i] - h) : std::uint16_t{0})
        << "lo of 0x" << std::hex << bits(v[i]);
  }
  // hi + lo carries v to about 2^-16 of its size where v is normal and not rounded to inf.
  const float v1 = 1.0f + 0x1.2345p-9f;
  std::uint16_t h1 = 0, l1 = 0;
  k().split_bf16(&v1, &h1, &l1, 1);
  EXPECT_EQ(h1, 0x3f80u);
  EXPECT_NEAR(bf16_to_float(h1) + bf16_to_float(l1), v1, 0x1p-16f);
  EXPECT_NE(l1, 0u);
}

// Slot-major data of one block: cr rows of ld floats, scores spread wide
// enough that exp sees arguments down to about -60.
struct Block {
  i64 cr, ld;
  std::vector<float> S, K, sc;
  explicit Block(i64 rows, i64 ld_, unsigned seed) : cr(rows), ld(ld_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    S.resize(static_cast<std::size_t>(cr * ld));
    K.resize(S.size());
    sc.resize(S.size());
    for (std::size_t i = 0; i < S.size(); ++i) {
      S[i] = std::abs(g(rng)) / static_cast<float>(cr);
      K[i] = g(rng);
      sc[i] = 12.0f * g(rng);
    }
  }
};

// Softmax of one column over the given rows, the way the spec states it
// (float64, std::exp): the oracle of block_softmax.
void softmax_column(const std::vector<const float*>& sc, const std::vector<const float*>& kv, i64 i,
                    std::vector<double>& s, double& out) {
  double mx = -std::numeric_limits<double>::infinity();
  for (const float* p : sc)
    if (p) mx = std::fmax(mx, static_cast<double>(p[i]));
  double sum = 0;
  s.assign(sc.size(), 0.0);
  for (std::size_t j = 0; j < sc.size(); ++j)
    if (sc[j]) sum += (s[j] = std::exp(static_cast<double>(sc[j][i]) - mx));
  out = 0;
  for (std::size_t j = 0; j < sc.size(); ++j) {
    s[j] /= sum;
    if (kv[j]) out += s[j] * static_cast<double>(kv[j][i]);
  }
}

struct SoftmaxRun {
  std::vector<float> s_out, k_out, cmp;
};

// The block's score and kv row pointers; with placeholders every third row
// is a placeholder (null).
struct BlockRows {
  std::vector<const float*> sc, kv;
  BlockRows(const Block& b, bool placeholders) {
    for (i64 j = 0; j < b.cr; ++j) {
      const bool hole = placeholders && j % 3 == 0;
      sc.push_back(hole ? nullptr : b.sc.data() + j * b.ld);
      kv.push_back(hole ? nullptr : b.K.data() + j * b.ld);
    }
  }
};

SoftmaxRun run_softmax(const SimdKernels& kern, const Block& b, i64 w, bool placeholders, DType io) {
  const BlockRows rows(b, placeholders);
  const auto& sc = rows.sc;
  const auto& kv = rows.kv;
  SoftmaxRun r;
  r.s_out.assign(static_cast<std::size_t>(b.cr * b.ld), -7.0f);
  r.k_out.assign(r.s_out.size(), -7.0f);
  r.cmp.assign(static_cast<std::size_t>(kSoftmaxChunk), -7.0f);
  std::vector<double> e(static_cast<std::size_t>((b.cr + 1) * kSoftmaxPitch));
  kern.block_softmax(sc.data(), kv.data(), b.cr, w, e.data(), r.s_out.data(), r.k_out.data(), b.ld,
                     r.cmp.data(), io);
  return r;
}

TEST_P(Simd, SoftmaxMatchesFloat64StdExp) {
  for (i64 cr : {1, 2, 8, 256}) {
    // kSoftmaxChunk, 128, 64 and 32: the widths compiled for (one thread's columns of D = 512 or 128).
    for (i64 w : {kSoftmaxChunk, i64{128}, i64{64}, i64{32}, kSlice, i64{5}, i64{100}}) {
      for (bool holes : {false, true}) {
        if (holes && cr < 2) continue;
        const Block b(cr, w + 24, static_cast<unsigned>(cr * 100 + w));
        const SoftmaxRun r = run_softmax(k(), b, w, holes, DType::f32);
        const BlockRows rows(b, holes);
        const auto& sc = rows.sc;
        const auto& kv = rows.kv;
        for (i64 i = 0; i < w; ++i) {
          std::vector<double> s;
          double out;
          softmax_column(sc, kv, i, s, out);
          for (i64 j = 0; j < cr; ++j) {
            const float got = r.s_out[static_cast<std::size_t>(j * b.ld + i)];
            // Stored as fp32: the float64 value rounded, or its neighbour
            // when the two float64 computations straddle a rounding midpoint.
            EXPECT_NEAR(got, static_cast<float>(s[static_cast<std::size_t>(j)]),
                        std::abs(s[static_cast<std::size_t>(j)]) * 1.2e-7 + 1e-45)
                << "cr " << cr << " w " << w << " row " << j << " col " << i;
            const float kexp =
                kv[static_cast<std::size_t>(j)] ? b.K[static_cast<std::size_t>(j * b.ld + i)] : 0.0f;
            EXPECT_EQ(bits(r.k_out[static_cast<std::size_t>(j * b.ld + i)]), bits(kexp));
          }
          EXPECT_NEAR(r.cmp[static_cast<std::size_t>(i)], out, std::abs(out) * 1.2e-7 + 1e-30);
        }
        // Columns past w are not touched.
        for (i64 i = w; i < b.ld; ++i) EXPECT_EQ(r.s_out[static_cast<std::size_t>(i)], -7.0f);
        for (i64 i = w; i < kSoftmaxChunk; ++i) EXPECT_EQ(r.cmp[static_cast<std::size_t>(i)], -7.0f);
      }
    }
  }
}

TEST_P(Simd, SoftmaxNonFiniteScores) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  Block b(4, kSlice, 3);
  // col 0: one -inf (weight exactly 0); col 1: all -inf (NaN, as 0/0);
  // col 2: a NaN (all NaN); col 3: one +inf (NaN, inf - inf);
  // col 4: spread past exp's underflow (weight exactly 0 for -1000).
  b.sc[0 * kSlice + 0] = -inf;
  for (i64 j = 0; j < 4; ++j) b.sc[static_cast<std::size_t>(j * kSlice + 1)] = -inf;
  b.sc[2 * kSlice + 2] = nan;
  b.sc[1 * kSlice + 3] = inf;
  b.sc[0 * kSlice + 4] = 0.0f;
  b.sc[1 * kSlice + 4] = -1000.0f;
  b.sc[2 * kSlice + 4] = -745.5f;
  b.sc[3 * kSlice + 4] = -30.0f;
  const SoftmaxRun r = run_softmax(k(), b, kSlice, false, DType::f32);
  auto S = [&](i64 j, i64 i) { return r.s_out[static_cast<std::size_t>(j * kSlice + i)]; };
  EXPECT_EQ(S(0, 0), 0.0f);
  EXPECT_TRUE(std::isfinite(r.cmp[0]));
  for (i64 j = 0; j < 4; ++j) EXPECT_TRUE(std::isnan(S(j, 1)));
  EXPECT_TRUE(std::isnan(r.cmp[1]));
  for (i64 j = 0; j < 4; ++j) EXPECT_TRUE(std::isnan(S(j, 2)));
  for (i64 j = 0; j < 4; ++j) EXPECT_TRUE(std::isnan(S(j, 3)));
  EXPECT_EQ(S(1, 4), 0.0f);
  EXPECT_EQ(S(2, 4), 0.0f);
  EXPECT_FLOAT_EQ(S(3, 4), static_cast<float>(std::exp(-30.0) / (1.0 + std::exp(-30.0))));
  EXPECT_FLOAT_EQ(S(0, 4), static_cast<float>(1.0 / (1.0 + std::exp(-30.0))));
}

TEST_P(Simd, BlockDotAndSlotGradMatchFloat64) {
  const i64 cr = 8, ld = 24;
  const Block b(cr, ld, 5);
  std::vector<float> dc(kSlice);
  std::mt19937 rng(9);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& v : dc) v = g(rng);
  for (i64 w : {kSlice, i64{3}}) {
    double wsum[kSlice];
    k().block_dot(b.S.data(), b.K.data(), cr, ld, w, wsum);
    for (i64 i = 0; i < w; ++i) {
      double ref = 0;
      for (i64 j = 0; j < cr; ++j)
        ref += static_cast<double>(b.S[static_cast<std::size_t>(j * ld + i)]) *
               b.K[static_cast<std::size_t>(j * ld + i)];
      EXPECT_EQ(wsum[i], ref);  // same order, exact products: identical
    }
    std::vector<float> dk(kSlice, -7.0f), dz(kSlice, -7.0f);
    std::vector<double> ape(kSlice, 0.25);
    const i64 j = 3;
    k().slot_grad(b.S.data() + j * ld, b.K.data() + j * ld, dc.data(), wsum, w, DType::f32, dk.data(),
                  dz.data(), ape.data());
    for (i64 i = 0; i < w; ++i) {
      const float sv = b.S[static_cast<std::size_t>(j * ld + i)],
                  kv = b.K[static_cast<std::size_t>(j * ld + i)];
      const double z =
          static_cast<double>(sv) * dc[static_cast<std::size_t>(i)] * (static_cast<double>(kv) - wsum[i]);
      EXPECT_EQ(dk[static_cast<std::size_t>(i)], dc[static_cast<std::size_t>(i)] * sv);
      EXPECT_EQ(dz[static_cast<std::size_t>(i)], static_cast<float>(z));
      EXPECT_EQ(ape[static_cast<std::size_t>(i)], 0.25 + z);
    }
    for (i64 i = w; i < kSlice; ++i) EXPECT_EQ(dk[static_cast<std::size_t>(i)], -7.0f);
    // npu_parity: the same values rounded to the io dtype.
    for (DType io : {DType::bf16, DType::f16}) {
      std::vector<float> pk(kSlice), pz(kSlice);
      k().slot_grad(b.S.data() + j * ld, b.K.data() + j * ld, dc.data(), wsum, w, io, pk.data(), pz.data(),
                    ape.data());
      for (i64 i = 0; i < w; ++i) {
        const auto round = [io](float v) {
          return io == DType::bf16 ? bf16_to_float(float_to_bf16(v)) : fp16_to_float(float_to_fp16(v));
        };
        EXPECT_EQ(bits(pk[static_cast<std::size_t>(i)]), bits(round(dk[static_cast<std::size_t>(i)])));
        EXPECT_EQ(bits(pz[static_cast<std::size_t>(i)]), bits(round(dz[static_cast<std::size_t>(i)])));
      }
    }
    // npu_parity with bf16 io written as bf16: the bits of the rounded values; ape as above.
    std::vector<std::uint16_t> hk(kSlice, 0x7777), hz(kSlice, 0x7777);
    std::vector<double> ape16(kSlice, 0.25);
    k().slot_grad_bf16(b.S.data() + j * ld, b.K.data() + j * ld, dc.data(), wsum, w, hk.data(), hz.data(),
                       nullptr, nullptr, ape16.data());
    for (i64 i = 0; i < w; ++i) {
      const auto u = static_cast<std::size_t>(i);
      const float sv = b.S[static_cast<std::size_t>(j * ld + i)],
                  kv = b.K[static_cast<std::size_t>(j * ld + i)];
      const double z = static_cast<double>(sv) * dc[u] * (static_cast<double>(kv) - wsum[i]);
      EXPECT_EQ(hk[u], float_to_bf16(dk[u]));
      EXPECT_EQ(hz[u], float_to_bf16(dz[u]));
      EXPECT_EQ(ape16[u], 0.25 + z);
    }
    for (i64 i = w; i < kSlice; ++i) EXPECT_EQ(hk[static_cast<std::size_t>(i)], 0x7777);
    // Precise with bf16 io: the two parts of the fp32 values, hi = bf16(v), lo = bf16(v - hi).
    std::vector<std::uint16_t> pk_hi(kSlice, 0x7777), pz_hi(kSlice, 0x7777), pk_lo(kSlice, 0x7777),
        pz_lo(kSlice, 0x7777);
    std::vector<double> ape_p(kSlice, 0.25);
    k().slot_grad_bf16(b.S.data() + j * ld, b.K.data() + j * ld, dc.data(), wsum, w, pk_hi.data(),
                       pz_hi.data(), pk_lo.data(), pz_lo.data(), ape_p.data());
    for (i64 i = 0; i < w; ++i) {
      const auto u = static_cast<std::size_t>(i);
      for (const auto& [v, hi, lo] :
           {std::tuple{dk[u], pk_hi[u], pk_lo[u]}, std::tuple{dz[u], pz_hi[u], pz_lo[u]}}) {
        EXPECT_EQ(hi, float_to_bf16(v));
        EXPECT_EQ(lo, float_to_bf16(v - bf16_to_float(float_to_bf16(v))));
        // hi + lo holds v to 2^-16 relative (v is a normal fp32 here).
        EXPECT_LE(std::fabs(static_cast<double>(bf16_to_float(hi)) + bf16_to_float(lo) - v),
                  std::ldexp(std::fabs(static_cast<double>(v)), -16));
      }
      EXPECT_EQ(ape_p[u], ape16[u]);
    }
    for (i64 i = w; i < kSlice; ++i) EXPECT_EQ(pk_lo[static_cast<std::size_t>(i)], 0x7777);
  }
}

// The vector variants against the scalar one, bitwise, on the same inputs.
TEST_P(Simd, BitwiseEqualToScalarVariant) {
  const SimdKernels& ref = simd_kernels(Isa::scalar);
  for (i64 cr : {3, 8, 512}) {
    const Block b(cr, kSoftmaxChunk + 8, static_cast<unsigned>(cr));
    for (i64 w : {kSoftmaxChunk, i64{128}, i64{64}, i64{32}, kSlice, i64{7}, i64{100}}) {
      for (DType io : {DType::f32, DType::bf16, DType::f16}) {
        const SoftmaxRun a = run_softmax(k(), b, w, cr > 3, io), s = run_softmax(ref, b, w, cr > 3, io);
        ASSERT_EQ(std::memcmp(a.s_out.data(), s.s_out.data(), a.s_out.size() * sizeof(float)), 0);
        ASSERT_EQ(std::memcmp(a.k_out.data(), s.k_out.data(), a.k_out.size() * sizeof(float)), 0);
        ASSERT_EQ(std::memcmp(a.cmp.data(), s.cmp.data(), a.cmp.size() * sizeof(float)), 0);
      }
      if (w > kSlice) continue;  // the backward's kernels take one slice
      double wa[kSlice] = {}, ws[kSlice] = {};
      k().block_dot(b.S.data(), b.K.data(), cr, b.ld, w, wa);
      ref.block_dot(b.S.data(), b.K.data(), cr, b.ld, w, ws);
      ASSERT_EQ(std::memcmp(wa, ws, sizeof wa), 0);
      for (DType parity : {DType::f32, DType::bf16, DType::f16}) {
        std::vector<float> ka(kSlice), za(kSlice), ks(kSlice), zs(kSlice);
        std::vector<double> pa(kSlice, 1.0), ps(kSlice, 1.0);
        k().slot_grad(b.S.data() + 2 * b.ld, b.K.data() + 2 * b.ld, b.sc.data(), wa, w, parity, ka.data(),
                      za.data(), pa.data());
        ref.slot_grad(b.S.data() + 2 * b.ld, b.K.data() + 2 * b.ld, b.sc.data(), ws, w, parity, ks.data(),
                      zs.data(), ps.data());
        ASSERT_EQ(std::memcmp(ka.data(), ks.data(), ka.size() * sizeof(float)), 0);
        ASSERT_EQ(std::memcmp(za.data(), zs.data(), za.size() * sizeof(float)), 0);
        ASSERT_EQ(std::memcmp(pa.data(), ps.data(), pa.size() * sizeof(double)), 0);
      }
      std::vector<std::uint16_t> ka(kSlice), za(kSlice), ks(kSlice), zs(kSlice);
      std::vector<double> pa(kSlice, 1.0), ps(kSlice, 1.0);
      for (const bool lo : {false, true}) {
        std::vector<std::uint16_t> kla(kSlice), zla(kSlice), kls(kSlice), zls(kSlice);
        k().slot_grad_bf16(b.S.data() + 2 * b.ld, b.K.data() + 2 * b.ld, b.sc.data(), wa, w, ka.data(),
                           za.data(), lo ? kla.data() : nullptr, lo ? zla.data() : nullptr, pa.data());
        ref.slot_grad_bf16(b.S.data() + 2 * b.ld, b.K.data() + 2 * b.ld, b.sc.data(), ws, w, ks.data(),
                           zs.data(), lo ? kls.data() : nullptr, lo ? zls.data() : nullptr, ps.data());
        ASSERT_EQ(ka, ks);
        ASSERT_EQ(za, zs);
        ASSERT_EQ(kla, kls);
        ASSERT_EQ(zla, zls);
        ASSERT_EQ(std::memcmp(pa.data(), ps.data(), pa.size() * sizeof(double)), 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, Simd, ::testing::ValuesIn(runnable()),
                         [](const ::testing::TestParamInfo<Isa>& p) {
                           return std::string(isa_name(p.param));
                         });

// The softmax's exp (common/numerics.hpp; the kernels above reach it through the vector FMA, this copy
// through libm's fma: BitwiseEqualToScalarVariant ties them) against the long double expl, in units
// in the last place of the double result: 2e6 arguments over [-708, 0], a tenth of them in
// (-2^-20, 0], plus the ends.
TEST(ExpNonpositive, WithinOneUlpOfExpl) {
  std::mt19937_64 g(20261202);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  double worst = 0.0, worst_x = 0.0;
  for (int i = 0; i < 2'000'000; ++i) {
    const double x = i % 10 == 0 ? -std::ldexp(u(g), -20 - i % 40) : -708.0 * u(g);
    const long double ref = expl(static_cast<long double>(x));
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<double>(ref)) - 52);
    // In long double: near -708 the difference is below the smallest double.
    const double err = static_cast<double>(
        std::fabs(static_cast<long double>(exp_nonpositive(x)) - ref) / static_cast<long double>(ulp));
    if (err > worst) worst = err, worst_x = x;
  }
  EXPECT_LE(worst, 1.01) << "at x = " << worst_x;  // measured: 0.93 (the 13-term Taylor form: 0.86)
  EXPECT_EQ(exp_nonpositive(0.0), 1.0);
  EXPECT_EQ(exp_nonpositive(-0.0), 1.0);
  EXPECT_EQ(exp_nonpositive(-std::numeric_limits<double>::infinity()), 0.0);
  EXPECT_EQ(exp_nonpositive(-708.5), 0.0);  // below 2^-1022: flushed
  EXPECT_GT(exp_nonpositive(-708.0), 0.0);
  EXPECT_TRUE(std::isnan(exp_nonpositive(std::numeric_limits<double>::quiet_NaN())));
}

// The vector exp the block softmax runs (AVX2, AVX-512: intrinsics) against the scalar function,
// bitwise: the flush threshold and its neighbours and specials (first, in the vector lanes, and again
// last, in the scalar tail: n is odd), random arguments over [-800, 0] and over each decade down to
// 1e-300.
TEST_P(Simd, ExpBitwiseEqualToScalar) {
  std::mt19937_64 g(20261206);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const std::vector<double> special = {-708.0,
                                       -707.9999999999999,
                                       -708.0000000000001,
                                       -745.2,
                                       -1e300,
                                       -0.0,
                                       0.0,
                                       -4.9e-324,
                                       -2.2250738585072014e-308,
                                       -std::numeric_limits<double>::infinity(),
                                       std::numeric_limits<double>::quiet_NaN(),
                                       -std::numeric_limits<double>::max(),
                                       -1.0,
                                       -0.5};
  std::vector<double> x = special;
  for (int i = 0; i < 200'001; ++i) x.push_back(-800.0 * u(g));
  for (int d = 0; d < 300; ++d)
    for (int i = 0; i < 50; ++i) x.push_back(-u(g) * std::pow(10.0, -d));
  x.insert(x.end(), special.begin() + 6, special.end());  // 8 more: a tail of 3 (AVX2) or 7 (AVX-512)
  std::vector<double> y(x.size()), ys(x.size());
  k().exp(x.data(), y.data(), static_cast<i64>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) ys[i] = exp_nonpositive(x[i]);
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint64_t a, b;
    std::memcpy(&a, &y[i], sizeof a);
    std::memcpy(&b, &ys[i], sizeof b);
    ASSERT_EQ(a, b) << "x = " << x[i] << ": " << y[i] << " against " << ys[i];
  }
  EXPECT_NEAR(y[0] / std::exp(-708.0), 1.0, 1e-15);  // kept: 2^-1021.4 is normal
  EXPECT_EQ(y[2], 0.0);                               // flushed
  EXPECT_EQ(y[5], 1.0);
  EXPECT_EQ(y[9], 0.0);
  EXPECT_TRUE(std::isnan(y[10]));
}

// KVCOMP_ISA caps the choice (ctest runs this binary with the variable set
// to each value and unset; KVCOMP_EXPECT_ISA says what to expect).
TEST(IsaChoice, EnvironmentCapsTheDetectedIsa) {
  const char* expect = std::getenv("KVCOMP_EXPECT_ISA");
  if (!expect) {
    EXPECT_EQ(active_isa(), detected_isa());
    EXPECT_EQ(simd_kernels().isa, detected_isa());
    return;
  }
  Isa want = Isa::scalar;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (std::string(expect) == isa_name(isa)) want = isa;
  want = std::min(want, detected_isa());
  EXPECT_EQ(active_isa(), want);
  EXPECT_EQ(simd_kernels().isa, want);
}

}  // namespace
}  // namespace kvcomp::detail
