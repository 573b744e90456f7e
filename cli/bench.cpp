// `kvcomp bench`: times both operators on the shapes of real models and
// compares each with the matrix products alone, done by oneDNN in the same
// process, with the same threads. The ratio (operator / products) is the
// figure of merit of issue #4: everything the operator does besides the two
// products (element-wise phase, conversions, data movement) shows up in it.
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "commands.hpp"
#include "workload.hpp"

namespace kvcomp::cli {

namespace {

using i64 = std::int64_t;
using Clock = std::chrono::steady_clock;

using bench::Case;
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

// Best wall time of `repeat` runs of f.
template <typename F>
double best_of(int repeat, F&& f) {
  double best = 1e300;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

struct Result {
  double fwd_s = 0, fwd_products_s = 0, bwd_s = 0, bwd_products_s = 0, bwd_products_bf16_s = 0;
  long rss_mib = 0;
  double compressed_fraction = 0;  // tokens inside compressed blocks / T
};

Result run_case(const Case& c, const BenchOptions& o) {
  Result res;
  {
    const Workload w(c);
    res.compressed_fraction = w.compressed_fraction();
    Options opt;
    opt.num_threads = o.threads;
    Status st;
    res.fwd_s = best_of(o.repeat, [&] { st = compressor_forward(w.forward(), opt); });
    if (!st.ok()) throw std::runtime_error(st.message);
    res.bwd_s = best_of(o.repeat, [&] { st = compressor_backward(w.backward(), opt); });
    if (!st.ok()) throw std::runtime_error(st.message);
    res.rss_mib = peak_rss_mib();
  }
  // The products alone (oneDNN, library threading, fp32 operands as the
  // precise path uses; bf16 operands as the fast path would).
  {
    Products fwd(c, Products::Which::forward, false);
    res.fwd_products_s = best_of(o.repeat, [&] { fwd.run(); });
  }
  for (bool bf16 : {false, true}) {
    try {
      Products bwd(c, Products::Which::backward, bf16);
      (bf16 ? res.bwd_products_bf16_s : res.bwd_products_s) = best_of(o.repeat, [&] { bwd.run(); });
    } catch (const dnnl::error&) {
      if (!bf16) throw;  // bf16 products need avx512_core (oneDNN 2.6): reported as n/a
    }
  }
  return res;
}

}  // namespace

#ifdef KVCOMP_HAVE_CUDA
int run_bench_cuda(const BenchOptions& o, const std::vector<bench::Case>& cases);  // cli/bench_cuda.cpp
#endif

int run_bench(const BenchOptions& o) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  std::vector<Case> cases;
  for (const bench::Profile& p : bench::kProfiles) {
    if (o.preset != "all" && o.preset != p.name) continue;
    for (i64 T : o.tokens) {
      cases.push_back({p, T, o.hidden, 1});
      const i64 batches = bench::varlen_batches(p, T, o.varlen);
      if (batches > 1) cases.push_back({p, T, o.hidden, batches});
    }
  }
  if (o.device.type == DeviceType::cuda) {
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
  std::printf("kvcomp %s bench: %d threads, H=%lld, bf16 io, precise mode, %s kernels, products %s, best of %d\n",
              version(), threads, static_cast<long long>(o.hidden), kernel_isa(), product_kernels(), o.repeat);
  std::printf("%-6s %-10s %7s %5s | %9s %8s %6s | %9s %8s %6s %9s | %8s\n", "prof", "layout", "T", "cmp%",
              "fwd ms", "GFLOP/s", "x prod", "bwd ms", "GFLOP/s", "x prod", "x bf16pr", "peak MiB");
  int i = 0;
  for (const Case& c : cases) {
    std::fprintf(stderr, "[%d/%zu] %s T=%lld %s ...\r", ++i, cases.size(), c.p.name,
                 static_cast<long long>(c.T), c.batches > 1 ? "TH" : "BSH");
    std::fflush(stderr);
    reset_peak_rss();
    const Result r = run_case(c, o);
    const double flop_fwd = c.forward_flop(), flop_bwd = c.backward_flop();
    const std::string layout = c.batches > 1 ? "TH/" + std::to_string(c.batches) : "BSH";
    char bf16_ratio[32] = "n/a";
    if (r.bwd_products_bf16_s > 0)
      std::snprintf(bf16_ratio, sizeof bf16_ratio, "%.3f", r.bwd_s / r.bwd_products_bf16_s);
    std::printf("%-6s %-10s %7lld %5.1f | %9.1f %8.1f %6.3f | %9.1f %8.1f %6.3f %9s | %8ld\n", c.p.name,
                layout.c_str(), static_cast<long long>(c.T), 100.0 * r.compressed_fraction, r.fwd_s * 1e3,
                flop_fwd / r.fwd_s / 1e9, r.fwd_s / r.fwd_products_s, r.bwd_s * 1e3, flop_bwd / r.bwd_s / 1e9,
                r.bwd_s / r.bwd_products_s, bf16_ratio, r.rss_mib);
    std::fflush(stdout);
  }
  std::fprintf(stderr, "%60s\r", "");
  std::printf(
      "x prod: operator time / time of its matrix products alone (oneDNN, fp32 operands, same threads);\n"
      "x bf16pr: the same against bf16-operand products. Flops: forward 4*T*C*H, backward 8*T*C*H.\n"
      "cmp%%: tokens inside compressed blocks (the backward's products skip whole chunks without any);\n"
      "TH/n: n sequences, lengths uniform in [0.5, 1.5] x T/n. peak MiB: the process's peak RSS in the "
      "case.\n");
  return kExitOk;
}

}  // namespace kvcomp::cli
