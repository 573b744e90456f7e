// Runs the library on a test case and compares it with the references:
// A = kvcomp, B = the fp32 "same" golden (ref<float>, d_new staged in the io
// dtype), C = the float64 oracle rounded to the output dtypes (spec 7.2).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kvcomp/half.hpp"
#include "kvcomp/kvcomp.hpp"
#include "random_problem.hpp"
#include "reference/reference.hpp"
#include "three_way.hpp"

namespace kvcomp::test {

// The small case of the rule tests (validation, devices): 2 batches of 8 tokens, H 16, D 4, coff 2,
// r 4, start positions up to 6, no empty TH segment.
inline RandomOptions small_rule_options(bool th) {
  RandomOptions o;
  o.th = th;
  o.B = 2;
  o.S = 8;
  o.H = 16;
  o.D = 4;
  o.coff = 2;
  o.r = 4;
  o.max_start_pos = 6;
  o.allow_empty_segments = false;
  return o;
}

// Typed storage for one tensor of the library call.
struct Buffer {
  DType dtype = DType::f32;
  std::vector<std::uint16_t> half;
  std::vector<float> f32;
  std::vector<std::int32_t> i32;

  void* data() {
    if (dtype == DType::i32) return i32.data();
    return dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(half.data());
  }
  std::size_t size() const {
    return dtype == DType::i32 ? i32.size() : dtype == DType::f32 ? f32.size() : half.size();
  }

  static Buffer of(const std::vector<double>& v, DType dt) {
    Buffer b;
    b.dtype = dt;
    if (dt == DType::f32) {
      b.f32.assign(v.begin(), v.end());
    } else {
      b.half.resize(v.size());
      for (std::size_t i = 0; i < v.size(); ++i)
        b.half[i] = dt == DType::bf16 ? float_to_bf16(static_cast<float>(v[i]))
                                      : float_to_fp16(static_cast<float>(v[i]));
    }
    return b;
  }
  static Buffer ints(const std::vector<std::int32_t>& v) {
    Buffer b;
    b.dtype = DType::i32;
    b.i32 = v;
    return b;
  }
  static Buffer filled(std::size_t n, DType dt, float value) { return of(std::vector<double>(n, value), dt); }

  double at(std::size_t i) const {
    switch (dtype) {
      case DType::bf16:
        return bf16_to_float(half[i]);
      case DType::f16:
        return fp16_to_float(half[i]);
      case DType::i32:
        return i32[i];
      default:
        return f32[i];
    }
  }
  std::vector<double> values() const {
    std::vector<double> v(size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = at(i);
    return v;
  }
};

inline std::vector<double> round_all(const std::vector<double>& v, DType dt) { return round_to_dtype(v, dt); }

// TH, about 1750 tokens (more than one chunk of rows), D = 40 (three column slices of 16).
inline RandomOptions chunked_case() {
  RandomOptions o;
  o.th = true;
  o.B = 5;
  o.S = 700;
  o.H = 40;
  o.D = 40;
  o.coff = 2;
  o.r = 4;
  o.max_start_pos = 9;
  return o;
}

// The same bytes: two runs' outputs bit for bit.
template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

inline Tensor tensor(Buffer& b, std::initializer_list<std::int64_t> dims) {
  return Tensor(b.data(), b.dtype, dims);
}

// The sequence part shared by both calls.
struct SequenceBuffers {
  Buffer x, wkv, wgate, cu, seqused, start_pos;
  void fill(const ref::Problem& p, const ref::ForwardInputs<double>& in, DType io, SequenceArgs& a) {
    x = Buffer::of(in.x, io);
    wkv = Buffer::of(in.wkv, io);
    wgate = Buffer::of(in.wgate, io);
    a.x = p.th ? tensor(x, {p.T, p.H}) : tensor(x, {p.B, p.S, p.H});
    a.wkv = tensor(wkv, {p.C(), p.H});
    a.wgate = tensor(wgate, {p.C(), p.H});
    if (p.th) {
      cu = Buffer::ints(p.cu_seqlens);
      a.cu_seqlens = tensor(cu, {p.B + 1});
    }
    if (!p.seqused.empty()) {
      seqused = Buffer::ints(p.seqused);
      a.seqused = tensor(seqused, {p.B});
    }
    if (!p.start_pos.empty()) {
      start_pos = Buffer::ints(p.start_pos);
      a.start_pos = tensor(start_pos, {p.B});
    }
    a.cmp_ratio = p.r;
    a.coff = p.coff;
  }
};

inline std::int64_t rows_per_batch(const ref::Problem& p) { return (p.S + p.r - 1) / p.r; }

// Output row count as the library expects it (BSH flattened).
inline std::int64_t out_rows(const ref::Problem& p) {
  return p.th ? std::min(p.T, p.T / p.r + p.B) : p.B * rows_per_batch(p);
}

inline Tensor compressed_tensor(Buffer& b, const ref::Problem& p, bool intermediate) {
  const std::int64_t cr = p.coff * p.r;
  if (p.th) return intermediate ? tensor(b, {out_rows(p), cr, p.D}) : tensor(b, {out_rows(p), p.D});
  return intermediate ? tensor(b, {p.B, rows_per_batch(p), cr, p.D})
                      : tensor(b, {p.B, rows_per_batch(p), p.D});
}

struct ForwardRun {
  SequenceBuffers seq;
  Buffer cache, ape, table, cmp_kv, softmax_score, kv;
  ForwardArgs args;

  ForwardRun(const ref::Problem& p, const ref::ForwardInputs<double>& in, DType io,
             bool grad_enabled = true) {
    seq.fill(p, in, io, args);
    cache = Buffer::of(in.cache.data, DType::f32);
    ape = Buffer::of(in.ape, DType::f32);
    table = Buffer::ints(in.cache.block_table);
    args.state_cache = tensor(cache, {in.cache.block_num, in.cache.block_size, 2 * p.C()});
    args.ape = tensor(ape, {p.r, p.C()});
    args.state_block_table =
        in.cache.cache_mode == 1 ? tensor(table, {p.B, in.cache.table_cols}) : tensor(table, {p.B});
    args.cache_mode = in.cache.cache_mode;
    args.grad_enabled = grad_enabled;
    // Pre-filled with garbage: every row must be written (padding with zeros).
    const std::size_t n = static_cast<std::size_t>(out_rows(p));
    const std::size_t cr = static_cast<std::size_t>(p.coff * p.r);
    cmp_kv = Buffer::filled(n * static_cast<std::size_t>(p.D), io, 7.0f);
    softmax_score = Buffer::filled(n * cr * static_cast<std::size_t>(p.D), DType::f32, 7.0f);
    kv = Buffer::filled(n * cr * static_cast<std::size_t>(p.D), DType::f32, 7.0f);
    args.cmp_kv = compressed_tensor(cmp_kv, p, false);
    args.softmax_score = compressed_tensor(softmax_score, p, true);
    args.kv = compressed_tensor(kv, p, true);
  }
  Status run(const Options& o = {}) { return compressor_forward(args, o); }
};

struct BackwardData {
  std::vector<double> d_cmp_kv;       // io-rounded values; padding rows NaN
  std::vector<double> softmax_score;  // fp32 values; padding rows NaN
  std::vector<double> kv;
};

// Intermediates from the float64 forward (rounded to fp32, as the library's
// forward would export them) and a random upstream gradient. Padding rows hold
// NaN: reading one would poison the outputs.
inline BackwardData make_backward_data(const ref::Problem& p, const ref::ForwardInputs<double>& in, DType io,
                                       std::uint64_t seed) {
  ref::ForwardInputs<double> copy = in;
  auto fwd = ref::forward<double>(p, copy);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  BackwardData d;
  const std::size_t D = static_cast<std::size_t>(p.D), blk = static_cast<std::size_t>(p.coff * p.r) * D;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  d.d_cmp_kv.resize(fwd.cmp_kv.size());
  d.softmax_score.resize(fwd.softmax_score.size());
  d.kv.resize(fwd.kv.size());
  for (std::size_t row = 0; row < fwd.valid.size(); ++row) {
    const bool v = fwd.valid[row] != 0;
    for (std::size_t i = 0; i < D; ++i) d.d_cmp_kv[row * D + i] = v ? round_to_dtype(dist(rng), io) : nan;
    for (std::size_t i = 0; i < blk; ++i) {
      d.softmax_score[row * blk + i] = v ? static_cast<float>(fwd.softmax_score[row * blk + i]) : nan;
      d.kv[row * blk + i] = v ? static_cast<float>(fwd.kv[row * blk + i]) : nan;
    }
  }
  return d;
}

struct BackwardRun {
  SequenceBuffers seq;
  Buffer d_cmp_kv, softmax_score, kv, d_x, d_wkv, d_wgate, d_ape;
  BackwardArgs args;

  BackwardRun(const ref::Problem& p, const ref::ForwardInputs<double>& in, const BackwardData& bd, DType io) {
    seq.fill(p, in, io, args);
    d_cmp_kv = Buffer::of(bd.d_cmp_kv, io);
    softmax_score = Buffer::of(bd.softmax_score, DType::f32);
    kv = Buffer::of(bd.kv, DType::f32);
    args.d_cmp_kv = compressed_tensor(d_cmp_kv, p, false);
    args.softmax_score = compressed_tensor(softmax_score, p, true);
    args.kv = compressed_tensor(kv, p, true);
    const std::size_t rows = static_cast<std::size_t>(p.rows()), H = static_cast<std::size_t>(p.H);
    const std::size_t C = static_cast<std::size_t>(p.C());
    d_x = Buffer::filled(rows * H, io, 3.0f);  // garbage: every element must be written
    d_wkv = Buffer::filled(C * H, io, 3.0f);
    d_wgate = Buffer::filled(C * H, io, 3.0f);
    d_ape = Buffer::filled(static_cast<std::size_t>(p.r) * C, DType::f32, 3.0f);
    args.d_x = p.th ? tensor(d_x, {p.T, p.H}) : tensor(d_x, {p.B, p.S, p.H});
    args.d_wkv = tensor(d_wkv, {p.C(), p.H});
    args.d_wgate = tensor(d_wgate, {p.C(), p.H});
    args.d_ape = tensor(d_ape, {p.r, p.C()});
  }
  Status run(const Options& o = {}) { return compressor_backward(args, o); }
};

// The B and C parties of the backward.
struct BackwardGoldens {
  ref::BackwardOutputs<double> same, high;  // both already rounded to the output dtypes
};

inline BackwardGoldens backward_goldens(const ref::Problem& p, const ref::ForwardInputs<double>& in,
                                        const BackwardData& bd, DType io) {
  ref::BackwardInputs<double> hi{in.x, in.wkv, in.wgate, bd.d_cmp_kv, bd.softmax_score, bd.kv};
  auto high = ref::backward<double>(p, hi);
  ref::BackwardInputs<float> lo{
      convert<float>(in.x),        convert<float>(in.wkv),           convert<float>(in.wgate),
      convert<float>(bd.d_cmp_kv), convert<float>(bd.softmax_score), convert<float>(bd.kv)};
  auto same_f =
      ref::backward<float>(p, lo, [io](float v) { return static_cast<float>(round_to_dtype(v, io)); });
  BackwardGoldens g;
  g.high = {round_all(high.d_x, io), round_all(high.d_wkv, io), round_all(high.d_wgate, io),
            round_all(high.d_ape, DType::f32)};
  g.same = {round_all(convert<double>(same_f.d_x), io), round_all(convert<double>(same_f.d_wkv), io),
            round_all(convert<double>(same_f.d_wgate), io),
            round_all(convert<double>(same_f.d_ape), DType::f32)};
  return g;
}

// gtest form of ref::fp32_projection_accuracy (see there for why the forward's
// projection-bound outputs use it instead of the three-way rule).
inline ::testing::AssertionResult projection_accuracy(const std::vector<double>& a,
                                                      const std::vector<double>& b,
                                                      const std::vector<double>& c, DType dt) {
  const auto r = fp32_projection_accuracy(a, b, c, dt);
  if (r.pass) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << r.why;
}

// KVCOMP_SWEEP_REPORT=1 in the environment also prints every comparison's
// summary ("three-way <test> <name>: ..."), for the ratio tables of
// docs/performance.md.
inline void report_three_way(const char* name, const std::string& summary) {
  if (!std::getenv("KVCOMP_SWEEP_REPORT")) return;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::printf("three-way %s/%s %s: %s\n", info ? info->test_suite_name() : "", info ? info->name() : "", name,
              summary.c_str());
}

#define KVCOMP_EXPECT_THREE_WAY(name, a, b, c, dt)                          \
  do {                                                                      \
    const auto r_ = ::kvcomp::test::three_way_compare((a), (b), (c), (dt)); \
    ::kvcomp::test::report_three_way((name), r_.summary());                 \
    EXPECT_TRUE(r_.pass) << (name) << ": " << r_.summary();                 \
  } while (0)

}  // namespace kvcomp::test
