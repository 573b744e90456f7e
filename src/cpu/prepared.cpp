#include "cpu/prepared.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "cpu/backend.hpp"
#include "cpu/convert.hpp"
#include "cpu/products/config.hpp"
#include "cpu/products/onednn_bf16.hpp"
#include "cpu/products/onednn_f32.hpp"
#include "cpu/products/rows.hpp"

namespace kvcomp::detail {

namespace {

constexpr char kMagic[8] = {'K', 'V', 'C', 'P', 'R', 'E', 'P', '1'};

struct Header {
  char magic[8];
  std::uint32_t kind;
  std::uint32_t io;
  std::int64_t C, H;
  std::uint64_t kernels;      // hash of product_kernels(): the blob is only good for these kernels
  std::uint64_t data_bytes;   // after the header
  std::uint64_t panel_bytes;  // the decode panels at the end of data_bytes (f32 kind), or 0
  std::uint64_t reserved;
};
static_assert(sizeof(Header) <= kPreparedHeaderBytes);

// FNV-1a of the product kernels' description (stable across runs of one build on one machine), up to
// a "; " note: the AVX2 rows kernel ("; 1-8 rows: ...") reads the same fp32 rows as sgemm, so a blob
// does not depend on whether it runs (KVCOMP_ISA, -rows, a call's row stability).
// Likewise without the AVX512-BF16 rows kernel's note (", 1-8 rows: ..."): it reads B where it lies or
// the blob's optional panels, which give the same bits.
std::uint64_t kernels_hash() {
  static const std::uint64_t hash = [] {
    std::string k = product_config().description;
    k = k.substr(0, k.find(';'));
    const std::size_t note = k.find(", 1-8 rows");
    if (note != std::string::npos) k.erase(note, k.find(')', note) - note);
    std::uint64_t h = 1469598103934665603ull;
    for (const char ch : k) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    return h;
  }();  // fixed for the process
  return hash;
}

// The AVX-512 decode panels' bytes that bf16 weights [C, H] may have in an in_place blob.
std::size_t possible_bf16_panel_bytes(std::int64_t C, std::int64_t H) {
  return 2 * bf16_panel_elements(C, H) * sizeof(std::uint16_t);
}

// The decode panels' bytes that weights [C, H] of dtype io may have in an f32 blob (products/onednn_f32.hpp),
// whether or not this process writes them.
std::size_t possible_panel_bytes(DType io, std::int64_t C, std::int64_t H) {
  return (io == DType::bf16 || io == DType::f16) && C % 16 == 0
             ? static_cast<std::size_t>(2 * C * H) * sizeof(std::uint16_t)
             : 0;
}

Status invalid(const std::string& what) { return {StatusCode::invalid_param, "[kvcomp] " + what}; }

}  // namespace

std::size_t bf16_panel_elements(std::int64_t C, std::int64_t H) {
  return C % 16 == 0 ? static_cast<std::size_t>((C / 16) * 32 * bf16_panel_pairs(H)) : 0;
}

void write_bf16_panels(const std::uint16_t* wkv, const std::uint16_t* wgate, std::int64_t C, std::int64_t H,
                       std::uint16_t* panels, int num_threads) {
  // Work items of 4 groups (64 columns, 4 x 32 x pairs(H) values): the groups of a panel are written
  // independently, so the threads deal them out.
  constexpr std::int64_t kGroups = 4;
  const std::int64_t groups = C / 16, items = (groups + kGroups - 1) / kGroups;
  const std::int64_t group = 32 * bf16_panel_pairs(H);
  const std::size_t per = bf16_panel_elements(C, H);
#pragma omp parallel for num_threads( \
    static_cast <int>(std::clamp <std::int64_t>(num_threads, 1, 2 * items))) schedule(static)
  for (std::int64_t i = 0; i < 2 * items; ++i) {
    const std::int64_t g0 = i % items * kGroups, n = 16 * (std::min(groups, g0 + kGroups) - g0);
    write_panels_avx512_bf16((i < items ? wkv : wgate) + 16 * g0 * H, H, n, H,
                             panels + (i < items ? 0 : per) + g0 * group);
  }
}

Bf16Shape projection_shape(std::int64_t C, std::int64_t H) { return {C, H, H, padded_ld(2 * C), H, true}; }

bool prepared_layout(DType io, std::int64_t C, std::int64_t H, PreparedLayout* out) {
  const ProductConfig& config = product_config();
  if (io == DType::bf16 && config.bf16()) {
    const Bf16Plan p = bf16_plan(config.bf16_kernels, projection_shape(C, H));
    if (!p.ok) return false;
    const std::size_t panels = config.bf16_decode_panels ? possible_bf16_panel_bytes(C, H) : 0;
    *out = p.packed_bytes > 0 ? PreparedLayout{PreparedKind::packed, 2 * p.packed_bytes}
                              : PreparedLayout{PreparedKind::in_place, panels, panels};
    return true;
  }
  const std::size_t panel_bytes =
      config.decode_panels_for(io == DType::f16) ? possible_panel_bytes(io, C, H) : 0;
  *out = {PreparedKind::f32, static_cast<std::size_t>(2 * C * padded_ld(H)) * sizeof(float) + panel_bytes,
          panel_bytes};
  return true;
}

Status write_prepared(const Tensor& wkv, const Tensor& wgate, const PreparedLayout& layout, void* blob,
                      int num_threads) {
  const std::int64_t C = wkv.dim(0), H = wkv.dim(1);
  auto* data = static_cast<unsigned char*>(blob) + kPreparedHeaderBytes;
  if (layout.kind == PreparedKind::packed) {
    const Bf16PackJob jobs[] = {
        {static_cast<const std::uint16_t*>(wkv.data), data},
        {static_cast<const std::uint16_t*>(wgate.data), data + layout.data_bytes / 2}};
    if (!bf16_pack_b(product_config().bf16_kernels, projection_shape(C, H), jobs, 2, num_threads))
      return {StatusCode::runtime_error, "[kvcomp] oneDNN reorder of the bf16 weights failed"};
  } else if (layout.kind == PreparedKind::in_place && layout.panel_bytes > 0) {
    write_bf16_panels(static_cast<const std::uint16_t*>(wkv.data),
                      static_cast<const std::uint16_t*>(wgate.data), C, H,
                      reinterpret_cast<std::uint16_t*>(data), num_threads);
  } else if (layout.kind == PreparedKind::f32) {
    const std::int64_t ld = padded_ld(H);
    auto* w = reinterpret_cast<float*>(data);
    rows_to_f32(wkv.data, wkv.dtype, C, H, w, ld, num_threads);
    rows_to_f32(wgate.data, wgate.dtype, C, H, w + C * ld, ld, num_threads);
    if (layout.panel_bytes > 0) {
      auto* panels = reinterpret_cast<std::uint16_t*>(w + 2 * C * ld);
      const bool fp16 = wkv.dtype == DType::f16;
      write_panels(static_cast<const std::uint16_t*>(wkv.data), H, C, H, panels, num_threads, fp16);
      write_panels(static_cast<const std::uint16_t*>(wgate.data), H, C, H, panels + C * H, num_threads, fp16);
    }
  }
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.kind = static_cast<std::uint32_t>(layout.kind);
  h.io = static_cast<std::uint32_t>(wkv.dtype);
  h.C = C;
  h.H = H;
  h.kernels = kernels_hash();
  h.data_bytes = layout.data_bytes;
  h.panel_bytes = layout.panel_bytes;
  std::memset(blob, 0, kPreparedHeaderBytes);
  std::memcpy(blob, &h, sizeof h);  // last: a blob whose data failed has no valid header
  return Status::success();
}

Status check_prepared(const void* blob, std::size_t bytes, DType io, std::int64_t C, std::int64_t H) {
  const std::string what = "prepared_weights (" + std::to_string(bytes) + " bytes) ";
  Header h{};
  if (bytes < kPreparedHeaderBytes) return invalid(what + "must come from prepare_weights() (too short)");
  std::memcpy(&h, blob, sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0)
    return invalid(what + "must come from prepare_weights() (no header)");
  if (h.C != C || h.H != H || h.io != static_cast<std::uint32_t>(io))
    return invalid(what + "must be prepared from weights like this call's: [" + std::to_string(h.C) + ", " +
                   std::to_string(h.H) + "] " + dtype_name(static_cast<DType>(h.io)) + " given, [" +
                   std::to_string(C) + ", " + std::to_string(H) + "] " + dtype_name(io) + " wanted");
  PreparedLayout want;
  if (!prepared_layout(io, C, H, &want))
    return {StatusCode::runtime_error, "[kvcomp] oneDNN could not create the bf16 projection product"};
  // Decode panels are optional (KVCOMP_KERNELS=-panels where the blob was written, or here): a blob
  // with or without them serves, the forward reads them only where present.
  const std::size_t rows_bytes = want.data_bytes - want.panel_bytes;
  const bool panels_ok =
      h.panel_bytes == 0 ||
      (want.kind == PreparedKind::f32 && h.panel_bytes == possible_panel_bytes(io, C, H)) ||
      (want.kind == PreparedKind::in_place && io == DType::bf16 &&
       h.panel_bytes == possible_bf16_panel_bytes(C, H));
  if (h.kernels != kernels_hash() || h.kind != static_cast<std::uint32_t>(want.kind) || !panels_ok ||
      h.data_bytes != rows_bytes + h.panel_bytes)
    return invalid(what + "must be prepared on this machine with these product kernels (" +
                   product_config().description + "); prepare again");
  if (bytes < kPreparedHeaderBytes + h.data_bytes)
    return invalid(what + "must hold its " + std::to_string(kPreparedHeaderBytes + h.data_bytes) + " bytes");
  return Status::success();
}

PreparedView prepared_view(const void* blob) {
  Header h{};
  std::memcpy(&h, blob, sizeof h);
  const auto* data = static_cast<const unsigned char*>(blob) + kPreparedHeaderBytes;
  if (h.kind == static_cast<std::uint32_t>(PreparedKind::in_place)) {  // AVX-512 decode panels or nothing
    PreparedView v;
    if (h.panel_bytes > 0) {
      v.kv_panels = reinterpret_cast<const std::uint16_t*>(data);
      v.gate_panels = v.kv_panels + h.panel_bytes / 2 / sizeof(std::uint16_t);
    }
    return v;
  }
  const std::size_t rows_bytes = h.data_bytes - h.panel_bytes;
  PreparedView v{data, data + rows_bytes / 2};  // two matrices of one size each
  if (h.panel_bytes > 0) {
    v.kv_panels = reinterpret_cast<const std::uint16_t*>(data + rows_bytes);
    v.gate_panels = v.kv_panels + h.panel_bytes / 2 / sizeof(std::uint16_t);
  }
  return v;
}

}  // namespace kvcomp::detail
