#include "cuda/staging.hpp"

#include <cuda_runtime.h>

#include <string>

namespace kvcomp::staging {

namespace {

Status failed(const char* what, cudaError_t e) {
  return {StatusCode::runtime_error, std::string("[kvcomp] ") + what + " (= " + cudaGetErrorName(e) + ": " +
                                         cudaGetErrorString(e) + ") must succeed"};
}

}  // namespace

DeviceCopies::~DeviceCopies() {
  if (cudaSetDevice(device_.index) != cudaSuccess) return;
  for (const Entry& e : entries_) cudaFree(e.dev);
}

Status DeviceCopies::move(Tensor& t) {
  t.device = device_;
  const std::size_t bytes = t.numel() > 0 ? static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype) : 0;
  if (!t.data || bytes == 0) return Status::success();
  for (const Entry& e : entries_)  // a tensor shared by two calls (the backward reads the forward's outputs)
    if (e.host == t.data && e.bytes == bytes) {
      t.data = e.dev;
      return Status::success();
    }
  if (cudaError_t e = cudaSetDevice(device_.index); e != cudaSuccess) return failed("cudaSetDevice", e);
  void* dev = nullptr;
  if (cudaError_t e = cudaMalloc(&dev, bytes); e != cudaSuccess) return failed("allocating a device copy", e);
  entries_.push_back({t.data, dev, bytes});
  if (cudaError_t e = cudaMemcpy(dev, t.data, bytes, cudaMemcpyHostToDevice); e != cudaSuccess)
    return failed("copying a tensor to the device", e);
  t.data = dev;
  return Status::success();
}

Status DeviceCopies::move_sequence(SequenceArgs& a) {
  for (Tensor* t : {&a.x, &a.wkv, &a.wgate})
    if (auto s = move(*t); !s.ok()) return s;
  for (std::optional<Tensor>* t : {&a.cu_seqlens, &a.seqused, &a.start_pos})
    if (auto s = move(*t); !s.ok()) return s;
  return Status::success();
}

Status DeviceCopies::stage(ForwardArgs& a) {
  if (auto s = move_sequence(a); !s.ok()) return s;
  if (auto s = move(a.state_block_table); !s.ok()) return s;
  for (Tensor* t : {&a.state_cache, &a.ape, &a.cmp_kv, &a.softmax_score, &a.kv})
    if (auto s = move(*t); !s.ok()) return s;
  return Status::success();
}

Status DeviceCopies::stage(BackwardArgs& a) {
  if (auto s = move_sequence(a); !s.ok()) return s;
  for (Tensor* t : {&a.d_cmp_kv, &a.softmax_score, &a.kv, &a.d_x, &a.d_wkv, &a.d_wgate, &a.d_ape})
    if (auto s = move(*t); !s.ok()) return s;
  return Status::success();
}

Status DeviceCopies::synchronize() {
  if (cudaError_t e = cudaSetDevice(device_.index); e != cudaSuccess) return failed("cudaSetDevice", e);
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return failed("running on the device", e);
  return Status::success();
}

Status DeviceCopies::copy_back() {
  if (auto s = synchronize(); !s.ok()) return s;
  for (const Entry& e : entries_)
    if (cudaError_t err = cudaMemcpy(e.host, e.dev, e.bytes, cudaMemcpyDeviceToHost); err != cudaSuccess)
      return failed("copying a tensor back to the host", err);
  return Status::success();
}

}  // namespace kvcomp::staging
