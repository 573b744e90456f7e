#include "cpu/gemm.hpp"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "cpu/convert.hpp"
#include "cpu/gemm_rows.hpp"
#include "cpu/isa.hpp"
#include "kvcomp/half.hpp"

namespace kvcomp::detail {

namespace {

// Tile sizes. Fixed per oneDNN ISA: changing them changes the rounding of
// results (still deterministic), so they are part of the numerical contract
// of a release. The row tile is a multiple of every row quantum of its ISA.
constexpr std::int64_t kTileN = 256;

// oneDNN 2.6's sgemm kernels (row-major A[M,K] becomes the n dimension of its
// column-major call). AVX-512 (avx512_core and up), one thread, tiles of at
// most 256 columns, leading dimensions never a multiple of 256 (padded_ld):
// every call of 16 to 199 rows computes each row alike. From 200 rows on,
// where B is transposed (the forward's projections), the tile is wider than
// 100 columns and K < 1200, sgemm leaves its copy-based kernel for its no-copy
// one (nocopy_checker_avx512), whose K blocks differ for K 769-1199: so tiles
// of 192 rows there, 256 elsewhere (tile_m; measured on AMD Zen 5: N 16-256,
// K 16-8200, calls of 16-256 rows (a sample) against 192- and 256-row calls,
// B transposed or not). AVX2: the no-copy driver cuts n into blocks
// of 64 (96 when our B is transposed) and a block into groups of 6 rows;
// rows in a final group of 1-3 rows are summed in another order, those in a
// final group of 4 or 5 rows as in a whole group. So a call of one block
// whose row count is 0, 4 or 5 modulo 6 computes every row as a whole block
// does, and with tiles of 192 rows every block of a longer call is whole.
// (Measured with Debian's oneDNN 2.6.3 on an AVX2-only AMD EPYC: every M <= 96
// (B transposed) or <= 64 (B plain) against 192-row calls, K from 1 to 10240,
// N from 1 to 256, rows at offsets 0-96, padded leading dimensions.)
bool onednn_has_avx512() {
  static const bool yes = [] {
    const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    const unsigned avx512_core = static_cast<unsigned>(dnnl_cpu_isa_avx512_core);
    return (isa & avx512_core) == avx512_core;
  }();
  return yes;
}

// oneDNN runs its AVX2 kernels (AVX2 and not AVX-512).
bool onednn_on_avx2() {
  const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const unsigned avx2 = static_cast<unsigned>(dnnl_cpu_isa_avx2);
  return (isa & avx2) == avx2 && !onednn_has_avx512();
}

// oneDNN's sgemm is one whose order gemm_rows.hpp reproduces (its AVX2 or AVX-512 kernels).
bool onednn_sgemm_known() { return onednn_on_avx2() || onednn_has_avx512(); }

// The kernel checks' buffers: std::malloc, never operator new (the fp32 products allocate nothing with it,
// docs/robustness.md); null when it fails.
using ProbeFloats = std::unique_ptr<float, decltype(&std::free)>;
ProbeFloats probe_floats(std::size_t count) {
  return ProbeFloats(static_cast<float*>(std::malloc(count * sizeof(float))), &std::free);
}

// Operands of the kernel checks: values of many magnitudes (2^-15 to 2^23) and both signs, so that the
// order of additions shows in the bits.
void fill_probe(float* v, std::size_t count, std::uint32_t state) {
  for (std::size_t i = 0; i < count; ++i) {
    state = state * 1664525u + 1013904223u;
    v[i] = static_cast<float>(static_cast<std::int32_t>(state >> 8) - (1 << 23)) /
           static_cast<float>(1u << (state & 15u));
  }
}

// The order (gemm_rows.hpp) in which oneDNN's AVX-512 sgemm, on one thread, sums the rows of a tile of nt
// columns (a multiple of 16) and depth K, A and B (stored [nt, K]) with row strides lda and ldb: the
// candidate whose gemm_rows_avx2 gives the last 1, 3 and 8 rows of a 24-row sgemm call (its long-call
// path) bit for bit, or none (std::malloc failed, or neither matches: the padding stays). The strides
// matter: with K 2048 or 4096 and 128 or more columns, sgemm sums in another order where they are K than
// where they are K + 16 (measured on AMD Zen 5). Called on one thread with the OpenMP limit 1.
std::optional<SgemmOrder> probe_avx512_order(std::int64_t nt, std::int64_t K, std::int64_t lda,
                                             std::int64_t ldb) {
  constexpr std::int64_t rows = 24;
  const std::size_t floats = static_cast<std::size_t>(rows * lda + nt * ldb + (rows + kRowsKernelMax) * nt);
  const ProbeFloats mem = probe_floats(floats);
  if (!mem) return std::nullopt;
  float* const a = mem.get();
  float* const b = a + rows * lda;
  float* const ref = b + nt * ldb;
  float* const out = ref + rows * nt;
  fill_probe(a, static_cast<std::size_t>(rows * lda + nt * ldb), 0x85ebca6bu + static_cast<std::uint32_t>(K));
  if (dnnl_sgemm('N', 'T', rows, nt, K, 1.0f, a, lda, b, ldb, 0.0f, ref, nt) != dnnl_success)
    return std::nullopt;
  for (const SgemmOrder order : {kSgemmAvx512Halves, kSgemmAvx512Fixed}) {
    bool same = true;
    for (const std::int64_t m : {std::int64_t{1}, std::int64_t{3}, kRowsKernelMax}) {
      gemm_rows_avx2(m, nt, K, a + (rows - m) * lda, lda, b, ldb, out, nt, order);
      const std::size_t bytes = static_cast<std::size_t>(m * nt) * sizeof(float);
      same = same && std::memcmp(out, ref + (rows - m) * nt, bytes) == 0;
    }
    if (same) return order;
  }
  return std::nullopt;
}

// The results of one probe of oneDNN's sgemm, per key (shape and strides), kept for the process: a fixed
// table of N entries, nothing allocated with operator new; past N a key is probed each time. The probe
// runs on one thread with the OpenMP limit 1, as gemm_f32 runs each sgemm tile.
template <class Key, class Value, std::size_t N>
class ProbeTable {
 public:
  template <class Probe>
  Value get(const Key& key, Probe&& probe) {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      for (std::size_t i = 0; i < used_; ++i)
        if (known_[i].first == key) return known_[i].second;
    }
    Value value{};
#pragma omp parallel num_threads(1)
    {
      omp_set_num_threads(1);
      value = probe();
    }
    const std::lock_guard<std::mutex> lock(mu_);
    if (used_ < N) known_[used_++] = {key, value};
    return value;
  }

 private:
  std::mutex mu_;
  std::array<std::pair<Key, Value>, N> known_{};
  std::size_t used_ = 0;
};

// sgemm's order for a tile of nt columns and depth K, A and B (stored [nt, K]) with row strides lda and
// ldb: none unless nt is a multiple of 16 (the kernel's groups); the AVX2 sgemm's is the same for every
// shape and stride (checked once per process by use_rows_kernel); the AVX-512 sgemm's is probed once per
// shape and strides and kept (a ProbeTable of 32).
std::optional<SgemmOrder> sgemm_order_for(std::int64_t nt, std::int64_t K, std::int64_t lda,
                                          std::int64_t ldb) {
  if (nt <= 0 || nt % 16 != 0 || K <= 0) return std::nullopt;
  if (!onednn_has_avx512()) return kSgemmAvx2;
  static ProbeTable<std::array<std::int64_t, 4>, std::optional<SgemmOrder>, 32> orders;
  return orders.get({nt, K, lda, ldb}, [&] { return probe_avx512_order(nt, K, lda, ldb); });
}

// The one order of all sgemm tiles of the forward projection [n, 2 half] (gemm_f32's column tiles over
// wkv's and wgate's columns side by side, its fp32 operands with row stride ld), or none where they
// differ: kvcomp's kernels cut that product per weight matrix.
std::optional<SgemmOrder> projection_order(std::int64_t half, std::int64_t K, std::int64_t ld) {
  const std::int64_t N = 2 * half, full = std::min(kTileN, N), last = N - (N - 1) / kTileN * kTileN;
  const std::optional<SgemmOrder> a = sgemm_order_for(full, K, ld, ld), b = sgemm_order_for(last, K, ld, ld);
  if (a && b && *a == *b) return a;
  return std::nullopt;
}

// gemm_b_plain_same_bits's probe, on one thread with the OpenMP limit 1: the last 16, 208 and 256 rows of
// a 256-row A against the full column tile and the last one of B, each product with B transposed and
// with B plain, bit for bit. Memory from std::malloc (as probe_avx512_order's: nothing with operator
// new); none: false.
bool probe_b_plain(std::int64_t N, std::int64_t K, std::int64_t lda, std::int64_t ldb_t,
                   std::int64_t ldb_plain) {
  constexpr std::int64_t rows = 256;
  const std::int64_t full = std::min(kTileN, N), last = N - (N - 1) / kTileN * kTileN;
  const std::size_t floats =
      static_cast<std::size_t>(rows * lda + full * ldb_t + K * ldb_plain + 2 * rows * full);
  const ProbeFloats mem = probe_floats(floats);
  if (!mem) return false;
  float* const a = mem.get();
  float* const bt = a + rows * lda;
  float* const b = bt + full * ldb_t;
  float* const c_t = b + K * ldb_plain;
  float* const c_plain = c_t + rows * full;
  fill_probe(a, static_cast<std::size_t>(rows * lda), 0x27d4eb2fu + static_cast<std::uint32_t>(K));
  fill_probe(bt, static_cast<std::size_t>(full * ldb_t), 0x165667b1u + static_cast<std::uint32_t>(N));
  for (std::int64_t k = 0; k < K; ++k)
    for (std::int64_t n = 0; n < full; ++n) b[k * ldb_plain + n] = bt[n * ldb_t + k];
  const std::int64_t widths[] = {full, last};
  for (int w = 0; w < (last == full ? 1 : 2); ++w)
    for (const std::int64_t m : {std::int64_t{16}, std::int64_t{208}, rows}) {
      const std::int64_t nt = widths[w];
      const float* a_m = a + (rows - m) * lda;
      if (dnnl_sgemm('N', 'T', m, nt, K, 1.0f, a_m, lda, bt, ldb_t, 0.0f, c_t, nt) != dnnl_success ||
          dnnl_sgemm('N', 'N', m, nt, K, 1.0f, a_m, lda, b, ldb_plain, 0.0f, c_plain, nt) != dnnl_success ||
          std::memcmp(c_t, c_plain, static_cast<std::size_t>(m * nt) * sizeof(float)) != 0)
        return false;
    }
  return true;
}

// KVCOMP_ROW_STABLE=0 (read once per process) turns the padding off: calls
// of fewer than 16 rows (decode) then take oneDNN's short-call path, about
// twice as fast at one row (docs/performance.md), and their rows no longer
// match the same tokens in a longer call.
bool row_stable() {
  static const bool yes = [] {
    const char* v = std::getenv("KVCOMP_ROW_STABLE");
    return v == nullptr || v[0] != '0';
  }();
  return yes;
}

// Rows per tile of a product of depth K: 192 where sgemm keeps every row's order only below 200 rows (AVX2;
// AVX-512 with B transposed and K < 1200, above), 256 elsewhere (fewer passes over B: C4A's forward at
// T = 4096 on fp32 products, 204 -> 183 ms on Zen 5) and without row stability.
std::int64_t tile_m(std::int64_t K, bool b_transposed) {
  if (!row_stable()) return 256;
  if (!onednn_has_avx512()) return 192;
  return b_transposed && K < 1200 ? 192 : 256;
}

// Compares gemm_rows_avx2 with sgemm bit for bit: every row count 1-8 against the rows of a 24-row call
// (the long-call path of both sgemms: four whole groups of 6 on AVX2, >= 16 rows on AVX-512), and one
// row from decode panels (gemm_row_avx2_panels),
// over K that take each branch of sgemm_k_blocks, with leading dimensions that are not multiples of 16.
// fp16 false: B in fp32 and bf16 rows, bf16 panels; true: B in fp16 rows (gemm_rows_avx2_f16) and fp16
// panels, B's values spanning fp16's range, subnormals and zeros included. False at the first difference,
// or when the buffers cannot be allocated (std::malloc: the fp32 products allocate nothing with operator
// new, docs/robustness.md).
bool rows_kernel_matches_sgemm(bool fp16) {
  constexpr std::int64_t rows = 24, n = 32, k_max = 4096, ld = k_max + 5;
  const std::size_t floats = static_cast<std::size_t>((rows + n) * ld + (rows + kRowsKernelMax) * n +
                                                      (n * ld + 1) / 2 + n * k_max / 2);
  const ProbeFloats mem = probe_floats(floats);
  if (!mem) return false;
  float* const a = mem.get();
  float* const b = a + rows * ld;
  float* const ref = b + n * ld;
  float* const out = ref + rows * n;
  auto* const b16 = reinterpret_cast<std::uint16_t*>(out + kRowsKernelMax * n);
  std::uint16_t* const panels = b16 + 2 * ((n * ld + 1) / 2);
  // fill_probe's values; B's are rounded to bf16 values, or scaled by 2^-10 / 2^(i % 16) and rounded to
  // fp16, kept as 16-bit values too for the 16-bit variants.
  fill_probe(a, static_cast<std::size_t>((rows + n) * ld), 0x9e3779b9u);
  for (std::size_t i = 0; i < static_cast<std::size_t>(n * ld); ++i) {
    b16[i] = fp16 ? float_to_fp16(b[i] * 0x1p-10f / static_cast<float>(1u << (i % 16))) : float_to_bf16(b[i]);
    b[i] = fp16 ? fp16_to_float(b16[i]) : bf16_to_float(b16[i]);
  }
  const auto rows_16bit = fp16 ? &gemm_rows_avx2_f16 : &gemm_rows_avx2_bf16;
  for (const std::int64_t k : {std::int64_t{3}, std::int64_t{256}, std::int64_t{300}, std::int64_t{511},
                               std::int64_t{769}, std::int64_t{1003}, std::int64_t{1539}, k_max}) {
    // AVX-512: the order probed for this shape (none: the kernel is not used for it, nothing to check).
    const std::optional<SgemmOrder> probed = sgemm_order_for(n, k, ld, ld);
    if (!probed) continue;
    const SgemmOrder order = *probed;
    if (dnnl_sgemm('N', 'T', rows, n, k, 1.0f, a, ld, b, ld, 0.0f, ref, n) != dnnl_success) return false;
    for (std::int64_t m = 1; m <= kRowsKernelMax; ++m) {
      // The last m rows: a run that does not start at a group boundary.
      const float* const want = ref + (rows - m) * n;
      const std::size_t bytes = static_cast<std::size_t>(m * n) * sizeof(float);
      if (!fp16) {
        gemm_rows_avx2(m, n, k, a + (rows - m) * ld, ld, b, ld, out, n, order);
        if (std::memcmp(out, want, bytes) != 0) return false;
      }
      rows_16bit(m, n, k, a + (rows - m) * ld, ld, b16, ld, out, n, order);
      if (std::memcmp(out, want, bytes) != 0) return false;
    }
    write_panels(b16, ld, n, k, panels, 1, fp16);
    gemm_row_avx2_panels(n, k, a + (rows - 1) * ld, panels, out, fp16, order);
    if (std::memcmp(out, ref + (rows - 1) * n, static_cast<std::size_t>(n) * sizeof(float)) != 0)
      return false;
  }
  return true;
}

// Whether gemm_f32 runs calls of at most kRowsKernelMax live rows on gemm_rows_avx2 (decided once per
// process): row stability on, oneDNN on its AVX2 or AVX-512 kernels, the CPU with AVX2 and FMA and
// kvcomp's own kernels not capped below them (KVCOMP_ISA), and the kernel matching sgemm here.
// rows_kernel_matches_sgemm(fp16) with sgemm on one thread, as gemm_f32 calls it (with more, it may
// split K and sum otherwise).
bool rows_kernel_matches_one_thread_sgemm(bool fp16) {
  bool matches = false;
#pragma omp parallel num_threads(1)
  {
    omp_set_num_threads(1);
    matches = rows_kernel_matches_sgemm(fp16);
  }
  return matches;
}

bool use_rows_kernel() {
  static const bool yes = row_stable() && onednn_sgemm_known() && active_isa() >= Isa::avx2 &&
                          rows_kernel_matches_one_thread_sgemm(false);
  return yes;
}

// Whether fp16 weights are read in place by gemm_rows_avx2_f16: the rows kernel in use, the CPU with F16C,
// and the fp16 variant matching sgemm here (checked once per process, as use_rows_kernel).
bool use_f16_rows_kernel() {
  static const bool yes = use_rows_kernel() && cpu_has_f16c() && rows_kernel_matches_one_thread_sgemm(true);
  return yes;
}

// The rows kernel for weights of this kind runs here: use_f16_rows_kernel for fp16 (which implies
// use_rows_kernel), use_rows_kernel for bf16 and fp32.
bool rows_kernel_for(bool fp16) { return fp16 ? use_f16_rows_kernel() : use_rows_kernel(); }

}  // namespace

bool gemm_row_stable() { return row_stable(); }

bool gemm_rows_kernel_active() { return use_rows_kernel(); }

bool gemm_rows_order_probed() { return onednn_has_avx512(); }

std::optional<SgemmOrder> gemm_rows_16bit_order(std::int64_t n, std::int64_t half, std::int64_t K,
                                                std::int64_t ld, bool fp16) {
  if (n < 1 || n > kRowsKernelMax || half <= 0 || half % 16 != 0 || !rows_kernel_for(fp16))
    return std::nullopt;
  return projection_order(half, K, ld);
}

namespace {

// Deals the column tiles of both weight matrices ([half, K] each; tiles of `width` columns, the last
// one narrower) to an OpenMP team: f(gate, n0, nt) for the tile [n0, n0 + nt) of wkv (gate false) or
// wgate. Any cut into whole 16-column groups gives the same bits: an element's order does not depend
// on its tile.
template <typename F>
void deal_weight_tiles(std::int64_t half, std::int64_t width, int num_threads, F&& f) {
  const std::int64_t per = (half + width - 1) / width, tiles = 2 * per;
#pragma omp parallel for num_threads(static_cast<int>(std::min<std::int64_t>(num_threads, tiles))) \
    schedule(dynamic, 1)
  for (std::int64_t tile = 0; tile < tiles; ++tile) {
    const bool gate = tile >= per;
    const std::int64_t n0 = (tile - (gate ? per : 0)) * width;
    f(gate, n0, std::min(width, half - n0));
  }
}

}  // namespace

void gemm_rows_16bit_weights(std::int64_t n, std::int64_t half, std::int64_t K, const float* a,
                             std::int64_t lda, const std::uint16_t* wkv, const std::uint16_t* wgate,
                             bool fp16, float* c, std::int64_t ldc, SgemmOrder order, int num_threads) {
  const auto kernel = fp16 ? &gemm_rows_avx2_f16 : &gemm_rows_avx2_bf16;
  // The column tiles of gemm_f32, narrower where the threads outnumber them.
  const std::int64_t width = dealt_tile_cols(half, 2, kTileN, num_threads);
  deal_weight_tiles(half, width, num_threads, [&](bool gate, std::int64_t n0, std::int64_t nt) {
    kernel(n, nt, K, a, lda, (gate ? wgate : wkv) + n0 * K, K, c + (gate ? half : 0) + n0, ldc, order);
  });
}

bool decode_panels_wanted(bool fp16) {
  static const bool yes = [] {
    const char* v = std::getenv("KVCOMP_DECODE_PANELS");
    return (v == nullptr || v[0] != '0') && detected_isa() >= Isa::avx2 && onednn_sgemm_known();
  }();
  return yes && (!fp16 || cpu_has_f16c());
}

void write_panels(const std::uint16_t* w, std::int64_t ldw, std::int64_t n, std::int64_t k,
                  std::uint16_t* out, int num_threads, bool fp16) {
  const std::int64_t panels = (n + kPanelWidth - 1) / kPanelWidth;
  const int threads = static_cast<int>(std::clamp<std::int64_t>(panels, 1, std::max(num_threads, 1)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t p = 0; p < panels; ++p) {
    const std::int64_t c0 = p * kPanelWidth;
    write_panels_avx2(w + c0 * ldw, ldw, std::min(kPanelWidth, n - c0), k, out + c0 * k, fp16);
  }
}

std::optional<SgemmOrder> gemm_row_panels_order(std::int64_t n, std::int64_t half, std::int64_t K,
                                                std::int64_t ld, bool fp16) {
  // Up to 256 rows on AVX-512 (decode: C4A B = 256 12.0 -> 10.5 ms on Zen 5, where sgemm alone on the
  // fp32 rows takes 9.0 ms); longer calls, whose padding costs little, keep sgemm's higher rate.
  const bool rows_ok = n == 1 || (n > 1 && n <= kPanelRowsMax && active_isa() >= Isa::avx512);
  if (!rows_ok || half <= 0 || half % 16 != 0 || !rows_kernel_for(fp16)) return std::nullopt;
  return projection_order(half, K, ld);
}

void gemm_row_panels(std::int64_t n, std::int64_t half, std::int64_t K, const float* a, std::int64_t lda,
                     const std::uint16_t* kv_panels, const std::uint16_t* gate_panels, bool fp16, float* c,
                     std::int64_t ldc, SgemmOrder order, int num_threads) {
  // One panel per tile.
  deal_weight_tiles(half, kPanelWidth, num_threads, [&](bool gate, std::int64_t n0, std::int64_t nt) {
    const std::uint16_t* panel = (gate ? gate_panels : kv_panels) + n0 * K;
    float* out = c + (gate ? half : 0) + n0;
    if (n == 1)
      gemm_row_avx2_panels(nt, K, a, panel, out, fp16, order);
    else
      gemm_rows_avx512_panels(n, nt, K, a, lda, panel, out, ldc, fp16, order);
  });
}

std::int64_t gemm_row_quantum(bool b_transposed) {
  if (!row_stable()) return 1;
  if (onednn_has_avx512()) return 16;
  return b_transposed ? 96 : 64;
}

std::int64_t gemm_tile_rows(std::int64_t K, bool b_transposed) { return tile_m(K, b_transposed); }

bool gemm_b_plain_same_bits(std::int64_t N, std::int64_t K, std::int64_t lda, std::int64_t ldb_t,
                            std::int64_t ldb_plain) {
  // Only where both layouts' tiles are the same 256 rows of sgemm's copy-based kernel.
  if (!row_stable() || !onednn_has_avx512() || N <= 0 || K < 1200 || tile_m(K, true) != 256 ||
      tile_m(K, false) != 256)
    return false;
  static ProbeTable<std::array<std::int64_t, 5>, bool, 16> same;
  return same.get({N, K, lda, ldb_t, ldb_plain}, [&] { return probe_b_plain(N, K, lda, ldb_t, ldb_plain); });
}

std::int64_t gemm_padded_rows(std::int64_t rows, bool b_transposed) {
  const std::int64_t q = gemm_row_quantum(b_transposed);
  if (row_stable() && !onednn_has_avx512() && rows > 0 && rows <= q) {
    // AVX2, one driver block (decode-sized calls): the fewest rows >= `rows`
    // that are 0, 4 or 5 modulo 6 (q itself is: 64 and 96 are), not q.
    std::int64_t m = std::max<std::int64_t>(rows, 4);
    while (m % 6 != 0 && m % 6 < 4) ++m;
    return m;
  }
  return (rows + q - 1) / q * q;
}

namespace {

// The tiles of gemm_f32: B's tile [n0, n0 + nt) comes from b_tile(n0, nt), which returns it as an operand
// (B itself offset to the tile, or a copy of the tile the provider made on the calling thread).
//
// Each tile is one dnnl_sgemm call (oneDNN's BLAS-style entry: no primitive,
// no memory objects, nothing allocated with operator new; its packing
// buffers come from oneDNN's own aligned malloc). The calling thread's
// OpenMP limit is set to 1 first, because dnnl_sgemm sizes its internal
// split by omp_get_max_threads() when it is not already inside an active
// parallel region, which is the case with one thread.
template <typename BTile>
bool gemm_f32_tiles(std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a, bool b_transposed,
                    std::int64_t ldb, BTile&& b_tile, float* c, std::int64_t ldc, bool accumulate,
                    int num_threads, std::int64_t live_rows) {
  if (M <= 0 || N <= 0) return true;
  if (K <= 0) {
    if (!accumulate)
      for (std::int64_t i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return true;
  }
  const std::int64_t rows_per_tile = tile_m(K, b_transposed);
  const std::int64_t tiles_m = (M + rows_per_tile - 1) / rows_per_tile;
  const std::int64_t tiles_n = (N + kTileN - 1) / kTileN;
  const std::int64_t tiles = tiles_m * tiles_n;
  const float beta = accumulate ? 1.0f : 0.0f;
  // Few live rows (decode): tiles of whole 16-column groups skip the padding rows
  // (gemm_rows.hpp); a tile with a partial group, whose last columns sgemm sums in another order,
  // stays with sgemm on all M rows.
  const bool rows_kernel = live_rows > 0 && live_rows <= kRowsKernelMax && live_rows <= M && !accumulate &&
                           !a.transposed && b_transposed && use_rows_kernel();
  // sgemm's order for the whole column tiles and the last one (the same on AVX2; probed on AVX-512).
  std::optional<SgemmOrder> order_full, order_last;
  if (rows_kernel) {
    order_full = sgemm_order_for(std::min(kTileN, N), K, a.ld, ldb);
    order_last = sgemm_order_for(N - (tiles_n - 1) * kTileN, K, a.ld, ldb);
  }
  std::atomic<bool> ok{true};
#pragma omp parallel num_threads(static_cast<int>(std::min<std::int64_t>(num_threads, tiles)))
  {
    omp_set_num_threads(1);  // this implicit task's limit only: oneDNN runs the tile on this thread
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t m0 = (tile / tiles_n) * rows_per_tile;
      const std::int64_t n0 = (tile % tiles_n) * kTileN;
      const std::int64_t mt = std::min(rows_per_tile, M - m0);
      const std::int64_t nt = std::min(kTileN, N - n0);
      // Row-major: A[M,K] (or stored [K,M] when transposed), B[K,N] (or [N,K]).
      const float* a_ptr = a.transposed ? a.ptr + m0 : a.ptr + m0 * a.ld;
      const GemmOperand b = b_tile(n0, nt);
      const std::optional<SgemmOrder>& order = nt == kTileN ? order_full : order_last;
      if (rows_kernel && nt % 16 == 0 && order) {
        gemm_rows_avx2(live_rows, nt, K, a_ptr, a.ld, b.ptr, b.ld, c + n0, ldc, *order);
        continue;
      }
      if (dnnl_sgemm(a.transposed ? 'T' : 'N', b_transposed ? 'T' : 'N', mt, nt, K, 1.0f, a_ptr, a.ld, b.ptr,
                     b.ld, beta, c + m0 * ldc + n0, ldc) != dnnl_success)
        ok = false;
    }
  }
  return ok;
}

}  // namespace

bool gemm_f32(std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a, GemmOperand b, float* c,
              std::int64_t ldc, bool accumulate, int num_threads, std::int64_t live_rows) {
  const auto b_tile = [&b](std::int64_t n0, std::int64_t) {
    return GemmOperand{b.transposed ? b.ptr + n0 * b.ld : b.ptr + n0, b.ld, b.transposed};
  };
  return gemm_f32_tiles(M, N, K, a, b.transposed, b.ld, b_tile, c, ldc, accumulate, num_threads, live_rows);
}

bool gemm_one_column_pass(std::int64_t M, std::int64_t K) { return M <= tile_m(K, true); }

std::size_t gemm_widen_scratch_floats(std::int64_t N, std::int64_t ld, int num_threads) {
  const std::int64_t team = std::clamp<std::int64_t>((N + kTileN - 1) / kTileN, 1, std::max(num_threads, 1));
  return static_cast<std::size_t>(team * kTileN * ld);
}

bool gemm_f32_widening(std::int64_t M, std::int64_t half, std::int64_t K, GemmOperand a, const void* wkv,
                       const void* wgate, DType dt, float* c, std::int64_t ldc, float* scratch,
                       std::int64_t ld_scratch, int num_threads, std::int64_t live_rows) {
  if (!gemm_one_column_pass(M, K)) return false;
  const std::size_t row_bytes = static_cast<std::size_t>(K) * dtype_size(dt);
  const auto b_tile = [&](std::int64_t n0, std::int64_t nt) {
    // This thread's tile of [wkv ; wgate] in fp32 (rows n0 .. n0 + nt of B, either matrix's rows).
    float* tile = scratch + static_cast<std::int64_t>(omp_get_thread_num()) * kTileN * ld_scratch;
    for (std::int64_t n = n0; n < n0 + nt; ++n) {
      const void* src = n < half ? wkv : wgate;
      const std::int64_t row = n < half ? n : n - half;
      to_f32(static_cast<const unsigned char*>(src) + static_cast<std::size_t>(row) * row_bytes, dt,
             tile + (n - n0) * ld_scratch, K);
    }
    return GemmOperand{tile, ld_scratch, true};
  };
  return gemm_f32_tiles(M, 2 * half, K, a, true, ld_scratch, b_tile, c, ldc, false, num_threads, live_rows);
}

}  // namespace kvcomp::detail
