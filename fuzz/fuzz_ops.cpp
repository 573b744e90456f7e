// libFuzzer target: the aclnn C ABI of both operators (phase one, then the
// launch when phase one succeeds). Each input describes a call: a base that
// is consistent under the aclnn profile (D = 128, H = 1024, small B and S,
// both layouts, both cache modes) so that the kernels are reached, then
// perturbations: null or absent tensors, other dtypes and ranks, dims changed
// by small amounts, and arbitrary values in cu_seqlens / seqused / start_pos
// / the block table. Whatever the call, the library must return a status and
// touch only the memory of the tensors it was given (ASan + UBSan watch).
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_compressor.h"
#include "aclnnop/aclnn_compressor_grad.h"

namespace {

std::size_t elem_size(aclDataType dt) { return dt == ACL_BF16 || dt == ACL_FLOAT16 ? 2 : 4; }

// One tensor: shape, dtype, storage exactly as large as the shape says.
struct Slot {
  std::vector<std::int64_t> shape;
  aclDataType dtype = ACL_FLOAT;
  bool present = true;
  bool null_data = false;
  std::vector<unsigned char> storage;
  aclTensor* handle = nullptr;

  Slot() = default;
  Slot(std::vector<std::int64_t> s, aclDataType dt) : shape(std::move(s)), dtype(dt) {}
  ~Slot() {
    if (handle) aclDestroyTensor(handle);
  }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d < 0 ? 0 : d;
    return n;
  }
  // Builds the aclTensor (contiguous strides); int values drawn by the caller.
  const aclTensor* get() {
    if (!present) return nullptr;
    if (!handle) {
      storage.resize(static_cast<std::size_t>(numel()) * elem_size(dtype));
      std::vector<std::int64_t> strides(shape.size(), 1);
      for (std::size_t i = shape.size(); i-- > 1;)
        strides[i - 1] = strides[i] * (shape[i] < 1 ? 1 : shape[i]);
      handle = aclCreateTensor(shape.data(), shape.size(), dtype, strides.data(), 0, ACL_FORMAT_ND,
                               shape.data(), shape.size(), null_data ? nullptr : storage.data());
    }
    return handle;
  }
  std::int32_t* ints() {
    storage.resize(static_cast<std::size_t>(numel()) * elem_size(dtype));
    return reinterpret_cast<std::int32_t*>(storage.data());
  }
};

constexpr std::int64_t kD = 128, kH = 1024;

// Possibly spoils a slot's description: absent, null data, dtype, rank, a dim.
void perturb(FuzzedDataProvider& fdp, Slot& s) {
  if (!fdp.ConsumeBool()) return;
  switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
      s.present = false;
      break;
    case 1:
      s.null_data = true;
      break;
    case 2: {
      const aclDataType dts[] = {ACL_FLOAT, ACL_FLOAT16, ACL_INT32, ACL_BF16};
      s.dtype = fdp.PickValueInArray(dts);
      break;
    }
    case 3:
      if (!s.shape.empty() && fdp.ConsumeBool())
        s.shape.pop_back();
      else if (s.shape.size() < 5)
        s.shape.push_back(fdp.ConsumeIntegralInRange<std::int64_t>(0, 3));
      break;
    default:
      if (!s.shape.empty()) {
        const std::size_t i = fdp.ConsumeIntegralInRange<std::size_t>(0, s.shape.size() - 1);
        s.shape[i] = std::max<std::int64_t>(0, s.shape[i] + fdp.ConsumeIntegralInRange<std::int64_t>(-2, 2));
      }
      break;
  }
}

// Fills int32 tensor data: usually the consistent values, sometimes anything.
void fill_ints(FuzzedDataProvider& fdp, Slot& s, const std::vector<std::int32_t>& good) {
  if (s.dtype != ACL_INT32) return;  // a perturbed dtype: the storage is not int32
  std::int32_t* p = s.ints();
  const std::size_t n = static_cast<std::size_t>(s.numel());
  const bool wild = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  for (std::size_t i = 0; i < n; ++i) {
    std::int32_t v = i < good.size() ? good[i] : 0;
    if (wild && fdp.ConsumeBool())
      v = fdp.ConsumeBool() ? fdp.ConsumeIntegralInRange<std::int32_t>(-3, 40)
                            : fdp.ConsumeIntegral<std::int32_t>();
    p[i] = v;
  }
}

void fill_floats(FuzzedDataProvider& fdp, Slot& s) {
  // A few fuzz-chosen bytes (NaN, Inf, huge values included), the rest zero.
  const std::size_t n = s.storage.size();
  for (int k = 0; k < 8 && n > 0 && fdp.remaining_bytes() > 0; ++k)
    s.storage[fdp.ConsumeIntegralInRange<std::size_t>(0, n - 1)] = fdp.ConsumeIntegral<unsigned char>();
}

struct Base {
  bool th;
  std::int64_t B, S, coff, r, T;
  std::vector<std::int32_t> cu, seqused, start_pos, lens;
  std::int64_t rows;  // cmp_kv rows (flattened)
};

Base make_base(FuzzedDataProvider& fdp) {
  Base b;
  b.th = fdp.ConsumeBool();
  b.B = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3);
  b.S = fdp.ConsumeIntegralInRange<std::int64_t>(0, 12);
  b.coff = fdp.ConsumeBool() ? 2 : 1;
  b.r = fdp.ConsumeIntegralInRange<std::int64_t>(2, 8);
  b.cu.push_back(0);
  for (std::int64_t i = 0; i < b.B; ++i) {
    const std::int32_t len =
        b.th ? fdp.ConsumeIntegralInRange<std::int32_t>(0, 12) : static_cast<std::int32_t>(b.S);
    b.lens.push_back(len);
    b.cu.push_back(b.cu.back() + len);
    b.seqused.push_back(fdp.ConsumeIntegralInRange<std::int32_t>(0, len));
    b.start_pos.push_back(fdp.ConsumeIntegralInRange<std::int32_t>(0, 20));
  }
  b.T = b.th ? b.cu.back() : b.B * b.S;
  b.rows = b.th ? std::min(b.T, b.T / b.r + b.B) : b.B * ((b.S + b.r - 1) / b.r);
  return b;
}

std::vector<std::int64_t> rows_shape(const Base& b, bool intermediate) {
  std::vector<std::int64_t> s =
      b.th ? std::vector<std::int64_t>{b.rows} : std::vector<std::int64_t>{b.B, (b.S + b.r - 1) / b.r};
  if (intermediate) s.push_back(b.coff * b.r);
  s.push_back(kD);
  return s;
}

void fuzz_grad(FuzzedDataProvider& fdp, const Base& b) {
  const aclDataType io = fdp.ConsumeBool() ? ACL_BF16 : ACL_FLOAT16;
  const std::int64_t C = b.coff * kD;
  const std::vector<std::int64_t> xs =
      b.th ? std::vector<std::int64_t>{b.T, kH} : std::vector<std::int64_t>{b.B, b.S, kH};
  Slot x(xs, io), wkv({C, kH}, io), wgate({C, kH}, io), dcmp(rows_shape(b, false), io),
      sm(rows_shape(b, true), ACL_FLOAT), kv(rows_shape(b, true), ACL_FLOAT), cu({b.B + 1}, ACL_INT32),
      su({b.B}, ACL_INT32), sp({b.B}, ACL_INT32), dx(xs, io), dwkv({C, kH}, io), dwg({C, kH}, io),
      dape({b.r, C}, ACL_FLOAT);
  cu.present = b.th;
  su.present = fdp.ConsumeBool();
  sp.present = fdp.ConsumeBool();
  for (Slot* s : {&x, &wkv, &wgate, &dcmp, &sm, &kv, &cu, &su, &sp, &dx, &dwkv, &dwg, &dape})
    perturb(fdp, *s);
  fill_ints(fdp, cu, b.cu);
  fill_ints(fdp, su, b.seqused);
  fill_ints(fdp, sp, b.start_pos);
  std::int64_t r = b.r, coff = b.coff;
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) r = fdp.ConsumeIntegralInRange<std::int64_t>(-2, 200);
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) coff = fdp.ConsumeIntegralInRange<std::int64_t>(-1, 3);
  std::uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  for (Slot* s : {&x, &wkv, &wgate, &dcmp, &sm, &kv, &cu, &su, &sp, &dx, &dwkv, &dwg, &dape}) s->get();
  for (Slot* s : {&x, &dcmp, &sm, &kv}) fill_floats(fdp, *s);
  const aclnnStatus st = aclnnCompressorGradGetWorkspaceSize(
      x.get(), wkv.get(), wgate.get(), dcmp.get(), sm.get(), kv.get(), cu.get(), su.get(), sp.get(), r, coff,
      dx.get(), dwkv.get(), dwg.get(), dape.get(), &ws, &ex);
  if (st != ACLNN_SUCCESS) return;
  if (ws > (std::uint64_t{1} << 30)) std::abort();  // a workspace far beyond these sizes is a bug
  std::vector<unsigned char> w(ws);
  const std::uint64_t give = fdp.ConsumeIntegralInRange<int>(0, 15) == 0 && ws > 0 ? ws - 1 : ws;
  (void)aclnnCompressorGrad(w.data(), give, ex, nullptr);
}

void fuzz_forward(FuzzedDataProvider& fdp, const Base& b) {
  const aclDataType io = fdp.ConsumeBool() ? ACL_BF16 : ACL_FLOAT16;
  const std::int64_t C = b.coff * kD;
  const std::int64_t mode = fdp.ConsumeIntegralInRange<std::int64_t>(1, 2);
  const std::int64_t bs = 128;  // covers S + start_pos + coff*r in both modes
  const std::int64_t blocks = fdp.ConsumeIntegralInRange<std::int64_t>(1, 4);
  const std::vector<std::int64_t> xs =
      b.th ? std::vector<std::int64_t>{b.T, kH} : std::vector<std::int64_t>{b.B, b.S, kH};
  Slot x(xs, io), wkv({C, kH}, io), wgate({C, kH}, io), cache({blocks, bs, 2 * C}, ACL_FLOAT),
      ape({b.r, C}, ACL_FLOAT),
      table(mode == 1 ? std::vector<std::int64_t>{b.B, 1} : std::vector<std::int64_t>{b.B}, ACL_INT32),
      cu({b.B + 1}, ACL_INT32), su({b.B}, ACL_INT32), sp({b.B}, ACL_INT32), cmp(rows_shape(b, false), io),
      sm(rows_shape(b, true), ACL_FLOAT), kv(rows_shape(b, true), ACL_FLOAT);
  cu.present = b.th;
  su.present = fdp.ConsumeBool();
  sp.present = fdp.ConsumeBool();
  const bool grad = fdp.ConsumeBool();
  for (Slot* s : {&x, &wkv, &wgate, &cache, &ape, &table, &cu, &su, &sp, &cmp, &sm, &kv}) perturb(fdp, *s);
  std::vector<std::int32_t> ids;
  for (std::int64_t i = 0; i < b.B; ++i) ids.push_back(static_cast<std::int32_t>(i % blocks));
  fill_ints(fdp, table, ids);
  fill_ints(fdp, cu, b.cu);
  fill_ints(fdp, su, b.seqused);
  fill_ints(fdp, sp, b.start_pos);
  std::int64_t r = b.r, coff = b.coff, stride0 = 0;
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) r = fdp.ConsumeIntegralInRange<std::int64_t>(-2, 200);
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) coff = fdp.ConsumeIntegralInRange<std::int64_t>(-1, 3);
  std::int64_t cache_mode = mode;
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0)
    cache_mode = fdp.ConsumeIntegralInRange<std::int64_t>(-1, 4);
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0)
    stride0 = fdp.ConsumeIntegralInRange<std::int64_t>(-1, 1 << 20);
  for (Slot* s : {&x, &wkv, &wgate, &cache, &ape, &table, &cu, &su, &sp, &cmp, &sm, &kv}) s->get();
  for (Slot* s : {&x, &cache, &ape}) fill_floats(fdp, *s);
  std::uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  const aclnnStatus st = aclnnCompressorGetWorkspaceSize(
      x.get(), wkv.get(), wgate.get(), const_cast<aclTensor*>(cache.get()), ape.get(), table.get(), cu.get(),
      su.get(), sp.get(), r, coff, cache_mode, stride0, grad, cmp.get(), sm.get(), kv.get(), &ws, &ex);
  if (st != ACLNN_SUCCESS) return;
  if (ws > (std::uint64_t{1} << 30)) std::abort();
  std::vector<unsigned char> w(ws);
  (void)aclnnCompressor(w.data(), ws, ex, nullptr);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const bool forward = fdp.ConsumeBool();
  const Base b = make_base(fdp);
  if (forward)
    fuzz_forward(fdp, b);
  else
    fuzz_grad(fdp, b);
  return 0;
}
