// Tests of the .npy reader/writer of the CLI. Hostile files are built byte
// by byte here, so each rejection is tested on exactly the defect it names.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "io_test_helpers.hpp"

using namespace io_test;  // NOLINT(google-build-using-namespace): the helpers of this suite

// ---------------------------------------------------------------- .npy files

using NpyRoundTrip = TempDir;

TEST_F(NpyRoundTrip, EveryDtype) {
  const fs::path p = dir_ / "a.npy";
  save(p, NpyType::f4, {2, 3}, std::vector<float>{0.f, 1.f, -2.5f, 3.25f, 1e-30f, -7e20f});
  NpyArray a = kvcomp::io::read_npy(p);
  EXPECT_EQ(a.type, NpyType::f4);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(cast<float>(a.bytes, 6), (std::vector<float>{0.f, 1.f, -2.5f, 3.25f, 1e-30f, -7e20f}));

  save(p, NpyType::f2, {3}, std::vector<std::uint16_t>{0x3c00, 0xc000, 0x7c00});
  a = kvcomp::io::read_npy(p);
  EXPECT_EQ(a.type, NpyType::f2);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{3}));
  EXPECT_EQ(cast<std::uint16_t>(a.bytes, 3), (std::vector<std::uint16_t>{0x3c00, 0xc000, 0x7c00}));

  save(p, NpyType::u2, {1, 2}, std::vector<std::uint16_t>{0x3f80, 0xbf81});
  a = kvcomp::io::read_npy(p);
  EXPECT_EQ(a.type, NpyType::u2);
  EXPECT_EQ(cast<std::uint16_t>(a.bytes, 2), (std::vector<std::uint16_t>{0x3f80, 0xbf81}));

  save(p, NpyType::i4, {4}, std::vector<std::int32_t>{0, -1, 2147483647, -2147483647 - 1});
  a = kvcomp::io::read_npy(p);
  EXPECT_EQ(a.type, NpyType::i4);
  EXPECT_EQ(kvcomp::io::npy_to_i32(a, "a"), (std::vector<std::int32_t>{0, -1, 2147483647, -2147483647 - 1}));

  save(p, NpyType::f8, {2}, std::vector<double>{0.1, -3.0});
  a = kvcomp::io::read_npy(p);
  EXPECT_EQ(a.type, NpyType::f8);
  EXPECT_EQ(cast<double>(a.bytes, 2), (std::vector<double>{0.1, -3.0}));

  save(p, NpyType::i8, {2}, std::vector<std::int64_t>{5, -6});
  a = kvcomp::io::read_npy(p);
  EXPECT_EQ(a.type, NpyType::i8);
  EXPECT_EQ(cast<std::int64_t>(a.bytes, 2), (std::vector<std::int64_t>{5, -6}));
}

TEST_F(NpyRoundTrip, WritesNumpyHeaderLayout) {
  const std::vector<unsigned char> b = raw(std::vector<float>{1, 2, 3, 4, 5, 6});
  const auto file = kvcomp::io::encode_npy(kvcomp::io::make_npy(NpyType::f4, {2, 3}, b.data(), b.size()));
  ASSERT_GE(file.size(), 10u);
  EXPECT_EQ(file[0], 0x93);
  EXPECT_EQ(std::string(file.begin() + 1, file.begin() + 6), "NUMPY");
  EXPECT_EQ(file[6], 1);
  EXPECT_EQ(file[7], 0);
  const std::size_t hlen = file[8] | (file[9] << 8);
  EXPECT_EQ((10 + hlen) % 64, 0u);
  const std::string header(file.begin() + 10, file.begin() + 10 + static_cast<std::ptrdiff_t>(hlen));
  EXPECT_EQ(header.rfind("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 0), 0u);
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(file.size(), 10 + hlen + 24);
  EXPECT_EQ(cast<float>(std::vector<unsigned char>(file.end() - 24, file.end()), 6),
            (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

TEST_F(NpyRoundTrip, ScalarAndEmptyArrays) {
  const fs::path p = dir_ / "s.npy";
  save(p, NpyType::f4, {}, std::vector<float>{42.f});
  NpyArray a = kvcomp::io::read_npy(p);
  EXPECT_TRUE(a.shape.empty());
  EXPECT_EQ(a.numel(), 1);
  EXPECT_EQ(cast<float>(a.bytes, 1)[0], 42.f);

  save(p, NpyType::u2, {0, 5}, std::vector<std::uint16_t>{});
  a = kvcomp::io::read_npy(p);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{0, 5}));
  EXPECT_EQ(a.numel(), 0);
  EXPECT_TRUE(a.bytes.empty());
}

TEST_F(NpyRoundTrip, ReadsVersions2And3AndLenientSpelling) {
  for (int major : {2, 3}) {
    write_file(dir_ / "v.npy", npy_file(kF4Header, kTwoFloats, major));
    const NpyArray a = kvcomp::io::read_npy(dir_ / "v.npy");
    EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2}));
    EXPECT_EQ(cast<float>(a.bytes, 2), (std::vector<float>{1.5f, -2.0f}));
  }
  // Any key order, double quotes, '|' order, no trailing comma, no padding.
  write_file(dir_ / "w.npy", npy_file("{\"shape\": (1, 2), \"fortran_order\": False, \"descr\": \"|f4\"}",
                                      kTwoFloats, 1, false));
  const NpyArray a = kvcomp::io::read_npy(dir_ / "w.npy");
  EXPECT_EQ(a.type, NpyType::f4);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(cast<float>(a.bytes, 2), (std::vector<float>{1.5f, -2.0f}));
}

TEST_F(NpyRoundTrip, ParsesInMemoryBytes) {
  const auto file = npy_file(kF4Header, kTwoFloats);
  const NpyArray a = kvcomp::io::parse_npy(file, "mem");
  EXPECT_EQ(cast<float>(a.bytes, 2), (std::vector<float>{1.5f, -2.0f}));
  auto shortened = file;
  shortened.pop_back();
  expect_io_error([&] { kvcomp::io::parse_npy(shortened, "mem"); }, IoError::Kind::contents,
                  {"mem", "truncated data"});
}

using NpyReject = TempDir;

TEST_F(NpyReject, MissingFileAndDirectory) {
  expect_io_error([&] { kvcomp::io::read_npy(dir_ / "nope.npy"); }, IoError::Kind::filesystem,
                  {"nope.npy", "cannot open"});
  fs::create_directory(dir_ / "d.npy");
  expect_io_error([&] { kvcomp::io::read_npy(dir_ / "d.npy"); }, IoError::Kind::filesystem,
                  {"d.npy", "directory"});
}

TEST_F(NpyReject, BadPreamble) {
  const fs::path p = dir_ / "x.npy";
  auto file = npy_file(kF4Header, kTwoFloats);
  file[1] = 'n';
  write_file(p, file);
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"x.npy", "bad magic"});

  write_file(p, {0x93, 'N', 'U', 'M', 'P'});
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"x.npy", "too short"});

  write_file(p, {});
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"x.npy", "too short"});

  file = npy_file(kF4Header, kTwoFloats);
  file[6] = 4;
  write_file(p, file);
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"version 4.0"});

  file = npy_file(kF4Header, kTwoFloats);
  file[7] = 1;
  write_file(p, file);
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"version 1.1"});

  // Version 2 preamble cut before its 4-byte length.
  write_file(p, {0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 10, 0, 0});
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"x.npy", "preamble"});
}

TEST_F(NpyReject, TruncatedHeader) {
  const fs::path p = dir_ / "x.npy";
  auto file = npy_file(kF4Header, {});
  file.resize(40);
  write_file(p, file);
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"x.npy", "truncated header"});
}

TEST_F(NpyReject, HeaderAboveCap) {
  const fs::path p = dir_ / "x.npy";
  write_file(p, npy_file(kF4Header, kTwoFloats));
  kvcomp::io::NpyLimits lim;
  lim.max_header_bytes = 32;
  expect_io_error([&] { kvcomp::io::read_npy(p, lim); }, IoError::Kind::contents,
                  {"x.npy", "header length 118"});
}

TEST_F(NpyReject, MalformedHeaderDicts) {
  const fs::path p = dir_ / "h.npy";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[1, 2]", "not a Python dict"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "expected ',' or '}'"},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}", "expected ',' or '}'"},
      {"{'descr' '<f4', 'fortran_order': False, 'shape': (2,)}", "expected ':'"},
      {"{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}", "expected ',' or '}'"},
      {"{descr: '<f4', 'fortran_order': False, 'shape': (2,)}", "quoted string"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} x", "after the header dict"},
      {"{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", "True or False"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2]}", "must be a tuple"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", "must be a tuple"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}", "negative dimension"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (02,)}", "leading zero"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}", "expected ',' or ')'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (,)}", "tuple of integers"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}", "overflows int64"},
      {"{'descr': '<f4', 'fortran_order': False}", "lacks the key 'shape'"},
      {"{'fortran_order': False, 'shape': (2,)}", "lacks the key 'descr'"},
      {"{'descr': '<f4', 'shape': (2,)}", "lacks the key 'fortran_order'"},
      {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", "duplicate key 'descr'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}", "unexpected key 'extra'"},
      {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}", "'descr' must be a string"},
      {"{'descr': '<f\\4', 'fortran_order': False, 'shape': (2,)}", "unsupported character"},
  };
  for (const auto& [header, fragment] : cases) {
    write_file(p, npy_file(header, kTwoFloats));
    SCOPED_TRACE(header);
    expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"h.npy", fragment});
  }
}

TEST_F(NpyReject, FortranOrder) {
  const fs::path p = dir_ / "f.npy";
  write_file(p, npy_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", kTwoFloats));
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents,
                  {"f.npy", "Fortran-order arrays are not supported"});
}

TEST_F(NpyReject, UnsupportedDescriptors) {
  const fs::path p = dir_ / "d.npy";
  write_file(p, npy_file("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", kTwoFloats));
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents,
                  {"d.npy", "big-endian data ('>f4') is not supported"});
  for (const char* d : {"<f16", "<u4", "|b1", "<c8", "=f4", "f4", "<U8", "|O"}) {
    write_file(p, npy_file(std::string("{'descr': '") + d + "', 'fortran_order': False, 'shape': (2,), }",
                           kTwoFloats));
    SCOPED_TRACE(d);
    expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents,
                    {"d.npy", std::string("unsupported dtype '") + d + "'"});
  }
}

TEST_F(NpyReject, ShapeOverflowAndCaps) {
  const fs::path p = dir_ / "o.npy";
  write_file(p,
             npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", {}));
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents,
                  {"o.npy", "overflows the element count"});
  write_file(p,
             npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952, 2), }", {}));
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents,
                  {"o.npy", "overflows the byte count"});
  // 64 TiB promised by a 128-byte file: refused on the header, nothing allocated.
  write_file(p, npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 16), }", {}));
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"o.npy", "above the limit"});
  write_file(p, npy_file(kF4Header, kTwoFloats));
  kvcomp::io::NpyLimits lim;
  lim.max_data_bytes = 7;
  expect_io_error([&] { kvcomp::io::read_npy(p, lim); }, IoError::Kind::contents,
                  {"needs 8 bytes", "limit of 7"});
  lim = {};
  lim.max_rank = 1;
  write_file(p, npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2), }", kTwoFloats));
  expect_io_error([&] { kvcomp::io::read_npy(p, lim); }, IoError::Kind::contents, {"more than 1 dimensions"});
}

TEST_F(NpyReject, DataShorterOrLongerThanPromised) {
  const fs::path p = dir_ / "s.npy";
  write_file(p, npy_file(kF4Header, std::vector<unsigned char>(kTwoFloats.begin(), kTwoFloats.end() - 1)));
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents,
                  {"s.npy", "truncated data", "needs 8 bytes", "holds 7"});
  auto longer = kTwoFloats;
  longer.push_back(0);
  write_file(p, npy_file(kF4Header, longer));
  expect_io_error([&] { kvcomp::io::read_npy(p); }, IoError::Kind::contents, {"s.npy", "1 unexpected bytes"});
}

TEST(NpyConvert, Float64ToFloat32) {
  const auto b = raw(std::vector<double>{1.5, -0.25, std::numeric_limits<double>::infinity(), 1e-50});
  const NpyArray a = kvcomp::io::make_npy(NpyType::f8, {4}, b.data(), b.size());
  const std::vector<float> f = kvcomp::io::npy_to_f32(a, "a");
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[1], -0.25f);
  EXPECT_EQ(f[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(f[3], 0.0f);
  const auto nanb = raw(std::vector<double>{std::nan("")});
  EXPECT_TRUE(
      std::isnan(kvcomp::io::npy_to_f32(kvcomp::io::make_npy(NpyType::f8, {1}, nanb.data(), 8), "n")[0]));

  const auto big = raw(std::vector<double>{0.0, -1e39});
  expect_io_error(
      [&] { kvcomp::io::npy_to_f32(kvcomp::io::make_npy(NpyType::f8, {2}, big.data(), 16), "big"); },
      IoError::Kind::contents, {"big", "flat index 1", "outside the float32 range"});
  const auto ints = raw(std::vector<std::int32_t>{1});
  expect_io_error(
      [&] { kvcomp::io::npy_to_f32(kvcomp::io::make_npy(NpyType::i4, {1}, ints.data(), 4), "i"); },
      IoError::Kind::contents, {"int32", "expected float32"});
}

TEST(NpyConvert, Int64ToInt32WithRangeCheck) {
  const auto b = raw(std::vector<std::int64_t>{-5, 2147483647, -2147483648LL});
  const auto v = kvcomp::io::npy_to_i32(kvcomp::io::make_npy(NpyType::i8, {3}, b.data(), b.size()), "a");
  EXPECT_EQ(v, (std::vector<std::int32_t>{-5, 2147483647, -2147483647 - 1}));
  for (std::int64_t bad : {2147483648LL, -2147483649LL}) {
    const auto bb = raw(std::vector<std::int64_t>{0, 0, bad});
    expect_io_error(
        [&] { kvcomp::io::npy_to_i32(kvcomp::io::make_npy(NpyType::i8, {3}, bb.data(), 24), "c"); },
        IoError::Kind::contents, {"c", "flat index 2", "does not fit in int32"});
  }
  const auto f = raw(std::vector<float>{1.f});
  expect_io_error([&] { kvcomp::io::npy_to_i32(kvcomp::io::make_npy(NpyType::f4, {1}, f.data(), 4), "f"); },
                  IoError::Kind::contents, {"float32", "expected int32"});
}

TEST(NpyConvert, MakeNpyChecksByteCount) {
  const auto b = raw(std::vector<float>{1.f, 2.f});
  expect_io_error([&] { kvcomp::io::make_npy(NpyType::f4, {3}, b.data(), b.size()); },
                  IoError::Kind::contents, {"holds 8 bytes"});
}
