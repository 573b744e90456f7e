// The subcommands of the `kvcomp` executable. Each returns the process exit
// status: 0 success, 1 the operator returned an error status (or the demo's
// precision check failed), 2 a usage or file error. Errors are printed to
// stderr as "error <code>: <sentence>". IoError escapes to main(), which
// prints it the same way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/case_dir.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::cli {

constexpr int kExitOk = 0;
constexpr int kExitStatus = 1;
constexpr int kExitUsage = 2;

struct CaseOptions {
  std::string in_dir;
  std::string out_dir;
  io::OutDType out_dtype = io::OutDType::f32;
  Options options;
  Device device;  // where the operator runs (--device)
};

int run_grad(const CaseOptions& o);
int run_fwd(const CaseOptions& o);

struct DemoOptions {
  std::int64_t tokens = 4096;  // S (BSH, B = 1)
  std::int64_t hidden = 4096;  // H
  std::int64_t head_dim = 512;
  std::int64_t coff = 2;
  std::int64_t cmp_ratio = 4;
  std::int64_t start_pos = 0;
  std::int64_t block_size = 128;
  std::int64_t check_tokens = 64;  // tokens of the reduced problem checked against the oracle
  int repeat = 1;
  int threads = 0;
  std::uint64_t seed = 1;
  std::string preset = "c4a";
  Device device;
};

int run_demo(const DemoOptions& o);

struct BenchOptions {
  std::string preset = "all";  // C4A, C4Li, C128A or all
  std::vector<std::int64_t> tokens{4096, 16384};
  std::int64_t hidden = 4096;
  std::int64_t varlen = 64;  // also a TH case with this many sequences (<= 1: BSH only)
  int repeat = 3;
  int threads = 0;
  std::string io = "bf16";                          // bf16 or fp16
  bool npu_parity = false;                          // the backward's precision mode (precise by default)
  bool training = true;                             // the T-token forward + backward cases
  std::vector<std::int64_t> decode{1, 8, 64, 256};  // decode cases: batch sizes (none: empty)
  std::int64_t decode_tokens = 1;
  std::string decode_cache = "paged";  // paged or ring
  std::string decode_layout = "bsh";   // bsh or th
  bool decode_cold = false;            // evict the caches before each timed decode call and product
  bool both_modes = false;             // also the npu_parity backward, in the same rounds as the precise one
  bool phases = false;                 // where each call's time goes (kvcomp::phase_times; CPU)
  std::string json;                    // also write the results to this file (CPU), unless empty
  Device device;                       // cpu, or a CUDA device (cli/bench_cuda.cpp)
};

int run_bench(const BenchOptions& o);

// Prints "error <code>: <message>" to stderr.
void print_error(int code, const std::string& message);

}  // namespace kvcomp::cli
