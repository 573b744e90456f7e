// Tests of the case-directory side of the CLI's io: meta.json, loading case
// directories (storage dtypes, rounding, strided caches), and writing the
// outputs without partial files.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "io_test_helpers.hpp"
#include "kvcomp/half.hpp"

using namespace io_test;  // NOLINT(google-build-using-namespace): the helpers of this suite

// ---------------------------------------------------------------- meta.json

TEST(Meta, ParsesEveryKey) {
  const auto m = kvcomp::io::parse_meta(
      R"({"cmp_ratio": 128, "coff": 1, "dtype": "fp16", "layout": "TH", "cache_mode": 2,
          "state_cache_stride0": 4096, "grad_enabled": false})",
      "meta.json");
  EXPECT_EQ(m.cmp_ratio, 128);
  EXPECT_EQ(m.coff, 1);
  EXPECT_EQ(m.dtype, DType::f16);
  ASSERT_TRUE(m.layout.has_value());
  EXPECT_EQ(*m.layout, "TH");
  EXPECT_EQ(m.cache_mode, 2);
  EXPECT_EQ(m.state_cache_stride0, 4096);
  EXPECT_FALSE(m.grad_enabled);
}

TEST(Meta, DefaultsForOptionalKeys) {
  const auto m = kvcomp::io::parse_meta(R"({"cmp_ratio": 4, "dtype": "bf16"})", "m");
  EXPECT_EQ(m.cmp_ratio, 4);
  EXPECT_EQ(m.dtype, DType::bf16);
  EXPECT_EQ(m.coff, 1);
  EXPECT_FALSE(m.layout.has_value());
  EXPECT_EQ(m.cache_mode, 1);
  EXPECT_EQ(m.state_cache_stride0, 0);
  EXPECT_TRUE(m.grad_enabled);
  EXPECT_EQ(kvcomp::io::parse_meta(R"({"cmp_ratio": 4, "dtype": "fp32"})", "m").dtype, DType::f32);
  // Values are the operator's to judge, not the loader's.
  EXPECT_EQ(kvcomp::io::parse_meta(R"({"cmp_ratio": -3, "dtype": "bf16", "coff": 7})", "m").cmp_ratio, -3);
}

TEST(Meta, BadJson) {
  for (const char* text :
       {"", "{", R"({"cmp_ratio": 4,})", R"({"cmp_ratio": 4 "dtype": "bf16"})", "{'a': 1}"}) {
    SCOPED_TRACE(text);
    expect_io_error([&] { kvcomp::io::parse_meta(text, "case/meta.json"); }, IoError::Kind::contents,
                    {"case/meta.json", "not valid JSON"});
  }
  expect_io_error([&] { kvcomp::io::parse_meta("[4]", "m"); }, IoError::Kind::contents,
                  {"JSON object", "array"});
}

TEST(Meta, SpellingsUnknownAndDuplicateKeys) {
  // Any spelling convention of a known key is that key; unknown keys are
  // reported back (the CLI warns) and otherwise ignored.
  const auto m = kvcomp::io::parse_meta(
      R"({"cmpRatio": 8, "dtype": "bfloat16", "Coff": 2, "CACHE_MODE": 2, "layout": "th", "note": "x"})",
      "m");
  EXPECT_EQ(m.cmp_ratio, 8);
  EXPECT_EQ(m.coff, 2);
  EXPECT_EQ(m.cache_mode, 2);
  EXPECT_EQ(m.dtype, kvcomp::DType::bf16);
  EXPECT_EQ(m.layout, std::optional<std::string>("TH"));
  EXPECT_EQ(m.ignored_keys, std::vector<std::string>{"note"});
  expect_io_error([&] { kvcomp::io::parse_meta(R"({"cmp_ratio": 4, "dtype": "bf16", "cmpRatio": 8})", "m"); },
                  IoError::Kind::contents, {"duplicate key"});
  expect_io_error(
      [&] { kvcomp::io::parse_meta(R"({"cmp_ratio": 4, "dtype": "bf16", "cmp_ratio": 8})", "m"); },
      IoError::Kind::contents, {"duplicate key \"cmp_ratio\""});
}

TEST(Meta, WrongTypes) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"cmp_ratio": "4", "dtype": "bf16"})", "\"cmp_ratio\" must be an integer"},
      {R"({"cmp_ratio": 4.0, "dtype": "bf16"})", "\"cmp_ratio\" must be an integer"},
      {R"({"cmp_ratio": true, "dtype": "bf16"})", "\"cmp_ratio\" must be an integer"},
      {R"({"cmp_ratio": 4, "dtype": "bf16", "coff": null})", "\"coff\" must be an integer"},
      {R"({"cmp_ratio": 4, "dtype": 16})", "\"dtype\" must be a string"},
      {R"({"cmp_ratio": 4, "dtype": "bf16", "layout": 3})", "\"layout\" must be a string"},
      {R"({"cmp_ratio": 4, "dtype": "bf16", "grad_enabled": 1})", "\"grad_enabled\" must be true or false"},
      {R"({"cmp_ratio": 4, "dtype": "bf16", "cache_mode": [1]})", "\"cache_mode\" must be an integer"},
      {R"({"cmp_ratio": 4, "dtype": "bf16", "state_cache_stride0": 1.5})",
       "\"state_cache_stride0\" must be an integer"},
      {R"({"cmp_ratio": 18446744073709551615, "dtype": "bf16"})", "does not fit in int64"},
      {R"({"cmp_ratio": 4, "dtype": "int8"})", "\"dtype\" must be \"bf16\", \"fp16\" or \"fp32\""},
      {R"({"cmp_ratio": 4, "dtype": "bf16", "layout": "SBH"})", "\"layout\" must be \"BSH\" or \"TH\""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.first);
    expect_io_error([&] { kvcomp::io::parse_meta(c.first, "m"); }, IoError::Kind::contents, {c.second});
  }
}

TEST(Meta, MissingRequiredKeys) {
  expect_io_error([&] { kvcomp::io::parse_meta(R"({"dtype": "bf16", "coff": 2})", "m"); },
                  IoError::Kind::contents, {"required key \"cmp_ratio\""});
  expect_io_error([&] { kvcomp::io::parse_meta(R"({"cmp_ratio": 4})", "m"); }, IoError::Kind::contents,
                  {"required key \"dtype\""});
}

TEST(Meta, MissingFileIsAFilesystemError) {
  expect_io_error([&] { kvcomp::io::read_meta("/nonexistent/kvcomp/meta.json"); }, IoError::Kind::filesystem,
                  {"meta.json", "cannot open"});
}

// ---------------------------------------------------------------- case dirs

namespace {

// A small grad case (the loader does not check operator shape rules).
void write_grad_case(const fs::path& d, const std::string& meta) {
  write_text(d / "meta.json", meta);
  save(d / "x.npy", NpyType::f4, {1, 8, 4}, std::vector<float>(32, 0.5f));
  save(d / "wkv.npy", NpyType::f4, {4, 4}, std::vector<float>(16, 0.25f));
  save(d / "wgate.npy", NpyType::f4, {4, 4}, std::vector<float>(16, -0.25f));
  save(d / "d_cmp_kv.npy", NpyType::f4, {1, 2, 2}, std::vector<float>(4, 1.f));
  save(d / "softmax_score.npy", NpyType::f4, {1, 2, 4, 2}, std::vector<float>(16, 0.25f));
  save(d / "kv.npy", NpyType::f8, {1, 2, 4, 2}, std::vector<double>(16, 3.0));
}

}  // namespace

using CaseDir = TempDir;

TEST_F(CaseDir, LoadsGradCase) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "coff": 2, "dtype": "bf16", "layout": "BSH"})");
  save(dir_ / "start_pos.npy", NpyType::i8, {1}, std::vector<std::int64_t>{5});
  auto c = kvcomp::io::load_grad_case(dir_);
  EXPECT_EQ(c.meta.cmp_ratio, 4);
  EXPECT_EQ(c.meta.coff, 2);
  EXPECT_EQ(c.x.dtype, DType::bf16);
  EXPECT_EQ(c.x.shape, (std::vector<std::int64_t>{1, 8, 4}));
  EXPECT_EQ(c.x.as<std::uint16_t>()[7], 0x3f00);      // 0.5
  EXPECT_EQ(c.wgate.as<std::uint16_t>()[0], 0xbe80);  // -0.25
  EXPECT_EQ(c.d_cmp_kv.dtype, DType::bf16);
  EXPECT_EQ(c.softmax_score.dtype, DType::f32);
  EXPECT_EQ(c.kv.dtype, DType::f32);
  EXPECT_EQ(c.kv.as<float>()[15], 3.0f);
  EXPECT_FALSE(c.cu_seqlens.has_value());
  EXPECT_FALSE(c.seqused.has_value());
  ASSERT_TRUE(c.start_pos.has_value());
  EXPECT_EQ(c.start_pos->dtype, DType::i32);
  EXPECT_EQ(c.start_pos->as<std::int32_t>()[0], 5);
  const kvcomp::Tensor v = c.softmax_score.view();
  EXPECT_EQ(v.rank, 4);
  EXPECT_EQ(v.dtype, DType::f32);
  EXPECT_EQ(v.shape[3], 2);
  EXPECT_EQ(v.data, c.softmax_score.bytes.data());
}

TEST_F(CaseDir, Float32RoundsToBf16TiesToEven) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "dtype": "bf16"})");
  // bf16 keeps 7 fraction bits: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7.
  const float t = std::ldexp(1.0f, -8);
  const std::vector<float> x = {1 + t,        1 + 3 * t, 1 + t + std::ldexp(1.0f, -20), -(1 + t),
                                -(1 + 3 * t), 1 + 2 * t, 1 - std::ldexp(1.0f, -9),      0.0f};
  save(dir_ / "x.npy", NpyType::f4, {1, 2, 4}, x);
  const auto c = kvcomp::io::load_grad_case(dir_);
  const std::uint16_t* h = c.x.as<std::uint16_t>();
  EXPECT_EQ(h[0], 0x3f80);  // tie, down to even 1.0
  EXPECT_EQ(h[1], 0x3f82);  // tie, up to even 1 + 2^-6
  EXPECT_EQ(h[2], 0x3f81);  // just above the tie: up
  EXPECT_EQ(h[3], 0xbf80);
  EXPECT_EQ(h[4], 0xbf82);
  EXPECT_EQ(h[5], 0x3f81);  // exact
  EXPECT_EQ(h[6], 0x3f80);  // 1 - 2^-9 is a tie below 1 (bf16 step 2^-8 there): even is 1.0
  EXPECT_EQ(h[7], 0x0000);
}

TEST_F(CaseDir, Float32RoundsToFp16TiesToEven) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "dtype": "fp16"})");
  const float t = std::ldexp(1.0f, -11);  // half of the fp16 step at 1
  save(dir_ / "x.npy", NpyType::f4, {1, 1, 4}, std::vector<float>{1 + t, 1 + 3 * t, 65520.f, 1.5f});
  const auto c = kvcomp::io::load_grad_case(dir_);
  EXPECT_EQ(c.x.dtype, DType::f16);
  const std::uint16_t* h = c.x.as<std::uint16_t>();
  EXPECT_EQ(h[0], 0x3c00);
  EXPECT_EQ(h[1], 0x3c02);
  EXPECT_EQ(h[2], 0x7c00);  // rounds past the largest fp16: Inf
  EXPECT_EQ(h[3], 0x3e00);
}

TEST_F(CaseDir, SixteenBitStorage) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "dtype": "bf16"})");
  save(dir_ / "x.npy", NpyType::u2, {1, 1, 3}, std::vector<std::uint16_t>{0x3f81, 0xffff, 0x0001});
  // float16 for bf16 io goes through float: 1 + 2^-10 rounds to 1.0, 3.140625 is exact.
  save(dir_ / "wkv.npy", NpyType::f2, {1, 2}, std::vector<std::uint16_t>{0x3c01, 0x4248});
  auto c = kvcomp::io::load_grad_case(dir_);
  EXPECT_EQ(c.x.as<std::uint16_t>()[0], 0x3f81);
  EXPECT_EQ(c.x.as<std::uint16_t>()[1], 0xffff);  // bits are kept, NaN payload included
  EXPECT_EQ(c.x.as<std::uint16_t>()[2], 0x0001);
  EXPECT_EQ(c.wkv.as<std::uint16_t>()[0], 0x3f80);
  EXPECT_EQ(c.wkv.as<std::uint16_t>()[1], 0x4049);

  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "fp16"})");
  save(dir_ / "x.npy", NpyType::f2, {1, 1, 2}, std::vector<std::uint16_t>{0x3c01, 0x8001});
  save(dir_ / "wkv.npy", NpyType::f4, {1, 1}, std::vector<float>{2.0f});
  c = kvcomp::io::load_grad_case(dir_);
  EXPECT_EQ(c.x.as<std::uint16_t>()[0], 0x3c01);
  EXPECT_EQ(c.x.as<std::uint16_t>()[1], 0x8001);
  EXPECT_EQ(c.wkv.as<std::uint16_t>()[0], 0x4000);

  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "fp32"})");
  save(dir_ / "x.npy", NpyType::f2, {1, 1, 1}, std::vector<std::uint16_t>{0x3555});
  save(dir_ / "wkv.npy", NpyType::f8, {1, 1}, std::vector<double>{0.1});
  c = kvcomp::io::load_grad_case(dir_);
  EXPECT_EQ(c.x.dtype, DType::f32);
  EXPECT_EQ(c.x.as<float>()[0], kvcomp::fp16_to_float(0x3555));
  EXPECT_EQ(c.wkv.as<float>()[0], 0.1f);
}

TEST_F(CaseDir, RefusedStorageDtypes) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "dtype": "fp16"})");
  save(dir_ / "x.npy", NpyType::u2, {1, 1, 1}, std::vector<std::uint16_t>{0x3c00});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents, {"x.npy", "bf16 bits"});

  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "bf16"})");
  save(dir_ / "x.npy", NpyType::f8, {1, 1, 1}, std::vector<double>{1.0});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents,
                  {"x.npy", "rounded twice"});

  save(dir_ / "x.npy", NpyType::i4, {1, 1, 1}, std::vector<std::int32_t>{1});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents, {"x.npy", "int32"});

  save(dir_ / "x.npy", NpyType::f4, {1, 1, 1}, std::vector<float>{1});
  save(dir_ / "softmax_score.npy", NpyType::f2, {1, 1}, std::vector<std::uint16_t>{0x3c00});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents,
                  {"softmax_score.npy", "expected float32"});

  save(dir_ / "softmax_score.npy", NpyType::f4, {1, 1}, std::vector<float>{1});
  save(dir_ / "cu_seqlens.npy", NpyType::i8, {2}, std::vector<std::int64_t>{0, 1LL << 40});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents,
                  {"cu_seqlens.npy", "does not fit in int32"});

  fs::remove(dir_ / "cu_seqlens.npy");
  save(dir_ / "seqused.npy", NpyType::f4, {1}, std::vector<float>{1});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents,
                  {"seqused.npy", "int32"});

  fs::remove(dir_ / "seqused.npy");
  save(dir_ / "x.npy", NpyType::f4, {1, 1, 1, 1, 1}, std::vector<float>{1});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents, {"x.npy", "rank 5"});
}

TEST_F(CaseDir, MissingFilesAndDirectories) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "dtype": "bf16"})");
  fs::remove(dir_ / "kv.npy");
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::filesystem,
                  {"kv.npy", "cannot open"});
  fs::remove(dir_ / "meta.json");
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::filesystem, {"meta.json"});
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_ / "absent"); }, IoError::Kind::filesystem,
                  {"absent", "does not exist"});
  write_text(dir_ / "plain", "x");
  expect_io_error([&] { kvcomp::io::load_fwd_case(dir_ / "plain"); }, IoError::Kind::filesystem,
                  {"plain", "not a directory"});
}

TEST_F(CaseDir, LayoutMustAgreeWithRankOfX) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "dtype": "bf16", "layout": "TH"})");
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents,
                  {"meta.json", "layout \"TH\" needs x of rank 2", "(1, 8, 4)"});
  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "bf16", "layout": "BSH"})");
  save(dir_ / "x.npy", NpyType::f4, {8, 4}, std::vector<float>(32, 1.f));
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents,
                  {"layout \"BSH\" needs x of rank 3"});
  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "bf16", "layout": "TH"})");
  EXPECT_EQ(kvcomp::io::load_grad_case(dir_).x.shape, (std::vector<std::int64_t>{8, 4}));
}

TEST_F(CaseDir, BadMetaInCaseDir) {
  write_grad_case(dir_, R"({"cmp_ratio": 4, "dtype": "bf16", "gradEnabled": "yes"})");
  expect_io_error([&] { kvcomp::io::load_grad_case(dir_); }, IoError::Kind::contents,
                  {"meta.json", "grad_enabled"});
}

namespace {

void write_fwd_case(const fs::path& d, const std::string& meta) {
  write_text(d / "meta.json", meta);
  save(d / "x.npy", NpyType::u2, {1, 4, 2}, std::vector<std::uint16_t>(8, 0x3f80));
  save(d / "wkv.npy", NpyType::u2, {2, 2}, std::vector<std::uint16_t>(4, 0x3f80));
  save(d / "wgate.npy", NpyType::u2, {2, 2}, std::vector<std::uint16_t>(4, 0x3f80));
  save(d / "ape.npy", NpyType::f4, {4, 2}, std::vector<float>(8, 0.5f));
  std::vector<float> cache(3 * 2 * 4);
  for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<float>(i);
  save(d / "state_cache.npy", NpyType::f4, {3, 2, 4}, cache);
  save(d / "block_table.npy", NpyType::i4, {1, 2}, std::vector<std::int32_t>{1, 2});
}

}  // namespace

TEST_F(CaseDir, LoadsFwdCaseAndStridedCache) {
  write_fwd_case(dir_, R"({"cmp_ratio": 4, "dtype": "bf16", "grad_enabled": false})");
  auto c = kvcomp::io::load_fwd_case(dir_);
  EXPECT_FALSE(c.meta.grad_enabled);
  EXPECT_EQ(c.ape.shape, (std::vector<std::int64_t>{4, 2}));
  EXPECT_EQ(c.state_cache.shape, (std::vector<std::int64_t>{3, 2, 4}));
  EXPECT_EQ(c.state_cache.as<float>()[23], 23.f);
  ASSERT_TRUE(c.block_table.has_value());
  EXPECT_EQ(c.block_table->as<std::int32_t>()[1], 2);
  EXPECT_EQ(kvcomp::io::state_cache_npy(c).bytes, c.state_cache.bytes);

  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "bf16", "state_cache_stride0": 11})");
  c = kvcomp::io::load_fwd_case(dir_);
  ASSERT_EQ(c.state_cache.bytes.size(), (2 * 11 + 8) * 4u);
  const float* s = c.state_cache.as<float>();
  EXPECT_EQ(s[11], 8.f);  // block 1 starts at the stride
  EXPECT_EQ(s[22 + 7], 23.f);
  EXPECT_TRUE(std::isnan(s[8]));  // gap after block 0
  EXPECT_EQ(c.state_cache.view().shape[0], 3);
  s = nullptr;
  c.state_cache.as<float>()[12] = -1.f;  // as if the operator wrote block 1, slot 0
  const NpyArray packed = kvcomp::io::state_cache_npy(c);
  EXPECT_EQ(packed.shape, (std::vector<std::int64_t>{3, 2, 4}));
  const std::vector<float> back = cast<float>(packed.bytes, 24);
  for (std::size_t i = 0; i < 24; ++i) EXPECT_EQ(back[i], i == 9 ? -1.f : static_cast<float>(i)) << i;

  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "bf16", "state_cache_stride0": 7})");
  expect_io_error([&] { kvcomp::io::load_fwd_case(dir_); }, IoError::Kind::contents,
                  {"state_cache_stride0 (= 7)", "(= 8)"});
  write_text(dir_ / "meta.json",
             R"({"cmp_ratio": 4, "dtype": "bf16", "state_cache_stride0": 4611686018427387904})");
  expect_io_error([&] { kvcomp::io::load_fwd_case(dir_); }, IoError::Kind::contents, {"larger than"});
  write_text(dir_ / "meta.json", R"({"cmp_ratio": 4, "dtype": "bf16"})");
  fs::remove(dir_ / "block_table.npy");
  EXPECT_FALSE(kvcomp::io::load_fwd_case(dir_).block_table.has_value());
  fs::remove(dir_ / "ape.npy");
  expect_io_error([&] { kvcomp::io::load_fwd_case(dir_); }, IoError::Kind::filesystem, {"ape.npy"});
}

// ---------------------------------------------------------------- outputs

TEST(OutputNpy, Dtypes) {
  auto t = kvcomp::io::HostTensor::zeros(DType::bf16, {2});
  t.as<std::uint16_t>()[0] = 0x3f81;
  t.as<std::uint16_t>()[1] = 0xc000;
  NpyArray a = kvcomp::io::output_npy(t, kvcomp::io::OutDType::f32);
  EXPECT_EQ(a.type, NpyType::f4);
  EXPECT_EQ(cast<float>(a.bytes, 2), (std::vector<float>{1.0078125f, -2.0f}));
  a = kvcomp::io::output_npy(t, kvcomp::io::OutDType::io);
  EXPECT_EQ(a.type, NpyType::u2);
  EXPECT_EQ(cast<std::uint16_t>(a.bytes, 2), (std::vector<std::uint16_t>{0x3f81, 0xc000}));

  auto h = kvcomp::io::HostTensor::zeros(DType::f16, {1, 1});
  h.as<std::uint16_t>()[0] = 0x3555;
  EXPECT_EQ(kvcomp::io::output_npy(h, kvcomp::io::OutDType::io).type, NpyType::f2);
  EXPECT_EQ(cast<float>(kvcomp::io::output_npy(h, kvcomp::io::OutDType::f32).bytes, 1)[0],
            kvcomp::fp16_to_float(0x3555));

  auto f = kvcomp::io::HostTensor::zeros(DType::f32, {0, 3});
  EXPECT_EQ(f.bytes.size(), 1u);  // never a null view
  a = kvcomp::io::output_npy(f, kvcomp::io::OutDType::io);
  EXPECT_EQ(a.type, NpyType::f4);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{0, 3}));
  EXPECT_TRUE(a.bytes.empty());
}

namespace {

NpyArray floats(std::vector<std::int64_t> shape, float value) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  const auto b = raw(std::vector<float>(static_cast<std::size_t>(n), value));
  return kvcomp::io::make_npy(NpyType::f4, std::move(shape), b.data(), b.size());
}

}  // namespace

using Outputs = TempDir;

TEST_F(Outputs, WritesEveryFileAndNoTemporaries) {
  const fs::path out = dir_ / "new" / "deeper";
  kvcomp::io::write_outputs(out, {{"a.npy", floats({2}, 1.f)}, {"b.npy", floats({3, 1}, 2.f)}});
  EXPECT_EQ(listing(out), (std::set<std::string>{"a.npy", "b.npy"}));
  EXPECT_EQ(cast<float>(kvcomp::io::read_npy(out / "a.npy").bytes, 2), (std::vector<float>{1.f, 1.f}));
  EXPECT_EQ(kvcomp::io::read_npy(out / "b.npy").shape, (std::vector<std::int64_t>{3, 1}));

  kvcomp::io::write_outputs(out, {{"a.npy", floats({1}, 5.f)}});
  EXPECT_EQ(listing(out), (std::set<std::string>{"a.npy", "b.npy"}));
  EXPECT_EQ(cast<float>(kvcomp::io::read_npy(out / "a.npy").bytes, 1)[0], 5.f);
}

TEST_F(Outputs, FailingWriteLeavesNoPartialFiles) {
  // A file-size limit makes the second (large) file fail mid-write with EFBIG,
  // after the first one was written completely: a real I/O failure.
  struct rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  if (old.rlim_max != RLIM_INFINITY && old.rlim_max < 8192) GTEST_SKIP() << "hard RLIMIT_FSIZE too low";
  kvcomp::io::write_outputs(dir_, {{"a.npy", floats({4}, 7.f)}});  // an older output that must survive
  const auto before = kvcomp::io::read_npy(dir_ / "a.npy").bytes;

  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old;
  lim.rlim_cur = 8192;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  bool threw = false;
  try {
    kvcomp::io::write_outputs(dir_, {{"a.npy", floats({16}, 1.f)}, {"b.npy", floats({4096}, 2.f)}});
  } catch (const IoError& e) {
    threw = true;
    EXPECT_EQ(e.kind(), IoError::Kind::filesystem);
    EXPECT_NE(std::string(e.what()).find("write failed"), std::string::npos) << e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(threw);
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"a.npy"}));
  EXPECT_EQ(kvcomp::io::read_npy(dir_ / "a.npy").bytes, before);
}

TEST_F(Outputs, FailuresFoundBeforeWritingTouchNothing) {
  fs::create_directory(dir_ / "b.npy");
  expect_io_error(
      [&] {
        kvcomp::io::write_outputs(dir_, {{"a.npy", floats({2}, 1.f)}, {"b.npy", floats({2}, 1.f)}});
      },
      IoError::Kind::filesystem, {"b.npy", "not a regular file"});
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"b.npy"}));

  NpyArray broken = floats({2}, 1.f);
  broken.bytes.pop_back();
  expect_io_error(
      [&] {
        kvcomp::io::write_outputs(dir_, {{"a.npy", floats({2}, 1.f)}, {"c.npy", broken}});
      },
      IoError::Kind::contents, {"c.npy", "holds 7 bytes"});
  expect_io_error(
      [&] {
        kvcomp::io::write_outputs(dir_, {{"a.npy", floats({2}, 1.f)}, {"a.npy", floats({2}, 1.f)}});
      },
      IoError::Kind::contents, {"given twice"});
  expect_io_error(
      [&] {
        kvcomp::io::write_outputs(dir_, {{"../a.npy", floats({2}, 1.f)}});
      },
      IoError::Kind::contents, {"invalid output file name"});
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"b.npy"}));

  write_text(dir_ / "file", "x");
  expect_io_error(
      [&] {
        kvcomp::io::write_outputs(dir_ / "file" / "sub", {{"a.npy", floats({2}, 1.f)}});
      },
      IoError::Kind::filesystem, {"cannot create the output directory"});
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"b.npy", "file"}));
}
