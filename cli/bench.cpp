// `kvcomp bench`: times both operators on the shapes of real models and
// compares each with the matrix products alone, done by oneDNN in the same
// process, with the same threads. The ratio (operator / products) is the
// figure of merit of issue #4: everything the operator does besides the two
// products (element-wise phase, conversions, data movement) shows up in it.
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.hpp"
#include "workload.hpp"

namespace kvcomp::cli {

namespace {

using i64 = std::int64_t;
using Clock = std::chrono::steady_clock;

using bench::Case;
using bench::DecodeCase;
using bench::DecodeWorkload;
using bench::Products;
using bench::Workload;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Resets the kernel's peak-RSS mark (Linux >= 4.0), so each case reports its own peak.
void reset_peak_rss() {
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
}

long peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss / 1024;
}

// Reads and writes a buffer of 4x the last-level cache (at least 128 MiB) so that no operand of the next
// call is cached: a server runs many layers between two calls of one, so their weights come from memory.
void evict_caches() {
  static std::vector<std::uint64_t> junk = [] {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    const std::size_t bytes =
        std::max<std::size_t>(std::size_t{128} << 20, 4 * static_cast<std::size_t>(std::max(l3, 0L)));
    return std::vector<std::uint64_t>(bytes / sizeof(std::uint64_t), 1);
  }();
  std::uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
  for (std::size_t i = 0; i < junk.size(); i += 8) sum += junk[i] += 1;  // one word per cache line
  if (sum == 42) std::fputc(' ', stderr);
}

// Untimed runs of a warm decode call before each timed one (and before its phase clock), so that it
// finds its data cached as a loop of its own calls would: the functions timed before it read 16-48 MiB
// of other weights. One run was not enough on a CPU with a small last-level cache: the call and its
// product alone then measured up to twice their time after three runs (docs/performance.md).
constexpr int kRewarmRuns = 3;
// The untimed runs before each timed decode call of this bench: none where --decode-cold evicts the caches.
int decode_rewarm_runs(const BenchOptions& o) { return o.decode_cold ? 0 : kRewarmRuns; }

// Best wall time of each of `fs` over `repeat` rounds. Every round runs each one once, in turn, so that a
// noisy stretch of a shared machine slows them alike and the ratios between them stay fair (timing all
// runs of one before the next let a burst of noise land on one side of a ratio only). Before each timed
// run: the caches evicted when `cold`; else `rewarm_runs` untimed runs of the same function (the previous
// one read other data). An empty function times as 0.
using Timed = std::function<void()>;
std::vector<double> best_in_rounds(int repeat, const std::vector<Timed>& fs, bool cold, int rewarm_runs) {
  std::vector<double> best(fs.size(), 1e300);
  for (int round = 0; round < repeat; ++round)
    for (std::size_t i = 0; i < fs.size(); ++i) {
      if (!fs[i]) continue;
      if (cold)
        evict_caches();
      else
        for (int w = 0; w < rewarm_runs; ++w) fs[i]();
      const auto t0 = Clock::now();
      fs[i]();
      best[i] = std::min(best[i], seconds_since(t0));
    }
  for (std::size_t i = 0; i < fs.size(); ++i)
    if (!fs[i]) best[i] = 0;
  return best;
}

// The products alone of one kind, or none where oneDNN has no such matmul here (bf16 operands need
// bf16 units: reported as n/a); fp32 products must exist. 16-bit products only for bf16 io: kvcomp
// runs an fp16 call's products in fp32 (oneDNN's fp16 matmul needs AVX512-FP16 or AMX-FP16, which
// kvcomp does not use), so a bf16 product is no baseline of it.
template <typename C, typename... A>
std::unique_ptr<Products> products_or_none(bool bf16, const C& c, const A&... a) {
  if (bf16 && c.io != DType::bf16) return nullptr;
  try {
    auto p = std::make_unique<Products>(c, a..., bf16);
    p->run();  // warm-up: primitive, pages
    return p;
  } catch (const dnnl::error&) {
    if (!bf16) throw;
    return nullptr;
  }
}

Timed run_of(const std::unique_ptr<Products>& p) {
  if (!p) return {};
  return [q = p.get()] { q->run(); };
}

// --phases: where a call's time goes. The call runs `calls` times more with the phase clock on
// (kvcomp::set_phase_timing): its mean wall time and each of its operator's phases' mean time per call
// (kvcomp::phase_times), in the order a call runs them. The wall time no phase holds (validation,
// planning, the workspace) is the call's "outside".
struct PhaseProfile {
  std::string label;  // the call, e.g. "forward", "backward precise", "decode close"
  bool forward = true;
  int calls = 0;
  double call_s = 0;
  std::vector<std::pair<std::string, double>> phases;  // name, mean seconds per call
  double outside_s() const {
    double in = 0;
    for (const auto& ph : phases) in += ph.second;
    return call_s - in;
  }
};

// `warm_runs` untimed runs of f before the clock starts (a warm decode call: kRewarmRuns).
PhaseProfile profile_phases(std::string label, const Timed& f, bool forward, int calls,
                            const Timed& before = {}, int warm_runs = 0) {
  PhaseProfile p{std::move(label), forward, calls, 0, {}};
  for (int i = 0; i < warm_runs; ++i) f();
  struct ClockOn {  // off again however the calls end
    ClockOn() {
      reset_phase_times();
      set_phase_timing(true);
    }
    ~ClockOn() { set_phase_timing(false); }
  };
  {
    const ClockOn on;
    for (int i = 0; i < calls; ++i) {
      if (before) before();  // --decode-cold: the caches evicted, untimed
      const auto t0 = Clock::now();
      f();
      p.call_s += seconds_since(t0) / calls;
    }
  }
  const std::string op = forward ? "forward" : "backward";
  for (const PhaseTime& t : phase_times())
    if (op == t.op)
      p.phases.emplace_back(t.phase, t.calls > 0 ? t.seconds / static_cast<double>(t.calls) : 0.0);
  return p;
}

nlohmann::json phases_json(const PhaseProfile& p) {
  nlohmann::json phases = nlohmann::json::array();
  for (const auto& [name, sec] : p.phases) phases.push_back({{"phase", name}, {"ms", sec * 1e3}});
  return {{"calls", p.calls},
          {"call_ms", p.call_s * 1e3},
          {"outside_ms", p.outside_s() * 1e3},
          {"phases", phases}};
}

// The phase tables (--phases): one per operator, a row per profiled call, each phase as a percentage
// of the call's mean wall time.
void print_phase_tables(const std::vector<PhaseProfile>& profiles) {
  for (const bool forward : {true, false}) {
    const PhaseProfile* first = nullptr;
    for (const PhaseProfile& p : profiles)
      if (p.forward == forward && !first) first = &p;
    if (!first) continue;
    std::printf("\n%s phases, %% of the call (--phases: the mean of %d calls with the phase clock on)\n",
                forward ? "forward" : "backward", first->calls);
    auto width = [](const std::string& name) {
      return static_cast<int>(std::max<std::size_t>(7, name.size()));
    };
    std::printf("%-36s %9s |", "call", "call ms");
    for (const auto& ph : first->phases) std::printf(" %*s", width(ph.first), ph.first.c_str());
    std::printf(" %7s\n", "outside");
    for (const PhaseProfile& p : profiles) {
      if (p.forward != forward) continue;
      std::printf("%-36s %9.3f |", p.label.c_str(), p.call_s * 1e3);
      for (const auto& ph : p.phases) std::printf(" %*.1f", width(ph.first), 100.0 * ph.second / p.call_s);
      std::printf(" %7.1f\n", 100.0 * p.outside_s() / p.call_s);
    }
  }
}

struct Result {
  double fwd_s = 0, fwd_products_s = 0, fwd_products_bf16_s = 0, bwd_s = 0, bwd_products_s = 0,
         bwd_products_bf16_s = 0;
  double bwd_parity_s = 0;  // --both-modes: the npu_parity backward (bwd_s is then the precise one)
  long rss_mib = 0;
  double compressed_fraction = 0;    // tokens inside compressed blocks / T
  std::vector<PhaseProfile> phases;  // --phases: forward, backward[, backward npu_parity]
};

Result run_case(const Case& c, const BenchOptions& o) {
  Result res;
  const Workload w(c);
  res.compressed_fraction = w.compressed_fraction();
  Options opt;
  opt.num_threads = o.threads;
  opt.precision = o.npu_parity ? Precision::npu_parity : Precision::precise;
  auto check = [](const Status& st) {
    if (!st.ok()) throw std::runtime_error(st.message);
  };
  const Timed fwd = [&] { check(compressor_forward(w.forward(), opt)); };
  const Timed bwd = [&] { check(compressor_backward(w.backward(), opt)); };
  Options parity_opt = opt;
  parity_opt.precision = Precision::npu_parity;
  const Timed bwd_parity =
      o.both_modes ? Timed{[&] { check(compressor_backward(w.backward(), parity_opt)); }} : Timed{};
  fwd();  // warm-up: workspace, pages; the peak RSS is the operator's, before the baselines' buffers exist
  bwd();
  if (bwd_parity) bwd_parity();
  res.rss_mib = peak_rss_mib();
  // The products alone (oneDNN, library threading), with fp32 and with bf16 operands, timed in the same
  // rounds as the operator.
  const auto fwd32 = products_or_none(false, c, Products::Which::forward);
  const auto fwd16 = products_or_none(true, c, Products::Which::forward);
  const auto bwd32 = products_or_none(false, c, Products::Which::backward);
  const auto bwd16 = products_or_none(true, c, Products::Which::backward);
  const std::vector<double> t = best_in_rounds(
      o.repeat, {fwd, run_of(fwd32), run_of(fwd16), bwd, run_of(bwd32), run_of(bwd16), bwd_parity}, false, 0);
  res.fwd_s = t[0];
  res.fwd_products_s = t[1];
  res.fwd_products_bf16_s = t[2];
  res.bwd_s = t[3];
  res.bwd_products_s = t[4];
  res.bwd_products_bf16_s = t[5];
  res.bwd_parity_s = t[6];
  if (o.phases) {
    res.phases.push_back(profile_phases("forward", fwd, true, o.repeat));
    res.phases.push_back(
        profile_phases(o.npu_parity ? "backward npu_parity" : "backward precise", bwd, false, o.repeat));
    if (bwd_parity) res.phases.push_back(profile_phases("backward npu_parity", bwd_parity, false, o.repeat));
  }
  return res;
}

struct DecodeResult {
  double open_s = 0, close_s = 0, close_raw_s = 0, products_s = 0, products_bf16_s = 0;
  std::vector<PhaseProfile> phases;  // --phases: the open call (where there is one), the closing one
};

// A decode call where no sequence closes a block, and one where every
// sequence does (both at positions past 1024), and its one product alone,
// timed in the same rounds.
DecodeResult run_decode(DecodeCase c, const BenchOptions& o) {
  Options opt;
  opt.num_threads = o.threads;
  const std::int64_t base = 1024 / c.p.r * c.p.r + c.p.r;  // a block start
  // One call's workload; a server prepares a layer's weights once (prepare_weights), and its open and
  // closing calls read that one blob (every workload has the same weights: fixed seeds); raw: every call
  // converts or packs them.
  struct Call {
    std::unique_ptr<DecodeWorkload> w;
    ForwardArgs args;
  };
  std::vector<unsigned char> blob;
  std::vector<std::unique_ptr<Call>> calls;
  auto call = [&](std::int64_t start_pos, bool prepared) -> Timed {
    c.start_pos = start_pos;
    auto k = std::make_unique<Call>();
    k->w = std::make_unique<DecodeWorkload>(c);
    k->args = k->w->forward();
    if (prepared) {
      if (blob.empty()) {  // the first prepared call prepares the blob
        std::size_t bytes = 0;
        Status s = prepared_weights_size(k->args.wkv, k->args.wgate, &bytes);
        blob.resize(bytes);
        if (s.ok()) s = prepare_weights(k->args.wkv, k->args.wgate, blob.data(), bytes, opt);
        if (!s.ok()) throw std::runtime_error(s.message);
      }
      k->args.prepared_weights = blob.data();
      k->args.prepared_weights_bytes = blob.size();
    }
    const Timed f = [&opt, a = &k->args] {
      const Status st = compressor_forward(*a, opt);
      if (!st.ok()) throw std::runtime_error(st.message);
    };
    f();  // warm-up: primitives, pages
    calls.push_back(std::move(k));
    return f;
  };
  // tokens base .. base + tokens - 1: no block end; the last token ends a block
  const Timed open = c.tokens < c.p.r ? call(base, true) : Timed{};
  const Timed close = call(base + c.p.r - c.tokens, true);
  const Timed raw = call(base + c.p.r - c.tokens, false);
  const auto p32 = products_or_none(false, c);
  const auto p16 = products_or_none(true, c);
  const int rewarm = decode_rewarm_runs(o);
  const std::vector<double> t =
      best_in_rounds(o.repeat, {open, close, raw, run_of(p32), run_of(p16)}, o.decode_cold, rewarm);
  DecodeResult r{t[0], t[1], t[2], t[3], t[4], {}};
  if (o.phases) {
    const Timed before = o.decode_cold ? Timed{evict_caches} : Timed{};
    if (open) r.phases.push_back(profile_phases("open", open, true, o.repeat, before, rewarm));
    r.phases.push_back(profile_phases("close", close, true, o.repeat, before, rewarm));
  }
  return r;
}

// "1.234" or "n/a" when the denominator was not measured.
std::string ratio(double num, double den) {
  if (!(num > 0) || !(den > 0)) return "n/a";
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", num / den);
  return b;
}

// Milliseconds, or null where the time was not measured (0).
nlohmann::json ms_or_null(double seconds) {
  return seconds > 0 ? nlohmann::json(seconds * 1e3) : nlohmann::json(nullptr);
}

// num / den, or null where either was not measured.
nlohmann::json ratio_or_null(double num, double den) {
  return num > 0 && den > 0 ? nlohmann::json(num / den) : nlohmann::json(nullptr);
}

// What the library's products run on for a bf16 call (product_kernels()).
struct Used {
  bool fwd_bf16, bwd_bf16;
  const char* fwd;
  const char* bwd;
};

Used products_used(bool npu_parity, DType io) {
  if (io != DType::bf16) return {false, false, "f32", "f32"};  // kvcomp's fp16 calls: fp32 products
  const std::string k = product_kernels();
  const bool units = k.rfind("bf16 (", 0) == 0;
  const bool split = k.find("precise as hi+lo") != std::string::npos;
  const bool bwd_units = units && k.find("backward in f32") == std::string::npos;
  Used u{units, bwd_units && (npu_parity || split), units ? "bf16" : "f32", "f32"};
  if (bwd_units && npu_parity) u.bwd = "bf16";
  if (units && !npu_parity && split) u.bwd = "hi+lo";
  return u;
}

// product_kernels() describes a bf16 call; an fp16 call's products are fp32 (kvcomp uses no fp16
// matmul), on the same few-row kernel where there is one.
std::string products_text(DType io) {
  const std::string k = product_kernels();
  if (io == DType::bf16) return k;
  const std::size_t rows = k.find("; ");
  return "f32 (dnnl_sgemm) for fp16 io" + (rows == std::string::npos ? std::string() : k.substr(rows));
}

}  // namespace

#ifdef KVCOMP_HAVE_CUDA
int run_bench_cuda(const BenchOptions& o, const std::vector<bench::Case>& cases);  // cli/bench_cuda.cpp
#endif

int run_bench(const BenchOptions& o) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  const DType io = o.io == "fp16" ? DType::f16 : DType::bf16;
  std::vector<Case> cases;
  for (const bench::Profile& p : bench::kProfiles) {
    if (o.preset != "all" && o.preset != p.name) continue;
    for (i64 T : o.training ? o.tokens : std::vector<i64>{}) {
      cases.push_back({p, T, o.hidden, 1, io});
      const i64 batches = bench::varlen_batches(p, T, o.varlen);
      if (batches > 1) cases.push_back({p, T, o.hidden, batches, io});
    }
  }
  if (o.device.type == DeviceType::cuda) {
    if (!o.json.empty() || o.both_modes || o.phases) {
      print_error(static_cast<int>(StatusCode::invalid_param),
                  std::string("[kvcomp] ") +
                      (o.both_modes ? "--both-modes"
                       : o.phases   ? "--phases"
                                    : "--json") +
                      " is for the CPU bench, not with --device cuda");
      return kExitStatus;
    }
    if (io != DType::bf16) {  // the GPU bench's products and buffers are bf16 (cli/bench_cuda.cpp)
      print_error(static_cast<int>(StatusCode::invalid_param),
                  "[kvcomp] --io (= " + o.io + ") must be bf16 with --device cuda");
      return kExitStatus;
    }
#ifdef KVCOMP_HAVE_CUDA
    return run_bench_cuda(o, cases);
#else
    print_error(
        static_cast<int>(StatusCode::invalid_param),
        "[kvcomp] --device (= " + device_name(o.device) +
            ") must be cpu: this build of kvcomp has no CUDA backend (configure it with -DKVCOMP_CUDA=ON "
            "and a CUDA 13 toolkit)");
    return kExitStatus;
#endif
  }
  // Opened first, so that an unwritable path fails before minutes of timing.
  std::ofstream json_file;
  if (!o.json.empty()) {
    json_file.open(o.json);
    if (!json_file) {
      print_error(static_cast<int>(StatusCode::runtime_error), "[kvcomp] cannot write --json file " + o.json);
      return kExitUsage;
    }
  }
  const Used used = products_used(o.npu_parity, io);
  nlohmann::json doc = {{"kvcomp", version()},
                        {"threads", threads},
                        {"hidden", o.hidden},
                        {"io", o.io},
                        {"mode", o.npu_parity ? "npu_parity" : "precise"},
                        {"both_modes", o.both_modes},
                        {"phases", o.phases},
                        {"isa", kernel_isa()},
                        {"products", products_text(io)},
                        {"repeat", o.repeat},
                        {"decode_cold", o.decode_cold},
                        {"decode_rewarm_runs", decode_rewarm_runs(o)},
                        {"training", nlohmann::json::array()},
                        {"decode", nlohmann::json::array()}};
  std::printf("kvcomp %s bench: %d threads, H=%lld, %s io, %s mode, %s kernels, products %s, best of %d%s\n",
              version(), threads, static_cast<long long>(o.hidden), o.io.c_str(),
              o.npu_parity ? "npu_parity" : "precise", kernel_isa(), products_text(io).c_str(), o.repeat,
              o.decode_cold ? ", decode cold" : "");
  int i = 0;
  if (!cases.empty()) {
    std::printf("%-6s %-8s %6s %5s | %-10s | %8s %7s %6s %6s | %8s %7s %6s %6s | %7s", "prof", "layout", "T",
                "cmp%", "products", "fwd ms", "GFLOP/s", "x f32p", "x 16p", "bwd ms", "GFLOP/s", "x f32p",
                "x 16p", "peak MiB");
    if (o.both_modes) std::printf(" | %8s %6s %6s", "par ms", "x 16p", "pr/par");
    std::printf("\n");
  }
  const Used parity_used = products_used(true, io);
  std::vector<PhaseProfile> profiles;  // --phases, every case's, for the tables at the end
  for (const Case& c : cases) {
    std::fprintf(stderr, "[%d/%zu] %s T=%lld %s ...\r", ++i, cases.size(), c.p.name,
                 static_cast<long long>(c.T), c.batches > 1 ? "TH" : "BSH");
    std::fflush(stderr);
    reset_peak_rss();
    const Result r = run_case(c, o);
    const double flop_fwd = c.forward_flop(), flop_bwd = c.backward_flop();
    const std::string layout = c.batches > 1 ? "TH/" + std::to_string(c.batches) : "BSH";
    const std::string kinds = std::string(used.fwd) + "/" + used.bwd;
    std::printf("%-6s %-8s %6lld %5.1f | %-10s | %8.1f %7.1f %6s %6s | %8.1f %7.1f %6s %6s | %7ld", c.p.name,
                layout.c_str(), static_cast<long long>(c.T), 100.0 * r.compressed_fraction, kinds.c_str(),
                r.fwd_s * 1e3, flop_fwd / r.fwd_s / 1e9, ratio(r.fwd_s, r.fwd_products_s).c_str(),
                ratio(r.fwd_s, r.fwd_products_bf16_s).c_str(), r.bwd_s * 1e3, flop_bwd / r.bwd_s / 1e9,
                ratio(r.bwd_s, r.bwd_products_s).c_str(), ratio(r.bwd_s, r.bwd_products_bf16_s).c_str(),
                r.rss_mib);
    if (o.both_modes) {
      const std::string par_x = ratio(r.bwd_parity_s, r.bwd_products_bf16_s);
      const std::string pr_par = ratio(r.bwd_s, r.bwd_parity_s);
      std::printf(" | %8.1f %6s %6s", r.bwd_parity_s * 1e3, par_x.c_str(), pr_par.c_str());
    }
    std::printf("\n");
    std::fflush(stdout);
    nlohmann::json row = {{"preset", c.p.name},
                          {"layout", c.batches > 1 ? "TH" : "BSH"},
                          {"sequences", c.batches},
                          {"T", c.T},
                          {"compressed_fraction", r.compressed_fraction},
                          {"products", {{"forward", used.fwd}, {"backward", used.bwd}}},
                          {"fwd_ms", ms_or_null(r.fwd_s)},
                          {"fwd_products_f32_ms", ms_or_null(r.fwd_products_s)},
                          {"fwd_products_16_ms", ms_or_null(r.fwd_products_bf16_s)},
                          {"fwd_x_f32p", ratio_or_null(r.fwd_s, r.fwd_products_s)},
                          {"fwd_x_16p", ratio_or_null(r.fwd_s, r.fwd_products_bf16_s)},
                          {"bwd_ms", ms_or_null(r.bwd_s)},
                          {"bwd_products_f32_ms", ms_or_null(r.bwd_products_s)},
                          {"bwd_products_16_ms", ms_or_null(r.bwd_products_bf16_s)},
                          {"bwd_x_f32p", ratio_or_null(r.bwd_s, r.bwd_products_s)},
                          {"bwd_x_16p", ratio_or_null(r.bwd_s, r.bwd_products_bf16_s)},
                          {"peak_mib", r.rss_mib}};
    if (o.both_modes) {
      row["products"]["backward_npu_parity"] = parity_used.bwd;
      row["bwd_npu_parity_ms"] = ms_or_null(r.bwd_parity_s);
      row["bwd_npu_parity_x_16p"] = ratio_or_null(r.bwd_parity_s, r.bwd_products_bf16_s);
      row["precise_over_npu_parity"] = ratio_or_null(r.bwd_s, r.bwd_parity_s);
    }
    if (o.phases) {
      row["phases"] = nlohmann::json::object();
      for (PhaseProfile p : r.phases) {
        row["phases"][p.label == "forward"                               ? "forward"
                      : p.label == "backward npu_parity" && o.both_modes ? "backward_npu_parity"
                                                                         : "backward"] = phases_json(p);
        p.label = std::string(c.p.name) + " " + layout + " T=" + std::to_string(c.T) + " " + p.label;
        profiles.push_back(p);
      }
    }
    doc["training"].push_back(row);
  }
  std::vector<DecodeCase> decode;
  for (const bench::Profile& p : bench::kProfiles) {
    if (o.preset != "all" && o.preset != p.name) continue;
    for (i64 b : o.decode)
      if (b > 0)
        decode.push_back(
            {p, b, o.decode_tokens, o.hidden, 0, o.decode_cache == "ring", io, o.decode_layout == "th"});
  }
  if (!decode.empty())
    std::printf("\n%-6s %4s %3s %-5s %-3s | %-8s | %9s %9s %6s %8s | %8s %8s | %6s %7s\n", "decode", "B",
                "tok", "cache", "lay", "products", "open ms", "close ms", "c/o", "raw ms", "16p ms",
                "f32p ms", "x prod", "GFLOP/s");
  for (const DecodeCase& c : decode) {
    std::fprintf(stderr, "decode %s B=%lld ...\r", c.p.name, static_cast<long long>(c.batches));
    std::fflush(stderr);
    const DecodeResult r = run_decode(c, o);
    // x prod: the block-closing call against the product alone of the kind the call uses.
    const double prod = used.fwd_bf16 ? r.products_bf16_s : r.products_s;
    char open_ms[32] = "n/a";
    if (r.open_s > 0) std::snprintf(open_ms, sizeof open_ms, "%.3f", r.open_s * 1e3);
    char bf16_ms[32] = "n/a";
    if (r.products_bf16_s > 0) std::snprintf(bf16_ms, sizeof bf16_ms, "%.3f", r.products_bf16_s * 1e3);
    std::printf("%-6s %4lld %3lld %-5s %-3s | %-8s | %9s %9.3f %6s %8.3f | %8s %8.3f | %6s %7.1f\n", c.p.name,
                static_cast<long long>(c.batches), static_cast<long long>(c.tokens), o.decode_cache.c_str(),
                c.th ? "TH" : "BSH", used.fwd, open_ms, r.close_s * 1e3, ratio(r.close_s, r.open_s).c_str(),
                r.close_raw_s * 1e3, bf16_ms, r.products_s * 1e3, ratio(r.close_s, prod).c_str(),
                c.flop() / r.close_s / 1e9);
    std::fflush(stdout);
    doc["decode"].push_back({{"preset", c.p.name},
                             {"B", c.batches},
                             {"tokens", c.tokens},
                             {"cache", o.decode_cache},
                             {"layout", c.th ? "TH" : "BSH"},
                             {"products", used.fwd},
                             {"open_ms", ms_or_null(r.open_s)},
                             {"close_ms", ms_or_null(r.close_s)},
                             {"close_raw_ms", ms_or_null(r.close_raw_s)},
                             {"products_16_ms", ms_or_null(r.products_bf16_s)},
                             {"products_f32_ms", ms_or_null(r.products_s)},
                             {"open_x_prod", ratio_or_null(r.open_s, prod)},
                             {"close_x_prod", ratio_or_null(r.close_s, prod)},
                             {"close_over_open", ratio_or_null(r.close_s, r.open_s)}});
    if (o.phases) {
      doc["decode"].back()["phases"] = nlohmann::json::object();
      for (PhaseProfile p : r.phases) {
        doc["decode"].back()["phases"][p.label] = phases_json(p);
        p.label = std::string(c.p.name) + " decode B=" + std::to_string(c.batches) +
                  " tok=" + std::to_string(c.tokens) + " " + p.label;
        profiles.push_back(p);
      }
    }
  }
  if (o.phases) print_phase_tables(profiles);
  std::fprintf(stderr, "%60s\r", "");
  std::printf(
      "products: what the forward / backward products of a bf16 call run on (bf16 units, hi+lo bf16 parts, "
      "f32).\n"
      "x f32p, x 16p: operator time / time of its matrix products alone (oneDNN, library threading, same "
      "threads)\n"
      "  with fp32 / bf16 operands (n/a: no bf16 matmul on this CPU; bf16: the weights pre-packed in the "
      "layout\n"
      "  the kernel reads, reordered before timing). Flops: forward 4*T*C*H, backward 8*T*C*H.\n"
      "cmp%%: tokens inside compressed blocks (the backward's products skip whole chunks without any);\n"
      "TH/n: n sequences, lengths uniform in [0.5, 1.5] x T/n. peak MiB: the process's peak RSS in the "
      "case.\n"
      "decode: forward of B sequences x tok tokens past position 1024, no gradient, lay(out) BSH or TH\n"
      "  (--decode-layout); open: no sequence ends a block,\n"
      "  close: every sequence does; c/o their ratio; both reading one blob of the weights prepared once\n"
      "  (prepare_weights); raw: the close call converting or packing the weights itself; 16p / f32p: the\n"
      "  call's product x[B*tok, H] . W[2C, H]^T alone (16p: W pre-packed);\n"
      "  x prod: close / the product alone of the kind the call uses. Each timed call and product after\n"
      "  %d untimed runs of it (warm, as in a loop of its own calls); --decode-cold: caches evicted\n"
      "  instead (weights read from memory, as in a server of many layers).\n",
      kRewarmRuns);
  if (o.phases)
    std::printf(
        "phases (--phases): each call run --repeat times more with the phase clock on, after its timed "
        "rounds\n"
        "  (a warm decode call after %d untimed runs);\n"
        "  call ms: their mean wall time; each phase's mean as %% of it (docs/performance.md names the "
        "phases);\n"
        "  outside: the rest (validation, planning, the workspace).\n",
        kRewarmRuns);
  if (o.both_modes)
    std::printf(
        "par ms, x 16p: the npu_parity backward (--both-modes) and its ratio to the bf16 products alone; "
        "pr/par: bwd ms (precise) / par ms.\n");
  if (json_file.is_open()) {
    json_file << doc.dump(2) << "\n";
    json_file.close();
    if (!json_file) {
      print_error(static_cast<int>(StatusCode::runtime_error), "[kvcomp] cannot write --json file " + o.json);
      return kExitUsage;
    }
  }
  return kExitOk;
}

}  // namespace kvcomp::cli
