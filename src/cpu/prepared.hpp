// Weights prepared once for many forward calls (kvcomp.hpp: prepare_weights): the form the
// forward's projection products read wkv and wgate in, written into caller memory behind a small
// header, so that a decode call need not convert (fp32 products) or pack (AMX) 2 * C * H weights
// every time. The forward reads the same bytes either way, so its outputs do not change.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/products/onednn_bf16.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp::detail {

// What the forward's products read the weights as, on this process's product kernels.
enum class PreparedKind : std::uint32_t {
  in_place =
      0,  // bf16 units whose kernel reads B where it lies: nothing, or (ProductConfig::bf16_decode_panels)
          // wkv's and wgate's AVX-512 decode panels (products/rows.hpp) for calls of any height
  packed = 1,  // bf16 units with a packed layout (AMX): wkv then wgate, packed_bytes each
  f32 = 2,     // fp32 products: [2C, padded_ld(H)] fp32, the wkv rows then the wgate rows; for bf16 or
            // fp16 weights where ProductConfig::decode_panels (products/config.hpp), then wkv's and wgate's
            // decode panels
};

// Bytes of the header in front of the prepared data (a multiple of 64, so the data keeps the
// blob's alignment).
constexpr std::size_t kPreparedHeaderBytes = 64;

// The layout the forward wants for weights [C, H] of dtype io: kind and data bytes after the header.
// False when oneDNN could not make the bf16 product (out of memory).
struct PreparedLayout {
  PreparedKind kind = PreparedKind::in_place;
  std::size_t data_bytes = 0;   // panel_bytes included
  std::size_t panel_bytes = 0;  // decode panels of both matrices (f32 kind, bf16 or fp16 weights), or 0
};
bool prepared_layout(DType io, std::int64_t C, std::int64_t H, PreparedLayout* out);

// Writes the header and the data of `layout` for wkv, wgate [C, H] (validated by the caller) into
// blob (at least kPreparedHeaderBytes + layout.data_bytes bytes).
Status write_prepared(const Tensor& wkv, const Tensor& wgate, const PreparedLayout& layout, void* blob,
                      int num_threads);

// The AVX-512 decode panels (products/rows.hpp) of one bf16 matrix [C, H]: elements, 0 unless C is a
// multiple of 16.
std::size_t bf16_panel_elements(std::int64_t C, std::int64_t H);
// Writes the panels of wkv and wgate ([C, H] bf16, C a multiple of 16) into `panels`
// (2 bf16_panel_elements(C, H) values: wkv's, then wgate's), the column groups dealt to the threads.
// AVX512-BF16 only (ProductConfig::bf16_rows_kernel).
void write_bf16_panels(const std::uint16_t* wkv, const std::uint16_t* wgate, std::int64_t C, std::int64_t H,
                       std::uint16_t* panels, int num_threads);

// The forward's bf16 projection product, [n, H] . [H, C] into one column half of the projections
// (row stride padded_ld(2C)): the shape its weights are packed for, per call or in a blob.
Bf16Shape projection_shape(std::int64_t C, std::int64_t H);

// Checks a forward call's prepared_weights against its wkv / wgate ([C, H], dtype io) and this
// process's kernels (at plan and at execute).
Status check_prepared(const void* blob, std::size_t bytes, DType io, std::int64_t C, std::int64_t H);

// Where a blob that check_prepared accepted holds the two matrices: wkv's and wgate's data (fp32
// rows or packed), both null for in_place; and their decode panels, null where the blob has none (a
// blob written under KVCOMP_KERNELS=-panels serves a process without it, and the other way round).
struct PreparedView {
  const void* kv = nullptr;
  const void* gate = nullptr;
  const std::uint16_t* kv_panels = nullptr;
  const std::uint16_t* gate_panels = nullptr;
};
PreparedView prepared_view(const void* blob);

}  // namespace kvcomp::detail
