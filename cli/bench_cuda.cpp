// `kvcomp bench --device cuda`: both operators on model shapes on a GPU, each
// against its matrix products alone (the operator's product shapes through
// the same gemm(), bf16 operands and bf16 outputs with fp32 accumulation, as
// torch.matmul does; the operator itself keeps fp32 outputs),
// timed in the same process with CUDA events (mean of --repeat runs after two
// warm-up runs). The operators run through plan / execute with the data and
// the workspace on the device already: the steady state of a training step.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.hpp"
#include "cuda/gemm.hpp"
#include "cuda/staging.hpp"
#include "workload.hpp"

namespace kvcomp::cli {

namespace {

using i64 = std::int64_t;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message);
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t bytes) {
    check(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Mean milliseconds of f over `repeat` runs on `stream`, after two warm-up runs.
template <typename F>
double mean_ms(cudaStream_t stream, int repeat, F&& f) {
  for (int i = 0; i < 2; ++i) f();
  cudaEvent_t t0, t1;
  check(cudaEventCreate(&t0), "cudaEventCreate");
  check(cudaEventCreate(&t1), "cudaEventCreate");
  check(cudaEventRecord(t0, stream), "cudaEventRecord");
  for (int i = 0; i < repeat; ++i) f();
  check(cudaEventRecord(t1, stream), "cudaEventRecord");
  check(cudaEventSynchronize(t1), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, t0, t1), "cudaEventElapsedTime");
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return static_cast<double>(ms) / repeat;
}

struct DeviceArray : DeviceBuffer {
  std::size_t bytes;
  explicit DeviceArray(std::size_t n) : DeviceBuffer(n), bytes(n) {}
};

// The operator's products alone, bf16 in and out (as the torch anchors of
// bench/torch_baselines.py): forward x[T,H] . [wkv; wgate]^T (one [2C, H]
// weight), backward dnew[T,2C] . W[2C,H] and dnew^T . x. Every buffer is
// sized in its own dtype and checked against the extent cuBLASLt is told to
// write (detail::cuda::lt_call), so a product never runs past its buffer.
struct Products {
  static constexpr DType kIn = DType::bf16, kOut = DType::bf16;
  i64 T, H, C2;
  DeviceArray x, w, p, dnew, dx, dw;
  DeviceBuffer ws;
  Products(i64 T_, i64 H_, i64 C2_)
      : T(T_),
        H(H_),
        C2(C2_),
        x(bytes(T * H, kIn)),
        w(bytes(C2 * H, kIn)),
        p(bytes(T * C2, kOut)),
        dnew(bytes(T * C2, kIn)),
        dx(bytes(T * H, kOut)),
        dw(bytes(C2 * H, kOut)),
        ws(detail::cuda::kGemmWorkspace) {
    // Never time on zeros: every operand element 0x3c3c (bf16 ~0.0115).
    check(cudaMemset(x.p, 0x3c, x.bytes), "cudaMemset");
    check(cudaMemset(w.p, 0x3c, w.bytes), "cudaMemset");
    check(cudaMemset(dnew.p, 0x3c, dnew.bytes), "cudaMemset");
  }
  static std::size_t bytes(i64 n, DType t) { return static_cast<std::size_t>(n) * dtype_size(t); }
  void gemm(i64 m, i64 n, i64 k, const DeviceArray& a, i64 lda, bool ta, const DeviceArray& b, i64 ldb,
            bool tb, DeviceArray& d, i64 ldd, cudaStream_t s) {
    detail::cuda::GemmCall g{m, n, k, kIn, {a.p, lda, ta}, {b.p, ldb, tb}, d.p, ldd};
    g.out = kOut;
    detail::cuda::LtCall c;
    check(detail::cuda::lt_call(g, &c));
    if (c.a.extent_bytes() > b.bytes || c.b.extent_bytes() > a.bytes || c.d.extent_bytes() > d.bytes)
      throw std::runtime_error("bench: a product's operands reach past their buffers");
    check(detail::cuda::gemm(g, ws.p, detail::cuda::kGemmWorkspace, s));
  }
  void forward(cudaStream_t s) { gemm(T, C2, H, x, H, false, w, H, true, p, C2, s); }
  void backward(cudaStream_t s) {
    gemm(T, H, C2, dnew, C2, false, w, H, false, dx, H, s);
    gemm(C2, H, T, dnew, C2, true, x, H, false, dw, H, s);
  }
};

std::size_t used_bytes() {
  std::size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return total - free;
}

struct Row {
  double fwd = 0, fwd_prod = 0, bwd = 0, bwd_parity = 0, bwd_prod = 0;
  double dev_mib = 0;
};

Row run_case(const bench::Case& c, const BenchOptions& o, cudaStream_t stream) {
  Row row;
  const std::size_t base = used_bytes();
  {
    const bench::Workload w(c);
    staging::DeviceCopies copies(o.device);
    ForwardArgs fa = w.forward();
    BackwardArgs ba = w.backward();
    check(copies.stage(fa));
    check(copies.stage(ba));
    Options opt;
    opt.stream = stream;
    ForwardPlan fp;
    check(plan_forward(fa, opt, &fp));
    DeviceBuffer fws(fp.workspace_size());
    check(execute(fp, fws.p, fp.workspace_size()));  // the backward reads these softmax_score / kv
    BackwardPlan bp;
    check(plan_backward(ba, opt, &bp));
    Options parity = opt;
    parity.precision = Precision::npu_parity;
    BackwardPlan pp;
    check(plan_backward(ba, parity, &pp));
    DeviceBuffer bws(std::max(bp.workspace_size(), pp.workspace_size()));
    row.dev_mib = static_cast<double>(used_bytes() - base) / (1 << 20);
    Status st;
    row.fwd = mean_ms(stream, o.repeat, [&] { st = execute(fp, fws.p, fp.workspace_size()); });
    check(st);
    row.bwd = mean_ms(stream, o.repeat, [&] { st = execute(bp, bws.p, bp.workspace_size()); });
    check(st);
    row.bwd_parity = mean_ms(stream, o.repeat, [&] { st = execute(pp, bws.p, pp.workspace_size()); });
    check(st);
  }
  Products prod(c.T, c.H, 2 * c.p.coff * c.p.D);
  row.fwd_prod = mean_ms(stream, o.repeat, [&] { prod.forward(stream); });
  row.bwd_prod = mean_ms(stream, o.repeat, [&] { prod.backward(stream); });
  return row;
}

}  // namespace

int run_bench_cuda(const BenchOptions& o, const std::vector<bench::Case>& cases) {
  if (o.device.index >= cuda_device_count()) {
    print_error(static_cast<int>(StatusCode::invalid_param),
                "[kvcomp] --device (= " + device_name(o.device) +
                    ") must be a CUDA device of this machine (it has " + std::to_string(cuda_device_count()) +
                    ")");
    return kExitStatus;
  }
  check(cudaSetDevice(o.device.index), "cudaSetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, o.device.index), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::printf(
      "kvcomp %s bench on %s (%s, sm_%d%d, driver %d, runtime %d): H=%lld, bf16 io, mean of %d after 2 "
      "warm-ups\n",
      version(), device_name(o.device).c_str(), prop.name, prop.major, prop.minor, driver, runtime,
      static_cast<long long>(o.hidden), o.repeat);
  std::printf("%-6s %-10s %7s | %9s %8s %6s | %9s %8s %6s | %9s %7s | %8s\n", "prof", "layout", "T", "fwd ms",
              "TFLOP/s", "x prod", "bwd ms", "TFLOP/s", "x prod", "parity ms", "x par", "dev MiB");
  for (const bench::Case& c : cases) {
    const Row r = run_case(c, o, stream);
    const double ff = c.forward_flop(), fb = c.backward_flop();
    const std::string layout = c.batches > 1 ? "TH/" + std::to_string(c.batches) : "BSH";
    std::printf("%-6s %-10s %7lld | %9.3f %8.1f %6.3f | %9.3f %8.1f %6.3f | %9.3f %7.3f | %8.0f\n", c.p.name,
                layout.c_str(), static_cast<long long>(c.T), r.fwd, ff / r.fwd * 1e-9, r.fwd / r.fwd_prod,
                r.bwd, fb / r.bwd * 1e-9, r.bwd / r.bwd_prod, r.bwd_parity, r.bwd / r.bwd_parity, r.dev_mib);
    std::fflush(stdout);
  }
  std::printf(
      "x prod: operator time / time of its matrix products alone (cuBLASLt, bf16 operands and outputs, fp32\n"
      "accumulation, same process); bwd is the precise mode, parity the npu_parity mode (x par: precise /\n"
      "parity). Flops: forward 4*T*C*H, backward 8*T*C*H. dev MiB: device memory the case holds (tensors,\n"
      "plans, workspaces). TH/n: n sequences, lengths uniform in [0.5, 1.5] x T/n.\n");
  cudaStreamDestroy(stream);
  return kExitOk;
}

}  // namespace kvcomp::cli
