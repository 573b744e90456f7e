// `kvcomp grad` and `kvcomp fwd`: load a case directory, size the outputs,
// run the operator, write the outputs.
#include <chrono>
#include <cstdio>
#include <vector>

#include "commands.hpp"
#include "device.hpp"

namespace kvcomp::cli {

namespace {

using io::HostTensor;

// Output shapes come from the inputs before the operator has validated them,
// so every quantity used for sizing is clamped to something harmless. A bad
// attribute or rank then still reaches the operator, which reports it with
// the proper code; the clamped sizes never decide which error is printed.
struct Sizing {
  std::int64_t r = 1;              // cmp_ratio, or 1 if unusable
  std::int64_t coff = 1;           // coff, or 1 if unusable
  std::int64_t C = 1;              // wkv.dim0
  std::int64_t D = 1;              // C / coff
  std::vector<std::int64_t> lead;  // leading dims of cmp_kv: BSH [B, ceil(S/r)], TH [rows]
};

Sizing size_outputs(const io::SequenceCase& c) {
  Sizing s;
  if (c.meta.cmp_ratio >= 1 && c.meta.cmp_ratio <= 1024) s.r = c.meta.cmp_ratio;
  if (c.wkv.shape.size() == 2 && c.wkv.shape[0] >= 1) s.C = c.wkv.shape[0];
  if (c.meta.coff >= 1 && c.meta.coff <= 2 && s.C % c.meta.coff == 0) s.coff = c.meta.coff;
  s.D = std::max<std::int64_t>(s.C / s.coff, 1);
  const auto& x = c.x.shape;
  if (x.size() == 3) {
    s.lead = {x[0], compressed_rows_bsh(x[1], s.r)};
  } else if (x.size() == 2) {
    std::int64_t B = 0;
    if (c.cu_seqlens && c.cu_seqlens->shape.size() == 1 && c.cu_seqlens->shape[0] >= 1)
      B = c.cu_seqlens->shape[0] - 1;
    s.lead = {compressed_rows_th(x[0], B, s.r)};
  } else {
    s.lead = {1};
  }
  return s;
}

std::vector<std::int64_t> with(std::vector<std::int64_t> lead, std::initializer_list<std::int64_t> tail) {
  lead.insert(lead.end(), tail);
  return lead;
}

void fill_sequence(SequenceArgs& a, io::SequenceCase& c) {
  a.x = c.x.view();
  a.wkv = c.wkv.view();
  a.wgate = c.wgate.view();
  if (c.cu_seqlens) a.cu_seqlens = c.cu_seqlens->view();
  if (c.seqused) a.seqused = c.seqused->view();
  if (c.start_pos) a.start_pos = c.start_pos->view();
  a.cmp_ratio = c.meta.cmp_ratio;
  a.coff = c.meta.coff;
}

}  // namespace

void print_error(int code, const std::string& message) {
  std::fprintf(stderr, "error %d: %s\n", code, message.c_str());
}

void warn_ignored(const io::CaseMeta& m) {
  for (const auto& k : m.ignored_keys)
    std::fprintf(stderr, "warning: meta.json key \"%s\" is not a kvcomp parameter; ignored\n", k.c_str());
}

int run_grad(const CaseOptions& o) {
  io::GradCase c = io::load_grad_case(o.in_dir);
  warn_ignored(c.meta);
  const Sizing s = size_outputs(c);
  const DType io_dt = c.meta.dtype;
  HostTensor d_x = HostTensor::zeros(io_dt, c.x.shape);
  HostTensor d_wkv = HostTensor::zeros(io_dt, c.wkv.shape);
  HostTensor d_wgate = HostTensor::zeros(io_dt, c.wgate.shape);
  HostTensor d_ape = HostTensor::zeros(DType::f32, {s.r, s.C});

  BackwardArgs a;
  fill_sequence(a, c);
  a.d_cmp_kv = c.d_cmp_kv.view();
  a.softmax_score = c.softmax_score.view();
  a.kv = c.kv.view();
  a.d_x = d_x.view();
  a.d_wkv = d_wkv.view();
  a.d_wgate = d_wgate.view();
  a.d_ape = d_ape.view();

  double ms = 0;
  const Status st = run_on(o.device, a, o.options, &ms);
  if (!st.ok()) {
    print_error(st.value(), st.message);
    return kExitStatus;
  }
  io::write_outputs(o.out_dir, {{"d_x.npy", io::output_npy(d_x, o.out_dtype)},
                                {"d_wkv.npy", io::output_npy(d_wkv, o.out_dtype)},
                                {"d_wgate.npy", io::output_npy(d_wgate, o.out_dtype)},
                                {"d_ape.npy", io::output_npy(d_ape, o.out_dtype)}});
  std::printf("grad (%s): %.3f ms; wrote d_x, d_wkv, d_wgate, d_ape to %s\n", device_name(o.device).c_str(),
              ms, o.out_dir.c_str());
  return kExitOk;
}

int run_fwd(const CaseOptions& o) {
  io::FwdCase c = io::load_fwd_case(o.in_dir);
  warn_ignored(c.meta);
  const Sizing s = size_outputs(c);
  const DType io_dt = c.meta.dtype;
  const bool grad = c.meta.grad_enabled;
  HostTensor cmp_kv = HostTensor::zeros(io_dt, with(s.lead, {s.D}));
  HostTensor score, kv;
  if (grad) {
    score = HostTensor::zeros(DType::f32, with(s.lead, {s.coff * s.r, s.D}));
    kv = HostTensor::zeros(DType::f32, with(s.lead, {s.coff * s.r, s.D}));
  }

  ForwardArgs a;
  fill_sequence(a, c);
  a.state_cache = c.state_cache.view();
  a.ape = c.ape.view();
  if (c.block_table) a.state_block_table = c.block_table->view();
  a.cache_mode = c.meta.cache_mode;
  a.state_cache_stride0 = c.meta.state_cache_stride0;
  a.grad_enabled = grad;
  a.cmp_kv = cmp_kv.view();
  if (grad) {
    a.softmax_score = score.view();
    a.kv = kv.view();
  }

  double ms = 0;
  const Status st = run_on(o.device, a, o.options, &ms);
  if (!st.ok()) {
    print_error(st.value(), st.message);
    return kExitStatus;
  }
  std::vector<io::OutputFile> files;
  files.push_back({"cmp_kv.npy", io::output_npy(cmp_kv, o.out_dtype)});
  if (grad) {
    files.push_back({"softmax_score.npy", io::output_npy(score, o.out_dtype)});
    files.push_back({"kv.npy", io::output_npy(kv, o.out_dtype)});
  }
  files.push_back({"state_cache.npy", io::state_cache_npy(c)});
  io::write_outputs(o.out_dir, files);
  std::printf("fwd (%s): %.3f ms; wrote cmp_kv%s, state_cache to %s\n", device_name(o.device).c_str(), ms,
              grad ? ", softmax_score, kv" : "", o.out_dir.c_str());
  return kExitOk;
}

}  // namespace kvcomp::cli
