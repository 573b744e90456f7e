// How the backward stages d_new (d_new_kv | d_new_score, the gradient of the projections) for its two
// matrix products, d_x = d_new . [wkv ; wgate] and [d_wkv ; d_wgate] = d_new^T . x. One choice per call,
// made when the call is planned (each backend's plan_backward) from the precision mode, the io dtype
// and the products the backend runs, and passed down to its kernels; both backends name it alike.
#pragma once

namespace kvcomp::detail {

enum class BackwardPath {
  f32,          // d_new in fp32, fp32 products (precise; fp32 io)
  f32_rounded,  // d_new rounded to the io dtype, kept in fp32, fp32 products (npu_parity without
                // 16-bit products)
  parity16,     // d_new rounded to the io dtype, one 16-bit product each (npu_parity: the NPU's arithmetic)
  precise16,    // d_new as a high and a low 16-bit part, two 16-bit products each (or one of twice the K)
};

// d_new is rounded to the io dtype before the products (the NPU's staging).
inline bool rounds_dnew(BackwardPath p) {
  return p == BackwardPath::f32_rounded || p == BackwardPath::parity16;
}
// The products take 16-bit operands (d_new's parts, the weights, x).
inline bool products_16bit(BackwardPath p) {
  return p == BackwardPath::parity16 || p == BackwardPath::precise16;
}
// 16-bit parts of d_new: 1 or 2 (0 for the fp32 paths).
inline int dnew_parts(BackwardPath p) {
  return p == BackwardPath::precise16 ? 2 : p == BackwardPath::parity16 ? 1 : 0;
}
inline const char* backward_path_name(BackwardPath p) {
  switch (p) {
    case BackwardPath::f32:
      return "f32";
    case BackwardPath::f32_rounded:
      return "f32, d_new rounded to the io dtype";
    case BackwardPath::parity16:
      return "16-bit, d_new rounded to the io dtype";
    case BackwardPath::precise16:
      return "16-bit, d_new as hi + lo parts";
  }
  return "unknown";
}

}  // namespace kvcomp::detail
