// A small, strict reader and writer of NumPy .npy files.
//
// Read: format versions 1.0, 2.0 and 3.0; little-endian ('<') or
// byte-order-free ('|') descriptors; C order only; the dtypes float32,
// float16, uint16 (carrying bf16 bits), int32, float64 and int64. Write:
// version 1.0, the same dtypes.
//
// Files are treated as hostile: every size is checked against the file and
// against caps before anything is allocated or read, and every failure is an
// IoError that names the file and the problem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvcomp::io {

// The one exception class of the io module. kind() tells bad contents (the
// aclnn "invalid parameter" code) from failures of the file system itself.
class IoError : public std::runtime_error {
 public:
  enum class Kind { contents, filesystem };

  IoError(Kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  Kind kind() const noexcept { return kind_; }
  // 161002 (bad contents) or 361001 (file system), the codes the CLI prints.
  int code() const noexcept { return kind_ == Kind::contents ? 161002 : 361001; }

 private:
  Kind kind_;
};

enum class NpyType { f4, f2, u2, i4, f8, i8 };

std::size_t npy_itemsize(NpyType t);
// The little-endian descriptor written to files, e.g. "<f4".
const char* npy_descr(NpyType t);
// A human name for messages, e.g. "float32".
const char* npy_type_name(NpyType t);

struct NpyArray {
  NpyType type = NpyType::f4;
  std::vector<std::int64_t> shape;   // empty: a 0-d array (one element)
  std::vector<unsigned char> bytes;  // little-endian, C order, numel() * itemsize bytes

  // Product of the dims; -1 if it overflows int64 or a dim is negative.
  std::int64_t numel() const;
};

struct NpyLimits {
  // Largest data section accepted. Far above any realistic case, low enough
  // that a corrupt header cannot make us try to allocate exabytes.
  std::uint64_t max_data_bytes = std::uint64_t{64} << 30;
  // numpy itself refuses headers above 10000 bytes unless told otherwise.
  std::uint64_t max_header_bytes = std::uint64_t{1} << 16;
  std::size_t max_rank = 32;
};

// Reads and checks a whole file. Throws IoError.
NpyArray read_npy(const std::filesystem::path& path, const NpyLimits& limits = {});

// Parses the bytes of a complete .npy file; `name` is used in messages.
NpyArray parse_npy(std::span<const unsigned char> file, const std::string& name,
                   const NpyLimits& limits = {});

// The bytes of a version 1.0 file holding `array` (header padded to 64 bytes).
// Throws IoError if the byte count does not match the shape.
std::vector<unsigned char> encode_npy(const NpyArray& array);

// Writes encode_npy(array) to `path`, checking every write and the close; a
// failed write removes the file. `exclusive`: fail if `path` already exists.
void write_npy(const std::filesystem::path& path, const NpyArray& array, bool exclusive = false);

// Builds an array from raw little-endian element bytes (copied).
NpyArray make_npy(NpyType type, std::vector<std::int64_t> shape, const void* data, std::size_t nbytes);

// Typed views of the data with the conversions the case loader allows.
// float32 as is; float64 converted, finite values outside the float32 range
// are rejected rather than silently turned into infinities.
std::vector<float> npy_to_f32(const NpyArray& array, const std::string& name);
// int32 as is; int64 converted when every value fits in int32.
std::vector<std::int32_t> npy_to_i32(const NpyArray& array, const std::string& name);

// Shape as "(2, 3)" for messages.
std::string shape_string(std::span<const std::int64_t> shape);

}  // namespace kvcomp::io
