// Case directories of the `kvcomp` CLI: a meta.json with the attributes and
// one .npy file per tensor, named after the operator parameters (spec 3).
//
//   meta.json   {"cmp_ratio": 4, "coff": 2, "dtype": "bf16", ...}
//   x.npy wkv.npy wgate.npy                       both operators
//   cu_seqlens.npy seqused.npy start_pos.npy      optional, both operators
//   d_cmp_kv.npy softmax_score.npy kv.npy         backward
//   ape.npy state_cache.npy [block_table.npy]     forward
//
// Loading converts every tensor to the dtype the operator takes, so the
// views handed to kvcomp are exactly what the API documents. Outputs are
// written all-or-nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/npy.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::io {

// meta.json. Required: cmp_ratio (int), dtype ("bf16" | "fp16" | "fp32").
// Optional: coff (int, default 1), layout ("BSH" | "TH", checked against the
// rank of x), cache_mode (int, default 1), state_cache_stride0 (int,
// default 0), grad_enabled (bool, default true). The forward-only keys are
// accepted, and ignored, by the backward so one directory can serve both.
// Value ranges are the operator's business; only JSON types are checked here.
struct CaseMeta {
  std::int64_t cmp_ratio = 4;
  std::int64_t coff = 1;
  DType dtype = DType::bf16;
  std::optional<std::string> layout;
  std::int64_t cache_mode = 1;
  std::int64_t state_cache_stride0 = 0;
  bool grad_enabled = true;
  std::vector<std::string> ignored_keys;  // keys that name nothing kvcomp knows (callers warn)
};

// `name` is used in messages. Throws IoError (contents).
CaseMeta parse_meta(std::string_view json_text, const std::string& name);
CaseMeta read_meta(const std::filesystem::path& file);

// An owned, contiguous tensor plus the view kvcomp takes.
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;  // at least one byte so that view().data is never null

  static HostTensor zeros(DType dtype, std::vector<std::int64_t> shape);
  std::int64_t numel() const;
  // Throws IoError if the rank is above kvcomp::kMaxRank.
  Tensor view();
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(bytes.data());
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
};

// Conversions of a loaded array to the operator dtypes; `name` is used in
// messages.
// io tensors (x, wkv, wgate, d_cmp_kv): float32 is rounded to the io dtype
// (nearest, ties to even); float16 and uint16 (bf16 bits) are taken as they
// are when they match the io dtype and go through float otherwise. float64
// is refused: float64 -> float32 -> 16 bits would round twice.
HostTensor io_tensor_from_npy(NpyArray a, DType io, const std::string& name);
// f32 tensors: float32, or float64 in range.
HostTensor f32_tensor_from_npy(NpyArray a, const std::string& name);
// int tensors: int32, or int64 in range.
HostTensor i32_tensor_from_npy(NpyArray a, const std::string& name);

struct SequenceCase {
  CaseMeta meta;
  HostTensor x, wkv, wgate;
  std::optional<HostTensor> cu_seqlens, seqused, start_pos;
};

struct GradCase : SequenceCase {
  HostTensor d_cmp_kv, softmax_score, kv;
};

struct FwdCase : SequenceCase {
  HostTensor ape;
  // [block_num, block_size, W] in the file. When meta.state_cache_stride0 is
  // larger than block_size*W, the blocks lie stride0 elements apart in
  // `state_cache.bytes` (the gaps hold NaN, so a kernel that reads them shows
  // it); state_cache_npy() packs them again.
  HostTensor state_cache;
  std::optional<HostTensor> block_table;
};

// Throw IoError: filesystem for a missing or unreadable file, contents for
// everything else.
GradCase load_grad_case(const std::filesystem::path& dir);
FwdCase load_fwd_case(const std::filesystem::path& dir);

// The state cache of a forward case as a contiguous float32 array.
NpyArray state_cache_npy(const FwdCase& c);

enum class OutDType {
  f32,  // every output as float32 (exact for bf16 / fp16)
  io,   // io-dtype outputs as stored: bf16 -> uint16 bits, fp16 -> float16, fp32 -> float32
};

// An output tensor as the array to write. int32 tensors are written as int32.
NpyArray output_npy(const HostTensor& t, OutDType out);

struct OutputFile {
  std::string name;  // file name inside the output directory, e.g. "d_x.npy"
  NpyArray array;
};

// Creates `dir` if needed, writes every file to a temporary name inside it and
// renames them into place only once all of them were written; on any failure
// the temporaries are removed and no output has been replaced. Throws IoError.
void write_outputs(const std::filesystem::path& dir, const std::vector<OutputFile>& files);

}  // namespace kvcomp::io
