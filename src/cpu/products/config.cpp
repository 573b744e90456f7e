#include "cpu/products/config.hpp"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cpu/products/amx.hpp"
#include "cpu/products/onednn_bf16_tiles.hpp"
#include "cpu/products/order_probes.hpp"

namespace kvcomp::detail {

namespace {

ProductChoice read_choice() {
  const char* v = std::getenv("KVCOMP_PRODUCTS");
  if (!v || !*v || std::strcmp(v, "auto") == 0) return ProductChoice::automatic;
  if (std::strcmp(v, "bf16") == 0) return ProductChoice::bf16;
  if (std::strcmp(v, "f32") == 0) return ProductChoice::f32;
  std::fprintf(stderr, "[kvcomp] KVCOMP_PRODUCTS (= %s) must be auto, bf16 or f32; ignored\n", v);
  return ProductChoice::automatic;
}

bool onednn_isa_at_least(dnnl_cpu_isa_t want) {
  const auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  return (isa & static_cast<unsigned>(want)) == static_cast<unsigned>(want);
}

// oneDNN's implementation name for the plain tile primitive of shape s, or empty where it makes none.
std::string tile_kernel_of(bool packed, const Bf16Shape& s) {
  try {
    return tile_primitive(packed, s, false)->pd.impl_info_str();
  } catch (const std::exception&) {
    return {};
  }
}

bool is_matrix_unit_kernel(const std::string& impl) {
  return impl.find("bf16") != std::string::npos &&
         (impl.find("amx") != std::string::npos || impl.find("avx512_core_bf16") != std::string::npos);
}

bool is_amd() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}

std::string describe(const ProductConfig& c) {
  // The f32 products' note: decode-sized projections on kvcomp's AVX2 kernel (rows.hpp).
  const std::string rows = !c.f32_rows_kernel ? ""
                           : c.sgemm_avx512   ? "; 1-8 rows: kvcomp avx2, order probed per shape"
                                              : "; 1-8 rows: kvcomp avx2";
  if (!c.bf16()) return "f32 (dnnl_sgemm)" + rows;
  const char* backward = c.bf16_split      ? ", precise as hi+lo"
                         : c.bf16_backward ? ", precise in f32"
                                           : ", backward in f32";
  const char* bf16_rows = !c.bf16_rows_kernel ? ""
                          : c.bf16_decode_panels
                              ? ", 1-8 rows, calls of 128+ rows and prepared weights: kvcomp avx512_bf16"
                              : ", 1-8 rows and prepared weights: kvcomp avx512_bf16";
  if (c.bf16_kernels.amx)
    return std::string("bf16 (kvcomp amx_bf16") + backward + ") + f32 (dnnl_sgemm)" + rows;
  return "bf16 (" + c.bf16_kernel + (c.bf16_kernels.packed ? ", packed B" : "") +
         (c.strided_kernel.empty() ? "" : ", row-strided tiles " + c.strided_kernel) + backward + bf16_rows +
         ") + f32 (dnnl_sgemm)" + rows;
}

ProductConfig make_config() {
  ProductConfig c;
  c.isa = active_isa();
  c.f16c = cpu_has_f16c();
  c.amd = is_amd();
  c.choice = read_choice();
  c.switches = kernel_switches();

  // fp32 products.
  c.sgemm_avx512 = onednn_isa_at_least(dnnl_cpu_isa_avx512_core);
  c.sgemm_known = c.sgemm_avx512 || onednn_isa_at_least(dnnl_cpu_isa_avx2);
  c.f32_rows_kernel = c.sgemm_known && c.isa >= Isa::avx2 && c.switches.rows &&
                      rows_kernel_matches_sgemm(c.sgemm_avx512, false);
  c.f16_rows_kernel = c.f32_rows_kernel && c.f16c && rows_kernel_matches_sgemm(c.sgemm_avx512, true);
  // Whatever KVCOMP_ISA says (detected, not active), so that a blob's size does not depend on it.
  c.decode_panels = c.switches.panels && detected_isa() >= Isa::avx2 && c.sgemm_known;

  // bf16 products: where the CPU has bf16 units, unless KVCOMP_PRODUCTS=f32 or KVCOMP_ISA caps the
  // kernels below avx512 (so that one machine tests both paths).
  c.bf16_kernels.packed = c.switches.packed;
  if (c.choice == ProductChoice::f32) {
    c.bf16_off = "KVCOMP_PRODUCTS=f32";
  } else if (c.isa != Isa::avx512) {
    c.bf16_off = detected_isa() != Isa::avx512 ? "this CPU has no AVX-512 (nor bf16 units)"
                                               : "KVCOMP_ISA caps kvcomp's kernels below avx512";
  } else {
    const std::string impl = tile_kernel_of(c.bf16_kernels.packed, Bf16Shape{256, 256, 256, 256, 256, false});
    if (is_matrix_unit_kernel(impl))
      c.bf16_kernel = impl;
    else  // (none too): fp32 products
      c.bf16_off =
          "oneDNN has no bf16 matrix-unit kernel on this CPU (" + (impl.empty() ? "none" : impl) + ")";
  }
  if (c.bf16()) {
    const bool amx = c.bf16_kernel.find("amx") != std::string::npos;
    // kvcomp's AMX kernel where oneDNN's kernel is its AMX one (so DNNL_MAX_CPU_ISA below AMX keeps it
    // off too) and the process may use the tiles; not in the packed test mode, which tests oneDNN's
    // packed path, nor with -amx.
    c.bf16_kernels.amx = amx && !c.bf16_kernels.packed && c.switches.amx && amx_tiles_usable();
    // The precise backward as hi + lo parts where that is faster than fp32: on AMX (bf16 at about 3x
    // the fp32 rate), not on AVX512-BF16 (about 1.5x on Zen 4: two parts are slower than fp32).
    c.bf16_split = c.choice == ProductChoice::bf16 || amx;
    // The npu_parity backward on the units where they outrun the fp32 FMAs: AMX, AMD's AVX512-BF16;
    // not Intel's AVX512-BF16 without AMX (Cooper Lake, or a Xeon whose AMX a hypervisor hides: 0.5-0.65x
    // the fp32 rate). The forward keeps the units there: a decode call reads the bf16 weights in place,
    // half the bytes, and the forward's kernel cannot differ between a decode and a prefill call.
    c.bf16_backward = c.bf16_split || c.amd;
    // kvcomp's AVX512-BF16 rows kernel sums in the order of oneDNN's jit gemm, which reads B where it
    // lies; where oneDNN packs B (AMX, whose CPUs have AVX512-BF16 too; +packed) it does not apply.
    c.bf16_rows_kernel =
        !c.bf16_kernels.packed && !amx && cpu_has_avx512_bf16() && c.isa >= Isa::avx512 && c.switches.rows;
    c.bf16_decode_panels = c.bf16_rows_kernel && c.switches.panels;
    // oneDNN 2.6's AMX brgemm takes only dense A and C, so on AMX the row-strided tiles (the two
    // projections side by side: most of kvcomp's product tiles) run its jit gemm.
    const std::string strided =
        tile_kernel_of(c.bf16_kernels.packed, Bf16Shape{256, 256, 256, 512, 256, true});
    if (strided != c.bf16_kernel) c.strided_kernel = strided;
  }
  c.description = describe(c);
  return c;
}

}  // namespace

const ProductConfig& product_config() {
  static const ProductConfig c = make_config();
  return c;
}

const char* product_kernels() { return product_config().description.c_str(); }

std::optional<SgemmOrder> projection_order(const ProductConfig& c, std::int64_t half, std::int64_t K,
                                           std::int64_t ld) {
  const std::int64_t N = 2 * half, full = std::min(kF32TileCols, N);
  const std::int64_t last = N - (N - 1) / kF32TileCols * kF32TileCols;
  const std::optional<SgemmOrder> a = sgemm_order_for(c.sgemm_avx512, full, K, ld, ld);
  const std::optional<SgemmOrder> b = sgemm_order_for(c.sgemm_avx512, last, K, ld, ld);
  if (a && b && *a == *b) return a;
  return std::nullopt;
}

std::optional<RowsKernelOrders> rows_kernel_orders(const ProductConfig& c, bool row_stable, std::int64_t N,
                                                   std::int64_t K, std::int64_t lda, std::int64_t ldb) {
  if (!row_stable || !c.f32_rows_kernel || N <= 0) return std::nullopt;
  const std::int64_t tiles_n = (N + kF32TileCols - 1) / kF32TileCols;
  return RowsKernelOrders{sgemm_order_for(c.sgemm_avx512, std::min(kF32TileCols, N), K, lda, ldb),
                          sgemm_order_for(c.sgemm_avx512, N - (tiles_n - 1) * kF32TileCols, K, lda, ldb)};
}

std::optional<SgemmOrder> rows_16bit_order(const ProductConfig& c, bool row_stable, std::int64_t n,
                                           std::int64_t half, std::int64_t K, std::int64_t ld, bool fp16) {
  if (!row_stable || n < 1 || n > kRowsKernelMax || half <= 0 || half % 16 != 0 || !c.rows_kernel_for(fp16))
    return std::nullopt;
  return projection_order(c, half, K, ld);
}

std::optional<SgemmOrder> row_panels_order(const ProductConfig& c, bool row_stable, std::int64_t n,
                                           std::int64_t half, std::int64_t K, std::int64_t ld, bool fp16) {
  // Up to kPanelRowsMax rows on AVX-512; longer calls, whose padding costs little, keep sgemm's rate.
  const bool rows_ok = n == 1 || (n > 1 && n <= kPanelRowsMax && c.isa >= Isa::avx512);
  if (!row_stable || !rows_ok || half <= 0 || half % 16 != 0 || !c.rows_kernel_for(fp16)) return std::nullopt;
  return projection_order(c, half, K, ld);
}

bool gemm_b_plain_same_bits(const F32Tiling& t, std::int64_t N, std::int64_t K, std::int64_t lda,
                            std::int64_t ldb_t, std::int64_t ldb_plain) {
  // Only where both layouts' tiles are the same 256 rows of sgemm's copy-based kernel.
  if (!t.row_stable || !t.sgemm_avx512 || N <= 0 || K < 1200 || gemm_tile_rows(t, K, true) != 256 ||
      gemm_tile_rows(t, K, false) != 256)
    return false;
  return sgemm_b_plain_matches(N, K, lda, ldb_t, ldb_plain);
}

bool bf16_c_rounds_like_f32(const Bf16Kernels& k, const Bf16Shape& s) {
  if (!s.c_bf16) return false;
  if (k.amx) return true;          // the kernel rounds its fp32 sums with f32_to_bf16
  return bf16_c_tile_probe(k, s);  // else: fp32 rows
}

std::int64_t bf16_packed_short_rows(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t n) {
  if (n < 1 || n >= kBf16TileRows) return 0;
  const std::int64_t m = (n + kBf16ShortTileRows - 1) / kBf16ShortTileRows * kBf16ShortTileRows;
  if (k.amx) return m;                            // any height gives a row the same sums
  return bf16_short_tile_probe(k, s, m) ? m : 0;  // else: a whole 64-row tile
}

bool bf16_rows_kernel_applicable(const Bf16Kernels& k, bool available, const Bf16Shape& s, std::int64_t M,
                                 bool panels) {
  if (!available || M < 1 || (M > kRowsKernelMax && !panels) || !s.b_transposed || s.N % 16 != 0 || s.K < 1)
    return false;
  // Decided once per shape (a decode call's is the same every time): oneDNN's jit gemm reads this B in
  // place, and the kernel's order matches it for this K (checked once per K).
  static std::mutex mu;
  using ShapeKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
  static std::map<ShapeKey, bool> shapes;
  const auto key = std::make_tuple(s.N, s.K, s.lda, s.ldc, s.ldb);
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (const auto it = shapes.find(key); it != shapes.end()) return it->second;
  }
  const bool ok = bf16_short_rows_stable(k, s, 2) && bf16_rows_kernel_probe(k, s.K);
  const std::lock_guard<std::mutex> lock(mu);
  return shapes[key] = ok;
}

}  // namespace kvcomp::detail
