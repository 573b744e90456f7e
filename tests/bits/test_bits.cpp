// The bits do not move: a fixed set of calls on every path (forward, both backward modes, decode with
// and without prepared weights, bf16 / fp16 / fp32 io, paged and ring caches, one or more chunks of
// rows), each call's outputs hashed and compared with the hashes recorded in tests/bits/hashes.txt.
//
// A refactoring of the engine room must leave every output bit where it was; the float64 oracle
// (tests/precision) cannot see a changed summation order that stays within the precision contract,
// this test does. The hashes were recorded by the code before the change, per kind of machine (the
// CPU's vendor and its widest product units: oneDNN's kernels differ by both) and per product
// configuration (ctest runs this binary once per configuration, with that configuration's
// environment: tests/bits/CMakeLists.txt). A machine kind without recorded hashes reports itself
// skipped. A change that moves bits on purpose (another library, another kernel order) records them
// again, in the commit that makes it, saying why:
//
//   test_bits --config NAME --hashes tests/bits/hashes.txt --record
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "harness.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::test {
namespace {

struct Settings {
  std::string config = "default";
  std::string hashes;
  bool record = false;
};
Settings g_settings;

// FNV-1a, 64 bits, over the outputs' bytes in a fixed order.
class Hash {
 public:
  void add(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h_ = (h_ ^ b[i]) * 0x100000001b3ull;
  }
  void add(Buffer& b) { add(b.data(), b.size() * (b.dtype == DType::f32 || b.dtype == DType::i32 ? 4 : 2)); }
  std::string hex() const {
    char s[17];
    std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(h_));
    return s;
  }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

// The kind of machine whose bits a line of hashes.txt holds: vendor and widest product units.
std::string machine_kind() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, vendor = "unknown";
  std::set<std::string> flags;
  while (std::getline(f, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    std::istringstream rest(line.substr(colon + 1));
    if (key == "vendor_id") {
      rest >> vendor;
    } else if (key == "flags" && flags.empty()) {
      for (std::string w; rest >> w;) flags.insert(w);
    }
  }
  const std::string v = vendor == "AuthenticAMD" ? "amd" : vendor == "GenuineIntel" ? "intel" : "other";
  if (flags.count("amx_bf16")) return v + "-amx";
  if (flags.count("avx512_bf16")) return v + "-avx512bf16";
  if (flags.count("avx512f")) return v + "-avx512";
  if (flags.count("avx2")) return v + "-avx2";
  return v + "-x86";
}

// The configuration whose calls run without row stability.
bool config_row_unstable() { return g_settings.config == "row_unstable"; }

Options call_options(Precision precision = Precision::precise) {
  Options o;
  o.row_stable = !config_row_unstable();
  o.num_threads = 2;
  o.precision = precision;
  return o;
}

struct Call {
  std::string name;
  RandomOptions shape;
  DType io;
  std::uint64_t seed;
  bool backward = true;   // also both backward modes on the forward's outputs
  bool prepared = false;  // the forward with prepared weights
};

std::string io_name(DType io) { return dtype_name(io); }

// Runs one call (and its backward in both modes) and returns name -> hash of each output set.
std::map<std::string, std::string> run_call(const Call& c) {
  std::map<std::string, std::string> out;
  auto rc = make_random_case(c.shape, c.seed);
  round_io_inputs(rc.in, c.io);
  const ref::Problem& p = rc.problem;
  ForwardRun fwd(p, rc.in, c.io, c.backward);
  std::vector<unsigned char> blob;
  if (c.prepared) {
    std::size_t bytes = 0;
    EXPECT_TRUE(prepared_weights_size(fwd.args.wkv, fwd.args.wgate, &bytes).ok());
    blob.resize(bytes);
    EXPECT_TRUE(prepare_weights(fwd.args.wkv, fwd.args.wgate, blob.data(), bytes, call_options()).ok());
    fwd.args.prepared_weights = blob.data();
    fwd.args.prepared_weights_bytes = bytes;
  }
  const Status s = fwd.run(call_options());
  EXPECT_TRUE(s.ok()) << c.name << ": " << s.message;
  Hash h;
  h.add(fwd.cmp_kv);
  h.add(fwd.cache);
  if (c.backward) {
    h.add(fwd.softmax_score);
    h.add(fwd.kv);
  }
  out[c.name + ".forward"] = h.hex();
  if (!c.backward) return out;

  // d_cmp_kv: random io values; the intermediates: the forward's own.
  std::mt19937_64 rng(c.seed ^ 0x5bd1e995u);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> d(fwd.cmp_kv.size());
  for (double& e : d) e = dist(rng);
  for (const Precision precision : {Precision::precise, Precision::npu_parity}) {
    BackwardData bd;
    bd.d_cmp_kv = round_to_dtype(d, c.io);
    bd.softmax_score = fwd.softmax_score.values();
    bd.kv = fwd.kv.values();
    BackwardRun bwd(p, rc.in, bd, c.io);
    const Status sb = bwd.run(call_options(precision));
    EXPECT_TRUE(sb.ok()) << c.name << ": " << sb.message;
    Hash hb;
    hb.add(bwd.d_x);
    hb.add(bwd.d_wkv);
    hb.add(bwd.d_wgate);
    hb.add(bwd.d_ape);
    out[c.name + (precision == Precision::precise ? ".backward_precise" : ".backward_npu_parity")] = hb.hex();
  }
  return out;
}

std::vector<Call> calls() {
  std::vector<Call> v;
  for (const DType io : {DType::bf16, DType::f16, DType::f32}) {
    const std::string t = io_name(io);
    // Prefill, BSH: C = 128 (whole 16-column groups), H not a multiple of 16.
    RandomOptions bsh;
    bsh.B = 2, bsh.S = 77, bsh.H = 200, bsh.D = 64, bsh.coff = 2, bsh.r = 4, bsh.max_start_pos = 9;
    v.push_back({"prefill_bsh_c4." + t, bsh, io, 11});
    // TH over more than one chunk of rows (1024), ring cache, coff 1.
    RandomOptions th;
    th.th = true, th.B = 3, th.S = 600, th.H = 96, th.D = 48, th.coff = 1, th.r = 8, th.cache_mode = 2;
    th.max_start_pos = 20, th.lengths = {700, 450, 300};
    v.push_back({"prefill_th_chunks." + t, th, io, 12});
    // A large ratio (C128A-like), BSH, paged.
    RandomOptions big;
    big.B = 1, big.S = 300, big.H = 128, big.D = 32, big.coff = 1, big.r = 128, big.max_start_pos = 200;
    big.block_size = 64;
    v.push_back({"prefill_r128." + t, big, io, 13});
    // A hidden size past 1200 (oneDNN's copy-based sgemm on AVX-512; B read plain where that keeps the
    // bits), two row tiles.
    RandomOptions wide;
    wide.B = 1, wide.S = 300, wide.H = 1536, wide.D = 128, wide.coff = 2, wide.r = 4, wide.max_start_pos = 5;
    v.push_back({"prefill_wide." + t, wide, io, 14});
    // Decode: one token per sequence, 1, 5, 8 and 12 sequences (the rows kernels' range and past it),
    // start positions that open and close blocks; with and without prepared weights.
    for (const std::int64_t B : {1, 5, 8, 12}) {
      RandomOptions dec;
      dec.th = true, dec.B = B, dec.S = 1, dec.H = 256, dec.D = 64, dec.coff = 2, dec.r = 4;
      dec.max_start_pos = 300, dec.block_size = 16, dec.allow_empty_segments = false;
      dec.random_seqused = false;
      const std::string n = "decode_b" + std::to_string(B) + "." + t;
      v.push_back({n, dec, io, static_cast<std::uint64_t>(20 + B), false, false});
      v.push_back({n + ".prepared", dec, io, static_cast<std::uint64_t>(20 + B), false, true});
    }
    // A short prefill chunk with prepared weights and its backward.
    RandomOptions pre;
    pre.th = true, pre.B = 2, pre.S = 40, pre.H = 256, pre.D = 64, pre.coff = 2, pre.r = 4;
    pre.max_start_pos = 30, pre.allow_empty_segments = false;
    v.push_back({"chunk_prepared." + t, pre, io, 30, true, true});
  }
  return v;
}

std::map<std::string, std::string> read_hashes(const std::string& path, const std::string& prefix,
                                               std::vector<std::string>* others) {
  std::map<std::string, std::string> m;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    if (line.empty() || line[0] == '#') {
      if (others) others->push_back(line);
      continue;
    }
    std::istringstream in(line);
    std::string key, hash;
    in >> key >> hash;
    if (key.rfind(prefix, 0) == 0)
      m[key.substr(prefix.size())] = hash;
    else if (others)
      others->push_back(line);
  }
  return m;
}

TEST(Bits, CallsKeepTheirRecordedBits) {
  ASSERT_FALSE(g_settings.hashes.empty()) << "--hashes FILE is required";
  const std::string prefix = machine_kind() + "/" + g_settings.config + "/";
  std::map<std::string, std::string> got;
  for (const Call& c : calls())
    for (auto& [k, h] : run_call(c)) got[k] = h;
  if (g_settings.record) {
    std::vector<std::string> others;
    read_hashes(g_settings.hashes, prefix, &others);
    std::ofstream f(g_settings.hashes, std::ios::trunc);
    for (const std::string& l : others) f << l << "\n";
    for (const auto& [k, h] : got) f << prefix << k << " " << h << "\n";
    std::printf("recorded %zu hashes under %s\n", got.size(), prefix.c_str());
    return;
  }
  const auto want = read_hashes(g_settings.hashes, prefix, nullptr);
  if (want.empty()) GTEST_SKIP() << "no hashes recorded for " << prefix << " in " << g_settings.hashes;
  for (const auto& [k, h] : got) {
    const auto it = want.find(k);
    if (it == want.end()) {
      ADD_FAILURE() << prefix << k << ": no recorded hash (record again where the set of calls grew)";
      continue;
    }
    EXPECT_EQ(it->second, h) << prefix << k << ": the bits moved";
  }
}

}  // namespace
}  // namespace kvcomp::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc)
      kvcomp::test::g_settings.config = argv[++i];
    else if (a == "--hashes" && i + 1 < argc)
      kvcomp::test::g_settings.hashes = argv[++i];
    else if (a == "--record")
      kvcomp::test::g_settings.record = true;
  }
  return RUN_ALL_TESTS();
}
