// Public API: tensors, plans, the two-phase calls and the one-call wrappers.
#include <omp.h>

#include <limits>
#include <memory>
#include <new>

#include "core/ops.hpp"
#include "kvcomp/kvcomp.hpp"
#include "validate/validate.hpp"

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
      return "f32";
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

std::int64_t compressed_rows_bsh(std::int64_t S, std::int64_t r) { return r > 0 ? (S + r - 1) / r : 0; }
std::int64_t compressed_rows_th(std::int64_t T, std::int64_t B, std::int64_t r) {
  return r > 0 ? std::min(T, T / r + B) : 0;
}

const char* version() { return "0.1.0"; }

struct ForwardPlanState {
  ForwardArgs args;
  Options options;
  int threads = 1;  // resolved when planning; the workspace is sized for it
  std::size_t workspace = 0;
};
struct BackwardPlanState {
  BackwardArgs args;
  Options options;
  int threads = 1;  // resolved when planning; the workspace is sized for it
  std::size_t workspace = 0;
};

std::size_t ForwardPlan::workspace_size() const { return state_ ? state_->workspace : 0; }
std::size_t BackwardPlan::workspace_size() const { return state_ ? state_->workspace : 0; }

namespace {

int resolve_threads(const Options& o) { return o.num_threads > 0 ? o.num_threads : omp_get_max_threads(); }

Status workspace_error(std::size_t given, std::size_t needed) {
  return {StatusCode::invalid_param, "[kvcomp] workspace_size (= " + std::to_string(given) + ") must be >= " +
                                         std::to_string(needed) + " bytes, the size planned"};
}

template <typename Plan, typename Args>
Status run_one_call(const Args& args, const Options& options) {
  Plan plan;
  Status s;
  if constexpr (std::is_same_v<Args, ForwardArgs>)
    s = plan_forward(args, options, &plan);
  else
    s = plan_backward(args, options, &plan);
  if (!s.ok()) return s;
  std::unique_ptr<unsigned char[]> ws(new (std::nothrow) unsigned char[plan.workspace_size()]);
  if (!ws)
    return {StatusCode::runtime_error, "[kvcomp] workspace (= " + std::to_string(plan.workspace_size()) +
                                           " bytes) could not be allocated"};
  return execute(plan, ws.get(), plan.workspace_size());
}

}  // namespace

Status plan_forward(const ForwardArgs& args, const Options& options, ForwardPlan* plan) {
  if (!plan) return {StatusCode::null_pointer, "[kvcomp] plan must not be null"};
  detail::BlockPlan bp;
  if (auto s = detail::validate_forward(args, options, &bp); !s.ok()) return s;
  auto st = std::make_shared<ForwardPlanState>();
  st->args = args;
  st->options = options;
  st->threads = resolve_threads(options);
  st->workspace = detail::forward_workspace_size(bp.dims, st->threads);
  plan->state_ = std::move(st);
  return Status::success();
}

Status plan_backward(const BackwardArgs& args, const Options& options, BackwardPlan* plan) {
  if (!plan) return {StatusCode::null_pointer, "[kvcomp] plan must not be null"};
  detail::BlockPlan bp;
  if (auto s = detail::validate_backward(args, options, &bp); !s.ok()) return s;
  auto st = std::make_shared<BackwardPlanState>();
  st->args = args;
  st->options = options;
  st->threads = resolve_threads(options);
  st->workspace = detail::backward_workspace_size(bp.dims, st->threads);
  plan->state_ = std::move(st);
  return Status::success();
}

// Execute re-validates: the int32 sequence data and block tables are read
// again, so a change between the two phases is caught, not trusted.
Status execute(ForwardPlan& plan, void* workspace, std::size_t workspace_size) {
  if (!plan.state_) return {StatusCode::invalid_param, "[kvcomp] plan (= empty) must come from plan_forward"};
  auto& st = *plan.state_;
  if (workspace_size < st.workspace) return workspace_error(workspace_size, st.workspace);
  if (!workspace) return {StatusCode::null_pointer, "[kvcomp] workspace must not be null"};
  detail::BlockPlan bp;
  if (auto s = detail::validate_forward(st.args, st.options, &bp); !s.ok()) return s;
  try {
    return detail::run_forward(st.args, bp, st.threads, workspace);
  } catch (const std::bad_alloc&) {
    return {StatusCode::runtime_error, "[kvcomp] out of memory during the forward"};
  }
}

Status execute(BackwardPlan& plan, void* workspace, std::size_t workspace_size) {
  if (!plan.state_)
    return {StatusCode::invalid_param, "[kvcomp] plan (= empty) must come from plan_backward"};
  auto& st = *plan.state_;
  if (workspace_size < st.workspace) return workspace_error(workspace_size, st.workspace);
  if (!workspace) return {StatusCode::null_pointer, "[kvcomp] workspace must not be null"};
  detail::BlockPlan bp;
  if (auto s = detail::validate_backward(st.args, st.options, &bp); !s.ok()) return s;
  try {
    return detail::run_backward(st.args, bp, st.options.precision, st.threads, workspace);
  } catch (const std::bad_alloc&) {
    return {StatusCode::runtime_error, "[kvcomp] out of memory during the backward"};
  }
}

Status compressor_forward(const ForwardArgs& args, const Options& options) {
  return run_one_call<ForwardPlan>(args, options);
}

Status compressor_backward(const BackwardArgs& args, const Options& options) {
  return run_one_call<BackwardPlan>(args, options);
}

}  // namespace kvcomp
