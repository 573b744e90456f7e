#include "tensor.hpp"

#include <memory>
#include <string>

#include "registry.hpp"
#include "status.hpp"

namespace kvcomp::aclnn {

namespace {

// Never destroyed: a caller may destroy tensors from its own static destructors.
Registry<aclTensor>& tensors() {
  static auto* registry = new Registry<aclTensor>;
  return *registry;
}

// Bytes per element; 0 for a value outside the aclDataType enum.
std::int64_t element_size(aclDataType dt) {
  switch (dt) {
    case ACL_INT8:
    case ACL_UINT8:
    case ACL_BOOL:
      return 1;
    case ACL_FLOAT16:
    case ACL_BF16:
    case ACL_INT16:
    case ACL_UINT16:
      return 2;
    case ACL_FLOAT:
    case ACL_INT32:
    case ACL_UINT32:
      return 4;
    case ACL_INT64:
    case ACL_UINT64:
    case ACL_DOUBLE:
      return 8;
    default:
      return 0;
  }
}

std::string dtype_label(aclDataType dt) {
  switch (dt) {
    case ACL_FLOAT:
      return "ACL_FLOAT";
    case ACL_FLOAT16:
      return "ACL_FLOAT16";
    case ACL_BF16:
      return "ACL_BF16";
    case ACL_INT8:
      return "ACL_INT8";
    case ACL_INT16:
      return "ACL_INT16";
    case ACL_INT32:
      return "ACL_INT32";
    case ACL_INT64:
      return "ACL_INT64";
    case ACL_UINT8:
      return "ACL_UINT8";
    case ACL_UINT16:
      return "ACL_UINT16";
    case ACL_UINT32:
      return "ACL_UINT32";
    case ACL_UINT64:
      return "ACL_UINT64";
    case ACL_DOUBLE:
      return "ACL_DOUBLE";
    case ACL_BOOL:
      return "ACL_BOOL";
    default:
      return "aclDataType " + std::to_string(static_cast<int>(dt));
  }
}

std::optional<DType> core_dtype(aclDataType dt) {
  switch (dt) {
    case ACL_FLOAT:
      return DType::f32;
    case ACL_FLOAT16:
      return DType::f16;
    case ACL_BF16:
      return DType::bf16;
    case ACL_INT32:
      return DType::i32;
    default:
      return std::nullopt;
  }
}

// Layouts whose memory order is given by the strides alone.
bool plain_format(aclFormat f) {
  return f == ACL_FORMAT_ND || f == ACL_FORMAT_NCHW || f == ACL_FORMAT_NHWC || f == ACL_FORMAT_NC ||
         f == ACL_FORMAT_NCL;
}

std::string list(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s + "]";
}

// Product of dims; nullopt on overflow.
std::optional<std::int64_t> element_count(const std::vector<std::int64_t>& dims) {
  std::int64_t n = 1;
  for (std::int64_t d : dims)
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  return n;
}

Status invalid(const std::string& sentence) { return {StatusCode::invalid_param, "[kvcomp] " + sentence}; }

// The view must stay inside its storage: a bad description is caught here,
// not as an out-of-bounds access inside the operator.
const char* check_description(const aclTensor& t) {
  for (std::int64_t d : t.shape)
    if (d < 0) return "must have non-negative view dims";
  for (std::int64_t s : t.strides)
    if (s < 0) return "must have non-negative strides";
  for (std::int64_t d : t.storage)
    if (d < 0) return "must have non-negative storage dims";
  if (t.offset < 0) return "must have a non-negative storage offset";
  const std::int64_t elem = element_size(t.dtype);
  if (elem == 0) return "must have a dataType of the aclDataType enum";
  const auto view_n = element_count(t.shape);
  const auto storage_n = element_count(t.storage);
  std::int64_t bytes = 0;
  if (!view_n || !storage_n || __builtin_mul_overflow(*storage_n, elem, &bytes))
    return "must have a size that fits in int64";
  if (*view_n == 0) return nullptr;
  std::int64_t last = t.offset;  // element index of the view's last element
  for (std::size_t i = 0; i < t.shape.size(); ++i) {
    std::int64_t step = 0;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.strides[i], &step) ||
        __builtin_add_overflow(last, step, &last))
      return "must have a size that fits in int64";
  }
  if (last >= *storage_n)
    return "must lie inside its storage (offset + sum((dim-1)*stride) < storage elements)";
  return nullptr;
}

// Stands in for the data of an empty view without storage: never read or
// written, but non-null, so the core judges the tensor by its shape (the
// backward reports "must not be empty", 561002) rather than as missing.
unsigned char empty_view_data;

Status bind_view(const char* name, const aclTensor* t, Expect expect, bool strided_dim0, Tensor* out,
                 std::int64_t* dim0_stride) {
  if (!tensors().contains(t))
    return invalid(std::string(name) + " (= " + address(t) +
                   ") must be a live aclTensor from aclCreateTensor, not yet destroyed");
  const auto dt = core_dtype(t->dtype);
  if (!dt) {
    const char* want = expect == Expect::io    ? "ACL_BF16 or ACL_FLOAT16"
                       : expect == Expect::f32 ? "ACL_FLOAT"
                                               : "ACL_INT32";
    return invalid(std::string(name) + " (dtype " + dtype_label(t->dtype) + ") must have dtype " + want);
  }
  if (!plain_format(t->format))
    return invalid(std::string(name) + " (aclFormat " + std::to_string(static_cast<int>(t->format)) +
                   ") must be ACL_FORMAT_ND");
  const auto rank = static_cast<int>(t->shape.size());
  if (rank > kMaxRank)
    return invalid(std::string(name) + " (rank " + std::to_string(rank) +
                   ") must have rank <= " + std::to_string(kMaxRank));
  const std::int64_t n = *element_count(t->shape);  // checked at creation
  if (n > 0) {
    std::vector<std::int64_t> want(t->shape.size());
    std::int64_t stride = 1;
    bool ok = true;
    for (int i = rank - 1; i >= 0; --i) {
      const auto k = static_cast<std::size_t>(i);
      want[k] = stride;
      // A dim of extent 1 is never stepped over, so its stride is irrelevant.
      if (t->shape[k] != 1 && !(strided_dim0 && i == 0) && t->strides[k] != stride) ok = false;
      stride *= t->shape[k];
    }
    if (!ok)
      return invalid(std::string(name) + " (strides " + list(t->strides) + ") must be " +
                     (strided_dim0 ? "contiguous except in dim 0" : "contiguous") + ", i.e. " + list(want) +
                     " for shape " + list(t->shape));
  }
  Tensor v;
  v.dtype = *dt;
  v.rank = rank;
  for (int i = 0; i < rank; ++i) v.shape[static_cast<std::size_t>(i)] = t->shape[static_cast<std::size_t>(i)];
  if (t->data)
    v.data = static_cast<unsigned char*>(t->data) + t->offset * element_size(t->dtype);
  else if (n == 0)
    v.data = &empty_view_data;
  if (dim0_stride) *dim0_stride = rank > 0 ? t->strides[0] : 0;
  *out = v;
  return Status::success();
}

}  // namespace

Status bind(const char* name, const aclTensor* t, Expect expect, Tensor* out) {
  return bind_view(name, t, expect, false, out, nullptr);
}

Status bind_optional(const char* name, const aclTensor* t, Expect expect, std::optional<Tensor>* out) {
  if (!t) {
    out->reset();
    return Status::success();
  }
  Tensor v;
  Status s = bind_view(name, t, expect, false, &v, nullptr);
  if (s.ok()) *out = v;
  return s;
}

Status bind_strided_dim0(const char* name, const aclTensor* t, Expect expect, Tensor* out,
                         std::int64_t* dim0_stride) {
  return bind_view(name, t, expect, true, out, dim0_stride);
}

}  // namespace kvcomp::aclnn

using namespace kvcomp::aclnn;

extern "C" aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType,
                                      const int64_t* stride, int64_t offset, aclFormat format,
                                      const int64_t* storageDims, uint64_t storageDimsNum, void* tensorData) {
  aclTensor* created = nullptr;
  guarded(ACLNN_ERR_RUNTIME_ERROR, [&]() -> int {
    // aclnn tensors have at most 8 dims.
    if (viewDimsNum > 8 || storageDimsNum > 8)
      return fail(ACLNN_ERR_PARAM_INVALID, "viewDimsNum, storageDimsNum (= " + std::to_string(viewDimsNum) +
                                               ", " + std::to_string(storageDimsNum) + ") must be <= 8");
    if (viewDimsNum > 0 && (!viewDims || !stride))
      return fail(ACLNN_ERR_PARAM_NULLPTR, "viewDims and stride must not be null when viewDimsNum > 0");
    if (storageDimsNum > 0 && !storageDims)
      return fail(ACLNN_ERR_PARAM_NULLPTR, "storageDims must not be null when storageDimsNum > 0");
    auto t = std::make_unique<aclTensor>();
    t->shape.assign(viewDims, viewDims + viewDimsNum);
    t->strides.assign(stride, stride + viewDimsNum);
    t->storage.assign(storageDims, storageDims + storageDimsNum);
    t->offset = offset;
    t->dtype = dataType;
    t->format = format;
    t->data = tensorData;
    if (const char* rule = check_description(*t))
      return fail(ACLNN_ERR_PARAM_INVALID, "tensor (shape " + list(t->shape) + ", strides " +
                                               list(t->strides) + ", offset " + std::to_string(offset) +
                                               ", storage " + list(t->storage) + ", " +
                                               dtype_label(dataType) + ") " + rule);
    created = tensors().add(std::move(t));
    return ACLNN_SUCCESS;
  });
  return created;
}

extern "C" aclnnStatus aclDestroyTensor(const aclTensor* tensor) {
  return guarded(ACLNN_ERR_RUNTIME_ERROR, [&]() -> int {
    if (!tensor) return ACLNN_SUCCESS;
    if (!tensors().take(tensor))
      return fail(ACLNN_ERR_PARAM_INVALID,
                  "tensor (= " + address(tensor) +
                      ") must be a live aclTensor (it was destroyed already or never "
                      "created)");
    return ACLNN_SUCCESS;
  });
}
