#include "cpu/products/order_probes.hpp"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common/numerics.hpp"
#include "cpu/products/onednn_bf16_tiles.hpp"
#include "cpu/products/onednn_f32.hpp"
#include "kvcomp/half.hpp"

namespace kvcomp::detail {

namespace {

// --- oneDNN's sgemm -------------------------------------------------------------------------------------

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

// The order (products/rows.hpp) in which oneDNN's AVX-512 sgemm, on one thread, sums the rows of a tile of nt
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

// gemm_b_plain_same_bits's probe, on one thread with the OpenMP limit 1: the last 16, 208 and 256 rows of
// a 256-row A against the full column tile and the last one of B, each product with B transposed and
// with B plain, bit for bit. Memory from std::malloc (as probe_avx512_order's: nothing with operator
// new); none: false.
bool probe_b_plain(std::int64_t N, std::int64_t K, std::int64_t lda, std::int64_t ldb_t,
                   std::int64_t ldb_plain) {
  constexpr std::int64_t rows = 256;
  const std::int64_t full = std::min(kF32TileCols, N), last = N - (N - 1) / kF32TileCols * kF32TileCols;
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

// Compares gemm_rows_avx2 with sgemm bit for bit: every row count 1-8 against the rows of a 24-row call
// (the long-call path of both sgemms: four whole groups of 6 on AVX2, >= 16 rows on AVX-512), and one
// row from decode panels (gemm_row_avx2_panels),
// over K that take each branch of sgemm_k_blocks, with leading dimensions that are not multiples of 16.
// fp16 false: B in fp32 and bf16 rows, bf16 panels; true: B in fp16 rows (gemm_rows_avx2_f16) and fp16
// panels, B's values spanning fp16's range, subnormals and zeros included. False at the first difference,
// or when the buffers cannot be allocated (std::malloc: the fp32 products allocate nothing with operator
// new, docs/robustness.md).
bool rows_kernel_matches_on(bool sgemm_avx512, bool fp16) {
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
    const std::optional<SgemmOrder> probed = sgemm_order_for(sgemm_avx512, n, k, ld, ld);
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

}  // namespace

std::optional<SgemmOrder> sgemm_order_for(bool sgemm_avx512, std::int64_t nt, std::int64_t K,
                                          std::int64_t lda, std::int64_t ldb) {
  if (nt <= 0 || nt % 16 != 0 || K <= 0) return std::nullopt;
  if (!sgemm_avx512) return kSgemmAvx2;
  static ProbeTable<std::array<std::int64_t, 4>, std::optional<SgemmOrder>, 32> orders;
  return orders.get({nt, K, lda, ldb}, [&] { return probe_avx512_order(nt, K, lda, ldb); });
}

// On one thread with the OpenMP limit 1, as gemm_f32 calls sgemm (with more, it may split K and sum
// otherwise).
bool rows_kernel_matches_sgemm(bool sgemm_avx512, bool fp16) {
  bool matches = false;
#pragma omp parallel num_threads(1)
  {
    omp_set_num_threads(1);
    matches = rows_kernel_matches_on(sgemm_avx512, fp16);
  }
  return matches;
}

bool sgemm_b_plain_matches(std::int64_t N, std::int64_t K, std::int64_t lda, std::int64_t ldb_t,
                           std::int64_t ldb_plain) {
  static ProbeTable<std::array<std::int64_t, 5>, bool, 16> same;
  return same.get({N, K, lda, ldb_t, ldb_plain}, [&] { return probe_b_plain(N, K, lda, ldb_t, ldb_plain); });
}

// --- oneDNN's bf16 matmul -------------------------------------------------------------------------------

namespace {

// A bf16 of random sign, exponent 2^-8 .. 2^8 and mantissa, from a linear congruential state.
std::uint16_t next_probe_value(std::uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  const std::uint32_t r = state >> 8;
  return static_cast<std::uint16_t>((r & 0x8000u) | ((127u - 8u + (r >> 7) % 17u) << 7) | (r & 0x7Fu));
}

// Random operands of one 64-row tile of shape s, from a state seeded by `seed` and the shape: A, and B
// where it lies and packed as `base` (the shape's plain fp32 tile primitive) reads it.
struct ProbeOperands {
  std::vector<std::uint16_t> a, b;
  std::vector<unsigned char> packed;
  const void* read_b = nullptr;  // what the primitives read: b, or its packed copy
};

// False if the packing could not run.
bool make_probe_operands(const Bf16Kernels& k, const Bf16Shape& s, const TilePrimitive* base,
                         std::uint32_t seed, ProbeOperands& o) {
  std::uint32_t state = seed + static_cast<std::uint32_t>(s.K * 131 + s.N);
  o.a.resize(static_cast<std::size_t>(kBf16TileRows * s.lda));
  o.b.resize(static_cast<std::size_t>((s.b_transposed ? s.N : s.K) * s.ldb));
  for (auto& v : o.a) v = next_probe_value(state);
  for (auto& v : o.b) v = next_probe_value(state);
  o.packed.resize(base->in_place ? 0 : base->pd.weights_desc().get_size());
  const Bf16PackJob job{o.b.data(), o.packed.data()};
  if (!bf16_pack_b(k, f32_twin(s), &job, 1, 1)) return false;
  o.read_b = base->in_place ? static_cast<const void*>(o.b.data()) : o.packed.data();
  return true;
}

// Whether the m-row tile primitive of this shape gives rows [0, m) and [64 - m, 64) of a 64-row tile
// the bits the 64-row primitive gives them, on random operands packed as the products read them; none
// where a reorder or product could not run (oneDNN reports those, e.g. out of memory, as failures).
std::optional<bool> short_packed_tile_matches(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t m) {
  const TilePrimitive* tall = tile_primitive(k.packed, s, false);
  if (tall->in_place) return false;
  const TilePrimitive* low = tile_primitive(k.packed, s, false, m);
  if (low->pd.weights_desc() != tall->pd.weights_desc()) return false;
  ProbeOperands o;
  if (!make_probe_operands(k, s, tall, 0x9E3779B9u, o)) return std::nullopt;
  const std::size_t c_size = static_cast<std::size_t>(kBf16TileRows * s.ldc);
  std::vector<float> want(c_size, 0.0f), got(c_size, 0.0f);
  const auto tall_tile = [&](std::int64_t) { return Tile{tall, o.a.data(), o.read_b, want.data()}; };
  if (!run_tiles(1, tall, tall, 1, tall_tile)) return std::nullopt;
  for (const std::int64_t r0 : {std::int64_t{0}, kBf16TileRows - m}) {
    const bool ran = run_tiles(1, low, low, 1, [&](std::int64_t) {
      return Tile{low, o.a.data() + r0 * s.lda, o.read_b, got.data() + r0 * s.ldc};
    });
    if (!ran) return std::nullopt;
    for (std::int64_t i = r0; i < r0 + m; ++i)
      if (std::memcmp(got.data() + i * s.ldc, want.data() + i * s.ldc, static_cast<std::size_t>(s.N) * 4))
        return false;
  }
  return true;
}

// Whether the bf16-C tile primitive of shape s (c_bf16) gives each element of a 64-row tile the fp32
// twin's sum rounded to nearest even, on random operands laid out as the products read them; none
// where a reorder or product could not run (as above).
std::optional<bool> bf16_c_tile_matches(const Bf16Kernels& k, const Bf16Shape& s) {
  const Bf16Shape twin = f32_twin(s);
  const TilePrimitive* f32 = tile_primitive(k.packed, twin, false);
  const TilePrimitive* narrow = tile_primitive(k.packed, s, false);
  if (narrow->pd.weights_desc() != f32->pd.weights_desc()) return false;
  ProbeOperands o;
  if (!make_probe_operands(k, s, f32, 0x7F4A7C15u, o)) return std::nullopt;
  std::vector<float> want(static_cast<std::size_t>(kBf16TileRows * twin.ldc), 0.0f);
  std::vector<std::uint16_t> got(static_cast<std::size_t>(kBf16TileRows * s.ldc), 0);
  if (!run_tiles(1, f32, f32, 1,
                 [&](std::int64_t) {
                   return Tile{f32, o.a.data(), o.read_b, want.data()};
                 }) ||
      !run_tiles(1, narrow, narrow, 1, [&](std::int64_t) {
        return Tile{narrow, o.a.data(), o.read_b, got.data()};
      }))
    return std::nullopt;
  for (std::int64_t i = 0; i < kBf16TileRows; ++i) {
    const std::uint16_t* row = got.data() + i * s.ldc;
    const float* sums = want.data() + i * twin.ldc;
    for (std::int64_t j = 0; j < s.N; ++j)
      if (row[j] != f32_to_bf16(sums[j])) return false;
  }
  return true;
}

// A shape and a tile height.
using ProbeKey =
    std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, std::int64_t>;

// The verdict of probe() for key, probed once per process (verdicts guarded by mu). A probe that could
// not run (none, or std::bad_alloc: out of memory) gives false this time and is probed again next
// time; one that threw anything else (dnnl::error, or only oneDNN's reference kernel) is false for good.
template <class Probe>
bool probed_once(std::mutex& mu, std::map<ProbeKey, bool>& verdicts, const ProbeKey& key, Probe&& probe) {
  const std::lock_guard<std::mutex> lock(mu);
  auto it = verdicts.find(key);
  if (it == verdicts.end()) {
    std::optional<bool> ok;
    try {
      ok = probe();
    } catch (const std::bad_alloc&) {  // ok stays empty
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok) return false;
    it = verdicts.emplace(key, *ok).first;
  }
  return it->second;
}

// Whether gemm_rows_avx512_bf16 gives, for this K, the bits oneDNN's jit gemm gives (its K blocks and
// pairing were measured, not documented): 3 rows x 32 columns of values spread over 2^-8 .. 2^8, both
// ways, on this thread.
bool rows_kernel_matches_jit(const Bf16Kernels& k, std::int64_t K) {
  // C's rows strided as the projections' (two products side by side), which is what makes oneDNN take
  // its jit gemm here.
  constexpr std::int64_t M = 3, N = 32, ldc = 2 * N;
  const Bf16Shape probe{N, K, K, ldc, K, true};
  if (!bf16_short_rows_stable(k, probe, M)) return false;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(M * K)), b(static_cast<std::size_t>(N * K));
  std::uint32_t state = 0x2545F491u + static_cast<std::uint32_t>(K);
  for (auto& v : a) v = next_probe_value(state);
  for (auto& v : b) v = next_probe_value(state);
  std::vector<float> want(static_cast<std::size_t>(M * ldc)), got(want.size());
  const Bf16Target t{b.data(), want.data()};
  if (!gemm_bf16_rows(k, probe, M, a.data(), {&t, 1}, false, 1)) return false;
  for (std::int64_t m = 1; m <= M; ++m) {  // the last m rows
    gemm_rows_avx512_bf16(m, N, K, a.data() + (M - m) * K, K, b.data(), K, got.data(), ldc);
    for (std::int64_t i = 0; i < m; ++i)
      if (std::memcmp(got.data() + i * ldc, want.data() + (M - m + i) * ldc, N * sizeof(float)) != 0)
        return false;
  }
  return true;
}

}  // namespace

bool bf16_c_tile_probe(const Bf16Kernels& k, const Bf16Shape& s) {
  static std::mutex mu;
  static std::map<ProbeKey, bool> verdicts;
  const ProbeKey key{s.N, s.K, s.lda, s.ldc, s.ldb, s.b_transposed, kBf16TileRows};
  return probed_once(mu, verdicts, key, [&] { return bf16_c_tile_matches(k, s); });
}

bool bf16_short_tile_probe(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t m) {
  static std::mutex mu;
  static std::map<ProbeKey, bool> verdicts;
  const ProbeKey key{s.N, s.K, s.lda, s.ldc, s.ldb, s.b_transposed, m};
  return probed_once(mu, verdicts, key, [&] { return short_packed_tile_matches(k, s, m); });
}

bool bf16_rows_kernel_probe(const Bf16Kernels& k, std::int64_t K) {
  static std::mutex mu;
  static std::map<std::int64_t, bool> orders;  // K -> the kernel's order holds
  const std::lock_guard<std::mutex> lock(mu);
  if (const auto it = orders.find(K); it != orders.end()) return it->second;
  bool ok = false;
#pragma omp parallel num_threads(1)
  {
    omp_set_num_threads(1);
    ok = rows_kernel_matches_jit(k, K);
  }
  return orders[K] = ok;
}

}  // namespace kvcomp::detail
