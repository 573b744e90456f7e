// Benchmark workloads shared by `kvcomp bench` and the Google Benchmark
// binary (bench/bench_ops.cpp): the shapes of real models, seeded data, and
// the operator's own matrix products done by oneDNN alone as the baseline.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::bench {

struct Profile {
  const char* name;
  std::int64_t D, coff, r;
};
// C4A, C4Li and C128A (DeepSeek-V4 compressed attention).
inline constexpr Profile kProfiles[] = {{"C4A", 512, 2, 4}, {"C4Li", 128, 2, 4}, {"C128A", 512, 1, 128}};
const Profile* find_profile(const char* name);  // nullptr if unknown

struct Case {
  Profile p;
  std::int64_t T, H, batches;  // batches > 1: TH varlen with that many sequences
  DType io = DType::bf16;      // x, the weights, cmp_kv and the gradients: bf16 or f16

  // Forward 4*T*C*H, backward 8*T*C*H (C = coff*D), counted on all T tokens.
  double forward_flop() const { return 4.0 * static_cast<double>(T * p.coff * p.D * H); }
  double backward_flop() const { return 2.0 * forward_flop(); }
};

// At most T / (4r) sequences, so that they are long enough to hold
// compressed blocks (64 sequences of 64 tokens have none at r = 128).
std::int64_t varlen_batches(const Profile& p, std::int64_t T, std::int64_t wanted);

// The tensors of one case, in its io dtype, seeded: forward arguments (with the
// backward's saved softmax_score / kv as outputs) and backward arguments.
// TH sequence lengths are uniform in [0.5, 1.5] x T/batches.
class Workload {
 public:
  explicit Workload(const Case& c);
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;
  ~Workload();

  const ForwardArgs& forward() const { return f_; }
  const BackwardArgs& backward() const { return g_; }
  double compressed_fraction() const { return compressed_fraction_; }  // tokens inside blocks / T

 private:
  struct Buffers;
  std::unique_ptr<Buffers> buf_;
  ForwardArgs f_;
  BackwardArgs g_;
  double compressed_fraction_ = 0;
};

// A decode-sized forward: `batches` sequences of `tokens` tokens each (BSH
// [B, tokens, H], io bf16 or f16), every sequence at start_pos, no gradient; a paged
// cache (block_size 16, ids only for the blocks the call reads or writes, 0
// elsewhere, as the upstream harnesses build them) or a ring cache (one
// block of coff*r + tokens slots per sequence).
struct DecodeCase {
  Profile p;
  std::int64_t batches, tokens, H, start_pos;
  bool ring;
  DType io = DType::bf16;
  bool th = false;  // TH: x [B * tokens, H] with cu_seqlens (else BSH [B, tokens, H])
  double flop() const { return 4.0 * static_cast<double>(batches * tokens * p.coff * p.D * H); }
};

class DecodeWorkload {
 public:
  explicit DecodeWorkload(const DecodeCase& c);
  DecodeWorkload(const DecodeWorkload&) = delete;
  DecodeWorkload& operator=(const DecodeWorkload&) = delete;
  ~DecodeWorkload();
  const ForwardArgs& forward() const { return f_; }

 private:
  struct Buffers;
  std::unique_ptr<Buffers> buf_;
  ForwardArgs f_;
};

// The operator's matrix products alone, by oneDNN with its own threading:
// forward x[T,H] . W[2C,H]^T; backward dnew[T,2C] . W[2C,H] and
// dnew^T . x[T,H]. Operands f32 or bf16 (bf16 throws dnnl::error where
// oneDNN has no bf16 matmul, e.g. oneDNN 2.6 without avx512_core); with
// bf16 operands W is held pre-packed in the layout the kernel reads.
class Products {
 public:
  enum class Which { forward, backward };
  Products(const Case& c, Which which, bool bf16_operands);
  // The decode call's one product: x[B*tokens, H] . W[2C, H]^T.
  Products(const DecodeCase& c, bool bf16_operands);
  ~Products();
  Products(const Products&) = delete;
  Products& operator=(const Products&) = delete;
  void run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcomp::bench
