// `kvcomp demo`: a realistic case with no input files.
//
// Builds a seeded random case (C4A by default: bf16, BSH, B=1, S=4096,
// H=4096, D=512, coff=2, r=4, paged state cache with block_size 128), runs
// the forward (grad_enabled) and the backward, times both, and checks the
// precision against the float64 oracle.
//
// The oracle is a plain loop nest, far too slow for the full case, so the
// check runs on a reduced copy of the problem: the same weights, APE and
// state cache, x cut to its first --check-tokens tokens. kvcomp runs that
// reduced problem too and both are compared under the three-party rule of
// spec 7.2. The full run is also sampled: the compressed rows, and the d_x
// rows, that depend only on the first tokens are the same numbers in both
// problems, so they are compared with the oracle directly.
//
// run_demo is the steps in order: make_data, run (reduced, then the timed
// full runs), make_goldens (the oracle), compare, report.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "commands.hpp"
#include "device.hpp"
#include "kvcomp/half.hpp"
#include "reference/precision.hpp"
#include "reference/reference.hpp"

namespace kvcomp::cli {

namespace {

using io::HostTensor;
using i64 = std::int64_t;
using Clock = std::chrono::steady_clock;

// Counter-based random numbers: element i of stream s depends only on (seed,
// s, i), so the data are the same for any thread count.
std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float uniform(std::uint64_t seed, std::uint64_t stream, i64 i) {  // [-1, 1)
  const std::uint64_t u = mix(mix(seed ^ (stream * 0xd1b54a32d192ed03ull)) + static_cast<std::uint64_t>(i));
  return static_cast<float>(static_cast<double>(u >> 40) * 0x1p-23 - 1.0);
}

enum Stream : std::uint64_t { kX = 1, kWkv, kWgate, kApe, kCache, kTable, kDcmp };

void fill_bf16(HostTensor& t, std::uint64_t seed, Stream s, float scale) {
  std::uint16_t* p = t.as<std::uint16_t>();
  const i64 n = t.numel();
#pragma omp parallel for schedule(static)
  for (i64 i = 0; i < n; ++i) p[i] = float_to_bf16(scale * uniform(seed, s, i));
}

void fill_f32(HostTensor& t, std::uint64_t seed, Stream s, float scale) {
  float* p = t.as<float>();
  const i64 n = t.numel();
#pragma omp parallel for schedule(static)
  for (i64 i = 0; i < n; ++i) p[i] = scale * uniform(seed, s, i);
}

std::string dims(const std::vector<i64>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One problem instance for kvcomp: inputs, state cache and outputs.
struct Instance {
  i64 S = 0;
  HostTensor x, cache, cmp_kv, score, kv, d_cmp_kv, d_x, d_wkv, d_wgate, d_ape;
};

struct Shared {  // tensors both instances use unchanged
  HostTensor wkv, wgate, ape, table, start_pos;
  i64 H = 0, D = 0, C = 0, coff = 0, r = 0, sp = 0, bs = 0, cols = 0, block_num = 0;
};

ForwardArgs forward_args(Shared& sh, Instance& in) {
  ForwardArgs a;
  a.x = in.x.view();
  a.wkv = sh.wkv.view();
  a.wgate = sh.wgate.view();
  a.start_pos = sh.start_pos.view();
  a.cmp_ratio = sh.r;
  a.coff = sh.coff;
  a.state_cache = in.cache.view();
  a.ape = sh.ape.view();
  a.state_block_table = sh.table.view();
  a.cache_mode = 1;
  a.grad_enabled = true;
  a.cmp_kv = in.cmp_kv.view();
  a.softmax_score = in.score.view();
  a.kv = in.kv.view();
  return a;
}

BackwardArgs backward_args(Shared& sh, Instance& in) {
  BackwardArgs a;
  a.x = in.x.view();
  a.wkv = sh.wkv.view();
  a.wgate = sh.wgate.view();
  a.start_pos = sh.start_pos.view();
  a.cmp_ratio = sh.r;
  a.coff = sh.coff;
  a.d_cmp_kv = in.d_cmp_kv.view();
  a.softmax_score = in.score.view();
  a.kv = in.kv.view();
  a.d_x = in.d_x.view();
  a.d_wkv = in.d_wkv.view();
  a.d_wgate = in.d_wgate.view();
  a.d_ape = in.d_ape.view();
  return a;
}

void allocate_outputs(const Shared& sh, Instance& in) {
  const i64 rows = compressed_rows_bsh(in.S, sh.r);
  in.cmp_kv = HostTensor::zeros(DType::bf16, {1, rows, sh.D});
  in.score = HostTensor::zeros(DType::f32, {1, rows, sh.coff * sh.r, sh.D});
  in.kv = HostTensor::zeros(DType::f32, {1, rows, sh.coff * sh.r, sh.D});
  in.d_x = HostTensor::zeros(DType::bf16, {1, in.S, sh.H});
  in.d_wkv = HostTensor::zeros(DType::bf16, {sh.C, sh.H});
  in.d_wgate = HostTensor::zeros(DType::bf16, {sh.C, sh.H});
  in.d_ape = HostTensor::zeros(DType::f32, {sh.r, sh.C});
}

// Copies of a tensor's first `count` elements as Real / as float.
template <typename Real>
std::vector<Real> to_real(const HostTensor& t, i64 count) {
  std::vector<Real> v(static_cast<std::size_t>(count));
  for (i64 i = 0; i < count; ++i) {
    const float f = t.dtype == DType::bf16 ? bf16_to_float(t.as<std::uint16_t>()[i]) : t.as<float>()[i];
    v[static_cast<std::size_t>(i)] = static_cast<Real>(f);
  }
  return v;
}

std::vector<double> floats(const HostTensor& t, i64 first_row, i64 rows, i64 width) {
  std::vector<double> v(static_cast<std::size_t>(rows * width));
  for (i64 i = 0; i < rows * width; ++i) {
    const i64 k = first_row * width + i;
    v[static_cast<std::size_t>(i)] =
        t.dtype == DType::bf16 ? bf16_to_float(t.as<std::uint16_t>()[k]) : t.as<float>()[k];
  }
  return v;
}

template <typename Real>
std::vector<double> rounded(const std::vector<Real>& v, i64 first_row, i64 rows, i64 width, DType dt) {
  std::vector<double> out(static_cast<std::size_t>(rows * width));
  for (i64 i = 0; i < rows * width; ++i)
    out[static_cast<std::size_t>(i)] =
        ref::round_to_dtype(static_cast<double>(v[static_cast<std::size_t>(first_row * width + i)]), dt);
  return out;
}

struct Report {
  bool all_pass = true;
  void header() const {
    std::printf("  %-26s %-5s %10s %9s %9s %9s %9s %9s %9s  %s\n", "output", "dtype", "elements", "MARE A",
                "MARE B", "MERE A", "MERE B", "RMSE A", "RMSE B", "verdict");
  }
  // projection_bound: an output only as accurate as the fp32 projection (the
  // forward's cmp_kv and kv), judged by ref::fp32_projection_accuracy.
  void row(const std::string& name, DType dt, const std::vector<double>& a, const std::vector<double>& b,
           const std::vector<double>& c, bool projection_bound = false) {
    const ref::ThreeWayResult t = ref::three_way_compare(a, b, c, dt);
    std::string verdict = t.pass ? "PASS" : "FAIL " + t.why;
    bool pass = t.pass;
    if (projection_bound) {
      const ref::AccuracyResult acc = ref::fp32_projection_accuracy(a, b, c, dt);
      pass = acc.pass;
      verdict = acc.pass ? "PASS (fp32-projection bound)" : "FAIL " + acc.why;
    }
    all_pass = all_pass && pass;
    std::printf("  %-26s %-5s %10zu %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e  %s\n", name.c_str(), dtype_name(dt),
                t.n, t.mare_a, t.mare_b, t.mere_a, t.mere_b, t.rmse_a, t.rmse_b, verdict.c_str());
  }
};

// The case: shapes and tensors of the full problem and of its reduced copy.
struct DemoCase {
  Shared sh;
  Instance full, red;
  HostTensor cache0;  // the state cache both runs start from
  i64 S = 0, rows = 0;
};

// The oracle's results on the reduced problem: float64 truth ("high") and
// fp32 golden ("same"), forward and backward, and the cache it wrote.
struct Goldens {
  ref::ForwardOutputs<double> fwd_high;
  ref::ForwardOutputs<float> fwd_same;
  ref::BackwardOutputs<double> bwd_high;
  ref::BackwardOutputs<float> bwd_same;
  std::vector<double> cache_high;
};

// The three typical combinations of the aclnnCompressor documentation.
void apply_preset(DemoOptions& o) {
  struct Preset {
    const char* name;
    i64 D, coff, r;
  };
  for (const Preset& p :
       {Preset{"c4a", 512, 2, 4}, Preset{"c4li", 128, 2, 4}, Preset{"c128a", 512, 1, 128}}) {
    if (o.preset == p.name) {
      o.head_dim = p.D;
      o.coff = p.coff;
      o.cmp_ratio = p.r;
    }
  }
}

// Step 1: the seeded data of the full case and of its reduced copy.
DemoCase make_data(const DemoOptions& o, int threads) {
  DemoCase dc;
  Shared& sh = dc.sh;
  sh.H = o.hidden;
  sh.D = o.head_dim;
  sh.coff = o.coff;
  sh.C = sh.coff * sh.D;
  sh.r = o.cmp_ratio;
  sh.sp = o.start_pos;
  sh.bs = o.block_size;
  const i64 S = o.tokens, H = sh.H, D = sh.D, C = sh.C, r = sh.r, sp = sh.sp;
  dc.S = S;
  sh.cols = (sp + S + sh.bs - 1) / sh.bs;
  // Block id 0 means "do not write" (spec 1.3), so ids start at 1.
  sh.block_num = sh.cols + 1;
  const std::uint64_t seed = o.seed;

  std::printf("kvcomp %s demo on %s: preset %s, seed %llu, %d threads\n", version(),
              device_name(o.device).c_str(), o.preset.c_str(), static_cast<unsigned long long>(seed),
              threads);
  std::printf("case: bf16 BSH B=1 S=%lld H=%lld D=%lld coff=%lld cmp_ratio=%lld start_pos=%lld\n",
              static_cast<long long>(S), static_cast<long long>(H), static_cast<long long>(D),
              static_cast<long long>(sh.coff), static_cast<long long>(r), static_cast<long long>(sp));
  std::printf("      paged state cache: block_size %lld, %lld blocks (id 0 unused), block_table [1, %lld]\n",
              static_cast<long long>(sh.bs), static_cast<long long>(sh.block_num),
              static_cast<long long>(sh.cols));

  const auto t_gen = Clock::now();
  Instance& full = dc.full;
  full.S = S;
  full.x = HostTensor::zeros(DType::bf16, {1, S, H});
  fill_bf16(full.x, seed, kX, 1.0f);
  // Weights scaled so that the projections are O(1), like trained ones.
  const auto wscale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(H)));
  sh.wkv = HostTensor::zeros(DType::bf16, {C, H});
  fill_bf16(sh.wkv, seed, kWkv, wscale);
  sh.wgate = HostTensor::zeros(DType::bf16, {C, H});
  fill_bf16(sh.wgate, seed, kWgate, wscale);
  sh.ape = HostTensor::zeros(DType::f32, {r, C});
  fill_f32(sh.ape, seed, kApe, 0.5f);
  // The upstream tests start from a state uniform in (-10, 10).
  dc.cache0 = HostTensor::zeros(DType::f32, {sh.block_num, sh.bs, 2 * C});
  fill_f32(dc.cache0, seed, kCache, 10.0f);
  sh.table = HostTensor::zeros(DType::i32, {1, sh.cols});
  {
    // A seeded shuffle of 1..cols: pages are scattered in a real cache.
    std::vector<std::int32_t> ids(static_cast<std::size_t>(sh.cols));
    std::iota(ids.begin(), ids.end(), 1);
    for (i64 i = sh.cols - 1; i > 0; --i) {
      const auto j = static_cast<i64>(mix(seed ^ (kTable << 32) ^ static_cast<std::uint64_t>(i)) %
                                      static_cast<std::uint64_t>(i + 1));
      std::swap(ids[static_cast<std::size_t>(i)], ids[static_cast<std::size_t>(j)]);
    }
    std::copy(ids.begin(), ids.end(), sh.table.as<std::int32_t>());
  }
  sh.start_pos = HostTensor::zeros(DType::i32, {1});
  sh.start_pos.as<std::int32_t>()[0] = static_cast<std::int32_t>(sp);
  full.cache = dc.cache0;
  allocate_outputs(sh, full);
  dc.rows = compressed_rows_bsh(S, r);
  full.d_cmp_kv = HostTensor::zeros(DType::bf16, {1, dc.rows, D});
  fill_bf16(full.d_cmp_kv, seed, kDcmp, 1.0f);

  // The reduced problem: the first Sr tokens, the same everything else.
  Instance& red = dc.red;
  // At least two compressed blocks, or the d_x sample (coff = 2) is empty.
  red.S = std::min(S, std::max(o.check_tokens, 2 * r));
  const i64 Sr = red.S, rows_r = compressed_rows_bsh(Sr, r);
  red.x = HostTensor::zeros(DType::bf16, {1, Sr, H});
  std::memcpy(red.x.bytes.data(), full.x.bytes.data(), static_cast<std::size_t>(Sr * H) * 2);
  red.cache = dc.cache0;
  allocate_outputs(sh, red);
  red.d_cmp_kv = HostTensor::zeros(DType::bf16, {1, rows_r, D});
  std::memcpy(red.d_cmp_kv.bytes.data(), full.d_cmp_kv.bytes.data(),
              static_cast<std::size_t>(rows_r * D) * 2);
  std::printf("data generated in %.2f s\n", seconds_since(t_gen));

  std::printf("shapes:\n");
  std::printf("  %-16s %-22s %s\n", "x, d_x", dims({1, S, H}).c_str(), "bf16");
  std::printf("  %-16s %-22s %s\n", "wkv, wgate (+d_)", dims({C, H}).c_str(), "bf16");
  std::printf("  %-16s %-22s %s\n", "ape, d_ape", dims({r, C}).c_str(), "fp32");
  std::printf("  %-16s %-22s %s\n", "state_cache", dims(dc.cache0.shape).c_str(), "fp32");
  std::printf("  %-16s %-22s %s\n", "cmp_kv, d_cmp_kv", dims({1, dc.rows, D}).c_str(), "bf16");
  std::printf("  %-16s %-22s %s\n", "softmax_score, kv", dims(full.score.shape).c_str(), "fp32");
  return dc;
}

// Step 2: kvcomp on the reduced problem (which also warms up the library:
// JIT kernels, thread pool), then the timed runs of the full case.
bool run(DemoCase& dc, const DemoOptions& o, const Options& opt) {
  Shared& sh = dc.sh;
  double ms = 0;
  Status st = run_on(o.device, forward_args(sh, dc.red), opt, &ms);
  if (st.ok()) st = run_on(o.device, backward_args(sh, dc.red), opt, &ms);
  if (!st.ok()) {
    print_error(st.value(), st.message);
    return false;
  }

  const i64 T = dc.S, C = sh.C, H = sh.H;
  const double tcH = static_cast<double>(T) * static_cast<double>(C) * static_cast<double>(H);
  auto time_op = [&](auto args, double flops, const char* label) -> bool {
    double best = 0, total = 0;
    if (const Status s = time_on(o.device, args, opt, o.repeat, &best, &total); !s.ok()) {
      print_error(s.value(), s.message);
      return false;
    }
    if (o.repeat == 1)
      std::printf("  %-24s %10.1f ms %9.1f GFLOP/s\n", label, best * 1e3, flops / best * 1e-9);
    else
      std::printf("  %-24s %10.1f ms best, %.1f ms mean of %d %9.1f GFLOP/s (best)\n", label, best * 1e3,
                  total / o.repeat * 1e3, o.repeat, flops / best * 1e-9);
    return true;
  };
  std::printf("timing on %s (full case, whole call incl. planning and workspace%s):\n",
              device_name(o.device).c_str(),
              o.device.type == DeviceType::cuda ? ", data already on the device" : "");
  // Writes go to positions >= start_pos and reads to positions below it, so a
  // repeated forward sees the same cache every time.
  if (!time_op(forward_args(sh, dc.full), 4 * tcH, "forward (grad_enabled)")) return false;
  if (!time_op(backward_args(sh, dc.full), 8 * tcH, "backward")) return false;
  std::printf("  flops counted: forward 4*T*C*H, backward 8*T*C*H (T=%lld, C=%lld, H=%lld)\n",
              static_cast<long long>(T), static_cast<long long>(C), static_cast<long long>(H));
  return true;
}

// Step 3: the float64 oracle and the fp32 golden on the reduced problem.
Goldens make_goldens(const DemoCase& dc) {
  const auto t_ref = Clock::now();
  const Shared& sh = dc.sh;
  const Instance& red = dc.red;
  const i64 Sr = red.S, H = sh.H, D = sh.D, C = sh.C, r = sh.r, rows_r = compressed_rows_bsh(Sr, r);
  ref::Problem p;
  p.th = false;
  p.B = 1;
  p.S = Sr;
  p.H = H;
  p.D = D;
  p.coff = sh.coff;
  p.r = r;
  p.start_pos = {static_cast<std::int32_t>(sh.sp)};
  const i64 nrow = sh.coff * r;
  const std::vector<std::int32_t> table(sh.table.as<std::int32_t>(), sh.table.as<std::int32_t>() + sh.cols);

  auto make_fwd_inputs = [&]<typename Real>(Real) {
    ref::ForwardInputs<Real> in;
    in.x = to_real<Real>(red.x, Sr * H);
    in.wkv = to_real<Real>(sh.wkv, C * H);
    in.wgate = to_real<Real>(sh.wgate, C * H);
    in.ape = to_real<Real>(sh.ape, r * C);
    in.cache.block_num = sh.block_num;
    in.cache.block_size = sh.bs;
    in.cache.cache_mode = 1;
    in.cache.block_table = table;
    in.cache.table_cols = sh.cols;
    in.cache.data = to_real<Real>(dc.cache0, dc.cache0.numel());
    return in;
  };
  // The backward of all three parties takes kvcomp's own forward
  // intermediates, so the backward is judged on its own.
  auto make_bwd_inputs = [&]<typename Real>(const ref::ForwardInputs<Real>& f) {
    ref::BackwardInputs<Real> in;
    in.x = f.x;
    in.wkv = f.wkv;
    in.wgate = f.wgate;
    in.d_cmp_kv = to_real<Real>(red.d_cmp_kv, rows_r * D);
    in.softmax_score = to_real<Real>(red.score, rows_r * nrow * D);
    in.kv = to_real<Real>(red.kv, rows_r * nrow * D);
    return in;
  };
  Goldens g;
  auto fin_d = make_fwd_inputs(0.0);
  g.fwd_high = ref::forward<double>(p, fin_d);
  g.bwd_high = ref::backward<double>(p, make_bwd_inputs(fin_d));
  g.cache_high = fin_d.cache.data;
  auto fin_f = make_fwd_inputs(0.0f);
  g.fwd_same = ref::forward<float>(p, fin_f);
  // The "same" golden stages d_new in the io dtype, as the NPU does (spec 6.2).
  g.bwd_same = ref::backward<float>(p, make_bwd_inputs(fin_f),
                                    [](float v) { return bf16_to_float(float_to_bf16(v)); });
  std::printf("float64 oracle and fp32 golden on the reduced problem: %.2f s\n", seconds_since(t_ref));
  return g;
}

// Step 4: the three-party comparisons, one report row each; false if any fails.
bool compare(const DemoCase& dc, const Goldens& g) {
  const Shared& sh = dc.sh;
  const Instance &red = dc.red, &full = dc.full;
  const i64 Sr = red.S, H = sh.H, D = sh.D, C = sh.C, r = sh.r, sp = sh.sp,
            rows_r = compressed_rows_bsh(Sr, r);
  const i64 nrow = sh.coff * r;
  const auto& fout_d = g.fwd_high;
  const auto& bout_d = g.bwd_high;
  const auto& fout_f = g.fwd_same;
  const auto& bout_f = g.bwd_same;
  // Valid (non-padding) compressed rows of the reduced problem form a prefix
  // for B = 1.
  i64 valid = 0;
  while (valid < rows_r && fout_d.valid[static_cast<std::size_t>(valid)]) ++valid;
  const DType bf = DType::bf16, f32 = DType::f32;
  Report rep;
  std::printf(
      "\nprecision, reduced problem (first %lld tokens, same weights, APE and cache) vs the float64 oracle\n",
      static_cast<long long>(Sr));
  std::printf(
      "  A = kvcomp, B = fp32 golden, C = float64 truth rounded to the output dtype; spec 7.2 three-party "
      "rule\n");
  rep.header();
  rep.row("cmp_kv (" + std::to_string(valid) + " rows)", bf, floats(red.cmp_kv, 0, valid, D),
          rounded(fout_f.cmp_kv, 0, valid, D, bf), rounded(fout_d.cmp_kv, 0, valid, D, bf), true);
  rep.row("softmax_score", f32, floats(red.score, 0, valid, nrow * D),
          rounded(fout_f.softmax_score, 0, valid, nrow * D, f32),
          rounded(fout_d.softmax_score, 0, valid, nrow * D, f32));
  rep.row("kv", f32, floats(red.kv, 0, valid, nrow * D), rounded(fout_f.kv, 0, valid, nrow * D, f32),
          rounded(fout_d.kv, 0, valid, nrow * D, f32), true);
  rep.row("d_x", bf, floats(red.d_x, 0, Sr, H), rounded(bout_f.d_x, 0, Sr, H, bf),
          rounded(bout_d.d_x, 0, Sr, H, bf));
  rep.row("d_wkv", bf, floats(red.d_wkv, 0, C, H), rounded(bout_f.d_wkv, 0, C, H, bf),
          rounded(bout_d.d_wkv, 0, C, H, bf));
  rep.row("d_wgate", bf, floats(red.d_wgate, 0, C, H), rounded(bout_f.d_wgate, 0, C, H, bf),
          rounded(bout_d.d_wgate, 0, C, H, bf));
  rep.row("d_ape", f32, floats(red.d_ape, 0, r, C), rounded(bout_f.d_ape, 0, r, C, f32),
          rounded(bout_d.d_ape, 0, r, C, f32));
  {
    const i64 n = dc.cache0.numel();
    const ref::TwoWayResult tp =
        ref::two_way_compare(floats(red.cache, 0, n, 1), rounded(g.cache_high, 0, n, 1, f32), bf);
    rep.all_pass = rep.all_pass && tp.pass;
    std::printf(
        "  %-26s two-party (spec 7.1, bf16 tolerances): %zu elements, pass rate %.4f%%, %zu outside  %s\n",
        "state_cache", tp.n, (1.0 - tp.fail_fraction) * 100, tp.n_fail, tp.pass ? "PASS" : "FAIL");
  }

  // Rows of the full run that are, mathematically, the same numbers as in the
  // reduced problem: the valid compressed rows, and the d_x rows of tokens
  // whose every block (their own and, for coff=2, the next) lies inside them.
  const i64 limit_r = (sp + Sr) / r * r;
  const i64 dx_rows = std::clamp<i64>(limit_r - (sh.coff - 1) * r - sp, 0, Sr);
  std::printf(
      "\nsample of the full run vs the float64 oracle (rows that depend only on the first %lld tokens)\n",
      static_cast<long long>(Sr));
  rep.header();
  rep.row("cmp_kv rows [0," + std::to_string(valid) + ")", bf, floats(full.cmp_kv, 0, valid, D),
          rounded(fout_f.cmp_kv, 0, valid, D, bf), rounded(fout_d.cmp_kv, 0, valid, D, bf), true);
  rep.row("softmax_score rows [0," + std::to_string(valid) + ")", f32, floats(full.score, 0, valid, nrow * D),
          rounded(fout_f.softmax_score, 0, valid, nrow * D, f32),
          rounded(fout_d.softmax_score, 0, valid, nrow * D, f32));
  rep.row("d_x rows [0," + std::to_string(dx_rows) + ")", bf, floats(full.d_x, 0, dx_rows, H),
          rounded(bout_f.d_x, 0, dx_rows, H, bf), rounded(bout_d.d_x, 0, dx_rows, H, bf));
  return rep.all_pass;
}

// Step 5: the legend and the verdict; the exit code.
int report(bool all_pass) {
  std::printf(
      "\nMARE = max relative error over |C| >= 2e-8 (bf16) / 2e-14 (fp32); pass: MARE_A < 10*MARE_B, "
      "MERE_A < 2*MERE_B, RMSE_A < 2*RMSE_B\n");
  std::printf(
      "fp32-projection bound (cmp_kv, kv: as accurate as the fp32 projection, like the NPU): within one io "
      "ulp"
      " of C plus 2^-18 max|C|, rounding flips <= 2x B's + 3; fp32: MERE, RMSE ratios < 2, max abs <= 10x "
      "B's\n");
  if (!all_pass) {
    std::printf("result: precision check FAILED\n");
    return kExitStatus;
  }
  std::printf("result: PASS\n");
  return kExitOk;
}

}  // namespace

int run_demo(const DemoOptions& o_in) {
  DemoOptions o = o_in;
  apply_preset(o);
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  DemoCase dc = make_data(o, threads);
  Options opt;
  opt.num_threads = o.threads;
  if (!run(dc, o, opt)) return kExitStatus;
  const Goldens g = make_goldens(dc);
  return report(compare(dc, g));
}

}  // namespace kvcomp::cli
