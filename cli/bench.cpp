// `kvcomp bench`: times both operators on the shapes of real models and
// compares each with the matrix products alone, done by oneDNN in the same
// process, with the same threads. The ratio (operator / products) is the
// figure of merit of issue #4: everything the operator does besides the two
// products (element-wise phase, conversions, data movement) shows up in it.
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <string>
#include <vector>

#include "commands.hpp"
#include "kvcomp/half.hpp"

namespace kvcomp::cli {

namespace {

using i64 = std::int64_t;
using Clock = std::chrono::steady_clock;

struct Profile {
  const char* name;
  i64 D, coff, r;
};
constexpr Profile kProfiles[] = {{"C4A", 512, 2, 4}, {"C4Li", 128, 2, 4}, {"C128A", 512, 1, 128}};

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

// One oneDNN matmul C[M,N] = A[M,K] . B[K,N] (B given transposed when
// b_t), f32 or bf16 operands, f32 result, library threading: the baseline.
struct Product {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::matmul prim;
  dnnl::memory a, b, c;

  Product(i64 M, i64 N, i64 K, bool a_t, bool b_t, dnnl::memory::data_type dt) {
    using tag = dnnl::memory::format_tag;
    const dnnl::memory::desc ad({M, K}, dt, a_t ? tag::ba : tag::ab);
    const dnnl::memory::desc bd({K, N}, dt, b_t ? tag::ba : tag::ab);
    const dnnl::memory::desc cd({M, N}, dnnl::memory::data_type::f32, tag::ab);
    prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), eng));
    a = dnnl::memory(ad, eng);
    b = dnnl::memory(bd, eng);
    c = dnnl::memory(cd, eng);
    fill(a, dt, ad.get_size());
    fill(b, dt, bd.get_size());
  }
  static void fill(dnnl::memory& m, dnnl::memory::data_type dt, std::size_t bytes) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    if (dt == dnnl::memory::data_type::f32) {
      auto* p = static_cast<float*>(m.get_data_handle());
      for (std::size_t i = 0; i < bytes / 4; ++i) p[i] = u(rng);
    } else {
      auto* p = static_cast<std::uint16_t*>(m.get_data_handle());
      for (std::size_t i = 0; i < bytes / 2; ++i) p[i] = float_to_bf16(u(rng));
    }
  }
  void run() {
    prim.execute(strm, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    strm.wait();
  }
};

struct Case {
  Profile p;
  i64 T, H, batches;  // batches > 1: TH varlen with that many sequences
};

std::vector<std::uint16_t> random_bf16(std::size_t n, float scale, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<std::uint16_t> v(n);
  for (auto& e : v) e = float_to_bf16(g(rng) * scale);
  return v;
}

struct Result {
  double fwd_s = 0, fwd_products_s = 0, bwd_s = 0, bwd_products_s = 0, bwd_products_bf16_s = 0;
  long rss_mib = 0;
  double compressed_fraction = 0;  // tokens inside compressed blocks / T
};

Result run_case(const Case& c, const BenchOptions& o) {
  const i64 C = c.p.coff * c.p.D, r = c.p.r, D = c.p.D, cr = c.p.coff * c.p.r, H = c.H, T = c.T;
  const bool th = c.batches > 1;
  // Sequence lengths: one sequence (BSH), or TH lengths drawn uniformly in
  // [0.5, 1.5] x T/B (seeded) and scaled to sum to T.
  std::vector<std::int32_t> cu(static_cast<std::size_t>(c.batches + 1), 0);
  {
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> u(0.5, 1.5);
    std::vector<double> w(static_cast<std::size_t>(c.batches));
    double sum = 0;
    for (auto& e : w) sum += (e = u(rng));
    double acc = 0;
    for (i64 b = 0; b < c.batches; ++b) {
      acc += w[static_cast<std::size_t>(b)];
      cu[static_cast<std::size_t>(b + 1)] = static_cast<std::int32_t>(
          b + 1 == c.batches ? T : std::llround(static_cast<double>(T) * acc / sum));
    }
  }
  const i64 B = c.batches;
  const i64 rows = th ? std::min(T, T / r + B) : (T + r - 1) / r;
  auto x = random_bf16(static_cast<std::size_t>(T * H), 1.0f, 1);
  auto wkv = random_bf16(static_cast<std::size_t>(C * H), 0.02f, 2);
  auto wgate = random_bf16(static_cast<std::size_t>(C * H), 0.02f, 3);
  auto dcmp = random_bf16(static_cast<std::size_t>(rows * D), 1.0f, 4);
  std::vector<float> ape(static_cast<std::size_t>(r * C), 0.01f);
  i64 max_len = th ? 0 : T, compressed = th ? 0 : T / r * r;
  for (i64 b = 0; th && b < B; ++b) {
    const i64 len = cu[static_cast<std::size_t>(b + 1)] - cu[static_cast<std::size_t>(b)];
    max_len = std::max(max_len, len);
    compressed += len / r * r;
  }
  const i64 bs = 128, cols = (max_len + bs - 1) / bs;
  std::vector<float> cache(static_cast<std::size_t>((B * cols + 1) * bs * 2 * C), 0.0f);
  std::vector<std::int32_t> table(static_cast<std::size_t>(B * cols));
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<std::int32_t>(i + 1);
  std::vector<std::uint16_t> cmp(static_cast<std::size_t>(rows * D));
  std::vector<float> S(static_cast<std::size_t>(rows * cr * D)), K(S.size());
  std::vector<std::uint16_t> dx(x.size()), dwkv(wkv.size()), dwgate(wgate.size());
  std::vector<float> dape(ape.size());

  Options opt;
  opt.num_threads = o.threads;
  ForwardArgs f;
  f.x = th ? Tensor(x.data(), DType::bf16, {T, H}) : Tensor(x.data(), DType::bf16, {1, T, H});
  if (th) f.cu_seqlens = Tensor(cu.data(), DType::i32, {B + 1});
  f.wkv = Tensor(wkv.data(), DType::bf16, {C, H});
  f.wgate = Tensor(wgate.data(), DType::bf16, {C, H});
  f.cmp_ratio = r;
  f.coff = c.p.coff;
  f.state_cache = Tensor(cache.data(), DType::f32, {B * cols + 1, bs, 2 * C});
  f.ape = Tensor(ape.data(), DType::f32, {r, C});
  f.state_block_table = Tensor(table.data(), DType::i32, {B, cols});
  f.grad_enabled = true;
  f.cmp_kv = th ? Tensor(cmp.data(), DType::bf16, {rows, D}) : Tensor(cmp.data(), DType::bf16, {1, rows, D});
  f.softmax_score =
      th ? Tensor(S.data(), DType::f32, {rows, cr, D}) : Tensor(S.data(), DType::f32, {1, rows, cr, D});
  f.kv = th ? Tensor(K.data(), DType::f32, {rows, cr, D}) : Tensor(K.data(), DType::f32, {1, rows, cr, D});

  BackwardArgs g;
  static_cast<SequenceArgs&>(g) = static_cast<const SequenceArgs&>(f);
  g.d_cmp_kv =
      th ? Tensor(dcmp.data(), DType::bf16, {rows, D}) : Tensor(dcmp.data(), DType::bf16, {1, rows, D});
  g.softmax_score = f.softmax_score;
  g.kv = f.kv;
  g.d_x = th ? Tensor(dx.data(), DType::bf16, {T, H}) : Tensor(dx.data(), DType::bf16, {1, T, H});
  g.d_wkv = Tensor(dwkv.data(), DType::bf16, {C, H});
  g.d_wgate = Tensor(dwgate.data(), DType::bf16, {C, H});
  g.d_ape = Tensor(dape.data(), DType::f32, {r, C});

  Result res;
  res.compressed_fraction = static_cast<double>(compressed) / static_cast<double>(T);
  Status st;
  res.fwd_s = best_of(o.repeat, [&] { st = compressor_forward(f, opt); });
  if (!st.ok()) throw std::runtime_error(st.message);
  res.bwd_s = best_of(o.repeat, [&] { st = compressor_backward(g, opt); });
  if (!st.ok()) throw std::runtime_error(st.message);
  res.rss_mib = peak_rss_mib();

  // The products alone (oneDNN, library threading, fp32 operands as the
  // precise path uses; bf16 operands as the fast path of issue #4 would).
  using dt = dnnl::memory::data_type;
  {
    Product proj(T, 2 * C, H, false, true, dt::f32);
    res.fwd_products_s = best_of(o.repeat, [&] { proj.run(); });
  }
  for (dt type : {dt::f32, dt::bf16}) {
    try {
      Product dxp(T, H, 2 * C, false, false, type);
      Product dwp(2 * C, H, T, true, false, type);
      const double s = best_of(o.repeat, [&] {
        dxp.run();
        dwp.run();
      });
      (type == dt::f32 ? res.bwd_products_s : res.bwd_products_bf16_s) = s;
    } catch (const dnnl::error&) {
      if (type == dt::f32) throw;  // bf16 products need avx512_core (oneDNN 2.6): reported as n/a
    }
  }
  return res;
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  std::vector<Case> cases;
  for (const Profile& p : kProfiles) {
    if (o.preset != "all" && o.preset != p.name) continue;
    for (i64 T : o.tokens) {
      cases.push_back({p, T, o.hidden, 1});
      // At most T / (4r) sequences, so that they are long enough to hold
      // compressed blocks (64 sequences of 64 tokens have none at r = 128).
      const i64 batches = std::min<i64>(o.varlen, std::max<i64>(1, T / (4 * p.r)));
      if (batches > 1) cases.push_back({p, T, o.hidden, batches});
    }
  }
  std::printf("kvcomp %s bench: %d threads, H=%lld, bf16 io, precise mode, best of %d\n", version(), threads,
              static_cast<long long>(o.hidden), o.repeat);
  std::printf("%-6s %-10s %7s %5s | %9s %8s %6s | %9s %8s %6s %9s | %8s\n", "prof", "layout", "T", "cmp%",
              "fwd ms", "GFLOP/s", "x prod", "bwd ms", "GFLOP/s", "x prod", "x bf16pr", "peak MiB");
  int i = 0;
  for (const Case& c : cases) {
    std::fprintf(stderr, "[%d/%zu] %s T=%lld %s ...\r", ++i, cases.size(), c.p.name,
                 static_cast<long long>(c.T), c.batches > 1 ? "TH" : "BSH");
    std::fflush(stderr);
    reset_peak_rss();
    const Result r = run_case(c, o);
    const double flop_fwd = 4.0 * static_cast<double>(c.T * c.p.coff * c.p.D * c.H);
    const double flop_bwd = 2.0 * flop_fwd;
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
