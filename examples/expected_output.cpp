// Prints what an example program must print, computed through the kvcomp C++
// API on the same inputs (profile aclnn, as the aclnn front door uses). The
// test suite compares this output with the example's, byte for byte:
//   expected_output grad   compressor_grad_example
//   expected_output fwd    compressor_example
//   expected_output seed   a program shaped like the CompressorGrad sample of
//                          the CANN documentation (B 1, S 4, H 4096, C4A, bf16,
//                          every input 0.1, start_pos 0), which prints the
//                          first 10 values of each output with %f
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "example_data.hpp"
#include "kvcomp/half.hpp"
#include "kvcomp/kvcomp.hpp"

namespace {

using kvcomp::DType;
using kvcomp::Tensor;

std::vector<std::uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = kvcomp::float_to_bf16(v[i]);
  return out;
}

std::vector<float> from_bf16(const std::vector<std::uint16_t>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = kvcomp::bf16_to_float(v[i]);
  return out;
}

kvcomp::Options aclnn_profile() {
  kvcomp::Options o;
  o.profile = kvcomp::Profile::aclnn;
  return o;
}

int report(const kvcomp::Status& s) {
  std::fprintf(stderr, "kvcomp call failed: %d %s\n", s.value(), s.message.c_str());
  return 1;
}

struct GradOutputs {
  std::vector<std::uint16_t> d_x, d_wkv, d_wgate;
  std::vector<float> d_ape;
};

// One backward call; inputs as float (rounded to bf16 here) plus start_pos.
kvcomp::Status run_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t coff,
                            std::int64_t r, const std::vector<float>& x, const std::vector<float>& wkv,
                            const std::vector<float>& wgate, const std::vector<float>& d_cmp_kv,
                            std::vector<float> softmax_score, std::vector<float> kv,
                            std::vector<std::int32_t> start_pos, GradOutputs* out) {
  const std::int64_t C = coff * D, Sr = (S + r - 1) / r;
  auto xb = to_bf16(x), wkvb = to_bf16(wkv), wgateb = to_bf16(wgate), dcb = to_bf16(d_cmp_kv);
  out->d_x.assign(xb.size(), 0);
  out->d_wkv.assign(wkvb.size(), 0);
  out->d_wgate.assign(wgateb.size(), 0);
  out->d_ape.assign(static_cast<std::size_t>(r * C), 0.0f);
  kvcomp::BackwardArgs a;
  a.x = Tensor(xb.data(), DType::bf16, {B, S, H});
  a.wkv = Tensor(wkvb.data(), DType::bf16, {C, H});
  a.wgate = Tensor(wgateb.data(), DType::bf16, {C, H});
  a.d_cmp_kv = Tensor(dcb.data(), DType::bf16, {B, Sr, D});
  a.softmax_score = Tensor(softmax_score.data(), DType::f32, {B, Sr, coff * r, D});
  a.kv = Tensor(kv.data(), DType::f32, {B, Sr, coff * r, D});
  a.start_pos = Tensor(start_pos.data(), DType::i32, {B});
  a.cmp_ratio = r;
  a.coff = coff;
  a.d_x = Tensor(out->d_x.data(), DType::bf16, {B, S, H});
  a.d_wkv = Tensor(out->d_wkv.data(), DType::bf16, {C, H});
  a.d_wgate = Tensor(out->d_wgate.data(), DType::bf16, {C, H});
  a.d_ape = Tensor(out->d_ape.data(), DType::f32, {r, C});
  return kvcomp::compressor_backward(a, aclnn_profile());
}

int grad() {
  const example::GradCase c;
  GradOutputs o;
  const auto s = run_backward(c.B, c.S, c.H, c.D, c.coff, c.cmpRatio, c.x, c.wkv, c.wgate, c.dCmpKv,
                              c.softmaxScore, c.kv, c.startPos, &o);
  if (!s.ok()) return report(s);
  std::printf("CompressorGrad execution succeeded.\n");
  example::PrintSummary("dX", from_bf16(o.d_x));
  example::PrintSummary("dWkv", from_bf16(o.d_wkv));
  example::PrintSummary("dWgate", from_bf16(o.d_wgate));
  example::PrintSummary("dApe", o.d_ape);
  return 0;
}

int fwd() {
  example::ForwardCase c;
  const std::int64_t C = c.coff * c.D, rows = c.coff * c.cmpRatio, out_rows = c.cmpRows();
  auto xb = to_bf16(c.x), wkvb = to_bf16(c.wkv), wgateb = to_bf16(c.wgate);
  std::vector<std::uint16_t> cmp_kv(static_cast<std::size_t>(out_rows * c.D), 0);
  std::vector<float> softmax_score(static_cast<std::size_t>(out_rows * rows * c.D), 0.0f), kv = softmax_score;
  kvcomp::ForwardArgs a;
  a.x = Tensor(xb.data(), DType::bf16, {c.T(), c.H});
  a.wkv = Tensor(wkvb.data(), DType::bf16, {C, c.H});
  a.wgate = Tensor(wgateb.data(), DType::bf16, {C, c.H});
  a.state_cache = Tensor(c.stateCache.data(), DType::f32, {c.blockNum, c.blockSize, 2 * C});
  a.ape = Tensor(c.ape.data(), DType::f32, {c.cmpRatio, C});
  a.state_block_table = Tensor(c.blockTable.data(), DType::i32, {c.B(), c.tableCols()});
  a.cu_seqlens = Tensor(c.cuSeqlens.data(), DType::i32, {c.B() + 1});
  a.start_pos = Tensor(c.startPos.data(), DType::i32, {c.B()});
  a.cmp_ratio = c.cmpRatio;
  a.coff = c.coff;
  a.cache_mode = c.cacheMode;
  a.grad_enabled = true;
  a.cmp_kv = Tensor(cmp_kv.data(), DType::bf16, {out_rows, c.D});
  a.softmax_score = Tensor(softmax_score.data(), DType::f32, {out_rows, rows, c.D});
  a.kv = Tensor(kv.data(), DType::f32, {out_rows, rows, c.D});
  if (const auto s = kvcomp::compressor_forward(a, aclnn_profile()); !s.ok()) return report(s);
  std::printf("Compressor execution succeeded.\n");
  example::PrintSummary("cmpKv", from_bf16(cmp_kv));
  example::PrintSummary("softmaxScore", softmax_score);
  example::PrintSummary("kv", kv);
  example::PrintSummary("stateCache", c.stateCache);
  return 0;
}

void print_first(const std::vector<float>& v) {
  for (std::size_t i = 0; i < v.size() && i < 10; ++i)
    std::printf("result[%zu] is: %f\n", i, static_cast<double>(v[i]));
}

int seed() {
  const std::int64_t B = 1, S = 4, H = 4096, D = 512, coff = 2, r = 4, C = coff * D, Sr = (S + r - 1) / r;
  const auto fill = [](std::int64_t n) { return std::vector<float>(static_cast<std::size_t>(n), 0.1f); };
  GradOutputs o;
  const auto s =
      run_backward(B, S, H, D, coff, r, fill(B * S * H), fill(C * H), fill(C * H), fill(B * Sr * D),
                   fill(B * Sr * coff * r * D), fill(B * Sr * coff * r * D), {0}, &o);
  if (!s.ok()) return report(s);
  std::printf("CompressorGrad execution succeeded.\n");
  print_first(from_bf16(o.d_x));
  print_first(from_bf16(o.d_wkv));
  print_first(from_bf16(o.d_wgate));
  print_first(o.d_ape);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "grad") == 0) return grad();
  if (argc == 2 && std::strcmp(argv[1], "fwd") == 0) return fwd();
  if (argc == 2 && std::strcmp(argv[1], "seed") == 0) return seed();
  std::fprintf(stderr, "usage: %s grad|fwd|seed\n", argv[0]);
  return 2;
}
