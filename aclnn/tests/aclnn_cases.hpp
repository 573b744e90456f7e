// Test support for the aclnn front door: tensors in host memory (the
// operators take any address) and ready-made valid calls of both operators
// under the NPU's ranges, whose arguments a test can then spoil one at a time.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_compressor.h"
#include "aclnnop/aclnn_compressor_grad.h"
#include "kvcomp/half.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::aclnn_test {

inline std::size_t element_size(aclDataType dt) {
  return dt == ACL_BF16 || dt == ACL_FLOAT16 ? 2 : dt == ACL_INT64 || dt == ACL_DOUBLE ? 8 : 4;
}

inline std::vector<std::int64_t> row_major_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size(), 1);
  for (std::size_t i = shape.size(); i-- > 1;) s[i - 1] = s[i] * shape[i];
  return s;
}

inline std::int64_t count(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Storage bytes plus an aclTensor viewing them; destroys the tensor unless a
// test already did (forget()).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(std::vector<std::int64_t> shape, aclDataType dt)
      : HostTensor(shape, dt, row_major_strides(shape), 0, {count(shape)}) {}
  // A general view: strides and offset in elements, storage of storage_shape.
  HostTensor(std::vector<std::int64_t> shape, aclDataType dt, std::vector<std::int64_t> strides,
             std::int64_t offset, std::vector<std::int64_t> storage_shape)
      : shape_(std::move(shape)), dt_(dt), offset_(offset) {
    bytes_.assign(static_cast<std::size_t>(count(storage_shape)) * element_size(dt), 0);
    // An empty tensor has no storage, as CANN programs create it.
    void* data = bytes_.empty() ? nullptr : bytes_.data();
    tensor_ = aclCreateTensor(shape_.data(), shape_.size(), dt, strides.data(), offset, ACL_FORMAT_ND,
                              storage_shape.data(), storage_shape.size(), data);
    EXPECT_NE(tensor_, nullptr) << aclGetRecentErrMsg();
  }
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;
  HostTensor(HostTensor&& o) noexcept { *this = std::move(o); }
  HostTensor& operator=(HostTensor&& o) noexcept {
    std::swap(shape_, o.shape_);
    std::swap(dt_, o.dt_);
    std::swap(offset_, o.offset_);
    std::swap(bytes_, o.bytes_);
    std::swap(tensor_, o.tensor_);
    return *this;
  }
  ~HostTensor() {
    if (tensor_) aclDestroyTensor(tensor_);
  }

  aclTensor* get() const { return tensor_; }
  void forget() { tensor_ = nullptr; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::vector<unsigned char>& bytes() { return bytes_; }
  // The view's first element (contiguous views only are filled through it).
  template <typename T>
  T* at() {
    return reinterpret_cast<T*>(bytes_.data() + static_cast<std::size_t>(offset_) * element_size(dt_));
  }
  std::size_t view_count() const { return static_cast<std::size_t>(count(shape_)); }

  // Values rounded to the tensor's dtype (contiguous views).
  void fill(const std::vector<float>& v) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (dt_ == ACL_BF16)
        at<std::uint16_t>()[i] = float_to_bf16(v[i]);
      else if (dt_ == ACL_FLOAT16)
        at<std::uint16_t>()[i] = float_to_fp16(v[i]);
      else
        at<float>()[i] = v[i];
    }
  }
  void fill_random(std::mt19937& rng, float scale) {
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(view_count());
    for (float& e : v) e = u(rng);
    fill(v);
  }
  void fill_ints(const std::vector<std::int32_t>& v) {
    std::memcpy(at<std::int32_t>(), v.data(), v.size() * 4);
  }

  // A core view of the same memory (contiguous views only).
  Tensor view() {
    Tensor t;
    t.data = bytes_.empty() ? nullptr : at<unsigned char>();
    t.dtype = dt_ == ACL_BF16      ? DType::bf16
              : dt_ == ACL_FLOAT16 ? DType::f16
              : dt_ == ACL_INT32   ? DType::i32
                                   : DType::f32;
    t.rank = static_cast<int>(shape_.size());
    for (std::size_t i = 0; i < shape_.size(); ++i) t.shape[i] = shape_[i];
    return t;
  }

 private:
  std::vector<std::int64_t> shape_;
  aclDataType dt_ = ACL_FLOAT;
  std::int64_t offset_ = 0;
  std::vector<unsigned char> bytes_;
  aclTensor* tensor_ = nullptr;
};

inline kvcomp::Options aclnn_profile() {
  kvcomp::Options o;
  o.profile = kvcomp::Profile::aclnn;
  return o;
}

// Runs phase one and launches with exactly the size asked for.
template <typename Plan, typename Launch>
aclnnStatus plan_and_launch(Plan plan, Launch launch) {
  std::uint64_t size = 0;
  aclOpExecutor* executor = nullptr;
  if (aclnnStatus s = plan(&size, &executor); s != ACLNN_SUCCESS) return s;
  std::vector<unsigned char> workspace(size);
  return launch(workspace.data(), size, executor, nullptr);
}

// A valid aclnnCompressorGrad call: C4Li (D 128, coff 2, cmp_ratio 4), H 1024,
// bf16; BSH B 1 S 8 start_pos {2}, or TH sequences of 5 and 7 tokens,
// start_pos {3, 0}, seqused {5, 6}.
struct GradCase {
  static constexpr const char* kNames[13] = {"x",     "wkv",        "wgate",   "d_cmp_kv",  "softmax_score",
                                             "kv",    "cu_seqlens", "seqused", "start_pos", "d_x",
                                             "d_wkv", "d_wgate",    "d_ape"};
  std::int64_t B, S, T, H = 1024, D = 128, coff = 2, r = 4;
  bool th;
  HostTensor x, wkv, wgate, d_cmp_kv, softmax_score, kv, cu_seqlens, seqused, start_pos, d_x, d_wkv, d_wgate,
      d_ape;
  std::array<const aclTensor*, 13> args{};  // parameter order, as kNames
  std::int64_t cmp_ratio_attr = 4, coff_attr = 2;

  explicit GradCase(bool th_layout = false, aclDataType io = ACL_BF16) : th(th_layout) {
    std::mt19937 rng(7);
    const std::int64_t C = coff * D, cr = coff * r;
    B = th ? 2 : 1;
    S = 8;
    T = th ? 12 : B * S;
    const std::int64_t rows = th ? std::min(T, T / r + B) : B * ((S + r - 1) / r);
    const std::vector<std::int64_t> x_shape =
        th ? std::vector<std::int64_t>{T, H} : std::vector<std::int64_t>{B, S, H};
    const std::vector<std::int64_t> c_shape =
        th ? std::vector<std::int64_t>{rows, D} : std::vector<std::int64_t>{B, rows, D};
    const std::vector<std::int64_t> s_shape =
        th ? std::vector<std::int64_t>{rows, cr, D} : std::vector<std::int64_t>{B, rows, cr, D};
    x = HostTensor(x_shape, io);
    wkv = HostTensor({C, H}, io);
    wgate = HostTensor({C, H}, io);
    d_cmp_kv = HostTensor(c_shape, io);
    softmax_score = HostTensor(s_shape, ACL_FLOAT);
    kv = HostTensor(s_shape, ACL_FLOAT);
    start_pos = HostTensor({B}, ACL_INT32);
    d_x = HostTensor(x_shape, io);
    d_wkv = HostTensor({C, H}, io);
    d_wgate = HostTensor({C, H}, io);
    d_ape = HostTensor({r, C}, ACL_FLOAT);
    for (HostTensor* t : {&x, &wkv, &wgate, &d_cmp_kv, &softmax_score, &kv}) t->fill_random(rng, 0.5f);
    if (th) {
      cu_seqlens = HostTensor({B + 1}, ACL_INT32);
      seqused = HostTensor({B}, ACL_INT32);
      cu_seqlens.fill_ints({0, 5, 12});
      seqused.fill_ints({5, 6});
      start_pos.fill_ints({3, 0});
    } else {
      start_pos.fill_ints({2});
    }
    args = {x.get(),     wkv.get(),        wgate.get(),   d_cmp_kv.get(),  softmax_score.get(),
            kv.get(),    cu_seqlens.get(), seqused.get(), start_pos.get(), d_x.get(),
            d_wkv.get(), d_wgate.get(),    d_ape.get()};
  }

  aclnnStatus plan(std::uint64_t* size, aclOpExecutor** executor) const {
    return aclnnCompressorGradGetWorkspaceSize(args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                                               args[7], args[8], cmp_ratio_attr, coff_attr, args[9], args[10],
                                               args[11], args[12], size, executor);
  }
  aclnnStatus run() const {
    return plan_and_launch([&](std::uint64_t* s, aclOpExecutor** e) { return plan(s, e); },
                           aclnnCompressorGrad);
  }

  // The same call through the C++ API, into the given outputs.
  kvcomp::BackwardArgs cpp_args(HostTensor& dx, HostTensor& dwkv, HostTensor& dwgate, HostTensor& dape) {
    kvcomp::BackwardArgs a;
    a.x = x.view();
    a.wkv = wkv.view();
    a.wgate = wgate.view();
    a.d_cmp_kv = d_cmp_kv.view();
    a.softmax_score = softmax_score.view();
    a.kv = kv.view();
    if (th) {
      a.cu_seqlens = cu_seqlens.view();
      a.seqused = seqused.view();
    }
    a.start_pos = start_pos.view();
    a.cmp_ratio = r;
    a.coff = coff;
    a.d_x = dx.view();
    a.d_wkv = dwkv.view();
    a.d_wgate = dwgate.view();
    a.d_ape = dape.view();
    return a;
  }
};

// A valid aclnnCompressor call: C4Li, H 1024, bf16, gradEnabled, paged cache
// of 4-token blocks; BSH B 1 S 8 start_pos {2}, or TH sequences of 5 and 7
// tokens, start_pos {3, 0}.
struct ForwardCase {
  static constexpr const char* kNames[12] = {
      "x",          "wkv",     "wgate",     "state_cache", "ape",           "state_block_table",
      "cu_seqlens", "seqused", "start_pos", "cmp_kv",      "softmax_score", "kv"};
  std::int64_t B, S, T, H = 1024, D = 128, coff = 2, r = 4, block_size = 4, block_num;
  bool th;
  HostTensor x, wkv, wgate, state_cache, ape, block_table, cu_seqlens, seqused, start_pos, cmp_kv,
      softmax_score, kv;
  std::array<const aclTensor*, 12> args{};  // parameter order, as kNames
  std::int64_t cmp_ratio_attr = 4, coff_attr = 2, cache_mode = 1, stride_attr = 0;
  bool grad_enabled = true;

  // pad: extra elements after each cache block (a dim-0 stride of
  // block_size * 2C + pad).
  explicit ForwardCase(bool th_layout = false, std::int64_t pad = 0) : th(th_layout) {
    std::mt19937 rng(11);
    const std::int64_t C = coff * D, cr = coff * r;
    B = th ? 2 : 1;
    S = 8;
    T = th ? 12 : B * S;
    block_num = th ? 6 : 4;
    const std::int64_t rows = th ? std::min(T, T / r + B) : B * ((S + r - 1) / r);
    const std::vector<std::int64_t> x_shape =
        th ? std::vector<std::int64_t>{T, H} : std::vector<std::int64_t>{B, S, H};
    x = HostTensor(x_shape, ACL_BF16);
    wkv = HostTensor({C, H}, ACL_BF16);
    wgate = HostTensor({C, H}, ACL_BF16);
    const std::int64_t block = block_size * 2 * C;
    state_cache = HostTensor({block_num, block_size, 2 * C}, ACL_FLOAT, {block + pad, 2 * C, 1}, 0,
                             {block_num * (block + pad)});
    ape = HostTensor({r, C}, ACL_FLOAT);
    block_table = HostTensor({B, 3}, ACL_INT32);
    start_pos = HostTensor({B}, ACL_INT32);
    cmp_kv =
        HostTensor(th ? std::vector<std::int64_t>{rows, D} : std::vector<std::int64_t>{B, rows, D}, ACL_BF16);
    const std::vector<std::int64_t> s_shape =
        th ? std::vector<std::int64_t>{rows, cr, D} : std::vector<std::int64_t>{B, rows, cr, D};
    softmax_score = HostTensor(s_shape, ACL_FLOAT);
    kv = HostTensor(s_shape, ACL_FLOAT);
    for (HostTensor* t : {&x, &wkv, &wgate, &ape}) t->fill_random(rng, 0.5f);
    // Block contents do not depend on pad; the gaps hold a marker.
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto* cache = reinterpret_cast<float*>(state_cache.bytes().data());
    for (std::int64_t b = 0; b < block_num; ++b)
      for (std::int64_t i = 0; i < block + pad; ++i) cache[b * (block + pad) + i] = i < block ? u(rng) : 7.0f;
    if (th) {
      cu_seqlens = HostTensor({B + 1}, ACL_INT32);
      cu_seqlens.fill_ints({0, 5, 12});
      start_pos.fill_ints({3, 0});
      block_table.fill_ints({2, 5, 1, 4, 3, 0});
    } else {
      start_pos.fill_ints({2});
      block_table.fill_ints({1, 3, 2});
    }
    args = {x.get(),         wkv.get(),         wgate.get(),         state_cache.get(),
            ape.get(),       block_table.get(), cu_seqlens.get(),    seqused.get(),
            start_pos.get(), cmp_kv.get(),      softmax_score.get(), kv.get()};
  }

  aclnnStatus plan(std::uint64_t* size, aclOpExecutor** executor) const {
    return aclnnCompressorGetWorkspaceSize(args[0], args[1], args[2], const_cast<aclTensor*>(args[3]),
                                           args[4], args[5], args[6], args[7], args[8], cmp_ratio_attr,
                                           coff_attr, cache_mode, stride_attr, grad_enabled, args[9],
                                           args[10], args[11], size, executor);
  }
  aclnnStatus run() const {
    return plan_and_launch([&](std::uint64_t* s, aclOpExecutor** e) { return plan(s, e); }, aclnnCompressor);
  }
};

// The message of the last failure, read (and so cleared) once.
inline std::string recent_message() {
  const char* m = aclGetRecentErrMsg();
  return m ? m : "";
}

}  // namespace kvcomp::aclnn_test
