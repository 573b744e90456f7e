// The CUDA backend's operators on a GPU (ctest label cuda): the CPU suite's
// sweep against the float64 oracle, agreement with the CPU backend,
// determinism, graph capture and replay, the validation rules with device
// memory, cache aliasing, and large cases. Without a device every test
// reports itself skipped.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "cuda_sweep.hpp"
#include "device_mirror.hpp"
#include "epilogue_check.hpp"

namespace kvcomp::test {
namespace {

std::vector<std::uint8_t> bytes_of(const Buffer& b) {
  const auto* p = static_cast<const std::uint8_t*>(const_cast<Buffer&>(b).data());
  const std::size_t n = b.size() * (b.dtype == DType::f32 || b.dtype == DType::i32 ? 4 : 2);
  return {p, p + n};
}

// The forward of rc on the CPU and the GPU; cmp_kv agrees to io precision.
void forward_on_both(const SweepCase& c, ForwardRun& cpu, ForwardRun& gpu) {
  ASSERT_TRUE(cpu.run().ok());
  const Status s = on_gpu(gpu, {});
  ASSERT_TRUE(s.ok()) << s.message;
  const auto tw = two_way_compare(gpu.cmp_kv.values(), cpu.cmp_kv.values(), c.io);
  EXPECT_TRUE(tw.pass) << "cmp_kv GPU vs CPU: " << tw.summary();
}

// The backward of bd on the CPU and the GPU with options o: d_ape bitwise
// equal, d_x / d_wkv / d_wgate to io precision.
void backward_on_both(const SweepCase& c, const RandomCase<double>& rc, const BackwardData& bd,
                      const Options& o) {
  BackwardRun bc(rc.problem, rc.in, bd, c.io), bg(rc.problem, rc.in, bd, c.io);
  ASSERT_TRUE(bc.run(o).ok());
  const Status sb = on_gpu(bg, o);
  ASSERT_TRUE(sb.ok()) << sb.message;
  const char* mode = o.precision == Precision::precise ? "precise" : "npu_parity";
  EXPECT_EQ(bytes_of(bg.d_ape), bytes_of(bc.d_ape)) << "d_ape GPU vs CPU, bitwise (" << mode << ")";
  for (auto [name, g, h] : {std::tuple{"d_x", &bg.d_x, &bc.d_x}, std::tuple{"d_wkv", &bg.d_wkv, &bc.d_wkv},
                            std::tuple{"d_wgate", &bg.d_wgate, &bc.d_wgate}}) {
    const auto r = two_way_compare(g->values(), h->values(), c.io);
    EXPECT_TRUE(r.pass) << name << " GPU vs CPU (" << mode << "): " << r.summary();
  }
}

// ---- The sweep against the oracle (the same checks as the CPU suite).

class CudaSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(CudaSweep, ForwardMatchesOracle) {
  KVCOMP_REQUIRE_GPU();
  check_forward(GetParam(), [](ForwardRun& r, const Options& o) { return on_gpu(r, o); });
}

TEST_P(CudaSweep, BackwardThreeWay) {
  KVCOMP_REQUIRE_GPU();
  check_backward(GetParam(), [](BackwardRun& r, const Options& o) { return on_gpu(r, o); });
}

// GPU and CPU agree: the forward to io precision (different products, same
// block formulas); the backward's d_ape bitwise (it depends on the inputs
// only through the block formulas, which both backends compute with the same
// operations in the same order), the rest to io precision.
TEST_P(CudaSweep, AgreesWithTheCpu) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase& c = GetParam();
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun cpu(rc.problem, rc.in, c.io), gpu(rc.problem, rc.in, c.io);
  forward_on_both(c, cpu, gpu);
  const auto ts = two_way_compare(gpu.softmax_score.values(), cpu.softmax_score.values(), c.io);
  EXPECT_TRUE(ts.pass) << "softmax_score GPU vs CPU: " << ts.summary();
  const BackwardData bd = make_backward_data(rc.problem, rc.in, c.io, c.backward_data_seed);
  for (Precision prec : {Precision::precise, Precision::npu_parity}) {
    Options o;
    o.precision = prec;
    backward_on_both(c, rc, bd, o);
  }
}

// Same inputs, same bits: every output of both operators, run twice.
TEST_P(CudaSweep, Deterministic) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase& c = GetParam();
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun f1(rc.problem, rc.in, c.io), f2(rc.problem, rc.in, c.io);
  ASSERT_TRUE(on_gpu(f1, {}).ok());
  ASSERT_TRUE(on_gpu(f2, {}).ok());
  EXPECT_EQ(bytes_of(f1.cmp_kv), bytes_of(f2.cmp_kv));
  EXPECT_EQ(bytes_of(f1.softmax_score), bytes_of(f2.softmax_score));
  EXPECT_EQ(bytes_of(f1.kv), bytes_of(f2.kv));
  EXPECT_EQ(bytes_of(f1.cache), bytes_of(f2.cache));
  const BackwardData bd = make_backward_data(rc.problem, rc.in, c.io, c.backward_data_seed);
  for (Precision prec : {Precision::precise, Precision::npu_parity}) {
    Options o;
    o.precision = prec;
    BackwardRun b1(rc.problem, rc.in, bd, c.io), b2(rc.problem, rc.in, bd, c.io);
    ASSERT_TRUE(on_gpu(b1, o).ok());
    ASSERT_TRUE(on_gpu(b2, o).ok());
    EXPECT_EQ(bytes_of(b1.d_x), bytes_of(b2.d_x));
    EXPECT_EQ(bytes_of(b1.d_wkv), bytes_of(b2.d_wkv));
    EXPECT_EQ(bytes_of(b1.d_wgate), bytes_of(b2.d_wgate));
    EXPECT_EQ(bytes_of(b1.d_ape), bytes_of(b2.d_ape));
  }
}

// ---- The model-level epilogue and calls without APE (epilogue_check.hpp's cases), against the float64
// reference.

class CudaEpilogue : public ::testing::TestWithParam<EpilogueCase> {};

TEST_P(CudaEpilogue, ForwardMatchesTheReference) {
  KVCOMP_REQUIRE_GPU();
  check_epilogue_forward([](ForwardRun& r, const Options& o) { return on_gpu(r, o); }, GetParam());
}

TEST_P(CudaEpilogue, BackwardMatchesTheOracle) {
  KVCOMP_REQUIRE_GPU();
  check_epilogue_backward([](ForwardRun& r, const Options& o) { return on_gpu(r, o); },
                          [](BackwardRun& r, const Options& o) { return on_gpu(r, o); }, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Epilogue, CudaEpilogue, ::testing::ValuesIn(epilogue_cases()),
                         [](const auto& tp) { return param_name(tp.param); });

// From the CPU forward's outputs, the GPU backward's d_norm_weight and d_ape are the CPU's bit for bit
// (the same formulas in the same order, no atomics), and both operators give the same bits run to run.
TEST(CudaEpilogueBits, TheCpusBitsAndDeterministic) {
  KVCOMP_REQUIRE_GPU();
  for (DType io : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(io));
    auto rc = make_random_case(chunked_case(), 61);
    round_io_inputs(rc.in, io);
    auto cpu = epilogue_backward(rc, io, {true, 8});
    auto gpu1 = epilogue_backward(rc, io, {true, 8});
    auto gpu2 = epilogue_backward(rc, io, {true, 8});
    ASSERT_TRUE(cpu->bwd->run().ok());
    for (auto* g : {gpu1.get(), gpu2.get()}) {
      const Status s = on_gpu(*g->bwd, {});
      ASSERT_TRUE(s.ok()) << s.message;
      EXPECT_EQ(bytes_of(g->e.d_norm_weight), bytes_of(cpu->e.d_norm_weight));
      EXPECT_EQ(bytes_of(g->bwd->d_ape), bytes_of(cpu->bwd->d_ape));
    }
    EXPECT_EQ(bytes_of(gpu1->bwd->d_x), bytes_of(gpu2->bwd->d_x));
    EXPECT_EQ(bytes_of(gpu1->bwd->d_wkv), bytes_of(gpu2->bwd->d_wkv));
    const ForwardRunner gpu_fwd = [](ForwardRun& r, const Options& o) { return on_gpu(r, o); };
    auto f1 = epilogue_backward(rc, io, {true, 8}, false, gpu_fwd);
    auto f2 = epilogue_backward(rc, io, {true, 8}, false, gpu_fwd);
    EXPECT_EQ(bytes_of(f1->fwd->cmp_kv), bytes_of(f2->fwd->cmp_kv));
    EXPECT_EQ(bytes_of(f1->e.pooled), bytes_of(f2->e.pooled));
  }
}

INSTANTIATE_TEST_SUITE_P(Issue11, CudaSweep, ::testing::ValuesIn(cuda_sweep()),
                         [](const auto& tp) { return tp.param.name; });

// ---- Execution: a stream of the caller's, graph capture and replay.

// A stream of the test's own. Declared before the plans made on it, so that
// it is destroyed after them: a plan frees its device memory on its stream
// when it goes (cudaFreeAsync), which needs the stream alive.
struct OwnStream {
  cudaStream_t s = nullptr;
  explicit OwnStream(unsigned flags = cudaStreamNonBlocking) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, flags), cudaSuccess);
  }
  ~OwnStream() {
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
};

// No error left pending on the thread: a test that leaves one would fail the
// next test's first launch check in the same process.
void expect_no_pending_error() {
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error was left pending";
}

SweepCase graph_case() {
  return {.name = "graph", .th = true, .B = 3, .S = 40, .H = 64, .D = 32, .max_start_pos = 9};
}

TEST(CudaExecution, ForwardAndBackwardReplayFromACudaGraph) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase c = graph_case();
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, c.io, c.backward_data_seed);
  ForwardRun direct_f(rc.problem, rc.in, c.io), graph_f(rc.problem, rc.in, c.io);
  BackwardRun direct_b(rc.problem, rc.in, bd, c.io), graph_b(rc.problem, rc.in, bd, c.io);
  ASSERT_TRUE(on_gpu(direct_f, {}).ok());
  ASSERT_TRUE(on_gpu(direct_b, {}).ok());

  OwnStream own;
  cudaStream_t stream = own.s;
  Options o;
  o.stream = stream;
  ForwardArgs fa = graph_f.args;
  BackwardArgs ba = graph_b.args;
  DeviceMirror m;
  move_forward(m, fa);
  move_backward(m, ba);
  // Plan first (planning reads the index data and may synchronise), then capture execute only.
  ForwardPlan fp;
  BackwardPlan bp;
  ASSERT_TRUE(plan_forward(fa, o, &fp).ok());
  ASSERT_TRUE(plan_backward(ba, o, &bp).ok());
  void *fws = nullptr, *bws = nullptr;
  ASSERT_EQ(cudaMalloc(&fws, fp.workspace_size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&bws, bp.workspace_size()), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status sf = execute(fp, fws, fp.workspace_size());
  const Status sb = execute(bp, bws, bp.workspace_size());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(sf.ok()) << sf.message;
  ASSERT_TRUE(sb.ok()) << sb.message;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  m.copy_back();
  EXPECT_EQ(bytes_of(graph_f.cmp_kv), bytes_of(direct_f.cmp_kv));
  EXPECT_EQ(bytes_of(graph_f.softmax_score), bytes_of(direct_f.softmax_score));
  EXPECT_EQ(bytes_of(graph_f.kv), bytes_of(direct_f.kv));
  EXPECT_EQ(bytes_of(graph_f.cache), bytes_of(direct_f.cache));
  EXPECT_EQ(bytes_of(graph_b.d_x), bytes_of(direct_b.d_x));
  EXPECT_EQ(bytes_of(graph_b.d_wkv), bytes_of(direct_b.d_wkv));
  EXPECT_EQ(bytes_of(graph_b.d_wgate), bytes_of(direct_b.d_wgate));
  EXPECT_EQ(bytes_of(graph_b.d_ape), bytes_of(direct_b.d_ape));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(fws);
  cudaFree(bws);
  expect_no_pending_error();
}  // fp and bp go first, then the stream (own)

// Planning waits for the stream, which a capturing stream cannot do: refused
// with the way out, and the capture stays usable.
TEST(CudaExecution, PlanningDuringACaptureIsRefused) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase c = graph_case();
  auto rc = make_random_case(c.options(), c.forward_seed);
  ForwardRun r(rc.problem, rc.in, c.io);
  ForwardArgs a = r.args;
  DeviceMirror m;
  move_forward(m, a);
  OwnStream own;
  cudaStream_t stream = own.s;
  Options o;
  o.stream = stream;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status s = compressor_forward(a, o);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_EQ(s.code, StatusCode::invalid_param);
  EXPECT_EQ(
      s.message.rfind(
          "[kvcomp] stream (= capturing a CUDA graph) must not be capturing while a call is planned", 0),
      0u)
      << s.message;
  if (graph) cudaGraphDestroy(graph);
  expect_no_pending_error();
}

// execute() queues on the plan's stream. Planned on the legacy default
// stream, it cannot join a capture on another (blocking) stream: refused
// with the way out (without the check the launch failed with
// cudaErrorStreamCaptureImplicit and invalidated the caller's capture). A
// non-blocking capturing stream does not synchronise with the legacy one:
// nothing to see then, the work runs outside the graph (documented).
TEST(CudaExecution, ExecuteOnTheDefaultStreamDuringAnotherCaptureIsRefused) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase c = graph_case();
  auto rc = make_random_case(c.options(), c.forward_seed);
  ForwardRun r(rc.problem, rc.in, c.io);
  ForwardArgs a = r.args;
  DeviceMirror m;
  move_forward(m, a);
  OwnStream capturing(cudaStreamDefault);  // blocking: the legacy stream would join its capture
  ForwardPlan plan;                        // on the default stream
  ASSERT_TRUE(plan_forward(a, {}, &plan).ok());
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, plan.workspace_size()), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(capturing.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status s = execute(plan, ws, plan.workspace_size());
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(capturing.s, &graph), cudaSuccess) << "the caller's capture must stay valid";
  EXPECT_EQ(s.code, StatusCode::invalid_param) << s.message;
  const char* expected = "[kvcomp] stream (= the legacy default stream, while another stream is capturing";
  EXPECT_EQ(s.message.rfind(expected, 0), 0u) << s.message;
  if (graph) cudaGraphDestroy(graph);
  cudaFree(ws);
  expect_no_pending_error();
}

// An error the caller's own code left pending is not this call's: the call
// succeeds (launch errors are read from each launch's return value).
TEST(CudaExecution, AnErrorLeftPendingByTheCallerIsNotReportedAsOurs) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase c = graph_case();
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun ref(rc.problem, rc.in, c.io), r(rc.problem, rc.in, c.io);
  ASSERT_TRUE(on_gpu(ref, {}).ok());
  ASSERT_NE(cudaSetDevice(1 << 20), cudaSuccess);  // leaves cudaErrorInvalidDevice pending
  const Status s = on_gpu(r, {});
  EXPECT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(bytes_of(r.cmp_kv), bytes_of(ref.cmp_kv));
  (void)cudaGetLastError();
  expect_no_pending_error();
}

// ---- Validation with device memory: the data rules give the CPU's status.

struct DataFault {
  const char* name;
  void (*apply)(ForwardRun&);
};

TEST(CudaValidation, IndexDataRulesGiveTheCpuSentences) {
  KVCOMP_REQUIRE_GPU();
  const DataFault faults[] = {
      {"cu_seqlens end", [](ForwardRun& r) { r.seq.cu.i32.back() += 1; }},
      {"cu_seqlens decreasing", [](ForwardRun& r) { std::swap(r.seq.cu.i32[1], r.seq.cu.i32[2]); }},
      {"seqused too long", [](ForwardRun& r) { r.seq.seqused.i32[0] = 1000; }},
      {"start_pos negative", [](ForwardRun& r) { r.seq.start_pos.i32[1] = -3; }},
      {"block id out of range",
       [](ForwardRun& r) {
         for (std::int32_t& id : r.table.i32) id = 1 << 20;
       }},
  };
  SweepCase c{.name = "faults",
              .th = true,
              .B = 3,
              .S = 12,
              .H = 16,
              .D = 8,
              .max_start_pos = 6,
              .allow_empty_segments = false};
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  for (const DataFault& f : faults) {
    ForwardRun cpu(rc.problem, rc.in, c.io), gpu(rc.problem, rc.in, c.io);
    f.apply(cpu);
    f.apply(gpu);
    const Status sc = cpu.run(), sg = on_gpu(gpu, {});
    EXPECT_FALSE(sc.ok()) << f.name;
    EXPECT_EQ(sg.code, sc.code) << f.name;
    EXPECT_EQ(sg.message, sc.message) << f.name;
  }
}

TEST(CudaValidation, AHostPointerTaggedAsDeviceMemoryIsRefused) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase c{.name = "host_pointer", .B = 2, .S = 8, .H = 16, .D = 8};
  auto rc = make_random_case(c.options(), c.forward_seed);
  ForwardRun r(rc.problem, rc.in, c.io);
  ForwardArgs a = r.args;
  DeviceMirror m;
  move_forward(m, a);
  a.wgate = r.args.wgate;                  // host memory ...
  a.wgate.device = {DeviceType::cuda, 0};  // ... claiming to be on the GPU
  const Status s = compressor_forward(a);
  EXPECT_EQ(s.code, StatusCode::invalid_param);
  EXPECT_EQ(s.message,
            "[kvcomp] wgate (= a host pointer) must point to memory on cuda:0, the device its tensor names: "
            "a call's "
            "tensors are all in host memory or all on one CUDA device");
}

// Index data changed on the device after planning is not seen (documented),
// and cannot make a kernel leave its tensors: cache block ids are clamped.
// (Run under compute-sanitizer memcheck by ctest.)
TEST(CudaValidation, ATableCorruptedAfterPlanningStaysInBounds) {
  KVCOMP_REQUIRE_GPU();
  const SweepCase c{.name = "corrupt", .B = 2, .S = 16, .H = 16, .D = 8, .max_start_pos = 9};
  auto rc = make_random_case(c.options(), c.forward_seed);
  ForwardRun r(rc.problem, rc.in, c.io);
  ForwardArgs a = r.args;
  DeviceMirror m;
  move_forward(m, a);
  ForwardPlan plan;
  ASSERT_TRUE(plan_forward(a, {}, &plan).ok());
  std::vector<std::int32_t> bad(r.table.i32.size());
  for (std::size_t i = 0; i < bad.size(); ++i) bad[i] = i % 2 ? 1 << 30 : -(1 << 30);
  ASSERT_EQ(cudaMemcpy(a.state_block_table->data, bad.data(), bad.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, plan.workspace_size()), cudaSuccess);
  EXPECT_TRUE(execute(plan, ws, plan.workspace_size()).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(ws);
}

// ---- Cache aliasing: batches sharing cache blocks keep the spec's order.

TEST(CudaCache, SharedBlocksFollowTheSpecOrderLikeTheCpu) {
  KVCOMP_REQUIRE_GPU();
  check_shared_cache_blocks([](ForwardRun& r, const Options& o) { return on_gpu(r, o); });
}

TEST(CudaCache, RepeatedBlockIdsKeepTheLastWriterLikeTheCpu) {
  KVCOMP_REQUIRE_GPU();
  check_repeated_block_ids([](ForwardRun& r, const Options& o) { return on_gpu(r, o); });
}

// ---- Large cases: GPU against the CPU backend (itself checked against the oracle).

void large_case(const SweepCase& c) {
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  ForwardRun cpu(rc.problem, rc.in, c.io), gpu(rc.problem, rc.in, c.io);
  forward_on_both(c, cpu, gpu);
  // The backward on the CPU forward's own intermediates, a fixed upstream gradient.
  BackwardData bd;
  bd.softmax_score = cpu.softmax_score.values();
  bd.kv = cpu.kv.values();
  bd.d_cmp_kv = cpu.cmp_kv.values();
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  for (double& v : bd.d_cmp_kv) v = round_to_dtype(dist(rng), c.io);
  backward_on_both(c, rc, bd, {});
}

TEST(CudaLarge, C4aBsh262144Tokens) {
  KVCOMP_REQUIRE_GPU();
  large_case({.name = "c4a_262144",
              .B = 1,
              .S = 262144,
              .H = 64,
              .D = 512,
              .max_start_pos = 0,
              .random_seqused = false});
}

TEST(CudaLarge, C128aTh1MTokensIn1000Sequences) {
  KVCOMP_REQUIRE_GPU();
  large_case({.name = "c128a_1m",
              .th = true,
              .B = 1000,
              .S = 1000,
              .H = 32,
              .D = 512,
              .coff = 1,
              .r = 128,
              .cache_mode = 1,
              .max_start_pos = 0,
              .block_size = 128,
              .lengths = std::vector<std::int32_t>(1000, 1000),
              .random_seqused = false,
              .allow_empty_segments = false});
}

}  // namespace
}  // namespace kvcomp::test
