#include "validate/validate.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace kvcomp::detail {

namespace {

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < t.rank; ++i) os << (i ? "," : "") << t.shape[static_cast<std::size_t>(i)];
  os << ']';
  return os.str();
}

std::string shape_str(std::initializer_list<std::int64_t> dims) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (auto d : dims) {
    os << (first ? "" : ",") << d;
    first = false;
  }
  os << ']';
  return os.str();
}

Status fail(StatusCode code, const std::string& msg) { return {code, "[kvcomp] " + msg}; }
Status null_ptr(const char* name) {
  return fail(StatusCode::null_pointer, std::string(name) + " must not be null");
}
Status invalid(const std::string& msg) { return fail(StatusCode::invalid_param, msg); }
Status shape(const std::string& msg) { return fail(StatusCode::shape_error, msg); }

bool same_shape(const Tensor& t, std::initializer_list<std::int64_t> dims) {
  if (t.rank != static_cast<int>(dims.size())) return false;
  int i = 0;
  for (auto d : dims)
    if (t.shape[static_cast<std::size_t>(i++)] != d) return false;
  return true;
}

Status check_shape(const char* name, const Tensor& t, std::initializer_list<std::int64_t> dims) {
  if (same_shape(t, dims)) return Status::success();
  return shape(std::string(name) + " (shape " + shape_str(t) + ") must have shape " + shape_str(dims));
}

Status check_rank_dtype(const char* name, const Tensor& t, DType dt, int rank) {
  if (t.dtype != dt)
    return invalid(std::string(name) + " (dtype " + dtype_name(t.dtype) + ") must have dtype " +
                   dtype_name(dt));
  if (t.rank != rank)
    return invalid(std::string(name) + " (rank " + std::to_string(t.rank) + ") must have rank " +
                   std::to_string(rank));
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[static_cast<std::size_t>(i)] < 0)
      return invalid(std::string(name) + " (shape " + shape_str(t) + ") must have non-negative dims");
  if (t.numel() < 0 || t.numel() > std::numeric_limits<std::int64_t>::max() / 8)
    return invalid(std::string(name) + " (shape " + shape_str(t) +
                   ") must have a byte size that fits in int64");
  return Status::success();
}

// A required tensor: non-null data (an empty tensor may have null data when
// allow_empty_null is set).
Status check_present(const char* name, const Tensor& t, bool allow_empty_null = false) {
  if (t.data == nullptr && !(allow_empty_null && t.numel() == 0)) return null_ptr(name);
  return Status::success();
}

using Named = std::pair<const char*, const Tensor*>;

// An empty view (Tensor{}: rank 0, no data): an optional input or output left out.
bool absent(const Tensor& t) { return t.rank == 0 && t.data == nullptr; }

// All tensors of a call live on one device, that of x; the call runs there.
// Checked before any tensor's data is read (the data checks read the index
// tensors through host pointers). A device this build cannot run on (no
// DeviceAccess for it) is refused here too.
Status check_devices(const std::vector<Named>& tensors, const DeviceAccess* device) {
  const auto where = [](const Device& d) {
    return d.type == DeviceType::cpu ? std::string("host memory") : "on " + device_name(d);
  };
  const Device home = tensors.front().second->device;
  for (const auto& [name, t] : tensors) {
    if (t->device == home) continue;
    const bool host_mix = (t->device.type == DeviceType::cpu) != (home.type == DeviceType::cpu);
    return invalid(std::string(name) + " (= " + where(t->device) + ") must be on the same device as x (" +
                   device_name(home) + ")" +
                   (host_mix ? ": a call's tensors are all in host memory or all on one CUDA device" : ""));
  }
  if (home.type == DeviceType::cuda) {
    if (device) return device->check_memory(tensors, home);
    return invalid("x (= " + where(home) +
                   ") must be in host memory: this build of kvcomp has no CUDA backend (configure it with "
                   "-DKVCOMP_CUDA=ON and a CUDA 13 toolkit)");
  }
  if (home.type != DeviceType::cpu)
    return invalid("x (= device type " + std::to_string(static_cast<int>(home.type)) +
                   ") must be cpu or cuda");
  return Status::success();
}

void add_optional(std::vector<Named>& v, const char* name, const std::optional<Tensor>& t) {
  if (t) v.emplace_back(name, &*t);
}

// A call without a gate projection (DeepSeek-V4.1's ratio 1): an extension; the NPU operator requires it.
bool no_gate(const SequenceArgs& a, const Options& o) {
  return absent(a.wgate) && o.profile == Profile::extended;
}

void add_sequence(std::vector<Named>& v, const SequenceArgs& a, const Options& o) {
  v.insert(v.end(), {{"x", &a.x}, {"wkv", &a.wkv}});
  if (!no_gate(a, o)) v.emplace_back("wgate", &a.wgate);
  add_optional(v, "cu_seqlens", a.cu_seqlens);
  add_optional(v, "seqused", a.seqused);
  add_optional(v, "start_pos", a.start_pos);
}

// The epilogue's tensors where the call runs, as every other tensor of it: the given ones only (a
// missing one is reported by check_epilogue / check_pooled); `pooled` (null: not taken) and
// d_norm_weight (null: none) where the epilogue is on.
void add_epilogue(std::vector<Named>& v, const SequenceArgs& a, const Tensor* pooled,
                  const Tensor* d_norm_weight) {
  const Epilogue& e = a.epilogue;
  if (e.norm_weight && e.norm_weight->data) v.emplace_back("epilogue.norm_weight", &*e.norm_weight);
  if (e.rope_cos && e.rope_cos->data) v.emplace_back("epilogue.rope_cos", &*e.rope_cos);
  if (e.rope_sin && e.rope_sin->data) v.emplace_back("epilogue.rope_sin", &*e.rope_sin);
  if (e.any() && pooled && pooled->data) v.emplace_back("pooled", pooled);
  if (e.norm_weight && d_norm_weight && d_norm_weight->data) v.emplace_back("d_norm_weight", d_norm_weight);
}

Status check_optional_int(const char* name, const std::optional<Tensor>& t, std::int64_t len) {
  if (!t) return Status::success();
  if (t->data == nullptr && t->numel() != 0) return null_ptr(name);
  if (auto s = check_rank_dtype(name, *t, DType::i32, 1); !s.ok()) return s;
  if (t->dim(0) != len)
    return shape(std::string(name) + " (shape " + shape_str(*t) + ") must have shape [" +
                 std::to_string(len) + "]");
  return Status::success();
}

bool is_io_dtype(DType dt, const Options& o) {
  return dt == DType::bf16 || dt == DType::f16 || (dt == DType::f32 && o.profile == Profile::extended);
}

// The index data a call's rules read: the tensors' own memory in host
// memory; for a CUDA call the host copies, fetched on first use.
class IndexData {
 public:
  IndexData(const SequenceArgs& a, const Options& o, const std::optional<Tensor>* table, IndexCopies* copies,
            const DeviceAccess* device)
      : a_(a), o_(o), table_(table), copies_(copies), device_(device) {}

  Status load() {
    if (a_.x.device.type == DeviceType::cpu) return Status::success();
    if (!copies_) return invalid("x (= on " + device_name(a_.x.device) + ") must be planned by kvcomp");
    if (copies_->fetched) return Status::success();
    // device_ is set: check_devices, which every caller runs first, refuses device tensors without one.
    if (auto s = device_->check_not_capturing(o_.stream); !s.ok()) return s;
    const std::pair<const std::optional<Tensor>*, std::vector<std::int32_t>*> all[] = {
        {&a_.cu_seqlens, &copies_->cu_seqlens},
        {&a_.seqused, &copies_->seqused},
        {&a_.start_pos, &copies_->start_pos},
        {table_, &copies_->block_table}};
    for (const auto& [t, dst] : all)
      if (t && *t)
        if (auto s = device_->copy_index_to_host(**t, o_.stream, *dst); !s.ok()) return s;
    copies_->fetched = true;
    return Status::success();
  }
  const std::int32_t* cu_seqlens() const { return get(a_.cu_seqlens, &IndexCopies::cu_seqlens); }
  const std::int32_t* seqused() const { return get(a_.seqused, &IndexCopies::seqused); }
  const std::int32_t* start_pos() const { return get(a_.start_pos, &IndexCopies::start_pos); }
  const std::int32_t* block_table() const { return get(*table_, &IndexCopies::block_table); }

 private:
  const std::int32_t* get(const std::optional<Tensor>& t,
                          std::vector<std::int32_t> IndexCopies::*copy) const {
    if (!t) return nullptr;
    if (a_.x.device.type == DeviceType::cpu) return static_cast<const std::int32_t*>(t->data);
    return (copies_->*copy).data();
  }
  const SequenceArgs& a_;
  const Options& o_;  // the stream of the copies
  const std::optional<Tensor>* table_;
  IndexCopies* copies_;
  const DeviceAccess* device_;
};

// Rules shared by both operators (SequenceArgs). Fills dims.
// forward_empty_ok: the forward accepts B = S = T = 0.
Status validate_sequence(const SequenceArgs& a, const Options& o, bool forward, Dims* dims) {
  if (auto s = check_present("x", a.x, forward); !s.ok()) return s;
  if (auto s = check_present("wkv", a.wkv); !s.ok()) return s;
  const bool gate = !no_gate(a, o);
  if (gate)
    if (auto s = check_present("wgate", a.wgate); !s.ok()) return s;

  if (a.x.rank != 2 && a.x.rank != 3)
    return invalid("x (rank " + std::to_string(a.x.rank) +
                   ") must have rank 2 ([T,H], TH) or 3 ([B,S,H], BSH)");
  const Layout layout = a.x.rank == 3 ? Layout::bsh : Layout::th;
  if (!is_io_dtype(a.x.dtype, o))
    return invalid(std::string("x (dtype ") + dtype_name(a.x.dtype) + ") must be bf16 or fp16" +
                   (o.profile == Profile::extended ? " (or fp32)" : " under the aclnn profile"));
  if (auto s = check_rank_dtype("x", a.x, a.x.dtype, a.x.rank); !s.ok()) return s;
  if (auto s = check_rank_dtype("wkv", a.wkv, a.x.dtype, 2); !s.ok()) return s;
  if (gate)
    if (auto s = check_rank_dtype("wgate", a.wgate, a.x.dtype, 2); !s.ok()) return s;

  if (layout == Layout::th && !a.cu_seqlens)
    return invalid("cu_seqlens (= absent) must be given when x has rank 2 (TH layout)");
  if (layout == Layout::bsh && a.cu_seqlens)
    return invalid("cu_seqlens (= given) must be absent when x has rank 3 (BSH layout)");

  const std::int64_t max_ratio = o.profile == Profile::aclnn ? 128 : 1024;
  const std::int64_t min_ratio = o.profile == Profile::aclnn ? 2 : 1;
  if (a.cmp_ratio < min_ratio || a.cmp_ratio > max_ratio)
    return invalid("cmp_ratio (= " + std::to_string(a.cmp_ratio) + ") must be in [" +
                   std::to_string(min_ratio) + ", " + std::to_string(max_ratio) + "]");
  if (a.coff != 1 && a.coff != 2) return invalid("coff (= " + std::to_string(a.coff) + ") must be 1 or 2");
  if (!gate && (a.cmp_ratio != 1 || a.coff != 1))
    return invalid("wgate (= absent) must be given unless cmp_ratio = 1 and coff = 1 (got cmp_ratio " +
                   std::to_string(a.cmp_ratio) + ", coff " + std::to_string(a.coff) +
                   "): only a block of one token needs no scores");

  Dims d;
  d.layout = layout;
  d.io = a.x.dtype;
  d.r = a.cmp_ratio;
  d.coff = a.coff;
  d.gate = gate;
  if (layout == Layout::bsh) {
    d.B = a.x.dim(0);
    d.S = a.x.dim(1);
    d.H = a.x.dim(2);
    d.T = d.B * d.S;
  } else {
    if (a.cu_seqlens->data == nullptr) return null_ptr("cu_seqlens");
    if (auto s = check_rank_dtype("cu_seqlens", *a.cu_seqlens, DType::i32, 1); !s.ok()) return s;
    if (a.cu_seqlens->dim(0) < 1)
      return shape("cu_seqlens (shape " + shape_str(*a.cu_seqlens) + ") must have at least 1 element (B+1)");
    d.B = a.cu_seqlens->dim(0) - 1;
    d.T = a.x.dim(0);
    d.H = a.x.dim(1);
  }
  if (a.wkv.dim(0) % a.coff != 0 || a.wkv.dim(0) == 0)
    return shape("wkv rows (= " + std::to_string(a.wkv.dim(0)) +
                 ") must be a positive multiple of coff (= " + std::to_string(a.coff) + ")");
  d.D = a.wkv.dim(0) / a.coff;
  d.C = a.wkv.dim(0);
  if (o.profile == Profile::aclnn) {
    if (d.D != 128 && d.D != 512)
      return invalid("D = wkv rows / coff (= " + std::to_string(d.D) +
                     ") must be 128 or 512 under the aclnn profile");
    if (d.H < 1024 || d.H > 10240 || d.H % 512 != 0)
      return invalid("H (= " + std::to_string(d.H) +
                     ") must be in [1024, 10240] and a multiple of 512 under the aclnn profile");
  } else if (d.H < 1) {
    return invalid("H (= " + std::to_string(d.H) + ") must be >= 1");
  }
  if (auto s = check_shape("wkv", a.wkv, {d.C, d.H}); !s.ok()) return s;
  if (gate)
    if (auto s = check_shape("wgate", a.wgate, {d.C, d.H}); !s.ok()) return s;
  if (auto s = check_optional_int("seqused", a.seqused, d.B); !s.ok()) return s;
  if (auto s = check_optional_int("start_pos", a.start_pos, d.B); !s.ok()) return s;
  if (d.T > std::numeric_limits<std::int32_t>::max())
    return invalid("token count T (= " + std::to_string(d.T) + ") must fit in int32");
  *dims = d;
  return Status::success();
}

// Shapes of cmp_kv-like tensors ([.., D] with rank(x)) and intermediates
// ([.., coff*r, D] with rank(x)+1). TH row counts are checked against the
// plan later (they only need to cover the compressed blocks).
Status check_compressed(const char* name, const Tensor& t, const Dims& d, bool intermediate) {
  const std::int64_t cr = d.coff * d.r;
  if (d.layout == Layout::bsh) {
    const std::int64_t rows = compressed_rows_bsh(d.S, d.r);
    return intermediate ? check_shape(name, t, {d.B, rows, cr, d.D}) : check_shape(name, t, {d.B, rows, d.D});
  }
  const bool ok = intermediate ? (t.dim(1) == cr && t.dim(2) == d.D) : t.dim(1) == d.D;
  if (ok) return Status::success();
  return shape(std::string(name) + " (shape " + shape_str(t) + ") must have shape [rows, " +
               (intermediate ? std::to_string(cr) + ", " : std::string()) + std::to_string(d.D) + "]");
}

Status check_th_rows(const char* name, const Tensor& t, const BlockPlan& plan) {
  if (plan.dims.layout != Layout::th || t.dim(0) >= plan.total_blocks) return Status::success();
  return invalid(std::string(name) + " rows (= " + std::to_string(t.dim(0)) + ") must be >= the number of " +
                 "compressed blocks (= " + std::to_string(plan.total_blocks) + ")");
}

Status build_plan(const IndexData& idx, const Dims& d, BlockPlan* plan) {
  return BlockPlan::build(d, idx.cu_seqlens(), idx.seqused(), idx.start_pos(), plan);
}

Status check_cache_tables(const ForwardArgs& a, const IndexData& idx, const BlockPlan& plan) {
  const Dims& d = plan.dims;
  const std::int64_t block_num = a.state_cache.dim(0);
  const std::int64_t bs = a.state_cache.dim(1);
  const std::int32_t* table = idx.block_table();
  auto check_id = [&](std::int64_t b, std::int64_t col, std::int64_t id) -> Status {
    if (id >= 0 && id < block_num) return Status::success();
    return invalid("state_block_table[" + std::to_string(b) +
                   (a.cache_mode == 1 ? "][" + std::to_string(col) : "") + "] (= " + std::to_string(id) +
                   ") must be a block id in [0, " + std::to_string(block_num) + ")");
  };
  std::int64_t max_len = 0;
  for (const auto& s : plan.batches) max_len = std::max(max_len, s.len);
  if (a.cache_mode == 2 && max_len > 0 && bs < d.coff * d.r + max_len - 1)
    return invalid("state_cache block_size (= " + std::to_string(bs) +
                   ") must be >= coff*cmp_ratio + S - 1 (= " + std::to_string(d.coff * d.r + max_len - 1) +
                   ") in ring mode (cache_mode 2)");
  const std::int64_t cols = a.cache_mode == 1 ? a.state_block_table->dim(1) : 1;
  for (std::int64_t b = 0; b < d.B; ++b) {
    const BatchSpan& s = plan.batches[static_cast<std::size_t>(b)];
    // Positions touched: reads from k0*r - (coff-1)*r (clipped at 0) up to sp,
    // writes from sp up to sp + used.
    if (s.used == 0) continue;  // nothing written, and no block reads the cache
    const std::int64_t lo = s.nblocks > 0 ? std::max<std::int64_t>(0, s.k0 * d.r - (d.coff - 1) * d.r) : s.sp;
    const std::int64_t hi = s.sp + s.used;  // exclusive
    if (a.cache_mode == 2) {
      if (auto st = check_id(b, 0, table[b]); !st.ok()) return st;
      continue;
    }
    const std::int64_t need_cols = (hi - 1) / bs + 1;
    if (need_cols > cols)
      return invalid("state_block_table columns (= " + std::to_string(cols) + ") must be >= " +
                     std::to_string(need_cols) + " to cover positions up to " + std::to_string(hi - 1) +
                     " of batch " + std::to_string(b) + " with block_size " + std::to_string(bs));
    for (std::int64_t c = lo / bs; c < need_cols; ++c)
      if (auto st = check_id(b, c, table[b * cols + c]); !st.ok()) return st;
  }
  return Status::success();
}

// The epilogue's inputs (Epilogue), once the plan is known: every row's position must lie in the RoPE
// table.
Status check_epilogue(const SequenceArgs& a, const Options& o, const BlockPlan& plan) {
  const Epilogue& e = a.epilogue;
  if (!e.any()) return Status::success();
  const Dims& d = plan.dims;
  const char* first = e.norm_weight ? "norm_weight" : "rope_cos";
  if (o.profile == Profile::aclnn)
    return invalid(std::string("epilogue.") + first +
                   " (= given) must be absent under the aclnn profile (the NPU operator has no epilogue)");
  if (e.norm_weight) {
    const Tensor& w = *e.norm_weight;
    if (auto s = check_present("epilogue.norm_weight", w); !s.ok()) return s;
    if (w.device != a.x.device)
      return invalid("epilogue.norm_weight (= on " + device_name(w.device) +
                     ") must be on the device of x (" + device_name(a.x.device) + ")");
    if (w.dtype != DType::f32 && w.dtype != d.io)
      return invalid(std::string("epilogue.norm_weight (dtype ") + dtype_name(w.dtype) +
                     ") must be f32 or the io dtype " + dtype_name(d.io));
    if (auto s = check_shape("epilogue.norm_weight", w, {d.D}); !s.ok()) return s;
    if (!(e.norm_eps > 0.0f) || !std::isfinite(e.norm_eps))
      return invalid("epilogue.norm_eps (= " + std::to_string(e.norm_eps) + ") must be finite and > 0");
  }
  if (e.rope_cos.has_value() != e.rope_sin.has_value())
    return null_ptr(e.rope_cos ? "epilogue.rope_sin" : "epilogue.rope_cos");
  if (e.rope_cos) {
    for (const auto& [name, t] :
         {Named{"epilogue.rope_cos", &*e.rope_cos}, Named{"epilogue.rope_sin", &*e.rope_sin}}) {
      if (auto s = check_present(name, *t); !s.ok()) return s;
      if (t->device != a.x.device)
        return invalid(std::string(name) + " (= on " + device_name(t->device) +
                       ") must be on the device of x (" + device_name(a.x.device) + ")");
      if (auto s = check_rank_dtype(name, *t, DType::f32, 2); !s.ok()) return s;
    }
    const Tensor& c = *e.rope_cos;
    if (c.dim(1) < 1 || 2 * c.dim(1) > d.D)
      return shape("epilogue.rope_cos (shape " + shape_str(c) +
                   ") must have rd / 2 columns with 2 <= rd <= D (= " + std::to_string(d.D) + ")");
    if (auto s = check_shape("epilogue.rope_sin", *e.rope_sin, {c.dim(0), c.dim(1)}); !s.ok()) return s;
    for (std::size_t b = 0; b < plan.batches.size(); ++b) {
      const BatchSpan& s = plan.batches[b];
      if (s.nblocks == 0) continue;
      const std::int64_t last = (s.k0 + s.nblocks - 1) * d.r;  // the last row's position
      if (last >= c.dim(0))
        return invalid("epilogue.rope_cos rows (= " + std::to_string(c.dim(0)) + ") must cover position " +
                       std::to_string(last) + " (the first token of batch " + std::to_string(b) +
                       "'s last compressed block)");
    }
  }
  return Status::success();
}

// `pooled` (forward output or backward input) and d_norm_weight, for a call with an epilogue.
Status check_pooled(const Tensor& pooled, const Tensor& like, const Dims& d) {
  if (auto s = check_present("pooled", pooled, true); !s.ok()) return s;
  if (pooled.device != like.device)
    return invalid("pooled (= " + device_name(pooled.device) + ") must be on the same device as x (" +
                   device_name(like.device) + ")");
  if (auto s = check_rank_dtype("pooled", pooled, d.io, like.rank); !s.ok()) return s;
  if (pooled.rank != like.rank ||
      !std::equal(like.shape.begin(), like.shape.begin() + like.rank, pooled.shape.begin()))
    return shape("pooled (shape " + shape_str(pooled) + ") must have the shape of cmp_kv (" +
                 shape_str(like) + ")");
  return Status::success();
}

}  // namespace

Status validate_forward(const ForwardArgs& a, const Options& o, BlockPlan* plan, IndexCopies* copies,
                        const DeviceAccess* device) {
  if (auto s = check_present("state_cache", a.state_cache); !s.ok()) return s;
  // No APE term (DeepSeek-V4.1) is an extension; the NPU operator requires the bias.
  const bool no_ape = absent(a.ape) && o.profile == Profile::extended;
  if (!no_ape)
    if (auto s = check_present("ape", a.ape); !s.ok()) return s;
  if (!a.state_block_table) return null_ptr("state_block_table");
  if (auto s = check_present("state_block_table", *a.state_block_table, true); !s.ok()) return s;
  if (auto s = check_present("cmp_kv", a.cmp_kv, true); !s.ok()) return s;
  if (a.grad_enabled) {
    if (auto s = check_present("softmax_score", a.softmax_score, true); !s.ok()) return s;
    if (auto s = check_present("kv", a.kv, true); !s.ok()) return s;
  }
  std::vector<Named> on_device;
  add_sequence(on_device, a, o);
  on_device.insert(on_device.end(), {{"state_cache", &a.state_cache}, {"cmp_kv", &a.cmp_kv}});
  if (!no_ape) on_device.emplace_back("ape", &a.ape);
  add_optional(on_device, "state_block_table", a.state_block_table);
  if (a.grad_enabled || a.softmax_score.data) on_device.emplace_back("softmax_score", &a.softmax_score);
  if (a.grad_enabled || a.kv.data) on_device.emplace_back("kv", &a.kv);
  add_epilogue(on_device, a, a.grad_enabled ? &a.pooled : nullptr, nullptr);
  if (auto s = check_devices(on_device, device); !s.ok()) return s;
  Dims d;
  if (auto s = validate_sequence(a, o, true, &d); !s.ok()) return s;
  if (auto s = check_rank_dtype("state_cache", a.state_cache, DType::f32, 3); !s.ok()) return s;
  if (!no_ape)
    if (auto s = check_rank_dtype("ape", a.ape, DType::f32, 2); !s.ok()) return s;
  if (a.cache_mode != 1 && a.cache_mode != 2)
    return invalid("cache_mode (= " + std::to_string(a.cache_mode) + ") must be 1 (paged) or 2 (ring)");
  if (auto s =
          check_rank_dtype("state_block_table", *a.state_block_table, DType::i32, a.cache_mode == 1 ? 2 : 1);
      !s.ok())
    return s;
  if (auto s = check_rank_dtype("cmp_kv", a.cmp_kv, d.io, a.x.rank); !s.ok()) return s;
  // Without grad_enabled the saved outputs are not written; like the Ascend
  // tiling, only their dtype and rank are checked when they are given.
  const bool want_saved = a.grad_enabled;
  if (want_saved || a.softmax_score.data)
    if (auto s = check_rank_dtype("softmax_score", a.softmax_score, DType::f32, a.x.rank + 1); !s.ok())
      return s;
  if (want_saved || a.kv.data)
    if (auto s = check_rank_dtype("kv", a.kv, DType::f32, a.x.rank + 1); !s.ok()) return s;
  const std::int64_t bs = a.state_cache.dim(1);
  if (a.state_cache.dim(0) < 1 || bs < 1)
    return shape("state_cache (shape " + shape_str(a.state_cache) + ") must not be empty");
  if (o.profile == Profile::aclnn && bs > 1024)
    return invalid("state_cache block_size (= " + std::to_string(bs) + ") must be in [1, 1024]");
  if (a.state_cache.dim(2) != 2 * d.C)
    return shape("state_cache (shape " + shape_str(a.state_cache) +
                 ") must have last dim 2*coff*D = " + std::to_string(2 * d.C));
  if (a.state_cache_stride0 != 0 && a.state_cache_stride0 < bs * 2 * d.C)
    return invalid("state_cache_stride0 (= " + std::to_string(a.state_cache_stride0) +
                   ") must be 0 (contiguous) or >= block_size*2*coff*D (= " + std::to_string(bs * 2 * d.C) +
                   ")");
  if (a.state_cache_stride0 > 0 &&
      a.state_cache_stride0 > (std::numeric_limits<std::int64_t>::max() / 8 - bs * 2 * d.C) /
                                  std::max<std::int64_t>(1, a.state_cache.dim(0) - 1))
    return invalid("state_cache_stride0 (= " + std::to_string(a.state_cache_stride0) +
                   ") must keep the cache's byte extent within int64");
  if (!no_ape)
    if (auto s = check_shape("ape", a.ape, {d.r, d.C}); !s.ok()) return s;
  if (a.state_block_table->dim(0) != d.B)
    return shape("state_block_table (shape " + shape_str(*a.state_block_table) + ") must have " +
                 std::to_string(d.B) + " rows (B)");
  if (a.cache_mode == 2 && a.state_cache.dim(0) < d.B)
    return shape("state_cache blocks (= " + std::to_string(a.state_cache.dim(0)) +
                 ") must be >= B (= " + std::to_string(d.B) + ") in ring mode");
  if (auto s = check_compressed("cmp_kv", a.cmp_kv, d, false); !s.ok()) return s;
  if (want_saved) {
    if (auto s = check_compressed("softmax_score", a.softmax_score, d, true); !s.ok()) return s;
    if (auto s = check_compressed("kv", a.kv, d, true); !s.ok()) return s;
    if (a.softmax_score.dim(0) != a.kv.dim(0) || a.softmax_score.dim(0) != a.cmp_kv.dim(0))
      return shape("softmax_score (shape " + shape_str(a.softmax_score) + ") and kv (shape " +
                   shape_str(a.kv) + ") must have as many rows as cmp_kv (shape " + shape_str(a.cmp_kv) +
                   ")");
  }
  IndexData idx(a, o, &a.state_block_table, copies, device);
  if (auto s = idx.load(); !s.ok()) return s;
  BlockPlan p;
  if (auto s = build_plan(idx, d, &p); !s.ok()) return s;
  if (auto s = check_th_rows("cmp_kv", a.cmp_kv, p); !s.ok()) return s;
  if (auto s = check_cache_tables(a, idx, p); !s.ok()) return s;
  if (auto s = check_epilogue(a, o, p); !s.ok()) return s;
  if (a.grad_enabled && a.epilogue.any())
    if (auto s = check_pooled(a.pooled, a.cmp_kv, d); !s.ok()) return s;
  *plan = std::move(p);
  return Status::success();
}

Status validate_backward(const BackwardArgs& a, const Options& o, BlockPlan* plan, IndexCopies* copies,
                         const DeviceAccess* device) {
  // d_ape may be left out (an empty view) under the extended profile: a call without APE.
  const bool no_dape = absent(a.d_ape) && o.profile == Profile::extended;
  // d_wgate is left out exactly where wgate is (a call without a gate projection).
  const bool gate = !no_gate(a, o);
  if (!gate && !absent(a.d_wgate))
    return invalid("d_wgate (= given) must be absent (an empty view) when wgate is: no gate, no gradient");
  std::vector<Named> required = {{"d_cmp_kv", &a.d_cmp_kv},
                                 {"softmax_score", &a.softmax_score},
                                 {"kv", &a.kv},
                                 {"d_x", &a.d_x},
                                 {"d_wkv", &a.d_wkv}};
  if (gate) required.emplace_back("d_wgate", &a.d_wgate);
  if (!no_dape) required.emplace_back("d_ape", &a.d_ape);
  // An empty tensor may come without storage: it is reported as empty
  // (561002) below, not as a null pointer.
  for (const auto& [name, t] : required)
    if (auto s = check_present(name, *t, true); !s.ok()) return s;
  // The backward's every tensor but the optional index ones: all on one device, none empty.
  std::vector<Named> non_empty = {{"x", &a.x}, {"wkv", &a.wkv}};
  if (gate) non_empty.emplace_back("wgate", &a.wgate);
  non_empty.insert(non_empty.end(), std::begin(required), std::end(required));
  std::vector<Named> on_device = non_empty;
  add_optional(on_device, "cu_seqlens", a.cu_seqlens);
  add_optional(on_device, "seqused", a.seqused);
  add_optional(on_device, "start_pos", a.start_pos);
  add_epilogue(on_device, a, &a.pooled, &a.d_norm_weight);
  if (auto s = check_devices(on_device, device); !s.ok()) return s;
  Dims d;
  if (auto s = validate_sequence(a, o, false, &d); !s.ok()) return s;
  if (auto s = check_rank_dtype("d_cmp_kv", a.d_cmp_kv, d.io, a.x.rank); !s.ok()) return s;
  if (auto s = check_rank_dtype("softmax_score", a.softmax_score, DType::f32, a.x.rank + 1); !s.ok())
    return s;
  if (auto s = check_rank_dtype("kv", a.kv, DType::f32, a.x.rank + 1); !s.ok()) return s;
  if (auto s = check_rank_dtype("d_x", a.d_x, d.io, a.x.rank); !s.ok()) return s;
  // d_wkv / d_wgate: the io dtype, or (extended profile, CPU) both fp32: the weight gradients unrounded,
  // for fp32 master weights and for partial sums that are reduced before any rounding.
  const bool wgrad_f32 =
      a.d_wkv.dtype == DType::f32 && (!gate || a.d_wgate.dtype == DType::f32) && d.io != DType::f32;
  if (wgrad_f32 && o.profile == Profile::aclnn)
    return invalid("d_wkv (dtype f32) must have the io dtype " + std::string(dtype_name(d.io)) +
                   " under the aclnn profile (fp32 weight gradients are an extension)");
  if (wgrad_f32 && a.d_wkv.device.type != DeviceType::cpu)
    return invalid("d_wkv (dtype f32 on " + device_name(a.d_wkv.device) + ") must have the io dtype " +
                   std::string(dtype_name(d.io)) + ": fp32 weight gradients are computed on the CPU only");
  const DType wgrad_dt = wgrad_f32 ? DType::f32 : d.io;
  if (auto s = check_rank_dtype("d_wkv", a.d_wkv, wgrad_dt, 2); !s.ok()) return s;
  if (gate)
    if (auto s = check_rank_dtype("d_wgate", a.d_wgate, wgrad_dt, 2); !s.ok()) return s;
  // d_ape: f32 [r, C]; or (extended profile, CPU) f32 [2, r, C]: the float64 sums as hi + lo parts.
  const bool dape_parts = a.d_ape.rank == 3 && o.profile == Profile::extended;
  if (dape_parts && a.d_ape.device.type != DeviceType::cpu)
    return invalid("d_ape (rank 3 on " + device_name(a.d_ape.device) +
                   ") must have rank 2: its float64 hi + lo parts are computed on the CPU only");
  if (!no_dape)
    if (auto s = check_rank_dtype("d_ape", a.d_ape, DType::f32, dape_parts ? 3 : 2); !s.ok()) return s;
  for (const auto& [name, t] : non_empty)
    if (t->numel() == 0)
      return shape(std::string(name) + " (shape " + shape_str(*t) +
                   ") must not be empty (the backward has no empty-tensor path)");
  if (auto s = check_compressed("d_cmp_kv", a.d_cmp_kv, d, false); !s.ok()) return s;
  if (auto s = check_compressed("softmax_score", a.softmax_score, d, true); !s.ok()) return s;
  if (auto s = check_compressed("kv", a.kv, d, true); !s.ok()) return s;
  if (d.layout == Layout::bsh) {
    if (auto s = check_shape("d_x", a.d_x, {d.B, d.S, d.H}); !s.ok()) return s;
  } else if (auto s = check_shape("d_x", a.d_x, {d.T, d.H}); !s.ok()) {
    return s;
  }
  if (auto s = check_shape("d_wkv", a.d_wkv, {d.C, d.H}); !s.ok()) return s;
  if (gate)
    if (auto s = check_shape("d_wgate", a.d_wgate, {d.C, d.H}); !s.ok()) return s;
  if (no_dape) {
  } else if (dape_parts) {
    if (auto s = check_shape("d_ape", a.d_ape, {2, d.r, d.C}); !s.ok()) return s;
  } else if (auto s = check_shape("d_ape", a.d_ape, {d.r, d.C}); !s.ok()) {
    return s;
  }
  IndexData idx(a, o, nullptr, copies, device);
  if (auto s = idx.load(); !s.ok()) return s;
  BlockPlan p;
  if (auto s = build_plan(idx, d, &p); !s.ok()) return s;
  if (auto s = check_th_rows("d_cmp_kv", a.d_cmp_kv, p); !s.ok()) return s;
  if (auto s = check_th_rows("softmax_score", a.softmax_score, p); !s.ok()) return s;
  if (auto s = check_th_rows("kv", a.kv, p); !s.ok()) return s;
  if (auto s = check_epilogue(a, o, p); !s.ok()) return s;
  if (a.epilogue.any())
    if (auto s = check_pooled(a.pooled, a.d_cmp_kv, d); !s.ok()) return s;
  if (a.epilogue.norm_weight) {
    const Tensor& w = *a.epilogue.norm_weight;
    if (auto s = check_present("d_norm_weight", a.d_norm_weight); !s.ok()) return s;
    if (a.d_norm_weight.device != w.device)
      return invalid("d_norm_weight (= " + device_name(a.d_norm_weight.device) +
                     ") must be on the device of norm_weight (" + device_name(w.device) + ")");
    if (auto s = check_rank_dtype("d_norm_weight", a.d_norm_weight, w.dtype, 1); !s.ok()) return s;
    if (auto s = check_shape("d_norm_weight", a.d_norm_weight, {d.D}); !s.ok()) return s;
  }
  *plan = std::move(p);
  return Status::success();
}

}  // namespace kvcomp::detail
