// The device rule: every tensor of a call on the device of x, checked before
// any data is read, with one sentence for a mix of host memory and a CUDA
// device; a device this build cannot run on is refused in its own sentence.
// Tensors tagged as CUDA memory point at addresses that fault when touched,
// so a check that read them would crash the test rather than pass it.
#include <gtest/gtest.h>

#include <string>

#include "harness.hpp"

namespace kvcomp::test {
namespace {

RandomOptions small() { return small_rule_options(false); }

constexpr Device kCuda0{DeviceType::cuda, 0};
constexpr Device kCuda1{DeviceType::cuda, 1};

// Moves a view "to" a device: tagged, and pointing at memory no host access may touch (page 0).
void to_device(Tensor& t, Device d) {
  t.device = d;
  t.data = reinterpret_cast<void*>(std::uintptr_t{64});
}
void to_device(std::optional<Tensor>& t, Device d) {
  if (t) to_device(*t, d);
}

void expect_invalid(const Status& s, const std::string& says) {
  EXPECT_EQ(s.code, StatusCode::invalid_param) << s.message;
  EXPECT_EQ(s.message, "[kvcomp] " + says);
}

const std::string kMix = ": a call's tensors are all in host memory or all on one CUDA device";

// Why a call whose tensors all claim device `index` is refused: no CUDA
// backend; no such device; or (a device that exists) pointers that are not
// its memory, as the fake addresses here are.
std::string refused(int index) {
  const std::string dev = "cuda:" + std::to_string(index);
  if (!has_cuda_backend())
    return "x (= on " + dev +
           ") must be in host memory: this build of kvcomp has no CUDA backend (configure it with "
           "-DKVCOMP_CUDA=ON and a CUDA 13 toolkit)";
  if (index >= cuda_device_count())
    return "x (= on " + dev + ") must be on a CUDA device of this machine (it has " +
           std::to_string(cuda_device_count()) + ")";
  return "x (= a host pointer) must point to memory on " + dev + ", the device its tensor names" + kMix;
}

struct Forward {
  RandomCase<double> rc = make_random_case(small(), 3);
  std::unique_ptr<ForwardRun> run;
  Forward() {
    round_io_inputs(rc.in, DType::bf16);
    run = std::make_unique<ForwardRun>(rc.problem, rc.in, DType::bf16);
  }
  // Every tensor of the call on d.
  ForwardArgs on(Device d) {
    ForwardArgs a = run->args;
    for (Tensor* t : {&a.x, &a.wkv, &a.wgate, &a.state_cache, &a.ape, &a.cmp_kv, &a.softmax_score, &a.kv})
      to_device(*t, d);
    to_device(a.state_block_table, d);
    to_device(a.cu_seqlens, d);
    to_device(a.seqused, d);
    to_device(a.start_pos, d);
    return a;
  }
};

struct Backward {
  RandomCase<double> rc = make_random_case(small(), 4);
  BackwardData bd;
  std::unique_ptr<BackwardRun> run;
  Backward() {
    round_io_inputs(rc.in, DType::bf16);
    bd = make_backward_data(rc.problem, rc.in, DType::bf16, 5);
    run = std::make_unique<BackwardRun>(rc.problem, rc.in, bd, DType::bf16);
  }
  BackwardArgs on(Device d) {
    BackwardArgs a = run->args;
    for (Tensor* t : {&a.x, &a.wkv, &a.wgate, &a.d_cmp_kv, &a.softmax_score, &a.kv, &a.d_x, &a.d_wkv,
                      &a.d_wgate, &a.d_ape})
      to_device(*t, d);
    to_device(a.cu_seqlens, d);
    to_device(a.seqused, d);
    to_device(a.start_pos, d);
    return a;
  }
};

TEST(Devices, NamesAreCpuAndCudaIndex) {
  EXPECT_EQ(device_name(Device{}), "cpu");
  EXPECT_EQ(device_name(kCuda1), "cuda:1");
  EXPECT_EQ(Tensor().device, Device{});  // host memory unless set
}

TEST(Devices, HostTensorInADeviceCallIsRefusedBeforeAnyRead) {
  Forward f;
  ForwardArgs a = f.on(kCuda0);
  a.state_cache = f.run->args.state_cache;  // real host memory
  const auto cache_before = f.run->cache.f32;
  expect_invalid(compressor_forward(a),
                 "state_cache (= host memory) must be on the same device as x (cuda:0)" + kMix);
  EXPECT_EQ(f.run->cache.f32, cache_before);

  Backward b;
  BackwardArgs g = b.on(kCuda0);
  g.d_ape = b.run->args.d_ape;
  BackwardPlan plan;
  expect_invalid(plan_backward(g, {}, &plan),
                 "d_ape (= host memory) must be on the same device as x (cuda:0)" + kMix);
}

TEST(Devices, DeviceTensorInAHostCallIsRefusedBeforeAnyRead) {
  Forward f;
  ForwardArgs a = f.run->args;
  to_device(a.start_pos, kCuda0);  // an index tensor: the data checks would read it first
  const auto cache_before = f.run->cache.f32;
  const auto out_before = f.run->cmp_kv.half;
  expect_invalid(compressor_forward(a),
                 "start_pos (= on cuda:0) must be on the same device as x (cpu)" + kMix);
  EXPECT_EQ(f.run->cache.f32, cache_before);
  EXPECT_EQ(f.run->cmp_kv.half, out_before);

  Backward b;
  BackwardArgs g = b.run->args;
  to_device(g.wgate, kCuda1);
  const auto dx_before = b.run->d_x.half;
  expect_invalid(compressor_backward(g), "wgate (= on cuda:1) must be on the same device as x (cpu)" + kMix);
  EXPECT_EQ(b.run->d_x.half, dx_before);
}

TEST(Devices, TwoCudaDevicesInOneCallAreRefused) {
  Forward f;
  ForwardArgs a = f.on(kCuda0);
  to_device(a.ape, kCuda1);
  expect_invalid(compressor_forward(a), "ape (= on cuda:1) must be on the same device as x (cuda:0)");
}

TEST(Devices, SavedOutputsCountOnlyWhenTheyAreWritten) {
  // Without grad_enabled and without storage, softmax_score / kv are not part of the call.
  Forward f;
  ForwardArgs a = f.run->args;
  a.grad_enabled = false;
  a.softmax_score = Tensor();
  a.kv = Tensor();
  a.softmax_score.device = kCuda0;
  EXPECT_TRUE(compressor_forward(a).ok());
  a.grad_enabled = true;
  a.softmax_score = f.run->args.softmax_score;
  a.kv = f.run->args.kv;
  to_device(a.kv, kCuda0);
  expect_invalid(compressor_forward(a), "kv (= on cuda:0) must be on the same device as x (cpu)" + kMix);
}

TEST(Devices, ACallOnACudaDeviceNeedsTheBackendTheDeviceAndItsMemory) {
  Forward f;
  expect_invalid(compressor_forward(f.on(kCuda0)), refused(0));
  Backward b;
  BackwardPlan plan;
  expect_invalid(plan_backward(b.on(kCuda1), {}, &plan), refused(1));
  if (!has_cuda_backend()) {
    EXPECT_EQ(cuda_device_count(), 0);
  }
}

}  // namespace
}  // namespace kvcomp::test
