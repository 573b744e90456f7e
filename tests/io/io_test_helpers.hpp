// Helpers of the io tests (test_npy.cpp, test_case_dir.cpp): a temporary
// directory per test, raw bytes, hand-built .npy files, and the check that an
// IoError names its defect.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "io/case_dir.hpp"
#include "io/npy.hpp"

namespace io_test {

namespace fs = std::filesystem;
using kvcomp::DType;
using kvcomp::io::IoError;
using kvcomp::io::NpyArray;
using kvcomp::io::NpyType;

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "kvcomp_io_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path dir_;
};

template <typename T>
std::vector<unsigned char> raw(const std::vector<T>& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename T>
std::vector<T> cast(const std::vector<unsigned char>& b, std::size_t n) {
  std::vector<T> v(n);
  if (n) std::memcpy(v.data(), b.data(), n * sizeof(T));
  return v;
}

// A complete .npy file with an arbitrary header text (padded like numpy).
inline std::vector<unsigned char> npy_file(const std::string& header, const std::vector<unsigned char>& data,
                                           int major = 1, bool pad = true) {
  std::string h = header;
  const std::size_t pre = major == 1 ? 10 : 12;
  if (pad) {
    h.append((64 - (pre + h.size() + 1) % 64) % 64, ' ');
    h += '\n';
  }
  std::vector<unsigned char> out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  const auto len = static_cast<std::uint32_t>(h.size());
  out.push_back(static_cast<unsigned char>(len & 0xff));
  out.push_back(static_cast<unsigned char>((len >> 8) & 0xff));
  if (major != 1) {
    out.push_back(static_cast<unsigned char>((len >> 16) & 0xff));
    out.push_back(static_cast<unsigned char>((len >> 24) & 0xff));
  }
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

inline void write_file(const fs::path& p, const std::vector<unsigned char>& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good());
}

inline void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
  ASSERT_TRUE(f.good());
}

template <typename T>
void save(const fs::path& p, NpyType t, std::vector<std::int64_t> shape, const std::vector<T>& v) {
  const auto b = raw(v);
  kvcomp::io::write_npy(p, kvcomp::io::make_npy(t, std::move(shape), b.data(), b.size()));
}

// Runs f, expects an IoError of the given kind whose message contains every
// fragment.
template <typename F>
void expect_io_error(F&& f, IoError::Kind kind, std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "no IoError thrown";
  } catch (const IoError& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.code(), kind == IoError::Kind::contents ? 161002 : 361001);
    for (const auto& frag : fragments)
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos) << e.what();
  }
}

inline const std::string kF4Header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
inline const std::vector<unsigned char> kTwoFloats = raw(std::vector<float>{1.5f, -2.0f});

inline std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

}  // namespace io_test
