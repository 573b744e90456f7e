// kvcomp._C: the Python front door of the C++ core (include/kvcomp/kvcomp.hpp).
//
// Tensors arrive as nanobind ndarrays, i.e. through DLPack (torch tensors) or
// the buffer protocol (numpy arrays), so this module never links libtorch and
// works with any PyTorch release that speaks DLPack. Outputs are allocated by
// the Python layer (kvcomp/_functional.py), which knows the array kind the
// caller wants back; here we only map views onto kvcomp::Tensor, call the core
// with the GIL released, and turn a non-ok Status into kvcomp.KvcompError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "kvcomp/kvcomp.hpp"

namespace nb = nanobind;

namespace {

// Carries a core Status (or a front-door check written in the same sentence
// style) to the exception translator below.
struct StatusError : std::runtime_error {
  int code;
  StatusError(int c, const std::string& msg) : std::runtime_error(msg), code(c) {}
};

[[noreturn]] void fail(kvcomp::StatusCode code, const std::string& msg) {
  throw StatusError(static_cast<int>(code), msg);
}

// Read-only inputs accept read-only numpy arrays too; outputs must be writable.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

std::string dtype_str(const nb::dlpack::dtype& dt) {
  static const char* const kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  std::string s = dt.code < 7 ? kinds[dt.code] : "code" + std::to_string(dt.code);
  s += std::to_string(dt.bits);
  if (dt.lanes != 1) s += "x" + std::to_string(dt.lanes);
  return s;
}

kvcomp::DType to_dtype(const nb::dlpack::dtype& dt, const char* name) {
  const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
  if (dt.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Float && dt.bits == 32) return kvcomp::DType::f32;
    if (code == nb::dlpack::dtype_code::Float && dt.bits == 16) return kvcomp::DType::f16;
    if (code == nb::dlpack::dtype_code::Bfloat && dt.bits == 16) return kvcomp::DType::bf16;
    if (code == nb::dlpack::dtype_code::Int && dt.bits == 32) return kvcomp::DType::i32;
  }
  // The core's own dtype rules (which tensor takes which) come after this
  // check; here only dtypes it has no name for are refused.
  fail(kvcomp::StatusCode::invalid_param, std::string("[kvcomp] ") + name + " (= dtype " + dtype_str(dt) +
                                              ") must be bfloat16, float16 or float32 (int32 for index "
                                              "tensors)");
}

// Maps an ndarray onto a core view. Every dimension must be row-major
// contiguous except dim 0 when `allow_strided_dim0` (the state cache: the
// core takes its dim-0 stride as an attribute, like the NPU op); that stride
// is returned through `stride0`.
template <typename Array>
kvcomp::Tensor view(const Array& a, const char* name, bool allow_strided_dim0 = false,
                    std::int64_t* stride0 = nullptr) {
  // Host memory or one CUDA device; the core's device rule then checks that a
  // call's tensors agree and that this build runs on that device. DLPack's
  // CUDA host (pinned) memory is host memory.
  kvcomp::Device device;
  if (a.device_type() == nb::device::cuda::value) {
    device = {kvcomp::DeviceType::cuda, static_cast<int>(a.device_id())};
  } else if (a.device_type() != nb::device::cpu::value && a.device_type() != nb::device::cuda_host::value) {
    fail(kvcomp::StatusCode::invalid_param, std::string("[kvcomp] ") + name + " (= a tensor on device type " +
                                                std::to_string(a.device_type()) +
                                                ") must be in host memory or on a CUDA device");
  }
  if (a.ndim() > static_cast<std::size_t>(kvcomp::kMaxRank)) {
    fail(kvcomp::StatusCode::invalid_param, std::string("[kvcomp] ") + name + " (= rank " +
                                                std::to_string(a.ndim()) + ") must have rank at most " +
                                                std::to_string(kvcomp::kMaxRank));
  }
  kvcomp::Tensor t;
  t.device = device;
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = to_dtype(a.dtype(), name);
  t.rank = static_cast<int>(a.ndim());
  // Size-1 dimensions may carry any stride (PyTorch leaves them arbitrary),
  // so only dimensions longer than one are checked; an empty array has no
  // element to reach, so none of its strides matters (the core then judges
  // its shape, e.g. cmp_kv of width 0 because coff = 0).
  const bool empty = a.size() == 0;
  std::int64_t expected = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    const auto ui = static_cast<std::size_t>(i);
    const auto extent = static_cast<std::int64_t>(a.shape(ui));
    t.shape[ui] = extent;
    const bool strided_ok = allow_strided_dim0 && i == 0;
    if (!empty && extent > 1 && a.stride(ui) != expected && !strided_ok) {
      fail(kvcomp::StatusCode::invalid_param, std::string("[kvcomp] ") + name + " (= stride " +
                                                  std::to_string(a.stride(ui)) + " in dim " +
                                                  std::to_string(i) + ") must be row-major contiguous");
    }
    expected *= extent;
  }
  // An empty array may come with a null data pointer (DLPack allows it); the core would report that
  // as a missing tensor (161001) rather than an empty one, so give it a valid address it never reads.
  if (t.data == nullptr && t.numel() == 0) {
    static std::max_align_t empty_placeholder;
    t.data = &empty_placeholder;
  }
  if (stride0 != nullptr) {
    // A strided dim 0 must not overlap the rows below it.
    const std::int64_t inner = t.rank > 0 && t.shape[0] > 0 ? expected / t.shape[0] : 0;
    *stride0 = t.rank > 0 && t.shape[0] > 1 ? a.stride(0) : inner;
    if (t.rank > 0 && t.shape[0] > 1 && *stride0 < inner) {
      fail(kvcomp::StatusCode::invalid_param,
           std::string("[kvcomp] ") + name + " (= stride " + std::to_string(*stride0) +
               " in dim 0) must be at least the size of one block (" + std::to_string(inner) + ")");
    }
  }
  return t;
}

std::optional<kvcomp::Tensor> view_opt(const std::optional<InArray>& a, const char* name) {
  if (!a) return std::nullopt;
  return view(*a, name);
}

kvcomp::Options make_options(const std::string& profile, const std::string& precision, int num_threads,
                             std::uintptr_t stream, bool row_stable = true) {
  kvcomp::Options o;
  o.row_stable = row_stable;
  o.stream = reinterpret_cast<void*>(stream);  // CUDA tensors: the caller's stream (torch's current one)
  if (profile == "extended") {
    o.profile = kvcomp::Profile::extended;
  } else if (profile == "aclnn") {
    o.profile = kvcomp::Profile::aclnn;
  } else {
    fail(kvcomp::StatusCode::invalid_param,
         "[kvcomp] profile (= \"" + profile + "\") must be \"extended\" or \"aclnn\"");
  }
  if (precision == "precise") {
    o.precision = kvcomp::Precision::precise;
  } else if (precision == "npu_parity") {
    o.precision = kvcomp::Precision::npu_parity;
  } else {
    fail(kvcomp::StatusCode::invalid_param,
         "[kvcomp] precision (= \"" + precision + "\") must be \"precise\" or \"npu_parity\"");
  }
  if (num_threads < 0) {
    fail(kvcomp::StatusCode::invalid_param,
         "[kvcomp] num_threads (= " + std::to_string(num_threads) + ") must be >= 0 (0: OpenMP default)");
  }
  o.num_threads = num_threads;
  return o;
}

void check(const kvcomp::Status& s) {
  if (!s.ok()) throw StatusError(s.value(), s.message);
}

// A prepared-weights blob (kvcomp.prepare_weights): contiguous 1-D uint8 in host memory.
template <typename Array>
std::pair<void*, std::size_t> blob_view(const Array& a, const char* name) {
  const auto dt = a.dtype();
  const bool bytes =
      static_cast<nb::dlpack::dtype_code>(dt.code) == nb::dlpack::dtype_code::UInt && dt.bits == 8;
  if (a.device_type() != nb::device::cpu::value || !bytes || a.ndim() != 1 ||
      (a.shape(0) > 1 && a.stride(0) != 1))
    fail(kvcomp::StatusCode::invalid_param,
         std::string("[kvcomp] ") + name + " (= dtype " + dtype_str(dt) + ", rank " +
             std::to_string(a.ndim()) +
             ") must be the contiguous host uint8 array of kvcomp.prepare_weights");
  return {const_cast<void*>(static_cast<const void*>(a.data())), a.shape(0)};
}

std::size_t prepared_weights_size(const InArray& wkv, const InArray& wgate) {
  std::size_t bytes = 0;
  check(kvcomp::prepared_weights_size(view(wkv, "wkv"), view(wgate, "wgate"), &bytes));
  return bytes;
}

void prepare_weights(const InArray& wkv, const InArray& wgate, const OutArray& blob, int num_threads) {
  const auto [data, bytes] = blob_view(blob, "blob");
  const kvcomp::Tensor k = view(wkv, "wkv"), g = view(wgate, "wgate");
  kvcomp::Options o = make_options("extended", "precise", num_threads, 0);
  kvcomp::Status s;
  {
    nb::gil_scoped_release release;
    s = kvcomp::prepare_weights(k, g, data, bytes, o);
  }
  check(s);
}

// The epilogue's inputs (kvcomp::Epilogue); any may be None.
kvcomp::Epilogue epilogue(const std::optional<InArray>& norm_weight, float norm_eps,
                          const std::optional<InArray>& rope_cos, const std::optional<InArray>& rope_sin) {
  kvcomp::Epilogue e;
  e.norm_weight = view_opt(norm_weight, "norm_weight");
  e.norm_eps = norm_eps;
  e.rope_cos = view_opt(rope_cos, "rope_cos");
  e.rope_sin = view_opt(rope_sin, "rope_sin");
  return e;
}

void forward(const InArray& x, const InArray& wkv, const std::optional<InArray>& wgate,
             const OutArray& state_cache, const std::optional<InArray>& ape,
             const std::optional<InArray>& state_block_table, const std::optional<InArray>& cu_seqlens,
             const std::optional<InArray>& seqused, const std::optional<InArray>& start_pos,
             std::int64_t cmp_ratio, std::int64_t coff, std::int64_t cache_mode, const OutArray& cmp_kv,
             const std::optional<OutArray>& softmax_score, const std::optional<OutArray>& kv,
             const std::string& profile, const std::string& precision, int num_threads, std::uintptr_t stream,
             const std::optional<InArray>& prepared_weights, bool row_stable,
             const std::optional<InArray>& norm_weight, float norm_eps,
             const std::optional<InArray>& rope_cos, const std::optional<InArray>& rope_sin,
             const std::optional<OutArray>& pooled) {
  const kvcomp::Options options = make_options(profile, precision, num_threads, stream, row_stable);
  kvcomp::ForwardArgs a;
  if (prepared_weights)
    std::tie(a.prepared_weights, a.prepared_weights_bytes) = blob_view(*prepared_weights, "prepared_weights");
  a.x = view(x, "x");
  a.wkv = view(wkv, "wkv");
  if (wgate) a.wgate = view(*wgate, "wgate");  // None: no gate projection (cmp_ratio 1, coff 1)
  a.state_cache = view(state_cache, "state_cache", /*allow_strided_dim0=*/true, &a.state_cache_stride0);
  if (ape) a.ape = view(*ape, "ape");  // None: no APE term
  a.epilogue = epilogue(norm_weight, norm_eps, rope_cos, rope_sin);
  if (pooled) a.pooled = view(*pooled, "pooled");
  a.state_block_table = view_opt(state_block_table, "state_block_table");
  a.cu_seqlens = view_opt(cu_seqlens, "cu_seqlens");
  a.seqused = view_opt(seqused, "seqused");
  a.start_pos = view_opt(start_pos, "start_pos");
  a.cmp_ratio = cmp_ratio;
  a.coff = coff;
  a.cache_mode = cache_mode;
  a.cmp_kv = view(cmp_kv, "cmp_kv");
  // The intermediates are exported exactly when the caller provides both.
  a.grad_enabled = softmax_score.has_value() && kv.has_value();
  if (softmax_score.has_value() != kv.has_value()) {
    fail(kvcomp::StatusCode::null_pointer,
         "[kvcomp] softmax_score and kv (= only one given) must both be given or both be None");
  }
  if (a.grad_enabled) {
    a.softmax_score = view(*softmax_score, "softmax_score");
    a.kv = view(*kv, "kv");
  }
  kvcomp::Status s;
  {
    nb::gil_scoped_release release;
    s = kvcomp::compressor_forward(a, options);
  }
  check(s);
}

void backward(const InArray& x, const InArray& wkv, const std::optional<InArray>& wgate,
              const InArray& d_cmp_kv, const InArray& softmax_score, const InArray& kv,
              const std::optional<InArray>& cu_seqlens, const std::optional<InArray>& seqused,
              const std::optional<InArray>& start_pos, std::int64_t cmp_ratio, std::int64_t coff,
              const OutArray& d_x, const OutArray& d_wkv, const std::optional<OutArray>& d_wgate,
              const std::optional<OutArray>& d_ape, const std::string& profile, const std::string& precision,
              int num_threads, std::uintptr_t stream, bool row_stable,
              const std::optional<InArray>& norm_weight, float norm_eps,
              const std::optional<InArray>& rope_cos, const std::optional<InArray>& rope_sin,
              const std::optional<InArray>& pooled, const std::optional<OutArray>& d_norm_weight) {
  const kvcomp::Options options = make_options(profile, precision, num_threads, stream, row_stable);
  kvcomp::BackwardArgs a;
  a.x = view(x, "x");
  a.wkv = view(wkv, "wkv");
  if (wgate) a.wgate = view(*wgate, "wgate");  // None: a call without a gate projection
  a.d_cmp_kv = view(d_cmp_kv, "d_cmp_kv");
  a.softmax_score = view(softmax_score, "softmax_score");
  a.kv = view(kv, "kv");
  a.cu_seqlens = view_opt(cu_seqlens, "cu_seqlens");
  a.seqused = view_opt(seqused, "seqused");
  a.start_pos = view_opt(start_pos, "start_pos");
  a.cmp_ratio = cmp_ratio;
  a.coff = coff;
  a.d_x = view(d_x, "d_x");
  a.d_wkv = view(d_wkv, "d_wkv");
  if (d_wgate) a.d_wgate = view(*d_wgate, "d_wgate");  // None: with wgate
  if (d_ape) a.d_ape = view(*d_ape, "d_ape");          // None: a call without APE
  a.epilogue = epilogue(norm_weight, norm_eps, rope_cos, rope_sin);
  if (pooled) a.pooled = view(*pooled, "pooled");
  if (d_norm_weight) a.d_norm_weight = view(*d_norm_weight, "d_norm_weight");
  kvcomp::Status s;
  {
    nb::gil_scoped_release release;
    s = kvcomp::compressor_backward(a, options);
  }
  check(s);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "kvcomp C++ core bindings (internal; use kvcomp.compressor_forward / kvcomp.compressor_grad)";

  // The exception class lives in Python (kvcomp/_errors.py) so that it is
  // picklable and documented like any Python class; it is looked up when the
  // first error is raised, which keeps this module importable on its own.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      try {
        nb::object cls = nb::module_::import_("kvcomp._errors").attr("KvcompError");
        nb::object exc = cls(e.code, e.what());
        PyErr_SetObject(cls.ptr(), exc.ptr());
      } catch (const nb::python_error&) {
        // kvcomp._errors is unavailable (the module was imported outside its
        // package): fall back to the base class, code in the text.
        PyErr_SetString(PyExc_RuntimeError, (std::to_string(e.code) + ": " + e.what()).c_str());
      }
    }
  });

  m.def("forward", &forward, nb::arg("x"), nb::arg("wkv"), nb::arg("wgate").none(), nb::arg("state_cache"),
        nb::arg("ape").none(), nb::arg("state_block_table").none(), nb::arg("cu_seqlens").none(),
        nb::arg("seqused").none(), nb::arg("start_pos").none(), nb::arg("cmp_ratio"), nb::arg("coff"),
        nb::arg("cache_mode"), nb::arg("cmp_kv"), nb::arg("softmax_score").none(), nb::arg("kv").none(),
        nb::arg("profile") = "extended", nb::arg("precision") = "precise", nb::arg("num_threads") = 0,
        nb::arg("stream") = 0, nb::arg("prepared_weights").none() = nb::none(), nb::arg("row_stable") = true,
        nb::arg("norm_weight").none() = nb::none(), nb::arg("norm_eps") = 1e-6f,
        nb::arg("rope_cos").none() = nb::none(), nb::arg("rope_sin").none() = nb::none(),
        nb::arg("pooled").none() = nb::none(),
        "Runs kvcomp::compressor_forward on caller-allocated outputs; state_cache is updated in place. "
        "stream: the cudaStream_t (as an integer) of a call on CUDA tensors, 0 for the default stream. "
        "prepared_weights: a blob of prepare_weights for this call's wkv and wgate, or None. "
        "row_stable: kvcomp::Options::row_stable. ape None: no APE term. wgate None: no gate projection "
        "(cmp_ratio 1, coff 1 only). norm_weight, norm_eps, rope_cos, "
        "rope_sin: kvcomp::Epilogue; pooled: its rows before the epilogue (with softmax_score and kv).");
  m.def("prepared_weights_size", &prepared_weights_size, nb::arg("wkv"), nb::arg("wgate"),
        "Bytes of the prepared-weights blob of wkv and wgate (kvcomp::prepared_weights_size).");
  m.def("prepare_weights", &prepare_weights, nb::arg("wkv"), nb::arg("wgate"), nb::arg("blob"),
        nb::arg("num_threads") = 0, "Writes the prepared-weights blob (kvcomp::prepare_weights).");
  m.def("backward", &backward, nb::arg("x"), nb::arg("wkv"), nb::arg("wgate").none(), nb::arg("d_cmp_kv"),
        nb::arg("softmax_score"), nb::arg("kv"), nb::arg("cu_seqlens").none(), nb::arg("seqused").none(),
        nb::arg("start_pos").none(), nb::arg("cmp_ratio"), nb::arg("coff"), nb::arg("d_x"), nb::arg("d_wkv"),
        nb::arg("d_wgate").none(), nb::arg("d_ape").none(), nb::arg("profile") = "extended",
        nb::arg("precision") = "precise", nb::arg("num_threads") = 0, nb::arg("stream") = 0,
        nb::arg("row_stable") = true, nb::arg("norm_weight").none() = nb::none(), nb::arg("norm_eps") = 1e-6f,
        nb::arg("rope_cos").none() = nb::none(), nb::arg("rope_sin").none() = nb::none(),
        nb::arg("pooled").none() = nb::none(), nb::arg("d_norm_weight").none() = nb::none(),
        "Runs kvcomp::compressor_backward on caller-allocated outputs (stream, row_stable: as for forward).");
  m.def("compressed_rows_bsh", &kvcomp::compressed_rows_bsh, nb::arg("S"), nb::arg("cmp_ratio"),
        "Rows of cmp_kv per batch in BSH layout: ceil(S / cmp_ratio).");
  m.def("compressed_rows_th", &kvcomp::compressed_rows_th, nb::arg("T"), nb::arg("B"), nb::arg("cmp_ratio"),
        "Rows of cmp_kv in TH layout: min(T, T // cmp_ratio + B).");
  m.def("version", &kvcomp::version, "Version of the C++ core.");
  m.def("kernel_isa", &kvcomp::kernel_isa,
        "Instruction set of the element-wise kernels: 'avx512', 'avx2' or 'scalar' (capped by KVCOMP_ISA).");
  m.def("product_kernels", &kvcomp::product_kernels,
        "Matrix-product kernels of the CPU backend, e.g. 'bf16 (kvcomp amx_bf16, precise as hi+lo) + "
        "f32 (dnnl_sgemm)' where the CPU has bf16 units (on AMX kvcomp's own kernel, KVCOMP_KERNELS=-amx "
        "keeps oneDNN's; KVCOMP_PRODUCTS=f32 keeps fp32; 'backward in f32' where "
        "they are slower than fp32 FMAs: Intel's AVX512-BF16 without AMX), 'f32 (dnnl_sgemm)' elsewhere "
        "('f32 (dnnl_sgemm); 1-8 rows: kvcomp avx2' where decode-sized projections run on kvcomp's AVX2 "
        "kernel).");
  m.def("has_cuda_backend", &kvcomp::has_cuda_backend,
        "Whether this build of the core has the CUDA backend (configured with KVCOMP_CUDA).");
  m.def("cuda_device_count", &kvcomp::cuda_device_count,
        "CUDA devices the core sees (0 without the backend, a driver or a GPU).");
  m.def("set_phase_timing", &kvcomp::set_phase_timing, nb::arg("on"),
        "Turns the CPU backend's phase clock on or off (kvcomp::set_phase_timing; off by default).");
  m.def(
      "phase_times",
      [] {
        nb::list out;
        for (const kvcomp::PhaseTime& p : kvcomp::phase_times()) {
          nb::dict d;
          d["op"] = p.op;
          d["phase"] = p.phase;
          d["seconds"] = p.seconds;
          d["calls"] = p.calls;
          out.append(d);
        }
        return out;
      },
      "The phase clock's totals since the last reset (kvcomp::phase_times): a list of dicts op, phase, "
      "seconds, calls, in the order a call runs the phases.");
  m.def("reset_phase_times", &kvcomp::reset_phase_times, "Zeroes the phase clock's totals.");
  m.def("release_cached_workspace", &kvcomp::release_cached_workspace,
        "Frees the calling thread's workspace kept between calls.");
}
