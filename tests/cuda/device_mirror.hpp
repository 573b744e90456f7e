// Runs a test case's call on the GPU: every tensor of its Args copied to
// device memory (outputs poisoned with all-ones bytes, NaN in every dtype, so
// an element the backend forgets to write fails the checks), the call made,
// and every tensor copied back into the run's host buffers.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <vector>

#include "harness.hpp"

namespace kvcomp::test {

#define KVCOMP_REQUIRE_GPU()                                                                              \
  do {                                                                                                    \
    if (::kvcomp::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device (or driver) on this machine"; \
  } while (0)

class DeviceMirror {
 public:
  DeviceMirror() = default;
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
  ~DeviceMirror() {
    for (const Entry& e : entries_) cudaFree(e.dev);
  }

  // Points t at a device copy of its memory (poisoned instead when poison).
  void move(Tensor& t, bool poison = false) {
    t.device = {DeviceType::cuda, 0};
    const std::size_t bytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype);
    if (!t.data || bytes == 0) return;
    void* dev = nullptr;
    EXPECT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
    if (poison)
      EXPECT_EQ(cudaMemset(dev, 0xff, bytes), cudaSuccess);
    else
      EXPECT_EQ(cudaMemcpy(dev, t.data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    entries_.push_back({t.data, dev, bytes});
    t.data = dev;
  }
  void move(std::optional<Tensor>& t) {
    if (t) move(*t);
  }
  // Every moved tensor's device contents back into its host memory.
  void copy_back() {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (const Entry& e : entries_)
      EXPECT_EQ(cudaMemcpy(e.host, e.dev, e.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  struct Entry {
    void* host;
    void* dev;
    std::size_t bytes;
  };
  std::vector<Entry> entries_;
};

inline void move_sequence(DeviceMirror& m, SequenceArgs& a) {
  m.move(a.x);
  m.move(a.wkv);
  m.move(a.wgate);
  m.move(a.cu_seqlens);
  m.move(a.seqused);
  m.move(a.start_pos);
  m.move(a.epilogue.norm_weight);
  m.move(a.epilogue.rope_cos);
  m.move(a.epilogue.rope_sin);
}

inline void move_forward(DeviceMirror& m, ForwardArgs& a) {
  move_sequence(m, a);
  m.move(a.state_cache);
  m.move(a.ape);
  m.move(a.state_block_table);
  m.move(a.cmp_kv, true);
  m.move(a.softmax_score, true);
  m.move(a.kv, true);
  m.move(a.pooled, true);
}

inline void move_backward(DeviceMirror& m, BackwardArgs& a) {
  move_sequence(m, a);
  m.move(a.d_cmp_kv);
  m.move(a.softmax_score);
  m.move(a.kv);
  m.move(a.d_x, true);
  m.move(a.d_wkv, true);
  m.move(a.d_wgate, true);
  m.move(a.d_ape, true);
  m.move(a.pooled);
  m.move(a.d_norm_weight, true);
}

inline void move_args(DeviceMirror& m, ForwardArgs& a) { move_forward(m, a); }
inline void move_args(DeviceMirror& m, BackwardArgs& a) { move_backward(m, a); }
inline Status call(const ForwardArgs& a, const Options& o) { return compressor_forward(a, o); }
inline Status call(const BackwardArgs& a, const Options& o) { return compressor_backward(a, o); }

// The one-call entry points on the GPU (the default stream); results land in
// the run's host buffers.
template <typename Run>
Status on_gpu(Run& r, const Options& o) {
  auto a = r.args;
  DeviceMirror m;
  move_args(m, a);
  const Status s = call(a, o);
  m.copy_back();
  return s;
}

}  // namespace kvcomp::test
