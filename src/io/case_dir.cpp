#include "io/case_dir.hpp"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <utility>

#include "kvcomp/half.hpp"

namespace kvcomp::io {

namespace {

namespace fs = std::filesystem;
using Kind = IoError::Kind;
using json = nlohmann::json;

[[noreturn]] void bad(const std::string& name, const std::string& what) {
  throw IoError(Kind::contents, name + ": " + what);
}

[[noreturn]] void fs_fail(const std::string& name, const std::string& what) {
  throw IoError(Kind::filesystem, name + ": " + what);
}

constexpr std::uint64_t kMaxMetaBytes = 1u << 20;
// Same cap as the .npy reader: a stride in meta.json must not make us
// allocate more than any real file could hold.
constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{64} << 30;

std::int64_t json_int(const json& v, const std::string& key, const std::string& name) {
  if (!v.is_number_integer()) bad(name, "\"" + key + "\" must be an integer, got " + v.dump());
  if (v.is_number_unsigned() &&
      v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    bad(name, "\"" + key + "\" (= " + v.dump() + ") does not fit in int64");
  return v.get<std::int64_t>();
}

std::string json_string(const json& v, const std::string& key, const std::string& name) {
  if (!v.is_string()) bad(name, "\"" + key + "\" must be a string, got " + v.dump());
  return v.get<std::string>();
}

std::string without_json_prefix(const char* what) {
  // nlohmann messages start with "[json.exception.parse_error.101] ".
  std::string s = what;
  if (!s.empty() && s[0] == '[') {
    const auto close = s.find("] ");
    if (close != std::string::npos) s.erase(0, close + 2);
  }
  return s;
}

void check_rank(const NpyArray& a, const std::string& name) {
  if (a.shape.size() > static_cast<std::size_t>(kMaxRank))
    bad(name,
        "rank " + std::to_string(a.shape.size()) + " is above the supported " + std::to_string(kMaxRank));
}

std::size_t byte_count(std::int64_t numel, DType dt) {
  return static_cast<std::size_t>(numel) * dtype_size(dt);
}

// HostTensor keeps at least one byte so that views of empty tensors are not
// null (null means "absent" to the operator).
HostTensor make_tensor(DType dt, std::vector<std::int64_t> shape, std::vector<unsigned char> bytes) {
  HostTensor t;
  t.dtype = dt;
  t.shape = std::move(shape);
  t.bytes = std::move(bytes);
  if (t.bytes.empty()) t.bytes.resize(1);
  return t;
}

template <typename Convert>
std::vector<unsigned char> convert_u16(const NpyArray& a, std::size_t in_size, Convert&& conv) {
  const std::size_t n = a.bytes.size() / in_size;
  std::vector<unsigned char> out(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t h = conv(a.bytes.data() + i * in_size);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

float load_f32(const unsigned char* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

std::uint16_t load_u16(const unsigned char* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

fs::path npy_path(const fs::path& dir, const char* tensor) { return dir / (std::string(tensor) + ".npy"); }

std::optional<NpyArray> read_if_present(const fs::path& file) {
  std::error_code ec;
  const auto st = fs::symlink_status(file, ec);
  if (st.type() == fs::file_type::not_found) return std::nullopt;
  return read_npy(file);
}

NpyArray read_required(const fs::path& dir, const char* tensor) { return read_npy(npy_path(dir, tensor)); }

std::optional<HostTensor> optional_i32(const fs::path& dir, const char* tensor) {
  const fs::path file = npy_path(dir, tensor);
  auto a = read_if_present(file);
  if (!a) return std::nullopt;
  return i32_tensor_from_npy(std::move(*a), file.string());
}

void check_case_dir(const fs::path& dir) {
  std::error_code ec;
  const auto st = fs::status(dir, ec);
  if (!fs::exists(st)) fs_fail(dir.string(), "case directory does not exist");
  if (!fs::is_directory(st)) fs_fail(dir.string(), "not a directory");
}

void load_sequence(const fs::path& dir, SequenceCase& c) {
  c.meta = read_meta(dir / "meta.json");
  const DType io = c.meta.dtype;
  const fs::path xf = npy_path(dir, "x");
  c.x = io_tensor_from_npy(read_required(dir, "x"), io, xf.string());
  if (c.meta.layout) {
    const std::size_t want = *c.meta.layout == "BSH" ? 3 : 2;
    if (c.x.shape.size() != want)
      bad((dir / "meta.json").string(), "layout \"" + *c.meta.layout + "\" needs x of rank " +
                                            std::to_string(want) + ", but " + xf.string() + " has shape " +
                                            shape_string(c.x.shape));
  }
  c.wkv = io_tensor_from_npy(read_required(dir, "wkv"), io, npy_path(dir, "wkv").string());
  c.wgate = io_tensor_from_npy(read_required(dir, "wgate"), io, npy_path(dir, "wgate").string());
  c.cu_seqlens = optional_i32(dir, "cu_seqlens");
  c.seqused = optional_i32(dir, "seqused");
  c.start_pos = optional_i32(dir, "start_pos");
}

// Lays the blocks of a contiguous [block_num, block_size, W] cache out at
// `stride` elements apart, as a caller with a strided cache would hand it over.
HostTensor spread_state_cache(HostTensor t, std::int64_t stride, const std::string& name) {
  const std::int64_t bn = t.shape[0];
  const std::int64_t block = t.shape[1] * t.shape[2];
  if (bn == 0) return t;
  const auto limit = static_cast<std::int64_t>(kMaxTensorBytes / 4);
  if ((bn - 1) > (limit - block) / stride)
    bad(name, "state_cache_stride0 (= " + std::to_string(stride) + ") makes the cache larger than " +
                  std::to_string(kMaxTensorBytes) + " bytes");
  const std::int64_t total = (bn - 1) * stride + block;
  std::vector<unsigned char> spread(static_cast<std::size_t>(total) * 4);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t i = 0; i < total; ++i) std::memcpy(spread.data() + 4 * i, &nan, 4);
  for (std::int64_t b = 0; b < bn; ++b)
    std::memcpy(spread.data() + 4 * b * stride, t.bytes.data() + 4 * b * block,
                static_cast<std::size_t>(block) * 4);
  t.bytes = std::move(spread);
  return t;
}

bool cache_is_spread(const FwdCase& c) {
  const auto& s = c.state_cache.shape;
  return s.size() == 3 && c.meta.state_cache_stride0 > s[1] * s[2] && s[0] > 0;
}

}  // namespace

namespace {

// Lower case, without underscores: "cmpRatio", "cmp_ratio" and "CMP_RATIO" meet.
std::string normalized_key(const std::string& key) {
  std::string out;
  for (char ch : key)
    if (ch != '_') out += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

// The snake_case name of a known key, or the key itself when unknown.
std::string canonical_key(const std::string& key) {
  static const char* const known[] = {"cmp_ratio",           "coff",        "dtype", "layout", "cache_mode",
                                      "state_cache_stride0", "grad_enabled"};
  const std::string n = normalized_key(key);
  for (const char* k : known)
    if (normalized_key(k) == n) return k;
  return key;
}

}  // namespace

CaseMeta parse_meta(std::string_view text, const std::string& name) {
  std::set<std::string> seen;
  std::string duplicate;
  json j;
  try {
    // nlohmann keeps the last of duplicate keys silently; a case file with
    // two "coff" entries is a mistake worth reporting.
    j = json::parse(text.begin(), text.end(), [&](int depth, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
        if (!seen.insert(normalized_key(parsed.get<std::string>())).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
      }
      return true;
    });
  } catch (const json::exception& e) {
    bad(name, "not valid JSON: " + without_json_prefix(e.what()));
  }
  if (!j.is_object()) bad(name, "must hold a JSON object, got " + std::string(j.type_name()));
  if (!duplicate.empty()) bad(name, "duplicate key \"" + duplicate + "\"");

  CaseMeta m;
  bool have_ratio = false, have_dtype = false;
  for (const auto& [raw_key, v] : j.items()) {
    // Keys match whatever the spelling convention: cmp_ratio, cmpRatio,
    // CMP_RATIO (the aclnn parameters are camelCase, the spec's snake_case).
    const std::string key = canonical_key(raw_key);
    if (key == "cmp_ratio") {
      m.cmp_ratio = json_int(v, key, name);
      have_ratio = true;
    } else if (key == "coff") {
      m.coff = json_int(v, key, name);
    } else if (key == "dtype") {
      const std::string s = json_string(v, key, name);
      if (s == "bf16" || s == "bfloat16")
        m.dtype = DType::bf16;
      else if (s == "fp16" || s == "float16" || s == "half")
        m.dtype = DType::f16;
      else if (s == "fp32" || s == "float32" || s == "float")
        m.dtype = DType::f32;
      else
        bad(name, "\"dtype\" must be \"bf16\", \"fp16\" or \"fp32\", got \"" + s + "\"");
      have_dtype = true;
    } else if (key == "layout") {
      std::string s = json_string(v, key, name);
      for (char& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      if (s != "BSH" && s != "TH") bad(name, "\"layout\" must be \"BSH\" or \"TH\", got \"" + s + "\"");
      m.layout = s;
    } else if (key == "cache_mode") {
      m.cache_mode = json_int(v, key, name);
    } else if (key == "state_cache_stride0") {
      m.state_cache_stride0 = json_int(v, key, name);
    } else if (key == "grad_enabled") {
      if (!v.is_boolean()) bad(name, "\"grad_enabled\" must be true or false, got " + v.dump());
      m.grad_enabled = v.get<bool>();
    } else {
      m.ignored_keys.push_back(raw_key);
    }
  }
  if (!have_ratio) bad(name, "required key \"cmp_ratio\" is missing");
  if (!have_dtype) bad(name, "required key \"dtype\" is missing");
  return m;
}

CaseMeta read_meta(const fs::path& file) {
  const std::string name = file.string();
  std::error_code ec;
  const auto st = fs::status(file, ec);
  if (!fs::exists(st)) fs_fail(name, "cannot open: " + std::generic_category().message(ENOENT));
  if (!fs::is_regular_file(st)) fs_fail(name, "not a regular file");
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(name.c_str(), "rb"), &std::fclose);
  if (!f) fs_fail(name, "cannot open: " + std::generic_category().message(errno));
  std::string text;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) {
    text.append(buf, n);
    if (text.size() > kMaxMetaBytes) bad(name, "larger than " + std::to_string(kMaxMetaBytes) + " bytes");
  }
  if (std::ferror(f.get())) fs_fail(name, "read failed: " + std::generic_category().message(errno));
  return parse_meta(text, name);
}

HostTensor HostTensor::zeros(DType dtype, std::vector<std::int64_t> shape) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const std::int64_t n = t.numel();
  if (n < 0) bad("output", "shape " + shape_string(t.shape) + " is invalid or overflows");
  if (static_cast<std::uint64_t>(n) > kMaxTensorBytes / dtype_size(dtype))
    bad("output",
        "shape " + shape_string(t.shape) + " is larger than " + std::to_string(kMaxTensorBytes) + " bytes");
  t.bytes.assign(std::max<std::size_t>(byte_count(n, dtype), 1), 0);
  return t;
}

std::int64_t HostTensor::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

Tensor HostTensor::view() {
  if (shape.size() > static_cast<std::size_t>(kMaxRank))
    bad("tensor",
        "rank " + std::to_string(shape.size()) + " is above the supported " + std::to_string(kMaxRank));
  Tensor t;
  t.data = bytes.data();
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

HostTensor io_tensor_from_npy(NpyArray a, DType io, const std::string& name) {
  check_rank(a, name);
  const char* io_name = io == DType::bf16 ? "bf16" : io == DType::f16 ? "fp16" : "fp32";
  auto refuse = [&](const char* why) {
    bad(name, std::string("dtype ") + npy_type_name(a.type) + " cannot hold " + io_name + " io data" + why);
  };
  if (io != DType::bf16 && io != DType::f16 && io != DType::f32)
    bad(name, "io dtype must be bf16, fp16 or fp32");
  std::vector<unsigned char> out;
  switch (a.type) {
    case NpyType::f4:
      if (io == DType::f32) {
        out = std::move(a.bytes);
      } else if (io == DType::bf16) {
        out = convert_u16(a, 4, [](const unsigned char* p) { return float_to_bf16(load_f32(p)); });
      } else {
        out = convert_u16(a, 4, [](const unsigned char* p) { return float_to_fp16(load_f32(p)); });
      }
      break;
    case NpyType::f2:
      if (io == DType::f16) {
        out = std::move(a.bytes);
      } else if (io == DType::bf16) {
        out = convert_u16(a, 2,
                          [](const unsigned char* p) { return float_to_bf16(fp16_to_float(load_u16(p))); });
      } else {
        const std::size_t n = a.bytes.size() / 2;
        out.resize(n * 4);
        for (std::size_t i = 0; i < n; ++i) {
          const float f = fp16_to_float(load_u16(a.bytes.data() + 2 * i));
          std::memcpy(out.data() + 4 * i, &f, 4);
        }
      }
      break;
    case NpyType::u2:
      // uint16 arrays carry bf16 bits (numpy has no bf16). Reading them as any
      // other dtype would silently misread fp16 bits stored as uint16.
      if (io != DType::bf16) refuse(" (uint16 means bf16 bits; store float16 or float32)");
      out = std::move(a.bytes);
      break;
    case NpyType::f8:
      if (io != DType::f32)
        refuse(" (float64 would be rounded twice; store float32, float16 or uint16 bf16 bits)");
      {
        const std::vector<float> f = npy_to_f32(a, name);
        out.resize(f.size() * 4);
        if (!f.empty()) std::memcpy(out.data(), f.data(), out.size());
      }
      break;
    default:
      refuse(" (store float32, float16, or uint16 with bf16 bits)");
  }
  return make_tensor(io, std::move(a.shape), std::move(out));
}

HostTensor f32_tensor_from_npy(NpyArray a, const std::string& name) {
  check_rank(a, name);
  std::vector<unsigned char> out;
  if (a.type == NpyType::f4) {
    out = std::move(a.bytes);
  } else {
    const std::vector<float> f = npy_to_f32(a, name);
    out.resize(f.size() * 4);
    if (!f.empty()) std::memcpy(out.data(), f.data(), out.size());
  }
  return make_tensor(DType::f32, std::move(a.shape), std::move(out));
}

HostTensor i32_tensor_from_npy(NpyArray a, const std::string& name) {
  check_rank(a, name);
  std::vector<unsigned char> out;
  if (a.type == NpyType::i4) {
    out = std::move(a.bytes);
  } else {
    const std::vector<std::int32_t> v = npy_to_i32(a, name);
    out.resize(v.size() * 4);
    if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  }
  return make_tensor(DType::i32, std::move(a.shape), std::move(out));
}

GradCase load_grad_case(const fs::path& dir) {
  check_case_dir(dir);
  GradCase c;
  load_sequence(dir, c);
  const DType io = c.meta.dtype;
  c.d_cmp_kv = io_tensor_from_npy(read_required(dir, "d_cmp_kv"), io, npy_path(dir, "d_cmp_kv").string());
  c.softmax_score =
      f32_tensor_from_npy(read_required(dir, "softmax_score"), npy_path(dir, "softmax_score").string());
  c.kv = f32_tensor_from_npy(read_required(dir, "kv"), npy_path(dir, "kv").string());
  return c;
}

FwdCase load_fwd_case(const fs::path& dir) {
  check_case_dir(dir);
  FwdCase c;
  load_sequence(dir, c);
  c.ape = f32_tensor_from_npy(read_required(dir, "ape"), npy_path(dir, "ape").string());
  const std::string cache_name = npy_path(dir, "state_cache").string();
  c.state_cache = f32_tensor_from_npy(read_required(dir, "state_cache"), cache_name);
  c.block_table = optional_i32(dir, "block_table");

  const std::int64_t stride = c.meta.state_cache_stride0;
  const auto& s = c.state_cache.shape;
  if (stride > 0 && s.size() == 3) {
    const std::int64_t block = s[1] * s[2];
    // A file holds whole blocks, so overlapping blocks cannot be expressed.
    if (stride < block)
      bad((dir / "meta.json").string(), "state_cache_stride0 (= " + std::to_string(stride) +
                                            ") must be 0 or at least block_size*W (= " +
                                            std::to_string(block) + ") for the state cache in " + cache_name);
    if (stride > block) c.state_cache = spread_state_cache(std::move(c.state_cache), stride, cache_name);
  }
  return c;
}

NpyArray state_cache_npy(const FwdCase& c) {
  const HostTensor& t = c.state_cache;
  const std::int64_t n = t.numel();
  NpyArray a;
  a.type = NpyType::f4;
  a.shape = t.shape;
  a.bytes.resize(byte_count(n, DType::f32));
  if (cache_is_spread(c)) {
    const std::int64_t block = t.shape[1] * t.shape[2];
    const std::int64_t stride = c.meta.state_cache_stride0;
    for (std::int64_t b = 0; b < t.shape[0]; ++b)
      std::memcpy(a.bytes.data() + 4 * b * block, t.bytes.data() + 4 * b * stride,
                  static_cast<std::size_t>(block) * 4);
  } else if (!a.bytes.empty()) {
    std::memcpy(a.bytes.data(), t.bytes.data(), a.bytes.size());
  }
  return a;
}

NpyArray output_npy(const HostTensor& t, OutDType out) {
  const std::int64_t n = t.numel();
  if (n < 0) bad("output", "shape " + shape_string(t.shape) + " is invalid or overflows");
  const auto count = static_cast<std::size_t>(n);
  NpyArray a;
  a.shape = t.shape;
  switch (t.dtype) {
    case DType::f32:
      a.type = NpyType::f4;
      a.bytes.assign(t.bytes.begin(), t.bytes.begin() + static_cast<std::ptrdiff_t>(count * 4));
      return a;
    case DType::i32:
      a.type = NpyType::i4;
      a.bytes.assign(t.bytes.begin(), t.bytes.begin() + static_cast<std::ptrdiff_t>(count * 4));
      return a;
    case DType::bf16:
    case DType::f16:
      if (out == OutDType::io) {
        a.type = t.dtype == DType::bf16 ? NpyType::u2 : NpyType::f2;
        a.bytes.assign(t.bytes.begin(), t.bytes.begin() + static_cast<std::ptrdiff_t>(count * 2));
      } else {
        a.type = NpyType::f4;
        a.bytes.resize(count * 4);
        for (std::size_t i = 0; i < count; ++i) {
          const std::uint16_t h = load_u16(t.bytes.data() + 2 * i);
          const float f = t.dtype == DType::bf16 ? bf16_to_float(h) : fp16_to_float(h);
          std::memcpy(a.bytes.data() + 4 * i, &f, 4);
        }
      }
      return a;
  }
  bad("output", "unknown dtype");
}

void write_outputs(const fs::path& dir, const std::vector<OutputFile>& files) {
  const std::string dname = dir.string();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fs_fail(dname, "cannot create the output directory: " + ec.message());
  if (!fs::is_directory(dir, ec)) fs_fail(dname, "not a directory");

  // Everything that can be checked is checked before the first byte is
  // written, so that the common failures leave the directory untouched.
  std::set<std::string> names;
  for (const OutputFile& f : files) {
    if (f.name.empty() || f.name == "." || f.name == ".." || f.name.find('/') != std::string::npos)
      bad(dname, "invalid output file name \"" + f.name + "\"");
    if (!names.insert(f.name).second) bad(dname, "output \"" + f.name + "\" given twice");
    const fs::path target = dir / f.name;
    const auto st = fs::symlink_status(target, ec);
    if (fs::exists(st) && !fs::is_regular_file(st))
      fs_fail(target.string(), "exists and is not a regular file; refusing to replace it");
    const std::int64_t n = f.array.numel();
    const std::size_t item = npy_itemsize(f.array.type);
    if (n < 0 || static_cast<std::uint64_t>(n) > f.array.bytes.size() / item ||
        static_cast<std::uint64_t>(n) * item != f.array.bytes.size())
      bad(target.string(), "output array of shape " + shape_string(f.array.shape) + " holds " +
                               std::to_string(f.array.bytes.size()) + " bytes");
  }

  static std::atomic<unsigned> counter{0};
  std::vector<fs::path> temps;
  auto remove_temps = [&](std::size_t from) {
    for (std::size_t i = from; i < temps.size(); ++i) {
      std::error_code ignored;
      fs::remove(temps[i], ignored);
    }
  };
  try {
    for (const OutputFile& f : files) {
      const fs::path tmp = dir / ("." + f.name + ".tmp-" + std::to_string(::getpid()) + "-" +
                                  std::to_string(counter.fetch_add(1)));
      // write_npy removes what it created when it fails, so only finished
      // temporaries need cleaning up here.
      write_npy(tmp, f.array, /*exclusive=*/true);
      temps.push_back(tmp);
    }
  } catch (...) {
    remove_temps(0);
    throw;
  }

  for (std::size_t i = 0; i < files.size(); ++i) {
    const fs::path target = dir / files[i].name;
    fs::rename(temps[i], target, ec);
    if (ec) {
      remove_temps(i);
      std::string done;
      for (std::size_t k = 0; k < i; ++k) done += (k ? ", " : "") + files[k].name;
      fs_fail(target.string(), "cannot move the output into place: " + ec.message() +
                                   (i ? " (already replaced: " + done + ")" : ""));
    }
  }
}

}  // namespace kvcomp::io
