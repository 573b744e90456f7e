// The model-level epilogue's inputs (kvcomp.hpp's Epilogue) as both backends' kernels read them: plain
// pointers and sizes, no optionals, so the CUDA kernels can take it by value.
#pragma once

#include <cstdint>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

struct EpilogueView {
  const void* norm_weight = nullptr;  // [D], norm_dtype; null: no RMSNorm
  DType norm_dtype = DType::f32;
  float eps = 0.0f;
  const float* cos = nullptr;  // [positions, pairs]; null: no RoPE
  const float* sin = nullptr;
  std::int64_t pairs = 0;  // rd / 2
  bool any() const { return norm_weight || cos; }
};

inline EpilogueView epilogue_view(const Epilogue& e) {
  EpilogueView v;
  if (e.norm_weight) {
    v.norm_weight = e.norm_weight->data;
    v.norm_dtype = e.norm_weight->dtype;
    v.eps = e.norm_eps;
  }
  if (e.rope_cos && e.rope_sin) {
    v.cos = static_cast<const float*>(e.rope_cos->data);
    v.sin = static_cast<const float*>(e.rope_sin->data);
    v.pairs = e.rope_cos->dim(1);
  }
  return v;
}

}  // namespace kvcomp::detail
