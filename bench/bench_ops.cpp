// Google Benchmark binary for both operators on the shapes of real models
// (C4A, C4Li, C128A; H from 1024 to 10240), next to their matrix products
// done by oneDNN alone (`.../products`), so ratios can be read off one run:
//
//   ./build/bench/kvcomp_benchmarks --benchmark_filter='C4A/BSH/T:4096/H:4096'
//
// Threads: OMP_NUM_THREADS. Counters: GFLOP/s (forward 4*T*C*H, backward
// 8*T*C*H flops per iteration) and the fraction of tokens inside blocks.
// These are measurements, not tests: nothing here asserts a time.
#include <benchmark/benchmark.h>
#include <omp.h>

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
