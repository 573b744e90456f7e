// The `kvcomp` command line: run either operator on a case directory of .npy
// files, or run a self-contained demo with timing and a precision check.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <map>
#include <new>
#include <string>

#include "commands.hpp"
#include "device.hpp"
#include "io/npy.hpp"

namespace {

using namespace kvcomp;
using namespace kvcomp::cli;

const char* const kCaseFooter = R"(
Case directory (--in DIR):
  meta.json      {"cmp_ratio": 4, "coff": 2, "dtype": "bf16"}; dtype is bf16, fp16 or fp32.
                 Optional: "layout" ("BSH" | "TH", checked against the rank of x),
                 "cache_mode", "state_cache_stride0", "grad_enabled" (fwd; default true).
                 Keys may also be spelled cmpRatio, CACHE_MODE, ...; unknown keys are
                 ignored with a warning.
  x.npy wkv.npy wgate.npy                    x is [B,S,H] (BSH) or [T,H] (TH)
  cu_seqlens.npy seqused.npy start_pos.npy   optional; int32 (int64 accepted)
  grad:  d_cmp_kv.npy softmax_score.npy kv.npy
  fwd:   ape.npy state_cache.npy block_table.npy
  io tensors (x, wkv, wgate, d_cmp_kv) may be float32 (rounded to the io dtype,
  nearest-even), float16, or uint16 holding bf16 bits; the others float32
  (float64 accepted).

Outputs (--out DIR, created if missing; written all-or-nothing):
  grad:  d_x.npy d_wkv.npy d_wgate.npy d_ape.npy
  fwd:   cmp_kv.npy [softmax_score.npy kv.npy] state_cache.npy (the updated cache)
  float32 by default; --out-dtype io keeps bf16 (as uint16 bits) / fp16.
)";

const char* const kExitFooter = R"(
Exit status: 0 success; 1 the operator refused the call or the demo's precision
check failed; 2 usage or file error. Errors print "error <code>: <reason>" with
the aclnn codes: 161001 null tensor, 161002 invalid parameter or file contents,
561002 inconsistent shapes, 361001 runtime or file-system failure.

)";

const char* const kDemoFooter = R"(
The demo builds a seeded random bf16 BSH case with a paged state cache, runs
the forward (grad_enabled) and then the backward with a random d_cmp_kv, and
times each whole call. The float64 oracle is too slow for the full case, so it
runs on a reduced copy (the first --check-tokens tokens, the same weights, APE
and cache), which kvcomp runs too; the full run is also sampled on the rows
that depend only on those tokens. Figures follow the three-party rule of the
upstream tests: A = kvcomp, B = fp32 golden, C = float64 truth.
)";

const char* const kExamples = R"(
Examples:
  kvcomp demo --threads 8
  kvcomp demo --device cuda --tokens 65536
  kvcomp grad --in case/ --out result/ --npu-parity
  kvcomp fwd --in case/ --out result/ --out-dtype io
)";

// --device: cpu, cuda or cuda:N, parsed into *device when the option is given.
void add_device_option(CLI::App* cmd, Device* device) {
  cmd->add_option_function<std::string>(
         "--device",
         [device](const std::string& text) {
           if (!parse_device(text, device))
             throw CLI::ValidationError("--device", "must be cpu, cuda or cuda:N");
         },
         "Where the operator runs: cpu, or a CUDA device (cuda = cuda:0); a CUDA run copies the case to the "
         "device and the results back, and times the call alone")
      ->type_name("cpu|cuda[:N]")
      ->default_str("cpu");
}

void add_case_options(CLI::App* cmd, CaseOptions& o, std::string& out_dtype, std::string& profile) {
  cmd->add_option("--in", o.in_dir, "Case directory to read")->required()->type_name("DIR");
  cmd->add_option("--out", o.out_dir, "Directory for the outputs (created if missing)")
      ->required()
      ->type_name("DIR");
  // "f32" is the spelling of releases before 0.1.x's naming clean-up; still accepted.
  cmd->add_option("--out-dtype", out_dtype, "fp32: every output as float32; io: io-dtype outputs as stored")
      ->check(CLI::IsMember({"fp32", "io", "f32"}))
      ->default_val("fp32");
  cmd->add_option("--profile", profile,
                  "extended: any D, H >= 1, 1 <= cmp_ratio <= 1024; aclnn: exactly the Ascend ranges")
      ->check(CLI::IsMember({"extended", "aclnn"}))
      ->default_val("extended");
  cmd->add_option("--threads", o.options.num_threads, "OpenMP threads (0: the OpenMP default)")
      ->check(CLI::Range(0, 4096))
      ->default_val(0);
  add_device_option(cmd, &o.device);
}

void finish_case_options(CaseOptions& o, const std::string& out_dtype, const std::string& profile) {
  o.out_dtype = out_dtype == "io" ? io::OutDType::io : io::OutDType::f32;
  o.options.profile = profile == "aclnn" ? Profile::aclnn : Profile::extended;
}

int run(int argc, char** argv) {
  CLI::App app{
      "kvcomp: the Compressor / CompressorGrad operators (aclnnCompressor / aclnnCompressorGrad) on CPUs and "
      "NVIDIA GPUs",
      "kvcomp"};
  app.set_version_flag("--version", std::string("kvcomp ") + version());
  app.require_subcommand(1);

  CaseOptions grad_o, fwd_o;
  std::string grad_dtype, grad_profile, fwd_dtype, fwd_profile;
  bool npu_parity = false;
  CLI::App* grad = app.add_subcommand(
      "grad", "Run CompressorGrad on a case directory and write d_x, d_wkv, d_wgate, d_ape");
  add_case_options(grad, grad_o, grad_dtype, grad_profile);
  grad->add_flag(
      "--npu-parity", npu_parity,
      "Round d_new_kv / d_new_score to the io dtype before the matrix products, as the Ascend kernel "
      "does (default: keep them fp32, more precise)");

  CLI::App* fwd = app.add_subcommand("fwd",
                                     "Run Compressor on a case directory and write cmp_kv, softmax_score, kv "
                                     "and the updated state_cache");
  add_case_options(fwd, fwd_o, fwd_dtype, fwd_profile);
  grad->footer(std::string(kCaseFooter) + kExitFooter);
  fwd->footer(std::string(kCaseFooter) + kExitFooter);

  DemoOptions demo_o;
  CLI::App* demo = app.add_subcommand(
      "demo",
      "Build a seeded random case, time forward and backward, check precision against the float64 oracle");
  const CLI::Range positive(std::int64_t{1}, std::int64_t{1} << 40);
  demo->add_option("--tokens", demo_o.tokens, "Sequence length S (BSH, B = 1)")
      ->check(positive)
      ->capture_default_str();
  demo->add_option("--hidden", demo_o.hidden, "Hidden size H")->check(positive)->capture_default_str();
  demo->add_option("--preset", demo_o.preset,
                   "c4a: D=512 coff=2 r=4; c4li: D=128 coff=2 r=4; c128a: D=512 coff=1 r=128")
      ->check(CLI::IsMember({"c4a", "c4li", "c128a"}))
      ->capture_default_str();
  demo->add_option("--start-pos", demo_o.start_pos, "Start position (tokens already in the state cache)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30))
      ->capture_default_str();
  demo->add_option("--block-size", demo_o.block_size, "State cache block size")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  demo->add_option("--check-tokens", demo_o.check_tokens,
                   "Tokens of the reduced problem run by the oracle (at least 2*cmp_ratio are used)")
      ->check(positive)
      ->capture_default_str();
  demo->add_option("--repeat", demo_o.repeat, "Timed runs of each operator (best and mean are shown)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  demo->add_option("--threads", demo_o.threads, "OpenMP threads (0: the OpenMP default)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  demo->add_option("--seed", demo_o.seed, "Random seed")->capture_default_str();
  add_device_option(demo, &demo_o.device);
  demo->footer(std::string(kDemoFooter) + kExitFooter);
  BenchOptions bench_o;
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Time both operators on model shapes against their matrix products alone (oneDNN; cuBLASLt on a GPU)");
  bench->add_option("--preset", bench_o.preset, "C4A, C4Li, C128A or all")
      ->check(CLI::IsMember({"all", "C4A", "C4Li", "C128A"}))
      ->capture_default_str();
  bench->add_option("--tokens", bench_o.tokens, "Token counts T (one case each)")
      ->check(positive)
      ->capture_default_str();
  bench->add_option("--hidden", bench_o.hidden, "Hidden size H")->check(positive)->capture_default_str();
  bench->add_option("--varlen", bench_o.varlen, "Also a TH case with this many sequences (<= 1: none)")
      ->capture_default_str();
  bench
      ->add_option("--repeat", bench_o.repeat,
                   "Timed rounds; each round runs every call of a case and its products alone once, in turn "
                   "(the best is shown)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  bench
      ->add_option("--io", bench_o.io,
                   "The operator's 16-bit dtype (x, weights, cmp_kv, gradients): bf16 or fp16 (the CPU only)")
      ->check(CLI::IsMember({"bf16", "fp16"}))
      ->capture_default_str();
  bench->add_option("--threads", bench_o.threads, "OpenMP threads (0: the OpenMP default)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  CLI::Option* parity = bench->add_flag("--npu-parity", bench_o.npu_parity,
                                        "Time the backward in npu_parity mode (default: precise)");
  bench
      ->add_flag("--both-modes", bench_o.both_modes,
                 "Time the backward in both modes, in the same rounds: precise, then npu_parity and "
                 "precise / npu_parity at the end of each training row")
      ->excludes(parity);
  bench->add_flag("!--no-training", bench_o.training, "Leave out the T-token forward + backward cases");
  bench->add_option("--decode", bench_o.decode, "Decode cases: batch sizes B (0: none)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  bench->add_option("--decode-tokens", bench_o.decode_tokens, "Tokens per sequence of a decode call")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  bench->add_option("--decode-cache", bench_o.decode_cache, "Cache of the decode cases: paged or ring")
      ->check(CLI::IsMember({"paged", "ring"}))
      ->capture_default_str();
  bench
      ->add_option("--decode-layout", bench_o.decode_layout,
                   "Layout of the decode cases: bsh (x [B, tok, H]) or th (x [B * tok, H], cu_seqlens)")
      ->check(CLI::IsMember({"bsh", "th"}))
      ->capture_default_str();
  bench->add_flag("--decode-cold", bench_o.decode_cold,
                  "Evict the CPU caches before each timed decode call and product (a server's many layers "
                  "leave no weights cached)");
  bench->add_flag("--phases", bench_o.phases,
                  "After each case's timed rounds, run its calls --repeat times more with the phase clock on "
                  "and show where their time goes (kvcomp::phase_times; the CPU bench)");
  bench->add_option("--json", bench_o.json, "Also write the results to this file (the CPU bench)")
      ->type_name("FILE");
  add_device_option(bench, &bench_o.device);
  bench->footer(kExitFooter);
  CLI::App* info =
      app.add_subcommand("info", "Print the version, the CPU kernels in use and the CUDA devices seen");
  // Set last: subcommands copy the parent's footer when they are created.
  app.footer(std::string(kCaseFooter) + kExitFooter + kExamples);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }

  try {
    if (grad->parsed()) {
      finish_case_options(grad_o, grad_dtype, grad_profile);
      grad_o.options.precision = npu_parity ? Precision::npu_parity : Precision::precise;
      return run_grad(grad_o);
    }
    if (fwd->parsed()) {
      finish_case_options(fwd_o, fwd_dtype, fwd_profile);
      return run_fwd(fwd_o);
    }
    if (demo->parsed()) return run_demo(demo_o);
    if (bench->parsed()) return run_bench(bench_o);
    if (info->parsed()) {
      std::printf("kvcomp %s\ncpu kernels: %s\ncpu products: %s\ncuda backend: %s\ncuda devices: %d\n",
                  version(), kernel_isa(), product_kernels(),
                  has_cuda_backend() ? "yes" : "no (built without a CUDA toolkit)", cuda_device_count());
      return kExitOk;
    }
  } catch (const io::IoError& e) {
    print_error(e.code(), e.what());
    return kExitUsage;
  } catch (const std::bad_alloc&) {
    print_error(static_cast<int>(StatusCode::runtime_error), "out of memory");
    return kExitStatus;
  } catch (const std::exception& e) {
    print_error(static_cast<int>(StatusCode::runtime_error), e.what());
    return kExitStatus;
  }
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
