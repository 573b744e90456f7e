// The CUDA backend's drivers and thread bodies run on the host (any machine,
// CI included): cuda/drivers.hpp with an executor that calls the bodies of
// cuda/kernel_bodies.hpp in loops over the launch grid and does the products
// with plain loops. Everything but the CUDA calls themselves (launch
// configuration, cuBLASLt's layouts) is checked here against the float64
// oracle, over the GPU suite's sweep; the GPU suite (test_ops_cuda.cpp) then
// checks the real thing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cuda/drivers.hpp"
#include "cuda/epilogue_bodies.hpp"
#include "cuda/kernel_bodies.hpp"
#include "cuda_sweep.hpp"
#include "epilogue_check.hpp"
#include "validate/validate.hpp"

namespace kvcomp::test {
namespace {

using ::kvcomp::detail::BackwardPath;
using ::kvcomp::detail::bf16_to_f32;
using ::kvcomp::detail::BlockPlan;
using ::kvcomp::detail::f32_to_bf16;
using namespace ::kvcomp::detail::cuda;
using i64 = std::int64_t;

double load(const void* p, i64 i, DType dt) { return body::load_io(p, i, dt); }

// cuBLASLt's column-major matmul as gemm() describes it (lt_call): the same
// refusals, the same types, layouts and transposes, the products in double.
Status emulate_lt(const GemmCall& g) {
  LtCall c;
  if (auto s = lt_call(g, &c); !s.ok()) return s;
  auto at = [](const LtMatrix& x, bool trans, i64 i, i64 j) {  // op(x)(i, j)
    const i64 r = trans ? j : i, col = trans ? i : j;
    EXPECT_TRUE(r < x.rows && col < x.cols) << "element outside its layout";
    return load(x.data, r + col * x.ld, x.type);
  };
  for (i64 j = 0; j < c.n; ++j)
    for (i64 i = 0; i < c.m; ++i) {
      double acc = 0;
      for (i64 p = 0; p < c.k; ++p) acc += at(c.a, c.trans_a, i, p) * at(c.b, c.trans_b, p, j);
      void* d = const_cast<void*>(c.d.data);
      const i64 where = i + j * c.d.ld;
      const float prev = c.beta != 0.0f ? static_cast<float>(load(d, where, c.d.type)) : 0.0f;
      body::store_io(d, where, c.d.type, c.alpha * static_cast<float>(acc) + c.beta * prev);
    }
  return Status::success();
}

// The plain kernel's products (launch_plain_gemm, CudaExec's fallback where
// cuBLASLt has no algorithm): its thread body over the whole grid.
Status emulate_plain(const GemmCall& g) {
  LtCall c;
  if (auto s = lt_call(g, &c); !s.ok()) return s;
  for (i64 e = 0; e < c.m * c.n; ++e) body::plain_gemm_element(c, e % c.m, e / c.m);
  return Status::success();
}

struct HostExec {
  i64 split = 0;       // > 0: products split-K over chunks of this many (as KVCOMP_KERNELS=+splitk does)
  bool plain = false;  // every product by the plain kernel (as if cuBLASLt had no algorithm for any)
  Status gemm(const GemmCall& g) {
    auto one = [this](const GemmCall& x) { return plain ? emulate_plain(x) : emulate_lt(x); };
    if (split == 0) return one(g);
    for (const GemmCall& part : split_k(g, split))
      if (auto s = one(part); !s.ok()) return s;
    return Status::success();
  }
  Status zero(void* p, std::size_t bytes) {
    if (bytes) std::memset(p, 0, bytes);
    return Status::success();
  }
  Status copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
    return Status::success();
  }
  Status forward_blocks(const ForwardKernelArgs& p, i64 lo, i64 hi) {
    for (i64 blk = lo; blk < hi; ++blk)
      for (i64 d = 0; d < p.g.D; ++d) body::forward_block(p, blk, d);
    return Status::success();
  }
  // One launch's threads run in no order: here the last row first, so that
  // two threads writing one slot would give the first writer's value (the
  // CPU keeps the last), and the emulation sees the race.
  Status cache_writes(const ForwardKernelArgs& p, i64 lo, i64 hi) {
    for (i64 row = hi - 1; row >= lo; --row)
      for (i64 col = 0; col < 2 * p.g.C; ++col) body::cache_write(p, row, col);
    return Status::success();
  }
  Status zero_padding(const ForwardKernelArgs& p) {
    for (i64 row = 0; row < p.out_rows; ++row)
      for (i64 d = 0; d < p.g.D; ++d) body::zero_padding(p, row, d);
    return Status::success();
  }
  Status backward_blocks(const BackwardKernelArgs& p, i64 lo, i64 hi, i64 a, i64 b) {
    for (i64 blk = lo; blk < hi; ++blk)
      for (i64 d = 0; d < p.g.D; ++d) body::backward_block(p, lo, blk, d, a, b);
    return Status::success();
  }
  Status dape_accumulate(const double* partials, i64 blocks, i64 n, double* dape) {
    for (i64 i = 0; i < n; ++i) body::dape_accumulate(partials, blocks, n, dape, i);
    return Status::success();
  }
  Status gradient_rows(const Geometry& g, const void* src, bool src_f32, void* dst, i64 a, i64 b, i64 H) {
    for (i64 i = 0; i < b - a; ++i)
      for (i64 h = 0; h < H; ++h) body::gradient_row(g, src, src_f32, dst, a, H, i, h);
    return Status::success();
  }
  Status narrow(const float* src, void* dst, DType io, i64 n) {
    for (i64 i = 0; i < n; ++i) body::narrow(src, dst, io, i);
    return Status::success();
  }
  Status f64_to_f32(const double* src, float* dst, i64 n) {
    for (i64 i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return Status::success();
  }
  // The two launches of each epilogue phase: the rows' statistics, then the elements (columns in
  // reverse, so that a thread reading what another of its launch writes would see the wrong value).
  Status epilogue_forward(const EpilogueKernelArgs& e) {
    for (i64 row = 0; row < e.rows; ++row) body::epilogue_forward_stats(e, row);
    for (i64 row = 0; row < e.rows; ++row)
      for (i64 d = e.g.D - 1; d >= 0; --d) body::epilogue_forward_element(e, row, d);
    return Status::success();
  }
  Status epilogue_backward(const EpilogueKernelArgs& e) {
    for (i64 row = 0; row < e.rows; ++row) body::epilogue_backward_stats(e, row);
    for (i64 row = 0; row < e.rows; ++row)
      for (i64 d = e.g.D - 1; d >= 0; --d) body::epilogue_backward_element(e, row, d);
    return Status::success();
  }
  Status epilogue_weight_terms(const EpilogueKernelArgs& e, i64 lo, i64 hi) {
    for (i64 row = lo; row < hi; ++row)
      for (i64 d = 0; d < e.g.D; ++d) body::epilogue_weight_term(e, lo, row, d);
    return Status::success();
  }
  Status f64_narrow(const double* src, void* dst, DType dt, i64 n) {
    for (i64 i = 0; i < n; ++i) body::f64_narrow(src, dst, dt, i);
    return Status::success();
  }
};

std::unique_ptr<unsigned char[]> workspace(std::size_t bytes) {
  return std::make_unique<unsigned char[]>(bytes);
}

::kvcomp::detail::CacheGeometry cache_geometry(const ForwardArgs& a) {
  return {a.state_cache.dim(0), a.state_cache.dim(1), static_cast<int>(a.cache_mode),
          static_cast<const std::int32_t*>(a.state_block_table->data),
          a.cache_mode == 1 ? a.state_block_table->dim(1) : 1};
}

// The CUDA forward on the host: validation, the chunk plan and the aliasing
// decision as planning makes them, then the driver.
Status emulate(ForwardRun& r, const Options& o, i64 split = 0, bool plain = false) {
  BlockPlan bp;
  if (auto s = ::kvcomp::detail::validate_forward(r.args, o, &bp); !s.ok()) return s;
  ChunkPlan cp = make_chunk_plan(bp, kForwardChunkRows, true);
  const ForwardArgs& a = r.args;
  cp.serial = ::kvcomp::detail::cache_slots_alias(bp, cache_geometry(a));
  const std::size_t bytes = ForwardBuffers(bp.dims, epilogue_rows(a, a.cmp_kv, bp.dims), nullptr).size;
  auto ws = workspace(bytes);
  HostExec ex{split, plain};
  return run_forward_chunks(ex, a, bp, cp, cp.batches.data(), cp.block_batch.data(), ws.get());
}

Status emulate(BackwardRun& r, const Options& o, i64 split = 0, bool plain = false) {
  BlockPlan bp;
  if (auto s = ::kvcomp::detail::validate_backward(r.args, o, &bp); !s.ok()) return s;
  const ChunkPlan cp = make_chunk_plan(bp, kBackwardChunkRows, false);
  const std::size_t bytes = BackwardBuffers(bp.dims, backward_path(bp.dims, o.precision), cp.max_chunk_blocks,
                                            epilogue_rows(r.args, r.args.d_cmp_kv, bp.dims), nullptr)
                                .size;
  auto ws = workspace(bytes);
  HostExec ex{split, plain};
  return run_backward_chunks(ex, r.args, bp, backward_path(bp.dims, o.precision), cp, cp.batches.data(),
                             cp.block_batch.data(), ws.get());
}

std::vector<std::uint8_t> bytes_of(Buffer& b) {
  const auto* p = static_cast<const std::uint8_t*>(b.data());
  return {p, p + b.size() * (b.dtype == DType::f32 || b.dtype == DType::i32 ? 4 : 2)};
}

class CudaLogic : public ::testing::TestWithParam<SweepCase> {};

TEST_P(CudaLogic, ForwardMatchesOracle) {
  check_forward(GetParam(), [](ForwardRun& r, const Options& o) { return emulate(r, o); });
}

TEST_P(CudaLogic, BackwardThreeWay) {
  check_backward(GetParam(), [](BackwardRun& r, const Options& o) { return emulate(r, o); });
}

// The block formulas are the CPU's, operation for operation: for the same
// backward inputs d_ape (which no product touches) is the CPU's, bit for bit,
// in both precision modes.
TEST_P(CudaLogic, DapeIsTheCpusBitwise) {
  const SweepCase& c = GetParam();
  auto rc = make_random_case(c.options(), c.forward_seed);
  round_io_inputs(rc.in, c.io);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, c.io, c.backward_data_seed);
  for (Precision prec : {Precision::precise, Precision::npu_parity}) {
    Options o;
    o.precision = prec;
    BackwardRun cpu(rc.problem, rc.in, bd, c.io), emu(rc.problem, rc.in, bd, c.io);
    ASSERT_TRUE(cpu.run(o).ok());
    ASSERT_TRUE(emulate(emu, o).ok());
    EXPECT_EQ(bytes_of(emu.d_ape), bytes_of(cpu.d_ape));
  }
}

// The split-K switch (item 3 of issue 19): the same walk with every fp32
// product split over K chunks of 8 (256 on the GPU; 8 so that H = 16 and
// the backward's 2C and chunk rows split too) still meets the oracle.
TEST_P(CudaLogic, SplitKProductsMatchTheOracle) {
  check_forward(GetParam(), [](ForwardRun& r, const Options& o) { return emulate(r, o, 8); });
  check_backward(GetParam(), [](BackwardRun& r, const Options& o) { return emulate(r, o, 8); });
}

// The fallback where cuBLASLt has no algorithm (item 5 of issue 19): every
// product by the plain kernel still meets the oracle.
TEST_P(CudaLogic, PlainKernelProductsMatchTheOracle) {
  check_forward(GetParam(), [](ForwardRun& r, const Options& o) { return emulate(r, o, 0, true); });
  check_backward(GetParam(), [](BackwardRun& r, const Options& o) { return emulate(r, o, 0, true); });
}

INSTANTIATE_TEST_SUITE_P(Issue11, CudaLogic, ::testing::ValuesIn(cuda_sweep()),
                         [](const auto& tp) { return tp.param.name; });

// ---- The model-level epilogue and calls without APE (epilogue_check.hpp's cases), against the float64
// reference.

class CudaLogicEpilogue : public ::testing::TestWithParam<EpilogueCase> {};

TEST_P(CudaLogicEpilogue, ForwardMatchesTheReference) {
  check_epilogue_forward([](ForwardRun& r, const Options& o) { return emulate(r, o); }, GetParam());
}

TEST_P(CudaLogicEpilogue, BackwardMatchesTheOracle) {
  check_epilogue_backward([](ForwardRun& r, const Options& o) { return emulate(r, o); },
                          [](BackwardRun& r, const Options& o) { return emulate(r, o); }, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Epilogue, CudaLogicEpilogue, ::testing::ValuesIn(epilogue_cases()),
                         [](const auto& tp) { return param_name(tp.param); });

// The epilogue's formulas are the CPU's, operation for operation, its sums in the CPU's order: on the
// CPU backend's pooled rows the forward gives its cmp_kv bit for bit; from the CPU forward's outputs
// the backward gives its d_norm_weight and d_ape bit for bit (the blocks read the same fp32 gradient
// of the pooled rows).
TEST(CudaLogicEpilogueBits, TheCpusBits) {
  for (DType io : {DType::bf16, DType::f16, DType::f32})
    for (bool th : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(io)) + (th ? " TH" : " BSH"));
      auto rc = make_random_case(th ? chunked_case() : epilogue_case(false), 61);
      round_io_inputs(rc.in, io);
      auto cpu = epilogue_backward(rc, io, {true, 8});
      auto emu = epilogue_backward(rc, io, {true, 8});  // the CPU's forward: the same backward inputs
      // The forward's epilogue on the CPU's pooled rows.
      BlockPlan bp;
      ASSERT_TRUE(::kvcomp::detail::validate_forward(cpu->fwd->args, {}, &bp).ok());
      const ChunkPlan cp = make_chunk_plan(bp, kForwardChunkRows, true);
      const ::kvcomp::detail::Dims& d = bp.dims;
      const i64 rows = epilogue_rows(cpu->fwd->args, cpu->fwd->args.cmp_kv, d);
      std::vector<float> rstd(static_cast<std::size_t>(rows));
      Buffer out = Buffer::of(cpu->e.pooled.values(), io);
      EpilogueKernelArgs e =
          epilogue_args(cpu->fwd->args.epilogue,
                        {cp.batches.data(), cp.block_batch.data(), d.B, d.D, d.C, d.r, d.coff, io}, rows);
      e.cmp_kv = out.data();
      e.rstd = rstd.data();
      HostExec ex;
      ASSERT_TRUE(ex.epilogue_forward(e).ok());
      EXPECT_EQ(bytes_of(out), bytes_of(cpu->fwd->cmp_kv));
      ASSERT_TRUE(cpu->bwd->run().ok());
      ASSERT_TRUE(emulate(*emu->bwd, {}).ok());
      EXPECT_EQ(bytes_of(emu->e.d_norm_weight), bytes_of(cpu->e.d_norm_weight));
      EXPECT_EQ(bytes_of(emu->bwd->d_ape), bytes_of(cpu->bwd->d_ape));
    }
}

// More output rows than one launch of the d_norm_weight terms (kEpilogueChunkRows): the sum carries
// over launches in row order, and the backward still meets the oracle.
TEST(CudaLogicEpilogueBits, NormWeightSumSpansLaunches) {
  RandomOptions o = chunked_case();
  o.th = false;  // BSH: 3 * 500 output rows
  o.B = 3;
  o.S = 1000;
  o.r = 2;
  o.coff = 1;
  o.D = 8;
  o.H = 8;
  o.allow_empty_segments = false;
  o.random_seqused = false;
  auto rc = make_random_case(o, 71);
  ASSERT_GT(out_rows(rc.problem), kEpilogueChunkRows);
  round_io_inputs(rc.in, DType::f32);
  auto run = epilogue_backward(rc, DType::f32, {true, 2}, true,
                               [](ForwardRun& r, const Options& op) { return emulate(r, op); });
  ASSERT_TRUE(emulate(*run->bwd, {}).ok());
  ref::ForwardInputs<double> copy = rc.in;
  const auto fwd = ref::forward<double>(rc.problem, copy);
  std::vector<double> d_pooled = run->d_out, d_norm;
  ref::epilogue_backward<double>(rc.problem, run->e.reference(DType::f32), fwd.position,
                                 run->e.pooled.values(), d_pooled, &d_norm);
  EXPECT_LE(relative_error(run->e.d_norm_weight.values(), d_norm), 1e-6);
}

// Tables whose batches share cache blocks take the serial path; its result is the CPU's.
TEST(CudaLogicCache, SharedBlocksFollowTheSpecOrderLikeTheCpu) {
  check_shared_cache_blocks([](ForwardRun& r, const Options& o) { return emulate(r, o); },
                            [](const ForwardRun& r) {
                              BlockPlan bp;
                              ASSERT_TRUE(::kvcomp::detail::validate_forward(r.args, {}, &bp).ok());
                              EXPECT_TRUE(::kvcomp::detail::cache_slots_alias(bp, cache_geometry(r.args)))
                                  << "the case must take the serial path";
                            });
}

// A paged table row repeating a block id: one launch writes a slot from two
// positions; only the batch's last writes it, as on the CPU.
TEST(CudaLogicCache, RepeatedBlockIdsKeepTheLastWriterLikeTheCpu) {
  check_repeated_block_ids([](ForwardRun& r, const Options& o) { return emulate(r, o); },
                           [](const ForwardRun& r) {
                             BlockPlan bp;
                             ASSERT_TRUE(::kvcomp::detail::validate_forward(r.args, {}, &bp).ok());
                             EXPECT_TRUE(::kvcomp::detail::cache_slots_alias(bp, cache_geometry(r.args)))
                                 << "the case must take the serial path";
                           });
}

// precise with fp16: a d_new past fp16's range has hi = +-inf; lo must then
// be 0 (not -+inf), so that hi + lo / scale in the products is the overflow's
// inf, not NaN. Finite values keep hi + lo / scale == v to fp16's bits.
TEST(CudaLogicPrecise, Fp16OverflowGivesInfNotNan) {
  for (DType io : {DType::f16, DType::bf16}) {
    std::uint16_t hi[2] = {0, 0}, lo[2] = {0, 0};  // 4 bytes: load_io's fp32 branch stays in bounds
    BackwardKernelArgs p;
    p.g.io = io;
    p.mode = BackwardPath::precise16;
    p.dnew_hi = hi;
    p.dnew_lo = lo;
    p.lo_scale = lo_scale(io);
    const float big = io == DType::f16 ? 70000.0f : std::numeric_limits<float>::max();
    const float inf = std::numeric_limits<float>::infinity();
    for (float v : {big, -big, inf, -inf}) {
      body::store_dnew(p, 0, v);
      const float h = body::load_io(hi, 0, io), l = body::load_io(lo, 0, io);
      const float sum = h + l / p.lo_scale;  // what the two products add up to, per unit weight
      EXPECT_TRUE(std::isinf(h)) << dtype_name(io) << " " << v;
      EXPECT_EQ(l, 0.0f) << dtype_name(io) << " " << v;
      EXPECT_EQ(sum, v > 0 ? inf : -inf) << dtype_name(io) << " " << v;
    }
    body::store_dnew(p, 0, 1000.3f);
    // About 16 (bf16) / 22 (fp16) bits of v reach the products.
    EXPECT_NEAR(body::load_io(hi, 0, io) + body::load_io(lo, 0, io) / p.lo_scale, 1000.3, 1000.3 * 0x1p-15);
  }
}

// ---- The products: what gemm() hands cuBLASLt (lt_call), run by emulate_lt.

// cuBLASLt with CUBLAS_COMPUTE_32F and fp32 scales runs 16-bit inputs into
// fp32 or the same 16-bit type, fp32 into fp32; anything else is refused by
// gemm() and by the emulation alike (never silently written as fp32).
TEST(CudaLogicGemm, OutputTypesAreTheOnesCublasLtRuns) {
  const DType types[] = {DType::f32, DType::bf16, DType::f16};
  for (DType in : types)
    for (DType out : types) {
      const bool expected = out == DType::f32 || out == in;
      float a = 1.0f, b = 1.0f, d[2] = {0.0f, 0.0f};
      GemmCall g{1, 1, 1, in, {&a, 1, false}, {&b, 1, false}, d, 1};
      g.out = out;
      LtCall c;
      const Status s = lt_call(g, &c);
      EXPECT_EQ(s.ok(), expected) << dtype_name(in) << " -> " << dtype_name(out) << ": " << s.message;
      EXPECT_EQ(emulate_lt(g).ok(), expected) << dtype_name(in) << " -> " << dtype_name(out);
      if (s.ok()) {
        EXPECT_EQ(c.d.type, out) << "D (and C) must be described in the requested dtype";
        EXPECT_EQ(c.a.type, in);
        EXPECT_EQ(c.b.type, in);
      }
    }
}

// A bf16-output product writes 2 bytes per element inside its rows (what
// `kvcomp bench --device cuda` sizes its buffers for), values rounded once
// from the fp32 accumulation; the bytes after D stay untouched.
TEST(CudaLogicGemm, ABf16OutputStaysInsideItsBuffer) {
  const i64 m = 5, n = 6, k = 7, ldd = 9;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(n * k));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = f32_to_bf16(0.25f * static_cast<float>(i % 7) - 0.5f);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(0.125f * static_cast<float>(i % 5) + 0.1f);
  const std::size_t d_elems = static_cast<std::size_t>((m - 1) * ldd + n), guard = 16;
  std::vector<std::uint16_t> d(d_elems + guard, 0xAAAA);
  // x [m, k] times w [n, k]^T, the forward's shape.
  GemmCall g{m, n, k, DType::bf16, {a.data(), k, false}, {b.data(), k, true}, d.data(), ldd};
  g.out = DType::bf16;
  LtCall c;
  ASSERT_TRUE(lt_call(g, &c).ok());
  EXPECT_EQ(c.d.extent_bytes(), d_elems * 2);
  ASSERT_TRUE(emulate_lt(g).ok());
  for (i64 i = 0; i < m; ++i)
    for (i64 j = 0; j < n; ++j) {
      double acc = 0;
      for (i64 p = 0; p < k; ++p)
        acc += static_cast<double>(bf16_to_f32(a[static_cast<std::size_t>(i * k + p)])) *
               bf16_to_f32(b[static_cast<std::size_t>(j * k + p)]);
      EXPECT_EQ(d[static_cast<std::size_t>(i * ldd + j)], f32_to_bf16(static_cast<float>(acc)))
          << i << "," << j;
    }
  for (std::size_t i = d_elems; i < d.size(); ++i) EXPECT_EQ(d[i], 0xAAAA) << "written past D at " << i;
}

// The plain kernel: D = alpha * (fp32 sum over K in order) + beta * D, for
// every transpose, with rows whose pitch is no multiple of 16 bytes (H = 20
// bf16: 40 bytes), the case cuBLASLt may have no algorithm for.
TEST(CudaLogicGemm, PlainKernelSumsInOrderInFp32) {
  const i64 m = 5, n = 3, k = 20;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(n * k));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = f32_to_bf16(0.3f * static_cast<float>(i % 9) - 1.2f);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(0.7f * static_cast<float>(i % 4) - 0.9f);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const i64 lda = ta ? m : k, ldb = tb ? k : n;
      std::vector<std::uint16_t> sa(a.size()), sb(b.size());
      auto A = [&](i64 i, i64 p) { return a[static_cast<std::size_t>(i * k + p)]; };
      auto B = [&](i64 p, i64 j) { return b[static_cast<std::size_t>(j * k + p)]; };
      for (i64 i = 0; i < m; ++i)
        for (i64 p = 0; p < k; ++p) sa[static_cast<std::size_t>(ta ? p * lda + i : i * lda + p)] = A(i, p);
      for (i64 p = 0; p < k; ++p)
        for (i64 j = 0; j < n; ++j) sb[static_cast<std::size_t>(tb ? j * ldb + p : p * ldb + j)] = B(p, j);
      std::vector<float> d(static_cast<std::size_t>(m * n), 0.25f);
      GemmCall g{m, n, k, DType::bf16, {sa.data(), lda, ta}, {sb.data(), ldb, tb}, d.data(), n, 1.5f, 0.5f};
      ASSERT_TRUE(emulate_plain(g).ok());
      for (i64 i = 0; i < m; ++i)
        for (i64 j = 0; j < n; ++j) {
          float acc = 0.0f;
          for (i64 p = 0; p < k; ++p) acc = acc + bf16_to_f32(A(i, p)) * bf16_to_f32(B(p, j));
          EXPECT_EQ(d[static_cast<std::size_t>(i * n + j)], 1.5f * acc + 0.5f * 0.25f)
              << "ta=" << ta << " tb=" << tb << " " << i << "," << j;
        }
    }
}

// split_k() covers K exactly once, in order, for every transpose: each part
// reads its own K columns of op(A) and rows of op(B), and the parts add up in
// fp32 through beta = 1 (expected here with the same roundings).
TEST(CudaLogicGemm, SplitKChunksCoverKInOrder) {
  const i64 m = 3, n = 4, k = 21, chunk = 8;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(n * k));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = f32_to_bf16(0.37f * static_cast<float>(i % 11) - 1.5f);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(0.21f * static_cast<float>(i % 13) - 1.1f);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      // Stored A: [m, k] or [k, m]; stored B: [k, n] or [n, k]; leading dimensions with slack.
      const i64 lda = (ta ? m : k) + 1, ldb = (tb ? k : n) + 2;
      std::vector<std::uint16_t> sa(static_cast<std::size_t>((ta ? k : m) * lda)),
          sb(static_cast<std::size_t>((tb ? n : k) * ldb));
      auto A = [&](i64 i, i64 p) { return a[static_cast<std::size_t>(i * k + p)]; };  // op(A)(i, p)
      auto B = [&](i64 p, i64 j) { return b[static_cast<std::size_t>(j * k + p)]; };  // op(B)(p, j)
      for (i64 i = 0; i < m; ++i)
        for (i64 p = 0; p < k; ++p) sa[static_cast<std::size_t>(ta ? p * lda + i : i * lda + p)] = A(i, p);
      for (i64 p = 0; p < k; ++p)
        for (i64 j = 0; j < n; ++j) sb[static_cast<std::size_t>(tb ? j * ldb + p : p * ldb + j)] = B(p, j);
      std::vector<float> d(static_cast<std::size_t>(m * n), 0.5f);
      GemmCall g{m, n, k, DType::bf16, {sa.data(), lda, ta}, {sb.data(), ldb, tb}, d.data(), n, 0.75f, 2.0f};
      const auto parts = split_k(g, chunk);
      ASSERT_EQ(parts.size(), 3u);
      for (const GemmCall& part : parts) ASSERT_TRUE(emulate_lt(part).ok());
      for (i64 i = 0; i < m; ++i)
        for (i64 j = 0; j < n; ++j) {
          float want = 0.5f;
          for (i64 k0 = 0; k0 < k; k0 += chunk) {
            double acc = 0;
            for (i64 p = k0; p < std::min(k, k0 + chunk); ++p)
              acc += static_cast<double>(bf16_to_f32(A(i, p))) * bf16_to_f32(B(p, j));
            want = 0.75f * static_cast<float>(acc) + (k0 == 0 ? 2.0f : 1.0f) * want;
          }
          EXPECT_EQ(d[static_cast<std::size_t>(i * n + j)], want)
              << "ta=" << ta << " tb=" << tb << " " << i << "," << j;
        }
    }
  // Not split: a 16-bit D (no fp32 epilogue sum), or K within one chunk.
  float x = 0;
  std::uint16_t y = 0;
  GemmCall bf{1, 1, 100, DType::bf16, {&x, 100, false}, {&x, 1, false}, &y, 1};
  bf.out = DType::bf16;
  EXPECT_EQ(split_k(bf, chunk).size(), 1u);
  GemmCall small{1, 1, 8, DType::bf16, {&x, 8, false}, {&x, 1, false}, &x, 1};
  EXPECT_EQ(split_k(small, chunk).size(), 1u);
}

}  // namespace
}  // namespace kvcomp::test
