// Public API: tensors, plans, the two-phase calls and the one-call wrappers.
#include <omp.h>
#include <sys/mman.h>

#include <limits>
#include <memory>
#include <new>

#include "cpu/backend.hpp"
#include "cpu/isa.hpp"
#include "cpu/phase_clock.hpp"
#include "cpu/prepared.hpp"
#include "kvcomp/kvcomp.hpp"
#include "kvcomp/version.hpp"
#include "validate/validate.hpp"
#ifdef KVCOMP_HAVE_CUDA
#include "cuda/backend.hpp"
#endif

namespace kvcomp {

std::size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f16:
    case DType::bf16:
      return 2;
    default:
      return 4;
  }
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::f32:
      return "fp32";
    case DType::f16:
      return "fp16";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "int32";
  }
  return "unknown";
}

Tensor::Tensor(void* ptr, DType dt, std::initializer_list<std::int64_t> dims) : data(ptr), dtype(dt) {
  rank = static_cast<int>(std::min<std::size_t>(dims.size(), kMaxRank));
  std::size_t i = 0;
  for (auto d : dims) {
    if (i < kMaxRank) shape[i] = d;
    ++i;
  }
  if (dims.size() > kMaxRank) rank = kMaxRank + 1;  // rejected by validation as a bad rank
}

std::int64_t Tensor::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < std::min(rank, kMaxRank); ++i) {
    const std::int64_t d = shape[static_cast<std::size_t>(i)];
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

std::string device_name(const Device& d) {
  return d.type == DeviceType::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

#ifndef KVCOMP_HAVE_CUDA
bool has_cuda_backend() { return false; }
int cuda_device_count() { return 0; }
#endif

std::int64_t compressed_rows_bsh(std::int64_t S, std::int64_t r) { return r > 0 ? (S + r - 1) / r : 0; }
std::int64_t compressed_rows_th(std::int64_t T, std::int64_t B, std::int64_t r) {
  return r > 0 ? std::min(T, T / r + B) : 0;
}

const char* version() { return KVCOMP_VERSION_STRING; }

#ifdef KVCOMP_HAVE_CUDA
using DevicePlanPtr = std::shared_ptr<const detail::cuda::DevicePlan>;
#else
using DevicePlanPtr = std::shared_ptr<const void>;  // never set: no call runs on a device
#endif

// What a plan keeps: the Args' views, the options, and what planning
// resolved: the thread count (CPU) or the device copy of the block plan and
// the host copies of the index data (CUDA).
template <typename Args>
struct PlanState {
  Args args;
  Options options;
  int threads = 1;  // CPU: resolved when planning; the workspace is sized for it
  std::size_t workspace = 0;
  detail::IndexCopies index;  // CUDA: the index tensors as read when planning
  DevicePlanPtr device_plan;  // CUDA
  bool on_cuda() const { return args.x.device.type == DeviceType::cuda; }
};
// CPU: what planning decided about the call's products (cpu/backend.hpp), used by execute as it is.
struct ForwardPlanState : PlanState<ForwardArgs> {
  detail::ForwardDecision decision;
};
struct BackwardPlanState : PlanState<BackwardArgs> {
  detail::BackwardDecision decision;
};

std::size_t ForwardPlan::workspace_size() const { return state_ ? state_->workspace : 0; }
std::size_t BackwardPlan::workspace_size() const { return state_ ? state_->workspace : 0; }

namespace {

// What validation may ask of device memory: the CUDA backend's access where this build has one.
const detail::DeviceAccess* device_access() {
#ifdef KVCOMP_HAVE_CUDA
  return &detail::cuda::device_access();
#else
  return nullptr;
#endif
}

int resolve_threads(const Options& o) { return o.num_threads > 0 ? o.num_threads : omp_get_max_threads(); }

Status out_of_memory(const std::string& during) {
  return {StatusCode::runtime_error,
          std::string("[kvcomp] memory must be available for ") + during + " (an allocation failed)"};
}

Status workspace_error(std::size_t given, std::size_t needed) {
  return {StatusCode::invalid_param, "[kvcomp] workspace_size (= " + std::to_string(given) + ") must be >= " +
                                         std::to_string(needed) + " bytes, the size planned"};
}

// The steps both operators share; only validation, sizing and running differ.
// Planning validates and sizes the workspace: for the thread count resolved
// now (CPU), or with the device plan built now (CUDA: prepare).
template <typename State, typename Args, typename Validate, typename Size, typename Prepare>
Status make_plan(const Args& args, const Options& options, const char* op, Validate validate,
                 Size workspace_size, Prepare prepare, std::shared_ptr<State>& out) {
  try {
    auto st = std::make_shared<State>();
    st->args = args;
    st->options = options;
    detail::BlockPlan bp;
    if (auto s = validate(args, options, &bp, &st->index, device_access()); !s.ok()) return s;
    if (st->on_cuda()) {
      if (auto s = prepare(*st, bp); !s.ok()) return s;
    } else {
      st->threads = resolve_threads(options);
      if (auto s = workspace_size(*st, bp.dims, &st->workspace); !s.ok()) return s;
    }
    out = std::move(st);
    return Status::success();
  } catch (const std::bad_alloc&) {
    return out_of_memory(std::string("planning the ") + op);
  }
}

// Execute re-validates: for host memory the int32 index data and block
// tables are read again, so a change between the two phases is caught, not
// trusted. A CUDA call re-validates from the copies read when planning
// (reading device memory again would synchronise with the host).
template <typename State, typename Validate, typename Run>
Status run_plan(State* st, const char* op, void* workspace, std::size_t workspace_size, Validate validate,
                Run run) {
  if (!st)
    return {StatusCode::invalid_param, std::string("[kvcomp] plan (= empty) must come from plan_") + op};
  if (workspace_size < st->workspace) return workspace_error(workspace_size, st->workspace);
  if (!workspace) return {StatusCode::null_pointer, "[kvcomp] workspace must not be null"};
  try {
    detail::BlockPlan bp;
    if (auto s = validate(st->args, st->options, &bp, &st->index, device_access()); !s.ok()) return s;
    return run(*st, bp, workspace);
  } catch (const std::bad_alloc&) {
    return out_of_memory(std::string("the ") + op);
  }
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVCOMP_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVCOMP_SANITIZED 1
#endif
#endif

// The one-call entry points keep their workspace, per calling thread, from
// one call to the next. A fresh buffer of ~100 MB (C4A, H = 4096) cost ~28k
// page faults per call, ~8% of a forward at T = 4096. The buffer is mapped
// with transparent huge pages where the kernel offers them (madvise), grows
// to the largest workspace the thread has needed (bounded independently of
// T), and is unmapped at thread exit or by release_cached_workspace().
// Sanitizer builds allocate per call on the heap instead, so that ASan still
// sees every out-of-bounds access to the workspace.
class CachedWorkspace {
 public:
  ~CachedWorkspace() { release(); }
  void* get(std::size_t bytes) {
#ifdef KVCOMP_SANITIZED
    heap_.reset(new (std::nothrow) unsigned char[bytes]);
    return heap_.get();
#else
    if (bytes <= size_) return ptr_;
    release();
    constexpr std::size_t kHuge = std::size_t{2} << 20;
    if (bytes > std::numeric_limits<std::size_t>::max() - 2 * kHuge) return nullptr;
    const std::size_t len = (bytes + kHuge - 1) / kHuge * kHuge + kHuge;  // + room to align to 2 MiB
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    map_ = p;
    map_len_ = len;
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    ptr_ = reinterpret_cast<void*>((addr + kHuge - 1) / kHuge * kHuge);
    size_ = len - (reinterpret_cast<std::uintptr_t>(ptr_) - addr);
    ::madvise(ptr_, size_, MADV_HUGEPAGE);  // advice only: failure changes nothing
    return ptr_;
#endif
  }
  void release() {
#ifdef KVCOMP_SANITIZED
    heap_.reset();
#else
    if (map_) ::munmap(map_, map_len_);
    map_ = ptr_ = nullptr;
    map_len_ = size_ = 0;
#endif
  }

 private:
#ifdef KVCOMP_SANITIZED
  std::unique_ptr<unsigned char[]> heap_;
#else
  void* map_ = nullptr;
  std::size_t map_len_ = 0;
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
#endif
};

thread_local CachedWorkspace t_workspace;

template <typename Plan, typename Args>
Status run_one_call(const Args& args, const Options& options) {
  Plan plan;
  Status s;
  if constexpr (std::is_same_v<Args, ForwardArgs>)
    s = plan_forward(args, options, &plan);
  else
    s = plan_backward(args, options, &plan);
  if (!s.ok()) return s;
  if (args.x.device.type == DeviceType::cuda) {
#ifdef KVCOMP_HAVE_CUDA
    // Device workspace, stream-ordered: allocated and freed on the call's stream.
    void* ws = nullptr;
    if (auto a = detail::cuda::allocate_async(args.x.device, options.stream, plan.workspace_size(), &ws);
        !a.ok())
      return a;
    s = execute(plan, ws, plan.workspace_size());
    detail::cuda::free_async(args.x.device, options.stream, ws);
    return s;
#endif
  }
  void* ws = t_workspace.get(plan.workspace_size());
  if (!ws)
    return {StatusCode::runtime_error, "[kvcomp] workspace (= " + std::to_string(plan.workspace_size()) +
                                           " bytes) could not be allocated"};
  return execute(plan, ws, plan.workspace_size());
}

// The forward's rules plus its prepared weights, when it names any: they must match this call's
// weights and this process's product kernels (CPU), and a device call takes none.
Status validate_forward_call(const ForwardArgs& a, const Options& o, detail::BlockPlan* bp,
                             detail::IndexCopies* copies, const detail::DeviceAccess* device) {
  if (auto s = detail::validate_forward(a, o, bp, copies, device); !s.ok()) return s;
  if (!a.prepared_weights) return Status::success();
  if (a.x.device.type != DeviceType::cpu)
    return {StatusCode::invalid_param, "[kvcomp] prepared_weights must be null for a call on " +
                                           device_name(a.x.device) +
                                           " (a GPU reads the weights where they lie)"};
  if (!bp->dims.gate)
    return {
        StatusCode::invalid_param,
        "[kvcomp] prepared_weights must be null for a call without wgate (a blob holds both projections)"};
  return detail::check_prepared(a.prepared_weights, a.prepared_weights_bytes, bp->dims.io, bp->dims.C,
                                bp->dims.H);
}

// wkv and wgate as prepare_weights takes them: host [C, H] of one io dtype.
Status check_weight_pair(const Tensor& wkv, const Tensor& wgate) {
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"wkv", &wkv}, {"wgate", &wgate}}) {
    if (!t->data) return {StatusCode::null_pointer, std::string("[kvcomp] ") + name + " must not be null"};
    if (t->device.type != DeviceType::cpu)
      return {StatusCode::invalid_param, std::string("[kvcomp] ") + name + " (on " + device_name(t->device) +
                                             ") must be in host memory to be prepared"};
    if (t->rank != 2 || t->dim(0) < 1 || t->dim(1) < 1)
      return {StatusCode::invalid_param,
              std::string("[kvcomp] ") + name + " must be a non-empty matrix [coff*D, H]"};
    if (t->dtype != DType::bf16 && t->dtype != DType::f16 && t->dtype != DType::f32)
      return {StatusCode::invalid_param, std::string("[kvcomp] ") + name + " (dtype " + dtype_name(t->dtype) +
                                             ") must be bf16, fp16 or fp32"};
  }
  if (wgate.dtype != wkv.dtype || wgate.dim(0) != wkv.dim(0) || wgate.dim(1) != wkv.dim(1))
    return {StatusCode::shape_error, "[kvcomp] wgate must have wkv's shape and dtype"};
  return Status::success();
}

Status weights_layout(const Tensor& wkv, const Tensor& wgate, detail::PreparedLayout* layout) {
  if (auto s = check_weight_pair(wkv, wgate); !s.ok()) return s;
  if (!detail::prepared_layout(wkv.dtype, wkv.dim(0), wkv.dim(1), layout))
    return {StatusCode::runtime_error, "[kvcomp] oneDNN could not create the bf16 projection product"};
  return Status::success();
}

}  // namespace

Status prepared_weights_size(const Tensor& wkv, const Tensor& wgate, std::size_t* bytes) {
  if (!bytes) return {StatusCode::null_pointer, "[kvcomp] bytes must not be null"};
  try {
    detail::PreparedLayout layout;
    if (auto s = weights_layout(wkv, wgate, &layout); !s.ok()) return s;
    *bytes = detail::kPreparedHeaderBytes + layout.data_bytes;
    return Status::success();
  } catch (const std::bad_alloc&) {
    return out_of_memory("sizing the prepared weights");
  }
}

Status prepare_weights(const Tensor& wkv, const Tensor& wgate, void* blob, std::size_t bytes,
                       const Options& options) {
  if (!blob) return {StatusCode::null_pointer, "[kvcomp] blob must not be null"};
  try {
    detail::PreparedLayout layout;
    if (auto s = weights_layout(wkv, wgate, &layout); !s.ok()) return s;
    const std::size_t need = detail::kPreparedHeaderBytes + layout.data_bytes;
    if (bytes < need)
      return {StatusCode::invalid_param, "[kvcomp] bytes (= " + std::to_string(bytes) + ") must be >= " +
                                             std::to_string(need) + ", prepared_weights_size()"};
    return detail::write_prepared(wkv, wgate, layout, blob, resolve_threads(options));
  } catch (const std::bad_alloc&) {
    return out_of_memory("preparing the weights");
  }
}

Status plan_forward(const ForwardArgs& args, const Options& options, ForwardPlan* plan) {
  if (!plan) return {StatusCode::null_pointer, "[kvcomp] plan must not be null"};
  return make_plan(
      args, options, "forward", validate_forward_call,
      [&args](ForwardPlanState& st, const detail::Dims& d, std::size_t* size) {
        st.decision = detail::decide_forward(d, st.options);
        return detail::forward_workspace_size(d, st.decision, args.prepared_weights, st.threads, size);
      },
      [](ForwardPlanState& st, const detail::BlockPlan& bp) {
#ifdef KVCOMP_HAVE_CUDA
        return detail::cuda::prepare_forward(st.args, st.options, bp, st.index.block_table, &st.device_plan,
                                             &st.workspace);
#else
        (void)st, (void)bp;
        return Status::success();  // unreachable: validation refuses device tensors in this build
#endif
      },
      plan->state_);
}

Status plan_backward(const BackwardArgs& args, const Options& options, BackwardPlan* plan) {
  if (!plan) return {StatusCode::null_pointer, "[kvcomp] plan must not be null"};
  return make_plan(
      args, options, "backward", detail::validate_backward,
      [](BackwardPlanState& st, const detail::Dims& d, std::size_t* size) {
        st.decision = detail::decide_backward(d, st.options);
        if (st.args.epilogue.any()) st.decision.epilogue_rows = st.args.d_cmp_kv.numel() / d.D;
        return detail::backward_workspace_size(d, st.decision, st.threads, size);
      },
      [](BackwardPlanState& st, const detail::BlockPlan& bp) {
#ifdef KVCOMP_HAVE_CUDA
        return detail::cuda::prepare_backward(st.args, st.options, bp, &st.device_plan, &st.workspace);
#else
        (void)st, (void)bp;
        return Status::success();  // unreachable: validation refuses device tensors in this build
#endif
      },
      plan->state_);
}

Status execute(ForwardPlan& plan, void* workspace, std::size_t workspace_size) {
  return run_plan(plan.state_.get(), "forward", workspace, workspace_size, validate_forward_call,
                  [](const ForwardPlanState& st, const detail::BlockPlan& bp, void* ws) {
#ifdef KVCOMP_HAVE_CUDA
                    if (st.on_cuda())
                      return detail::cuda::run_forward(st.args, st.options, bp, *st.device_plan, ws);
#endif
                    return detail::run_forward(st.args, bp, st.decision, st.threads, ws, st.workspace);
                  });
}

Status execute(BackwardPlan& plan, void* workspace, std::size_t workspace_size) {
  return run_plan(plan.state_.get(), "backward", workspace, workspace_size, detail::validate_backward,
                  [](const BackwardPlanState& st, const detail::BlockPlan& bp, void* ws) {
#ifdef KVCOMP_HAVE_CUDA
                    if (st.on_cuda())
                      return detail::cuda::run_backward(st.args, st.options, bp, *st.device_plan, ws);
#endif
                    return detail::run_backward(st.args, bp, st.decision, st.threads, ws, st.workspace);
                  });
}

void release_cached_workspace() {
  t_workspace.release();
#ifdef KVCOMP_HAVE_CUDA
  detail::cuda::release_workspace_pools();
#endif
}

const char* kernel_isa() { return detail::isa_name(detail::active_isa()); }

const char* product_kernels() { return detail::product_kernels(); }

void set_phase_timing(bool on) { detail::set_phase_timing_on(on); }

std::vector<PhaseTime> phase_times() {
  std::vector<PhaseTime> out;
  for (int i = 0; i < static_cast<int>(detail::Phase::count); ++i) {
    const auto p = static_cast<detail::Phase>(i);
    const detail::PhaseName n = detail::phase_name(p);
    out.push_back({n.op, n.phase, static_cast<double>(detail::phase_ns(p)) * 1e-9, detail::phase_calls(p)});
  }
  return out;
}

void reset_phase_times() { detail::reset_phase_ns(); }

Status compressor_forward(const ForwardArgs& args, const Options& options) {
  return run_one_call<ForwardPlan>(args, options);
}

Status compressor_backward(const BackwardArgs& args, const Options& options) {
  return run_one_call<BackwardPlan>(args, options);
}

}  // namespace kvcomp
