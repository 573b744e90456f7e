// Validation of a call on a device goes through the DeviceAccess the entry points hand it
// (common/device_access.hpp), never through a backend directly: its memory checks, its capture
// check and its host copies of the index tensors. A fake device whose "device memory" is host
// memory shows, with no GPU, that validation asks the access for each, in that order, reads the
// index data only from the copies, and fetches them once per plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "harness.hpp"
#include "validate/validate.hpp"

namespace kvcomp::test {
namespace {

using ::kvcomp::detail::BlockPlan;
using ::kvcomp::detail::DeviceAccess;
using ::kvcomp::detail::IndexCopies;

constexpr Device kCuda0{DeviceType::cuda, 0};

class FakeDevice final : public DeviceAccess {
 public:
  Status memory = Status::success(), capture = Status::success();
  mutable int memory_checks = 0, capture_checks = 0, copies = 0;
  mutable std::vector<std::string> checked;  // the tensor names check_memory saw

  Status check_memory(const NamedTensors& tensors, Device dev) const override {
    ++memory_checks;
    EXPECT_EQ(dev, kCuda0);
    for (const auto& [name, t] : tensors) checked.emplace_back(name);
    return memory;
  }
  Status check_not_capturing(void*) const override {
    ++capture_checks;
    return capture;
  }
  Status copy_index_to_host(const Tensor& t, void*, std::vector<std::int32_t>& out) const override {
    ++copies;
    out.resize(static_cast<std::size_t>(t.numel()));
    if (!out.empty()) std::memcpy(out.data(), t.data, out.size() * sizeof(std::int32_t));
    return Status::success();
  }
};

void tag(Tensor& t) { t.device = kCuda0; }
void tag(std::optional<Tensor>& t) {
  if (t) tag(*t);
}

// A TH forward with every index tensor (cu_seqlens, seqused, start_pos, the block table), "on" cuda:0.
struct DeviceForward {
  RandomCase<double> rc;
  std::unique_ptr<ForwardRun> run;
  ForwardArgs host, dev;
  DeviceForward() {
    RandomOptions o = small_rule_options(true);
    rc = make_random_case(o, 11);
    run = std::make_unique<ForwardRun>(rc.problem, rc.in, DType::bf16);
    host = dev = run->args;
    for (Tensor* t :
         {&dev.x, &dev.wkv, &dev.wgate, &dev.state_cache, &dev.ape, &dev.cmp_kv, &dev.softmax_score, &dev.kv})
      tag(*t);
    for (auto* t : {&dev.state_block_table, &dev.cu_seqlens, &dev.seqused, &dev.start_pos}) tag(*t);
  }
  int index_tensors() const {
    int n = 0;
    for (const auto* t : {&dev.state_block_table, &dev.cu_seqlens, &dev.seqused, &dev.start_pos})
      n += t->has_value();
    return n;
  }
};

void expect_same_plan(const BlockPlan& a, const BlockPlan& b) {
  ASSERT_EQ(a.batches.size(), b.batches.size());
  EXPECT_EQ(a.total_blocks, b.total_blocks);
  for (std::size_t i = 0; i < a.batches.size(); ++i) {
    const auto &x = a.batches[i], &y = b.batches[i];
    EXPECT_EQ(x.base, y.base);
    EXPECT_EQ(x.len, y.len);
    EXPECT_EQ(x.sp, y.sp);
    EXPECT_EQ(x.used, y.used);
    EXPECT_EQ(x.nblocks, y.nblocks);
    EXPECT_EQ(x.out_row, y.out_row);
  }
}

TEST(DeviceAccess, ADeviceCallIsPlannedFromHostCopiesFetchedOnce) {
  DeviceForward f;
  ASSERT_EQ(f.index_tensors(), 4);
  BlockPlan host_plan;
  ASSERT_TRUE(::kvcomp::detail::validate_forward(f.host, {}, &host_plan).ok());

  FakeDevice fake;
  IndexCopies copies;
  BlockPlan plan;
  const Status s = ::kvcomp::detail::validate_forward(f.dev, {}, &plan, &copies, &fake);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(fake.memory_checks, 1);
  EXPECT_EQ(fake.capture_checks, 1);
  EXPECT_EQ(fake.copies, 4);
  EXPECT_TRUE(copies.fetched);
  for (const char* name : {"x", "wkv", "wgate", "state_cache", "ape", "cmp_kv", "state_block_table"})
    EXPECT_NE(std::find(fake.checked.begin(), fake.checked.end(), name), fake.checked.end()) << name;
  expect_same_plan(plan, host_plan);

  // Execute re-validates from the copies: the "device" data changing in between is not read again.
  auto* start_pos = static_cast<std::int32_t*>(f.dev.start_pos->data);
  const std::int32_t was = start_pos[0];
  start_pos[0] = -5;  // would be refused if it were read
  BlockPlan again;
  const Status s2 = ::kvcomp::detail::validate_forward(f.dev, {}, &again, &copies, &fake);
  start_pos[0] = was;
  ASSERT_TRUE(s2.ok()) << s2.message;
  EXPECT_EQ(fake.copies, 4);
  EXPECT_EQ(fake.capture_checks, 1);
  EXPECT_EQ(fake.memory_checks, 2);
  expect_same_plan(again, host_plan);
}

TEST(DeviceAccess, TheAccessRefusalsAreTheCallsStatus) {
  DeviceForward f;
  BlockPlan plan;
  {
    FakeDevice fake;
    fake.memory = {StatusCode::invalid_param, "[kvcomp] fake memory refusal"};
    IndexCopies copies;
    const Status s = ::kvcomp::detail::validate_forward(f.dev, {}, &plan, &copies, &fake);
    EXPECT_EQ(s.code, StatusCode::invalid_param);
    EXPECT_EQ(s.message, "[kvcomp] fake memory refusal");
    EXPECT_EQ(fake.copies, 0);  // refused before any index data is read
  }
  {
    FakeDevice fake;
    fake.capture = {StatusCode::invalid_param, "[kvcomp] fake capture refusal"};
    IndexCopies copies;
    const Status s = ::kvcomp::detail::validate_forward(f.dev, {}, &plan, &copies, &fake);
    EXPECT_EQ(s.message, "[kvcomp] fake capture refusal");
    EXPECT_EQ(fake.copies, 0);
    EXPECT_FALSE(copies.fetched);
  }
  {
    FakeDevice fake;  // no place for the copies: a device call must come through a plan
    const Status s = ::kvcomp::detail::validate_forward(f.dev, {}, &plan, nullptr, &fake);
    EXPECT_EQ(s.message, "[kvcomp] x (= on cuda:0) must be planned by kvcomp");
    EXPECT_EQ(fake.copies, 0);
  }
}

TEST(DeviceAccess, WithoutAnAccessADeviceCallIsThisBuildsLimit) {
  DeviceForward f;
  BlockPlan plan;
  IndexCopies copies;
  const Status s = ::kvcomp::detail::validate_forward(f.dev, {}, &plan, &copies, nullptr);
  EXPECT_EQ(s.code, StatusCode::invalid_param);
  EXPECT_EQ(
      s.message,
      "[kvcomp] x (= on cuda:0) must be in host memory: this build of kvcomp has no CUDA backend (configure "
      "it with -DKVCOMP_CUDA=ON and a CUDA 13 toolkit)");
  EXPECT_FALSE(copies.fetched);
}

TEST(DeviceAccess, TheBackwardAsksTheSameAccess) {
  RandomOptions o = small_rule_options(true);
  auto rc = make_random_case(o, 12);
  round_io_inputs(rc.in, DType::bf16);
  const BackwardData bd = make_backward_data(rc.problem, rc.in, DType::bf16, 13);
  BackwardRun run(rc.problem, rc.in, bd, DType::bf16);
  BackwardArgs dev = run.args;
  for (Tensor* t : {&dev.x, &dev.wkv, &dev.wgate, &dev.d_cmp_kv, &dev.softmax_score, &dev.kv, &dev.d_x,
                    &dev.d_wkv, &dev.d_wgate, &dev.d_ape})
    tag(*t);
  for (auto* t : {&dev.cu_seqlens, &dev.seqused, &dev.start_pos}) tag(*t);
  BlockPlan host_plan, plan;
  ASSERT_TRUE(::kvcomp::detail::validate_backward(run.args, {}, &host_plan).ok());
  FakeDevice fake;
  IndexCopies copies;
  const Status s = ::kvcomp::detail::validate_backward(dev, {}, &plan, &copies, &fake);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(fake.memory_checks, 1);
  EXPECT_EQ(fake.copies, 3);
  for (const char* name :
       {"d_cmp_kv", "softmax_score", "kv", "d_x", "d_wkv", "d_wgate", "d_ape", "cu_seqlens"})
    EXPECT_NE(std::find(fake.checked.begin(), fake.checked.end(), name), fake.checked.end()) << name;
  expect_same_plan(plan, host_plan);
}

}  // namespace
}  // namespace kvcomp::test
