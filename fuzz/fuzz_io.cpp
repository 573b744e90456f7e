// libFuzzer target: the .npy parser and the meta.json parser of src/io, the
// two readers of untrusted files in the CLI. The first byte picks the reader.
// Any outcome other than a parsed value or an io::IoError (a crash, a
// sanitizer report, another exception type, an allocation beyond libFuzzer's
// -rss_limit_mb / -malloc_limit_mb) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>

#include "io/case_dir.hpp"
#include "io/npy.hpp"

namespace {

void check(bool ok) {
  if (!ok) std::abort();  // an invariant of a successful parse does not hold
}

void fuzz_npy(std::span<const unsigned char> bytes) {
  kvcomp::io::NpyArray a;
  try {
    a = kvcomp::io::parse_npy(bytes, "fuzz.npy");
  } catch (const kvcomp::io::IoError& e) {
    check(e.kind() == kvcomp::io::IoError::Kind::contents);
    return;
  }
  // A parsed array is self-consistent and survives a round trip unchanged.
  check(a.numel() >= 0);
  check(a.bytes.size() == static_cast<std::size_t>(a.numel()) * kvcomp::io::npy_itemsize(a.type));
  const auto encoded = kvcomp::io::encode_npy(a);
  const auto b = kvcomp::io::parse_npy(encoded, "round-trip.npy");
  check(b.type == a.type && b.shape == a.shape && b.bytes == a.bytes);
  try {
    (void)kvcomp::io::npy_to_f32(a, "fuzz.npy");
  } catch (const kvcomp::io::IoError&) {
  }
  try {
    (void)kvcomp::io::npy_to_i32(a, "fuzz.npy");
  } catch (const kvcomp::io::IoError&) {
  }
}

void fuzz_meta(std::string_view text) {
  try {
    (void)kvcomp::io::parse_meta(text, "meta.json");
  } catch (const kvcomp::io::IoError& e) {
    check(e.kind() == kvcomp::io::IoError::Kind::contents);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::span<const unsigned char> rest(data + 1, size - 1);
  if (data[0] & 1)
    fuzz_meta(std::string_view(reinterpret_cast<const char*>(rest.data()), rest.size()));
  else
    fuzz_npy(rest);
  return 0;
}
