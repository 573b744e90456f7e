#include "io/npy.hpp"

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>
#include <system_error>

namespace kvcomp::io {

// The element bytes are copied as they are, so the host must share the file's
// byte order. Every target of this project is x86-64.
static_assert(std::endian::native == std::endian::little, "kvcomp::io assumes a little-endian host");

namespace {

using Kind = IoError::Kind;

constexpr unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

[[noreturn]] void bad(const std::string& name, const std::string& what) {
  throw IoError(Kind::contents, name + ": " + what);
}

[[noreturn]] void fs_fail(const std::string& name, const std::string& what) {
  throw IoError(Kind::filesystem, name + ": " + what);
}

std::string errno_text(int err) { return std::generic_category().message(err); }

struct FileCloser {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

// ---- header dictionary ---------------------------------------------------

struct Header {
  NpyType type = NpyType::f4;
  std::vector<std::int64_t> shape;
  std::uint64_t data_bytes = 0;
};

// A parser for exactly the subset of Python literal syntax numpy writes:
// a dict with the keys 'descr' (str), 'fortran_order' (bool) and 'shape'
// (tuple of non-negative ints). Anything else is rejected, not guessed at.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& name, const NpyLimits& limits)
      : s_(text), name_(name), limits_(limits) {}

  Header parse() {
    skip_ws();
    if (!eat('{')) fail("header is not a Python dict (expected '{')");
    std::optional<std::string> descr;
    std::optional<bool> fortran;
    std::optional<std::vector<std::int64_t>> shape;
    skip_ws();
    while (!eat('}')) {
      const std::string key = parse_string("dict key");
      skip_ws();
      if (!eat(':')) fail("expected ':' after key '" + key + "'");
      skip_ws();
      if (key == "descr") {
        if (descr) fail("duplicate key 'descr'");
        if (at_end() || (peek() != '\'' && peek() != '"'))
          fail("'descr' must be a string (structured dtypes are not supported)");
        descr = parse_string("descr");
      } else if (key == "fortran_order") {
        if (fortran) fail("duplicate key 'fortran_order'");
        fortran = parse_bool();
      } else if (key == "shape") {
        if (shape) fail("duplicate key 'shape'");
        shape = parse_shape();
      } else {
        fail("unexpected key '" + key + "' in header");
      }
      skip_ws();
      if (eat(',')) {
        skip_ws();
        continue;
      }
      if (eat('}')) break;
      fail("expected ',' or '}' in header dict");
    }
    skip_ws();
    if (!at_end()) fail("unexpected text after the header dict");
    if (!descr) fail("header lacks the key 'descr'");
    if (!fortran) fail("header lacks the key 'fortran_order'");
    if (!shape) fail("header lacks the key 'shape'");
    if (*fortran) fail("Fortran-order arrays are not supported (fortran_order is True); save in C order");

    Header h;
    h.type = parse_descr(*descr);
    h.shape = std::move(*shape);
    std::uint64_t count = 1;
    for (const std::int64_t d : h.shape) {
      const auto ud = static_cast<std::uint64_t>(d);
      if (ud != 0 && count > std::numeric_limits<std::uint64_t>::max() / ud)
        fail("shape " + shape_string(h.shape) + " overflows the element count");
      count *= ud;
    }
    if (count > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail("shape " + shape_string(h.shape) + " overflows the element count");
    const std::uint64_t item = npy_itemsize(h.type);
    if (count > std::numeric_limits<std::uint64_t>::max() / item)
      fail("shape " + shape_string(h.shape) + " overflows the byte count");
    h.data_bytes = count * item;
    if (h.data_bytes > limits_.max_data_bytes)
      fail("shape " + shape_string(h.shape) + " needs " + std::to_string(h.data_bytes) +
           " bytes, above the limit of " + std::to_string(limits_.max_data_bytes));
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { bad(name_, what); }

  bool at_end() const { return i_ >= s_.size(); }
  char peek() const { return s_[i_]; }
  bool eat(char c) {
    if (!at_end() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void skip_ws() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++i_;
  }

  std::string parse_string(const char* what) {
    if (at_end() || (peek() != '\'' && peek() != '"'))
      fail(std::string("expected a quoted string for the ") + what);
    const char quote = s_[i_++];
    std::string out;
    while (true) {
      if (at_end()) fail(std::string("unterminated string in the ") + what);
      const char c = s_[i_++];
      if (c == quote) break;
      // numpy never writes escapes or control characters; refusing them keeps
      // the parser trivially correct.
      if (c == '\\' || static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f)
        fail(std::string("unsupported character in the ") + what);
      out.push_back(c);
    }
    return out;
  }

  bool parse_bool() {
    if (s_.substr(i_).starts_with("True")) {
      i_ += 4;
      return true;
    }
    if (s_.substr(i_).starts_with("False")) {
      i_ += 5;
      return false;
    }
    fail("'fortran_order' must be True or False");
  }

  std::int64_t parse_dim() {
    if (!at_end() && peek() == '-') fail("negative dimension in 'shape'");
    if (at_end() || peek() < '0' || peek() > '9') fail("'shape' must be a tuple of integers");
    if (peek() == '0' && i_ + 1 < s_.size() && s_[i_ + 1] >= '0' && s_[i_ + 1] <= '9')
      fail("malformed integer in 'shape' (leading zero)");
    std::int64_t v = 0;
    while (!at_end() && peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10)
        fail("dimension in 'shape' overflows int64");
      v = v * 10 + digit;
      ++i_;
    }
    return v;
  }

  std::vector<std::int64_t> parse_shape() {
    if (!eat('(')) fail("'shape' must be a tuple");
    std::vector<std::int64_t> dims;
    skip_ws();
    if (eat(')')) return dims;
    while (true) {
      dims.push_back(parse_dim());
      if (dims.size() > limits_.max_rank)
        fail("'shape' has more than " + std::to_string(limits_.max_rank) + " dimensions");
      skip_ws();
      if (eat(')')) {
        // "(5)" is an int in Python, not a tuple.
        if (dims.size() == 1) fail("'shape' must be a tuple ('(n,)' for one dimension)");
        return dims;
      }
      if (!eat(',')) fail("expected ',' or ')' in 'shape'");
      skip_ws();
      if (eat(')')) return dims;
    }
  }

  NpyType parse_descr(const std::string& d) const {
    if (d.size() >= 2 && d[0] == '>')
      fail("big-endian data ('" + d + "') is not supported; save little-endian");
    if (d.size() == 3 && (d[0] == '<' || d[0] == '|')) {
      const std::string_view t = std::string_view(d).substr(1);
      if (t == "f4") return NpyType::f4;
      if (t == "f2") return NpyType::f2;
      if (t == "u2") return NpyType::u2;
      if (t == "i4") return NpyType::i4;
      if (t == "f8") return NpyType::f8;
      if (t == "i8") return NpyType::i8;
    }
    fail("unsupported dtype '" + d + "' (supported: <f4, <f2, <u2 (bf16 bits), <i4, <f8, <i8)");
  }

  std::string_view s_;
  std::size_t i_ = 0;
  const std::string& name_;
  const NpyLimits& limits_;
};

// Parses the fixed preamble (magic, version, header length) from the first
// bytes of a file of `file_size` bytes. Returns {header offset, header length}.
std::pair<std::size_t, std::size_t> parse_preamble(std::span<const unsigned char> first,
                                                   std::uint64_t file_size, const std::string& name,
                                                   const NpyLimits& limits) {
  if (file_size < 10 || first.size() < 10)
    bad(name, "truncated: " + std::to_string(file_size) + " bytes is too short for a .npy file");
  if (std::memcmp(first.data(), kMagic, sizeof kMagic) != 0) bad(name, "not a .npy file (bad magic string)");
  const unsigned major = first[6], minor = first[7];
  if (major < 1 || major > 3 || minor != 0)
    bad(name, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor));
  std::size_t offset = 10;
  std::uint64_t len = first[8] | (static_cast<std::uint64_t>(first[9]) << 8);
  if (major >= 2) {
    if (file_size < 12 || first.size() < 12) bad(name, "truncated in the .npy preamble");
    len |= (static_cast<std::uint64_t>(first[10]) << 16) | (static_cast<std::uint64_t>(first[11]) << 24);
    offset = 12;
  }
  if (len > limits.max_header_bytes)
    bad(name, "header length " + std::to_string(len) + " is above the limit of " +
                  std::to_string(limits.max_header_bytes));
  if (len > file_size - offset)
    bad(name, "truncated header: " + std::to_string(len) + " bytes promised, " +
                  std::to_string(file_size - offset) + " present");
  return {offset, static_cast<std::size_t>(len)};
}

void check_data_size(const Header& h, std::uint64_t available, const std::string& name) {
  if (available < h.data_bytes)
    bad(name, "truncated data: shape " + shape_string(h.shape) + " needs " + std::to_string(h.data_bytes) +
                  " bytes, the file holds " + std::to_string(available));
  if (available > h.data_bytes)
    bad(name, std::to_string(available - h.data_bytes) + " unexpected bytes after the data of shape " +
                  shape_string(h.shape));
}

std::string header_text(const NpyArray& a) {
  std::string h = "{'descr': '";
  h += npy_descr(a.type);
  h += "', 'fortran_order': False, 'shape': ";
  h += shape_string(a.shape);
  h += ", }";
  // numpy pads with spaces so that the data starts 64-byte aligned and ends
  // the header with a newline; readers rely on neither but we match it.
  const std::size_t unpadded = 10 + h.size() + 1;
  h.append((64 - unpadded % 64) % 64, ' ');
  h += '\n';
  return h;
}

void check_consistent(const NpyArray& a, const std::string& name) {
  const std::int64_t n = a.numel();
  if (n < 0) bad(name, "shape " + shape_string(a.shape) + " is invalid or overflows");
  const auto want = static_cast<std::uint64_t>(n);
  const std::uint64_t item = npy_itemsize(a.type);
  if (want > std::numeric_limits<std::uint64_t>::max() / item || want * item != a.bytes.size())
    bad(name, "array of shape " + shape_string(a.shape) + " and dtype " + npy_type_name(a.type) + " holds " +
                  std::to_string(a.bytes.size()) + " bytes");
}

}  // namespace

std::size_t npy_itemsize(NpyType t) {
  switch (t) {
    case NpyType::f2:
    case NpyType::u2:
      return 2;
    case NpyType::f4:
    case NpyType::i4:
      return 4;
    case NpyType::f8:
    case NpyType::i8:
      return 8;
  }
  return 1;
}

const char* npy_descr(NpyType t) {
  switch (t) {
    case NpyType::f4:
      return "<f4";
    case NpyType::f2:
      return "<f2";
    case NpyType::u2:
      return "<u2";
    case NpyType::i4:
      return "<i4";
    case NpyType::f8:
      return "<f8";
    case NpyType::i8:
      return "<i8";
  }
  return "?";
}

const char* npy_type_name(NpyType t) {
  switch (t) {
    case NpyType::f4:
      return "float32";
    case NpyType::f2:
      return "float16";
    case NpyType::u2:
      return "uint16";
    case NpyType::i4:
      return "int32";
    case NpyType::f8:
      return "float64";
    case NpyType::i8:
      return "int64";
  }
  return "?";
}

std::int64_t NpyArray::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

NpyArray parse_npy(std::span<const unsigned char> file, const std::string& name, const NpyLimits& limits) {
  const auto [offset, len] =
      parse_preamble(file.first(std::min<std::size_t>(file.size(), 12)), file.size(), name, limits);
  const std::string_view text(reinterpret_cast<const char*>(file.data() + offset), len);
  Header h = HeaderParser(text, name, limits).parse();
  const std::size_t data_at = offset + len;
  check_data_size(h, file.size() - data_at, name);
  NpyArray a;
  a.type = h.type;
  a.shape = std::move(h.shape);
  a.bytes.assign(file.begin() + static_cast<std::ptrdiff_t>(data_at), file.end());
  return a;
}

NpyArray read_npy(const std::filesystem::path& path, const NpyLimits& limits) {
  const std::string name = path.string();
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st))
    fs_fail(name, "cannot open: " + (ec ? ec.message() : errno_text(ENOENT)));
  if (std::filesystem::is_directory(st)) fs_fail(name, "is a directory, not a .npy file");
  // FIFOs and devices have no size to check against the header.
  if (!std::filesystem::is_regular_file(st)) fs_fail(name, "not a regular file");

  FilePtr f(std::fopen(name.c_str(), "rb"));
  if (!f) fs_fail(name, "cannot open: " + errno_text(errno));
  if (std::fseek(f.get(), 0, SEEK_END) != 0) fs_fail(name, "cannot seek: " + errno_text(errno));
  const long end = std::ftell(f.get());
  if (end < 0) fs_fail(name, "cannot tell the file size: " + errno_text(errno));
  std::rewind(f.get());
  const auto file_size = static_cast<std::uint64_t>(end);

  auto read_exact = [&](unsigned char* dst, std::size_t n) {
    if (n != 0 && std::fread(dst, 1, n, f.get()) != n) {
      if (std::ferror(f.get())) fs_fail(name, "read failed: " + errno_text(errno));
      fs_fail(name, "file shrank while being read");
    }
  };

  unsigned char first[12] = {};
  const std::size_t first_n = static_cast<std::size_t>(std::min<std::uint64_t>(file_size, sizeof first));
  read_exact(first, first_n);
  const auto [offset, len] =
      parse_preamble(std::span<const unsigned char>(first, first_n), file_size, name, limits);

  // Re-read from the header start: the preamble buffer may already hold a few
  // header bytes (version 1 preambles are 10 bytes long).
  if (std::fseek(f.get(), static_cast<long>(offset), SEEK_SET) != 0)
    fs_fail(name, "cannot seek: " + errno_text(errno));
  std::string text(len, '\0');
  read_exact(reinterpret_cast<unsigned char*>(text.data()), len);
  Header h = HeaderParser(text, name, limits).parse();
  check_data_size(h, file_size - offset - len, name);

  NpyArray a;
  a.type = h.type;
  a.shape = std::move(h.shape);
  a.bytes.resize(static_cast<std::size_t>(h.data_bytes));
  read_exact(a.bytes.data(), a.bytes.size());
  if (std::fgetc(f.get()) != EOF) bad(name, "file grew while being read");
  return a;
}

std::vector<unsigned char> encode_npy(const NpyArray& array) {
  check_consistent(array, "encode_npy");
  const std::string h = header_text(array);
  if (h.size() > 0xffff) bad("encode_npy", "header too long for format version 1.0");
  std::vector<unsigned char> out(10 + h.size() + array.bytes.size());
  std::memcpy(out.data(), kMagic, sizeof kMagic);
  out[6] = 1;
  out[7] = 0;
  out[8] = static_cast<unsigned char>(h.size() & 0xff);
  out[9] = static_cast<unsigned char>(h.size() >> 8);
  std::memcpy(out.data() + 10, h.data(), h.size());
  if (!array.bytes.empty()) std::memcpy(out.data() + 10 + h.size(), array.bytes.data(), array.bytes.size());
  return out;
}

void write_npy(const std::filesystem::path& path, const NpyArray& array, bool exclusive) {
  const std::string name = path.string();
  check_consistent(array, name);
  const std::string h = header_text(array);
  if (h.size() > 0xffff) bad(name, "header too long for format version 1.0");
  unsigned char pre[10];
  std::memcpy(pre, kMagic, sizeof kMagic);
  pre[6] = 1;
  pre[7] = 0;
  pre[8] = static_cast<unsigned char>(h.size() & 0xff);
  pre[9] = static_cast<unsigned char>(h.size() >> 8);

  std::FILE* raw = std::fopen(name.c_str(), exclusive ? "wbx" : "wb");
  if (!raw) fs_fail(name, "cannot create: " + errno_text(errno));
  FilePtr f(raw);
  bool ok = std::fwrite(pre, 1, sizeof pre, raw) == sizeof pre &&
            std::fwrite(h.data(), 1, h.size(), raw) == h.size() &&
            (array.bytes.empty() ||
             std::fwrite(array.bytes.data(), 1, array.bytes.size(), raw) == array.bytes.size());
  int err = ok ? 0 : errno;
  if (ok && std::fflush(raw) != 0) {
    ok = false;
    err = errno;
  }
  // fclose can be where a delayed write error (quota, NFS) shows up.
  if (std::fclose(f.release()) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
    fs_fail(name, "write failed: " + errno_text(err));
  }
}

NpyArray make_npy(NpyType type, std::vector<std::int64_t> shape, const void* data, std::size_t nbytes) {
  NpyArray a;
  a.type = type;
  a.shape = std::move(shape);
  const auto* p = static_cast<const unsigned char*>(data);
  if (nbytes) a.bytes.assign(p, p + nbytes);
  check_consistent(a, "make_npy");
  return a;
}

std::vector<float> npy_to_f32(const NpyArray& array, const std::string& name) {
  check_consistent(array, name);
  if (array.type == NpyType::f4) {
    std::vector<float> out(array.bytes.size() / 4);
    if (!out.empty()) std::memcpy(out.data(), array.bytes.data(), array.bytes.size());
    return out;
  }
  if (array.type == NpyType::f8) {
    std::vector<float> out(array.bytes.size() / 8);
    for (std::size_t i = 0; i < out.size(); ++i) {
      double v;
      std::memcpy(&v, array.bytes.data() + 8 * i, 8);
      // A finite double beyond the float range has no float value (the
      // conversion is undefined behaviour), so it is an error, not an Inf.
      if (std::isfinite(v) && std::fabs(v) > static_cast<double>(std::numeric_limits<float>::max()))
        bad(name, "float64 value " + std::to_string(v) + " at flat index " + std::to_string(i) +
                      " is outside the float32 range");
      out[i] = static_cast<float>(v);
    }
    return out;
  }
  bad(name, std::string("dtype is ") + npy_type_name(array.type) + ", expected float32 (or float64)");
}

std::vector<std::int32_t> npy_to_i32(const NpyArray& array, const std::string& name) {
  check_consistent(array, name);
  if (array.type == NpyType::i4) {
    std::vector<std::int32_t> out(array.bytes.size() / 4);
    if (!out.empty()) std::memcpy(out.data(), array.bytes.data(), array.bytes.size());
    return out;
  }
  if (array.type == NpyType::i8) {
    std::vector<std::int32_t> out(array.bytes.size() / 8);
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::int64_t v;
      std::memcpy(&v, array.bytes.data() + 8 * i, 8);
      if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
        bad(name, "int64 value " + std::to_string(v) + " at flat index " + std::to_string(i) +
                      " does not fit in int32");
      out[i] = static_cast<std::int32_t>(v);
    }
    return out;
  }
  bad(name, std::string("dtype is ") + npy_type_name(array.type) + ", expected int32 (or int64)");
}

}  // namespace kvcomp::io
