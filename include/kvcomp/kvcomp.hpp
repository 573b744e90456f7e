// kvcomp: the Compressor / CompressorGrad operator pair of compressed sparse
// attention (DeepSeek-V4 style C4A / C4Li / C128A), on any x86-64 CPU and, in
// a build with the CUDA backend, on NVIDIA GPUs (sm_80 and later), with the
// semantics of the Ascend aclnnCompressor / aclnnCompressorGrad operators.
//
// Life cycle (the aclnn two-phase shape): fill an Args struct with tensor
// views, call plan_*() (validates everything, returns the workspace size),
// allocate that many bytes, call execute(). compressor_forward() /
// compressor_backward() do the three steps in one call.
//
// Tensors are non-owning views of contiguous row-major memory. The library
// never allocates or frees user memory. A call that fails validation writes
// nothing.
//
// On a CUDA device (every tensor's `device` set to it, device memory):
// plan_*() copies the index tensors (cu_seqlens, seqused, start_pos, the
// block table) to the host once, waiting for Options::stream, and builds the
// device plan; execute() re-validates from those copies and only queues work
// on the stream (no allocation, no host wait), so it can be captured in a
// CUDA graph. Index data changed after planning is not seen: plan again. The
// plan must outlive the work it queued (and any graph replaying it), and its
// stream must outlive the plan (the plan frees its device memory on that
// stream when it goes; do not destroy a plan while its stream is capturing).
// execute() queues on the stream the plan was made with: to capture it,
// capture that stream (a capture on another stream records none of it; the
// legacy default stream while another stream captures is refused).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvcomp/export.hpp"

namespace kvcomp {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2, i32 = 3 };

KVCOMP_API std::size_t dtype_size(DType dt);
KVCOMP_API const char* dtype_name(DType dt);

// Status codes carry the aclnn numbers so that both front doors report alike.
enum class StatusCode : int {
  ok = 0,
  null_pointer = 161001,   // ACLNN_ERR_PARAM_NULLPTR: a required tensor or its data is null
  invalid_param = 161002,  // ACLNN_ERR_PARAM_INVALID: dtype, rank, attribute or data value not supported
  runtime_error = 361001,  // ACLNN_ERR_RUNTIME_ERROR: allocation or execution failure
  shape_error = 561002,    // ACLNN_ERR_INNER_TILING_ERROR: shapes inconsistent with each other
};

struct Status {
  StatusCode code = StatusCode::ok;
  std::string message;  // one sentence: "[kvcomp] <parameter> (= <value>) must <rule>"

  bool ok() const { return code == StatusCode::ok; }
  int value() const { return static_cast<int>(code); }
  static Status success() { return {}; }
};

constexpr int kMaxRank = 4;

// Where a tensor's memory is: host memory (cpu) or one CUDA device. All the
// tensors of a call must be on the same device; the call runs there.
enum class DeviceType : int { cpu = 0, cuda = 1 };
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // the CUDA device ordinal; 0 for cpu
  friend bool operator==(const Device&, const Device&) = default;
};
// "cpu" or "cuda:<index>".
KVCOMP_API std::string device_name(const Device& d);

// A non-owning view of a contiguous row-major tensor.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  Device device{};  // host memory unless set

  Tensor() = default;
  KVCOMP_API Tensor(void* ptr, DType dt, std::initializer_list<std::int64_t> dims);
  std::int64_t dim(int i) const { return shape[static_cast<std::size_t>(i)]; }
  // Product of the dims (1 for rank 0); -1 if it overflows int64.
  KVCOMP_API std::int64_t numel() const;
};

// aclnn: exactly the ranges the Ascend operator accepts (D in {128,512},
// H in [1024,10240] multiple of 512, cmp_ratio in [2,128], coff in {1,2}).
// extended (the C++ default): any D >= 1, H >= 1, 1 <= cmp_ratio <= 1024.
enum class Profile { extended, aclnn };

// How the backward stages d_new_kv / d_new_score before the matrix products.
// precise: more precise than the NPU: fp32 on the CPU; on a GPU a high and a
// low io-dtype part, two tensor-core products (about 16 bits for bf16, 22 for
// fp16; fp32 io stays fp32). npu_parity: rounded to the io dtype first, like
// the Ascend kernel, so NPU numbers can be reproduced.
enum class Precision { precise, npu_parity };

struct Options {
  Profile profile = Profile::extended;
  Precision precision = Precision::precise;
  int num_threads = 0;  // 0: OpenMP default. Results never depend on this.
  // Row stability (on by default): a token's projections, and so every output, have the bits they
  // have in any other call holding that token, whatever the call's other rows; chunked prefill and
  // context parallelism then reproduce the one-call results bit for bit. Off, decode-sized CPU calls
  // skip the padding that guarantees it (about twice as fast at one token on fp32 products), and their
  // rows may differ in the last bits from the same tokens in a longer call; every call stays
  // deterministic. The CUDA backend ignores it.
  bool row_stable = true;
  // CUDA tensors: the cudaStream_t the call is queued on (nullptr: the
  // default stream). Unused for host tensors.
  void* stream = nullptr;
};

// The model-level epilogue (opt-in; extended profile; tensors where the call's others are: host memory
// or its CUDA device): what DeepSeek-V4's compressor does
// to each pooled row before it is stored, fused into the operator. In the model's arithmetic:
// - the pooled row p is rounded to the io dtype;
// - RMSNorm over D (norm_weight given): x_hat = p * rstd with rstd = 1 / sqrt(mean(p^2) + eps) (the
//   mean in float64, rstd rounded to fp32, x_hat in fp32), y = weight * x_hat in fp32, rounded to the
//   io dtype;
// - RoPE on the last rd channels (rope_cos / rope_sin given): each adjacent pair (y[D-rd+2i],
//   y[D-rd+2i+1]) as a complex number times cos + i sin of the row's position, in fp32, rounded to
//   the io dtype. A row's position is its block's first token's: k * cmp_ratio for block k of the
//   sequence, start_pos counted (the positions are global).
// cmp_kv then holds the epilogue's rows. A forward with grad_enabled also writes `pooled` (the rounded
// rows before the epilogue), which the backward takes; the backward's epilogue step (the inverse
// rotation, the RMSNorm backward) runs in float64 and feeds the pooling's backward in fp32, with no
// rounding to the io dtype, and writes d_norm_weight, summed over the rows in a fixed order.
struct Epilogue {
  std::optional<Tensor> norm_weight;  // [D], f32 or the io dtype: RMSNorm on
  float norm_eps = 1e-6f;             // RMSNorm's epsilon, > 0
  std::optional<Tensor> rope_cos;     // f32 [positions, rd / 2], 2 <= rd <= D: RoPE on (with rope_sin)
  std::optional<Tensor> rope_sin;     // f32, rope_cos's shape
  bool any() const { return norm_weight || rope_cos || rope_sin; }
};

// What both operators take: the token matrix, the two projections and the
// sequence description. Layout: x rank 3 [B,S,H] is BSH, rank 2 [T,H] is TH
// (then cu_seqlens [B+1] is required; for BSH it must be absent).
struct SequenceArgs {
  Tensor x;                          // io dtype (bf16, f16, or f32 as an extension)
  Tensor wkv;                        // [coff*D, H], io dtype
  Tensor wgate;                      // [coff*D, H], io dtype; an empty view (Tensor{}; extended profile)
                                     // at cmp_ratio 1 with coff 1 only: no gate product at all, every
                                     // score 0 (+ ape), so a block's one token has weight 1 and the
                                     // pooled row is its projection row (DeepSeek-V4.1's ratio 1)
  std::optional<Tensor> cu_seqlens;  // int32 [B+1], TH only
  std::optional<Tensor> seqused;     // int32 [B]; absent: whole sequences
  std::optional<Tensor> start_pos;   // int32 [B]; absent: all zero
  std::int64_t cmp_ratio = 4;
  std::int64_t coff = 1;
  Epilogue epilogue;  // none by default: cmp_kv is the pooled rows, as the NPU operator gives them
};

struct ForwardArgs : SequenceArgs {
  Tensor state_cache;  // f32 [block_num, block_size, 2*coff*D], updated in place
  Tensor ape;          // f32 [cmp_ratio, coff*D]; an empty view (Tensor{}): no APE term (extended profile)
  std::optional<Tensor> state_block_table;  // int32: cache_mode 1 [B, nblk], cache_mode 2 [B]
  std::int64_t cache_mode = 1;              // 1 paged, 2 ring
  std::int64_t state_cache_stride0 = 0;     // element stride of state_cache dim 0; 0: contiguous
  bool grad_enabled = false;
  // Optional (CPU): this call's wkv and wgate as prepare_weights() wrote them, and that blob's size.
  // The call then skips converting or packing the weights; its outputs are bitwise the same, and its
  // plan sizes no workspace for what the blob holds (execute refuses a blob that holds less than the
  // one planned with: plan again). A call of more than one row tile on fp32 products may still copy
  // the blob's fp32 rows, transposed, where oneDNN's sgemm runs faster from there with the same bits.
  const void* prepared_weights = nullptr;
  std::size_t prepared_weights_bytes = 0;

  // outputs
  Tensor cmp_kv;         // io dtype, BSH [B, ceil(S/r), D], TH [min(T, T/r + B), D]
  Tensor softmax_score;  // f32 [..., coff*r, D]; required when grad_enabled, else may be null
  Tensor kv;             // f32, same shape; the raw assembled kv block (not S*kv)
  Tensor pooled;         // io dtype, cmp_kv's shape: the rows before the epilogue; required when
                         // grad_enabled and the call has an epilogue, else unused
};

struct BackwardArgs : SequenceArgs {
  Tensor d_cmp_kv;       // io dtype, shape of cmp_kv
  Tensor softmax_score;  // f32, from the forward
  Tensor kv;             // f32, from the forward
  Tensor pooled;         // with an epilogue: the forward's `pooled`; else unused

  // outputs
  Tensor d_x;            // io dtype, shape of x
  Tensor d_wkv;          // io dtype, [coff*D, H]; or f32 (both; extended profile, CPU): unrounded
  Tensor d_wgate;        // io dtype, [coff*D, H]; f32 with d_wkv; an empty view where wgate is one
  Tensor d_ape;          // f32, [cmp_ratio, coff*D]; or f32 [2, cmp_ratio, coff*D] (extended profile,
                         // CPU): the float64 sums as hi + lo (hi the f32 result, lo what it rounded off);
                         // an empty view (Tensor{}; extended profile): not computed (a call without APE)
  Tensor d_norm_weight;  // with epilogue.norm_weight: its shape and dtype; else unused
};

struct ForwardPlanState;
struct BackwardPlanState;

// A validated, ready-to-run call. Holds the views of the Args (not the data):
// the memory they point to must stay valid until execute() returns.
class KVCOMP_API ForwardPlan {
 public:
  std::size_t workspace_size() const;
  bool valid() const { return state_ != nullptr; }

 private:
  std::shared_ptr<ForwardPlanState> state_;
  friend Status plan_forward(const ForwardArgs&, const Options&, ForwardPlan*);
  friend Status execute(ForwardPlan&, void*, std::size_t);
};

class KVCOMP_API BackwardPlan {
 public:
  std::size_t workspace_size() const;
  bool valid() const { return state_ != nullptr; }

 private:
  std::shared_ptr<BackwardPlanState> state_;
  friend Status plan_backward(const BackwardArgs&, const Options&, BackwardPlan*);
  friend Status execute(BackwardPlan&, void*, std::size_t);
};

// Phase one: validate every rule and size the workspace. Writes nothing.
KVCOMP_API Status plan_forward(const ForwardArgs& args, const Options& options, ForwardPlan* plan);
KVCOMP_API Status plan_backward(const BackwardArgs& args, const Options& options, BackwardPlan* plan);

// Phase two: run. The workspace must hold at least plan.workspace_size() bytes
// (64-byte alignment is best; any alignment works); for a call on a CUDA
// device it is device memory of that device.
KVCOMP_API Status execute(ForwardPlan& plan, void* workspace, std::size_t workspace_size);
KVCOMP_API Status execute(BackwardPlan& plan, void* workspace, std::size_t workspace_size);

// One call: plan, allocate the workspace, execute. The workspace is kept for
// the calling thread's next call (it does not grow with T: ~120 MB for C4A
// at H = 4096), so repeated calls skip the page faults of a fresh buffer; it
// is freed when the thread exits or by release_cached_workspace(). On a CUDA
// device the workspace is taken and returned stream-ordered on
// Options::stream (cudaMallocFromPoolAsync / cudaFreeAsync) from a memory
// pool of the library's own per device, which keeps its memory between calls.
KVCOMP_API Status compressor_forward(const ForwardArgs& args, const Options& options = {});
KVCOMP_API Status compressor_backward(const BackwardArgs& args, const Options& options = {});
// Frees the calling thread's kept one-call workspace now, and trims the CUDA
// workspace pools (process-wide; memory still in use stays).
KVCOMP_API void release_cached_workspace();

// Weights prepared once for many forward calls (decode, serving). On the CPU a forward call first
// brings wkv and wgate into the form its projection products read: fp32 copies (fp32 products:
// CPUs without bf16 units, fp16 and fp32 io, KVCOMP_PRODUCTS=f32) or oneDNN's packed layout (AMX).
// That is 2 * coff*D * H weights read and written on every call, more than the products themselves
// cost at decode sizes. prepare_weights() does it once, into caller memory; a forward call that
// names the result (ForwardArgs::prepared_weights) skips it, with bitwise the same outputs.
// - The blob is a snapshot of the weights: prepare again after they change. A stale blob gives the
//   old weights' results (detecting it would mean reading the weights, the cost saved).
// - It holds the layout of this process's product kernels (product_kernels()); a blob made under
//   other kernels (another machine, KVCOMP_PRODUCTS, KVCOMP_ISA) or for other weight shapes is
//   refused (invalid_param). Where the products read the weights in place (AVX512-BF16's gemm) it
//   is a header only and changes nothing. On AVX2 CPUs with fp32 products a blob of bf16 or fp16
//   weights also holds them as 16-bit decode panels for one-token calls (half the bytes to read; 1.5x the
//   blob), unless KVCOMP_KERNELS=-panels; a blob with or without them serves either way.
// - Host tensors only; a call on a CUDA device refuses a blob (the GPU reads the weights in place).
// prepared_weights_size: the blob's size for these weights (bytes, header included).
KVCOMP_API Status prepared_weights_size(const Tensor& wkv, const Tensor& wgate, std::size_t* bytes);
// Writes the blob (at least prepared_weights_size() bytes; 64-byte alignment is best) using
// options.num_threads threads. Writes nothing but the blob.
KVCOMP_API Status prepare_weights(const Tensor& wkv, const Tensor& wgate, void* blob, std::size_t bytes,
                                  const Options& options = {});

// The instruction set of kvcomp's element-wise kernels in this process:
// "avx512", "avx2" or "scalar" (the best the CPU has, capped by the
// environment variable KVCOMP_ISA; chosen once). Outputs do not depend on it.
KVCOMP_API const char* kernel_isa();

// The matrix-product kernels of the CPU backend in this process:
// "bf16 (<oneDNN implementation>, precise as hi+lo | precise in f32 |
// backward in f32[, 1-8 rows[, calls of 128+ rows] and prepared weights: kvcomp avx512_bf16]) +
// f32 (dnnl_sgemm)[; 1-8 rows: ...]" where the CPU has bf16 dot-product
// units (AMX-BF16, AVX512-BF16): the products of bf16 calls run there (the
// forward; the npu_parity backward where the units outrun fp32, i.e. AMX and
// AMD's AVX512-BF16, not Intel's AVX512-BF16 without AMX: "backward in f32";
// the precise backward as bf16 high + low parts where that is faster than
// fp32, i.e. on AMX; KVCOMP_PRODUCTS=bf16 asks for all of them); else
// "f32 (dnnl_sgemm)", or "f32 (dnnl_sgemm); 1-8 rows: kvcomp avx2" where
// fp32 forward projections of 1-8 token rows (decode) run on kvcomp's own
// AVX2 kernel, which gives each row sgemm's bits (checked once per process;
// KVCOMP_ISA=scalar or KVCOMP_KERNELS=-rows turn it off; calls without row_stable do not use it);
// ", order probed per
// shape" where oneDNN runs its AVX-512 sgemm, whose order depends on the shape
// (a shape of unknown order keeps sgemm's padding rows). "kvcomp avx512_bf16":
// on AVX512-BF16 without AMX (oneDNN reads B in place) the bf16 forward projections of 1-8 token
// rows, of calls of 128 rows or more (the weights' panels written per call;
// not under KVCOMP_KERNELS=-panels) and of calls with prepared weights run on
// kvcomp's own kernel, which gives each row the bits of oneDNN's jit gemm.
// KVCOMP_PRODUCTS=f32, or KVCOMP_ISA below avx512, keeps every product fp32.
// Chosen once per process.
KVCOMP_API const char* product_kernels();

// Where the CPU backend's calls spend their time, phase by phase (diagnostics; `kvcomp bench
// --phases`). Off by default. While on, each CPU forward and backward adds the wall time of each of
// its phases to process-wide totals: a few clock reads per chunk of rows, and no result changes.
// Calls on several threads at once add to the same totals. CUDA calls are not timed. Time outside
// the phases (validation, planning, the workspace) is not counted.
struct PhaseTime {
  const char* op;      // "forward" or "backward"
  const char* phase;   // "weights", "x rows", "products", "blocks", ... (docs/performance.md)
  double seconds;      // summed over the timed calls since the last reset
  std::int64_t calls;  // the timed calls of op since the last reset
};
KVCOMP_API void set_phase_timing(bool on);
// Every phase of both operators, in the order a call runs them, also those no call entered (0 s).
KVCOMP_API std::vector<PhaseTime> phase_times();
KVCOMP_API void reset_phase_times();

// Whether this build has the CUDA backend (configured with KVCOMP_CUDA), and
// how many CUDA devices it sees (0 without the backend, a driver or a GPU).
KVCOMP_API bool has_cuda_backend();
KVCOMP_API int cuda_device_count();

// Output row count of cmp_kv / d_cmp_kv for a layout: BSH ceil(S/r) per
// batch, TH min(T, T/r + B). Useful to size outputs.
KVCOMP_API std::int64_t compressed_rows_bsh(std::int64_t S, std::int64_t cmp_ratio);
KVCOMP_API std::int64_t compressed_rows_th(std::int64_t T, std::int64_t B, std::int64_t cmp_ratio);

KVCOMP_API const char* version();

}  // namespace kvcomp
