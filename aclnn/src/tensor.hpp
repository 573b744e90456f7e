// aclTensor: a strided view into caller memory, and its translation into the
// core's contiguous kvcomp::Tensor.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "aclnn/acl_meta.h"
#include "kvcomp/kvcomp.hpp"

struct aclTensor {
  std::vector<std::int64_t> shape;    // view dims
  std::vector<std::int64_t> strides;  // view strides, in elements
  std::vector<std::int64_t> storage;  // storage dims
  std::int64_t offset = 0;            // of the view's first element, in elements
  aclDataType dtype = ACL_DT_UNDEFINED;
  aclFormat format = ACL_FORMAT_ND;
  void* data = nullptr;  // storage start
};

namespace kvcomp::aclnn {

// The dtype family a parameter takes; words the message for a dtype the core
// cannot represent (the core checks the exact dtype of representable ones).
enum class Expect { io, f32, i32 };

// A live aclTensor of a representable dtype, plain format, rank <= kMaxRank,
// contiguous, as a core view (data = storage start + offset). `name` is the
// parameter's operator-definition name.
Status bind(const char* name, const aclTensor* t, Expect expect, Tensor* out);
// The same, NULL meaning absent.
Status bind_optional(const char* name, const aclTensor* t, Expect expect, std::optional<Tensor>* out);
// The same, except that dim 0 may have any stride (returned in *dim0_stride).
Status bind_strided_dim0(const char* name, const aclTensor* t, Expect expect, Tensor* out,
                         std::int64_t* dim0_stride);

}  // namespace kvcomp::aclnn
