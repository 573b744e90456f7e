// Google Benchmark binary for both operators on the shapes of real models
// (C4A, C4Li, C128A; H from 1024 to 10240), next to their matrix products
// done by oneDNN alone (`.../products`), so ratios can be read off one run:
//
//   ./build/bench/kvcomp_benchmarks --benchmark_filter='C4A/BSH/T:4096/H:4096'
//
// Threads: OMP_NUM_THREADS. Counters: GFLOP/s (forward 4*T*C*H, backward
// 8*T*C*H flops per iteration) and the fraction of tokens inside blocks.
// `peak/...`: the cores' multiply-add peak that efficiency figures are taken
// against (--benchmark_filter=peak).
// These are measurements, not tests: nothing here asserts a time.
#include <benchmark/benchmark.h>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "workload.hpp"

namespace {

using kvcomp::bench::Case;
using kvcomp::bench::Products;
using kvcomp::bench::Workload;

enum class Op { forward, backward };

void run_operator(benchmark::State& state, Case c, Op op) {
  const Workload w(c);
  kvcomp::Status st;
  for (auto _ : state) {
    st = op == Op::forward ? kvcomp::compressor_forward(w.forward())
                           : kvcomp::compressor_backward(w.backward());
    if (!st.ok()) {
      state.SkipWithError(st.message.c_str());
      break;
    }
  }
  const double flop = op == Op::forward ? c.forward_flop() : c.backward_flop();
  state.counters["GFLOP/s"] = benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["cmp"] = w.compressed_fraction();
  state.counters["threads"] = omp_get_max_threads();
}

void run_products(benchmark::State& state, Case c, Op op, bool bf16) {
  try {
    Products p(c, op == Op::forward ? Products::Which::forward : Products::Which::backward, bf16);
    for (auto _ : state) p.run();
  } catch (const dnnl::error& e) {
    state.SkipWithError((std::string("oneDNN has no such matmul on this CPU: ") + e.what()).c_str());
    return;
  }
  const double flop = op == Op::forward ? c.forward_flop() : c.backward_flop();
  state.counters["GFLOP/s"] = benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = omp_get_max_threads();
}

// ---- The multiply-add peak: kChains independent accumulator chains per thread (more than the
// instructions' latency times their issue rate, and with the two operands few enough for AVX2's 16
// registers), kSteps steps each per iteration, every OpenMP thread at once. Each function is compiled
// for its own ISA and only called where the CPU has it.
constexpr int kChains = 12;
constexpr std::int64_t kSteps = std::int64_t{1} << 16;

__attribute__((target("avx2,fma"))) float chains_fp32_avx2(std::int64_t steps) {
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
  for (std::int64_t s = 0; s < steps; ++s)
    for (auto& v : acc) v = _mm256_fmadd_ps(v, a, b);
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  return _mm256_cvtss_f32(sum);
}

// The chains' sum (so that no chain is dead code), stored and added up in plain code: GCC 12 warns on
// its own header for _mm512_reduce_add_ps.
__attribute__((target("avx512f"))) float lane_sum(const __m512 (&acc)[kChains]) {
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  float lanes[16];
  _mm512_storeu_ps(lanes, sum);
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

__attribute__((target("avx512f"))) float chains_fp32_avx512(std::int64_t steps) {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  for (std::int64_t s = 0; s < steps; ++s)
    for (auto& v : acc) v = _mm512_fmadd_ps(v, a, b);
  return lane_sum(acc);
}

// vdpbf16ps: per fp32 lane, two bf16 products added to the accumulator (4 flops).
__attribute__((target("avx512f,avx512bf16"))) float chains_bf16_dot(std::int64_t steps) {
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-2f), _mm512_set1_ps(2e-2f));
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  for (std::int64_t s = 0; s < steps; ++s)
    for (auto& v : acc) v = _mm512_dpbf16_ps(v, a, a);
  return lane_sum(acc);
}

bool cpu_has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __builtin_cpu_supports("avx512f") && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 &&
         (a & (1u << 5)) != 0;
}

void run_peak(benchmark::State& state, float (*chains)(std::int64_t), double flop_per_step, bool supported) {
  if (!supported) {
    state.SkipWithError("this CPU lacks the instructions");
    return;
  }
  int threads = 1;
  for (auto _ : state) {
    float sink = 0.0f;
#pragma omp parallel reduction(+ : sink)
    {
      sink += chains(kSteps);
#pragma omp single
      threads = omp_get_num_threads();
    }
    benchmark::DoNotOptimize(sink);
  }
  state.counters["GFLOP/s"] = benchmark::Counter(threads * kSteps * kChains * flop_per_step * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}

void register_peaks() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f");
  benchmark::RegisterBenchmark("peak/fp32_fma_avx2", run_peak, chains_fp32_avx2, 16.0, avx2)->UseRealTime();
  benchmark::RegisterBenchmark("peak/fp32_fma_avx512", run_peak, chains_fp32_avx512, 32.0, avx512)
      ->UseRealTime();
  benchmark::RegisterBenchmark("peak/bf16_dot_avx512", run_peak, chains_bf16_dot, 64.0, cpu_has_avx512_bf16())
      ->UseRealTime();
}

void register_case(const Case& c) {
  const std::string shape = std::string(c.p.name) +
                            (c.batches > 1 ? "/TH" + std::to_string(c.batches) : "/BSH") +
                            "/T:" + std::to_string(c.T) + "/H:" + std::to_string(c.H);
  for (Op op : {Op::forward, Op::backward}) {
    const std::string name = (op == Op::forward ? "forward/" : "backward/") + shape;
    benchmark::RegisterBenchmark(name.c_str(), run_operator, c, op)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark((name + "/products").c_str(), run_products, c, op, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    if (op == Op::backward)
      benchmark::RegisterBenchmark((name + "/products_bf16").c_str(), run_products, c, op, true)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_peaks();
  for (const auto& p : kvcomp::bench::kProfiles) {
    for (std::int64_t H : {1024, 2048, 4096, 7168, 10240}) register_case({p, 4096, H, 1});
    register_case({p, 16384, 4096, 1});
    register_case({p, 4096, 4096, kvcomp::bench::varlen_batches(p, 4096, 64)});
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
